"""A Lightning batch cut into the replicas' slices (``centralstore.lightning._batches``).

One replica takes the usual batch as it is, without the split's walk of its tree; any other
batch takes the walk, and both give what the split rule gives.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning")

import torch

from centralstore.input.split import split_leaves
from centralstore.lightning import _batches

_Pair = namedtuple("_Pair", "x y")


@pytest.mark.parametrize("batch", [
    pytest.param(torch.ones(5, 3), id="tensor"),
    pytest.param((torch.ones(5, 3), torch.arange(5)), id="tuple"),
    pytest.param([torch.ones(5, 3), torch.arange(5)], id="list"),
    pytest.param({"ids": torch.arange(5), "mask": torch.ones(5, 2)}, id="dict"),
    pytest.param((torch.tensor(2.0), torch.ones(5, 3)), id="a-scalar-first"),
])
def test_one_replica_takes_the_usual_batch_as_it_is(batch: Any) -> None:
    slices, sizes = _batches.split(batch, ["cpu:0"])
    assert slices[0] is batch and sizes == [5]


@pytest.mark.parametrize("batch", [
    pytest.param((np.ones((5, 3), dtype=np.float32), torch.arange(5)), id="numpy"),
    pytest.param((torch.ones(5, 3), ["a", "b", "c", "d", "e"]), id="strings"),
    pytest.param(_Pair(torch.ones(5, 3), torch.arange(5)), id="namedtuple"),
    pytest.param({"x": torch.ones(5, 3), "nested": {"y": torch.arange(5)}}, id="nested"),
    pytest.param((torch.nn.Parameter(torch.ones(5, 3)), torch.arange(5)), id="a-subclass"),
])
def test_one_replica_walks_any_other_batch_as_the_split_rule_does(batch: Any) -> None:
    slices, sizes = _batches.split(batch, ["cpu:0"])
    columns, _ = split_leaves(batch, 1)
    leaves = [column[0] for column in columns]
    got = slices[0]
    assert got is not batch and type(got) is type(batch) and sizes == [5]
    flat = list(got.values()) if isinstance(got, dict) else list(got)
    if isinstance(batch, dict):
        flat = [flat[0], flat[1]["y"]]
    for value, leaf in zip(flat, leaves, strict=True):
        assert (value == list(leaf)) if isinstance(value, list) else torch.equal(value, leaf)


def test_a_batch_of_scalars_has_no_rows_on_either_path() -> None:
    as_is = (torch.tensor(1.0), torch.tensor(2))
    walked = _Pair(*as_is)
    assert _batches.split(as_is, ["cpu:0"])[1] == _batches.split(walked, ["cpu:0"])[1] == [0]


@pytest.mark.usefixtures("fake_gpus")
def test_one_replica_on_another_device_takes_its_copy() -> None:
    batch = (torch.ones(5, 3), torch.arange(5))
    slices, sizes = _batches.split(batch, ["cuda:0"])
    assert sizes == [5]
    assert [leaf.device for leaf in slices[0]] == [torch.device("cuda:0")] * 2
