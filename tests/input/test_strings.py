"""Strings: a batch of strings is one leaf, slices stay batches, and stacking checks shapes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from centralstore import _tree
from centralstore.input.strings import Strings, num_rows, rows, stack, to_strings


def test_strings_is_a_list_and_one_leaf() -> None:
    batch = Strings(["a", "b", "c"])
    assert isinstance(batch, list)
    assert batch == ["a", "b", "c"]
    leaves, _ = _tree.flatten((batch, torch.zeros(1)))
    assert leaves[0] is batch
    assert type(batch[0:2]) is Strings
    assert batch[-1] == "c"
    assert pickle.loads(pickle.dumps(batch)) == batch
    assert type(pickle.loads(pickle.dumps(batch))) is Strings


def test_to_strings_reads_lists_and_arrays_of_strings() -> None:
    assert to_strings(["a", b"b"]) == ["a", b"b"]
    nested = to_strings([["a", "b"], ["c", "d"]])
    assert isinstance(nested, Strings) and isinstance(nested[0], Strings)
    assert to_strings(np.array(["x", "y"])) == ["x", "y"]
    assert to_strings(np.array([b"x"])) == [b"x"]
    assert to_strings(np.array("x")) is None
    assert to_strings([]) is None
    assert to_strings(["a", 1]) is None
    assert to_strings([["a"], [1]]) is None


def test_ragged_string_lists_raise() -> None:
    with pytest.raises(ValueError, match=r"Dataset cannot stack string components"):
        to_strings([["a", "b"], ["c"]])


def test_stack_checks_one_kind_and_length() -> None:
    assert stack(["a", "b"], "f") == ["a", "b"]
    with pytest.raises(ValueError, match=r"f cannot stack.*\['str', 2\]"):
        stack(["a", Strings(["b", "c"])], "f")
    with pytest.raises(ValueError, match="f cannot stack"):
        stack(["a", 1], "f")


def test_rows_of_tensors_and_strings() -> None:
    assert num_rows(Strings([])) == 0
    assert num_rows("abc") is None
    assert num_rows(np.zeros(3)) is None  # numpy arrays become tensors before this
    assert list(rows(Strings(["a", "b"]))) == ["a", "b"]
    assert [r.tolist() for r in rows(torch.arange(2))] == [0, 1]
