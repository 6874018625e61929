"""A Keras batch cut into the replicas' slices: the usual tuple without a tree walk, any
other structure through Keras' tree, both by the same rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from centralstore.keras._batches import rows, split


def _as_lists(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _as_lists(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_as_lists(item) for item in value)
    return value


@pytest.mark.parametrize("array", [torch.arange, np.arange])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_plain_tuple_slices_as_the_tree_does(array: Any, replicas: int) -> None:
    x, y, weights = array(10).reshape(5, 2), array(5), array(5) * 2
    for batch in [(x, y, None), (x, y, weights), (x,)]:
        # a list holding the same leaves goes through Keras' tree: the reference
        plain, walked = split(batch, replicas), split(list(batch), replicas)
        assert [list(_as_lists(s)) for s in plain] == [list(_as_lists(s)) for s in walked]
        assert all(type(s) is tuple for s in plain)
        assert sum(rows(s[0]) for s in plain) == 5
        assert [s[0].shape[0] for s in plain] == [len(s[0]) for s in walked]


def test_one_array_and_nested_structures() -> None:
    slices = split(torch.arange(5), 2)
    assert [s.tolist() for s in slices] == [[0, 1, 2], [3, 4]]
    nested = ({"a": torch.arange(4), "b": torch.ones(4, 2)}, torch.arange(4) * 3, None)
    parts = split(nested, 2)
    assert parts[1][0]["a"].tolist() == [2, 3] and parts[1][1].tolist() == [6, 9]
    assert parts[1][2] is None
    assert rows(nested) == 4


def test_mismatched_rows_and_no_array_raise() -> None:
    with pytest.raises(ValueError, match=r"same number of examples.*5 and another 4"):
        split((torch.zeros(5), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="same number of examples"):
        split([torch.zeros(5), torch.zeros(4)], 2)
    with pytest.raises(ValueError, match="at least one array"):
        rows((None, None))
