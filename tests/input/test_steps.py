"""The two walks that make a step of a global batch give one result, and the plain one
needs no pytree (``distributed.split_steps``)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch

from centralstore import _tree
from centralstore._values import PerReplica
from centralstore.input import distributed
from centralstore.input.distributed import distribute_dataset
from centralstore.input.split import Split

Pair = collections.namedtuple("Pair", ["x", "y"])
DEVICES = {1: ("cpu:0",), 2: ("cpu:0", "cpu:1"), 3: ("cpu:0", "cpu:1", "cpu:2")}


def plain(step: Any) -> Any:
    """A step as nested plain values: one list per PerReplica, ``tolist`` per tensor."""
    if isinstance(step, PerReplica):
        return ["PerReplica", [plain(v) for v in step]]
    if isinstance(step, torch.Tensor):
        return [str(step.dtype), list(step.shape), step.tolist()]
    if isinstance(step, dict):
        return [type(step).__name__, [(k, plain(v)) for k, v in step.items()]]
    if isinstance(step, (tuple, list)):
        return [type(step).__name__, [plain(v) for v in step]]
    return step


BATCHES = [
    torch.arange(5),
    (torch.arange(5.0).reshape(5, 1), torch.arange(5)),
    [torch.arange(4), (torch.zeros(4, 2), {"b": torch.arange(2), "a": torch.ones(4)})],
    {"z": torch.arange(7), "a": [torch.arange(7), torch.arange(3)]},
    (),
    {"empty": []},
]


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("batch", BATCHES, ids=range(len(BATCHES)))
def test_the_plain_walk_gives_what_the_general_walk_gives(batch: Any, replicas: int) -> None:
    """The plain walk's step against the general one (Split.leaves, then the mover's value):
    the same structure (container types, dict order), dtypes, shapes and values."""
    devices = DEVICES[replicas]
    split = Split(replicas)
    place = distributed._Mover(devices, True)
    general = place.value(*split.leaves(batch))
    (step,) = list(distribute_dataset([batch], devices))
    assert plain(step) == plain(general)


def test_a_plain_batch_is_cut_without_pytree(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    flatten, unflatten = _tree.flatten, _tree.unflatten
    monkeypatch.setattr(_tree, "flatten", lambda *a, **k: calls.append(a) or flatten(*a, **k))
    monkeypatch.setattr(_tree, "unflatten", lambda *a: calls.append(a) or unflatten(*a))
    batches = [(torch.arange(4), {"y": torch.arange(4)})] * 3
    steps = list(distribute_dataset(batches, DEVICES[2]))
    assert calls == []
    assert [plain(s) for s in steps] == [plain(steps[0])] * 3
    list(distribute_dataset([Pair(torch.arange(4), torch.arange(4))], DEVICES[2]))
    assert calls  # a namedtuple goes through pytree


def test_a_pass_that_meets_another_kind_of_batch_keeps_its_values() -> None:
    """Plain batches, then one that needs the general walk (a namedtuple, numpy, strings),
    then plain ones again: every step is what the batch alone would give."""
    batches = [
        (torch.arange(4), torch.arange(4)),
        Pair(torch.arange(4), np.arange(4)),
        (torch.arange(3), ["a", "b", "c"]),
        (torch.arange(2), torch.arange(2)),
    ]
    together = [plain(s) for s in distribute_dataset(batches, DEVICES[2])]
    alone = [plain(next(iter(distribute_dataset([b], DEVICES[2])))) for b in batches]
    assert together == alone
    assert together[1][0] == "Pair"
    assert together[2][1][1] == ["PerReplica", [["Strings", ["a", "b"]], ["Strings", ["c"]]]]


def test_a_scalar_in_a_plain_batch_says_to_batch() -> None:
    with pytest.raises(ValueError, match="Batch the dataset first"):
        list(distribute_dataset([(torch.arange(2), torch.tensor(1))], DEVICES[2]))


def test_one_replica_keeps_every_leaf_object_of_a_plain_batch() -> None:
    x, y = torch.arange(3), torch.tensor(7)  # a scalar is fine with one replica
    ((sx, sy),) = list(distribute_dataset([(x, y)], DEVICES[1]))
    assert sx is x and sy is y


def test_split_keeps_each_batch_size_cut_once() -> None:
    split = Split(2)
    assert split.sizes(5) is split.sizes(5) == (3, 2)
    assert [t.tolist() for t in split.tensor(torch.arange(5))] == [[0, 1, 2], [3, 4]]
    assert split.sizes(1) == (1, 0)
    with pytest.raises(ValueError, match="Cannot split a scalar tensor"):
        split.tensor(torch.tensor(3))


def test_a_step_on_host_devices_has_nothing_to_wait_for() -> None:
    """A host target's copy is done when it returns: the mover hands the consumer no waits,
    whether the slices were kept or copied."""
    place = distributed._Mover(DEVICES[2], True)
    batch = torch.arange(4)
    place.leaf(batch, [batch[:2], batch[2:]])
    assert place.waits() == ()


@pytest.mark.usefixtures("fake_gpus")
def test_a_step_waits_for_each_gpu_that_copied_and_for_no_host_target() -> None:
    """Replicas on the host and on two GPUs: the consumer gets one wait per GPU that received
    slices since the last call, none for the host, and none once they are handed out."""
    place = distributed._Mover(("cpu:0", "cuda:0", "cuda:1"), True)
    batch = torch.arange(6.0)
    step = place.leaf(batch, [batch[:2], batch[2:4], batch[4:]])
    assert [t.device.type for t in step] == ["cpu", "cuda", "cuda"]
    waits = place.waits()
    assert len(waits) == 2
    for wait in waits:
        wait()
    assert place.waits() == ()
