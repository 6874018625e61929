"""How workers combine their replicas' writes to central variables (``strategies/_writes.py``),
without processes: the bound that lets integer sums travel as float64, and the values every
worker carries in its agreement row, combined alike on every worker by each variable's
aggregation. Two workers of real processes: ``test_multi_worker.py``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from centralstore import VariableAggregation
from centralstore.strategies import _writes
from centralstore.strategies._flat import pack, unpack
from centralstore.strategies._writes import CarriedWrites, ValuesBefore, wide


def test_integer_writes_travel_as_float64_only_while_every_sum_is_exact() -> None:
    """The bound on a worker's integer write terms (value, change, value times writers),
    times the workers, against 2**53: the batch count of batch norm fits; a value of 2**51
    written by three replicas of each of two workers may not (its mean's term is 3 * 2**51
    per worker); floats never count."""

    def bound(value: torch.Tensor, start: torch.Tensor, writers: int) -> bool:
        return wide([value], {0: (writers, False)}, {0: start}, workers=2)

    assert not bound(torch.tensor(1_001), torch.tensor(1_000), 1)
    assert not bound(torch.tensor(2.0**60), torch.tensor(0.0), 3)
    assert not bound(torch.tensor(2**50), torch.tensor(0), 3)
    assert bound(torch.tensor(2**51), torch.tensor(0), 3)
    assert bound(torch.tensor(-(2**63)), torch.tensor(0), 1)  # its abs overflows in int64


SUM, MEAN, FIRST = (
    VariableAggregation.SUM, VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA
)
# name, aggregation, start, per worker: (its replicas that wrote, whether one assigned,
# the value its own replicas left); a worker without writers keeps the start
CASES: list[tuple[str, VariableAggregation, torch.Tensor, list[tuple[int, bool, Any]]]] = [
    ("running mean", MEAN, torch.tensor([1.0, 2.0, 3.0]),
     [(1, False, [1.5, 2.5, 3.5]), (1, False, [0.5, 1.5, 2.5]), (1, False, [1.0, 1.0, 1.0])]),
    ("batch count", MEAN, torch.tensor(7), [(1, False, 8), (1, False, 8), (1, False, 8)]),
    ("mean, 2 + 0 + 3 writers", MEAN, torch.tensor([0.0, 0.0]),
     [(2, False, [1.0, 4.0]), (0, False, None), (3, False, [2.0, -1.0])]),
    ("mean over an infinite start", MEAN, torch.tensor([float("inf")]),
     [(1, False, [2.0]), (1, False, [4.0]), (1, False, [6.0])]),
    ("added to", SUM, torch.tensor([10.0, 20.0]),
     [(2, False, [12.0, 21.0]), (1, False, [11.0, 20.5]), (0, False, None)]),
    ("assigned on one worker", SUM, torch.tensor([10.0]),
     [(2, False, [12.0]), (1, True, [5.0]), (1, False, [11.0])]),
    ("integer added to", SUM, torch.tensor([2**60 + 1]),
     [(1, False, [2**60 + 2]), (2, False, [2**60 + 5]), (1, False, [2**60 + 1])]),
    ("first writer only", FIRST, torch.tensor([0.0]),
     [(0, False, None), (2, False, [3.0]), (1, False, [9.0])]),
    ("half precision", MEAN, torch.tensor([1.0, 2.0], dtype=torch.float16),
     [(1, False, [2.0, 2.0]), (1, False, [4.0, 3.0]), (1, False, [0.0, 1.0])]),
    ("carried, not written", MEAN, torch.tensor([5.0]),
     [(0, False, None), (0, False, None), (0, False, None)]),
]

# What one process of all the replicas gives (docs/design.md §3.6), worked out by hand.
EXPECTED = {
    "running mean": [1.0, 5 / 3, 7 / 3],
    "batch count": 8,
    "mean, 2 + 0 + 3 writers": [(2 * 1.0 + 3 * 2.0) / 5, (2 * 4.0 + 3 * -1.0) / 5],
    "mean over an infinite start": [4.0],
    "added to": [10.0 + 2.0 + 1.0, 20.0 + 1.0 + 0.5],
    # once one writer assigned, finals add: worker 0's two replicas (10 + 10 + their
    # changes, 2), then 5 and 11
    "assigned on one worker": [12.0 + 10.0 + 5.0 + 11.0],
    "integer added to": [2**60 + 1 + 1 + 4],
    "first writer only": [3.0],
    "half precision": [2.0, 2.0],
    "carried, not written": [5.0],
}


def _worker_tensors(worker: int) -> list[torch.Tensor]:
    """Worker ``worker``'s variables after its local fold."""
    tensors = []
    for _, _, start, groups in CASES:
        count, _, value = groups[worker]
        tensors.append(start.clone() if not count else torch.tensor(value, dtype=start.dtype))
    return tensors


def test_carried_writes_combine_as_one_process_would_on_every_worker() -> None:
    """Three workers, each with its own writers of ten variables of four dtypes and every
    aggregation: combined from the gathered rows, every worker holds the same values, which
    are those of one process with all the replicas (a mean weighted by writers, a sum of
    changes, finals once one assigned, the first writer's value, exact integers beyond
    float64's, a variable carried but not written left alone)."""
    records: Any = [SimpleNamespace(aggregation=a) for _, a, _, _ in CASES]
    workers = [_worker_tensors(w) for w in range(3)]
    starts = [start for *_, start, _ in CASES]
    carried = CarriedWrites.of(records, workers[0], range(len(CASES)), workers=3)
    assert carried is not None
    payloads = [carried.payload(records, tensors) for tensors in workers]
    assert all(p is not None and p.shape == (carried.words,) for p in payloads)
    rows = torch.stack(payloads)  # type: ignore[arg-type]
    writers = torch.tensor([[groups[w][0] for *_, groups in CASES] for w in range(3)])
    assigned = torch.tensor([[int(groups[w][1]) for *_, groups in CASES] for w in range(3)])
    for w, tensors in enumerate(workers):
        before = {i: starts[i].clone() for i in range(len(CASES)) if writers[w, i]}
        carried.combine(rows, tensors, records, before, writers, assigned)
    for (name, _, start, _), *values in zip(CASES, *workers, strict=True):
        for value in values:
            assert torch.equal(value, values[0]), name  # the same bits on every worker
            assert value.dtype == start.dtype, name
        torch.testing.assert_close(
            values[0], torch.tensor(EXPECTED[name], dtype=start.dtype), msg=name
        )


def test_carried_writes_stay_home_when_the_layout_changed_or_too_large() -> None:
    """A payload only for the layout the variables were chosen in (the same variables, of
    the same shapes and dtypes); nothing carried past ``CARRY_BYTES`` or for a bool."""
    records: Any = [SimpleNamespace(aggregation=MEAN) for _ in range(2)]
    tensors = [torch.zeros(3), torch.zeros((), dtype=torch.int64)]
    carried = CarriedWrites.of(records, tensors, [0, 1], workers=2)
    assert carried is not None and carried.words == 2 + 1  # 12 bytes padded to 16, then 8
    assert carried.payload(records, tensors) is not None
    other: Any = SimpleNamespace(aggregation=SUM)
    assert carried.payload([*records[:1], other], tensors) is None
    assert carried.payload(records, [torch.zeros(4), tensors[1]]) is None
    assert carried.payload(records, [tensors[0].double(), tensors[1]]) is None
    large = [torch.zeros(_writes.CARRY_BYTES // 4 + 1)]
    assert CarriedWrites.of(records[:1], large, [0], workers=2) is None
    assert CarriedWrites.of(records[:1], [torch.zeros(16_000)], [0], workers=64) is None
    assert CarriedWrites.of(records[:1], [torch.zeros(3, dtype=torch.bool)], [0], 2) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.float64])
def test_carried_values_arrive_bit_for_bit(dtype: torch.dtype) -> None:
    """Odd sizes of every width: each group's bytes start at a multiple of 8 in the row."""
    records: Any = [SimpleNamespace(aggregation=FIRST) for _ in range(3)]
    tensors = [
        torch.arange(5).to(dtype), torch.arange(3, dtype=torch.float32) / 3,
        torch.arange(7).to(dtype) - 2,
    ]
    carried = CarriedWrites.of(records, tensors, [0, 1, 2], workers=1)
    assert carried is not None
    row = carried.payload(records, tensors)
    assert row is not None
    zero = [torch.zeros_like(t) for t in tensors]
    writers = torch.ones(1, 3, dtype=torch.int64)
    carried.combine(row[None], zero, records, {}, writers, torch.zeros_like(writers))
    for got, sent in zip(zero, tensors, strict=True):
        assert torch.equal(got, sent)


def test_values_before_are_copies_handed_back_in_each_shape() -> None:
    """``ValuesBefore`` copies the variables it is given (one kernel per dtype and device)
    and hands each back in its own shape and dtype, as it was, whatever the fold then
    writes; a variable it was not given is not in it."""
    tensors = [
        torch.tensor([1.0, 2.0]), torch.tensor(3), torch.arange(6.0).double().reshape(2, 3),
        torch.tensor([4.0, 5.0, 6.0], requires_grad=True), torch.tensor(9.0),
    ]
    before = ValuesBefore(tensors, [3, 0, 1, 2])
    expected = {i: tensors[i].detach().clone() for i in range(4)}
    with torch.no_grad():
        for tensor in tensors:
            tensor.add_(1)
    assert sorted(before) == [0, 1, 2, 3] and len(before) == 4
    assert 4 not in before and before.get(4) is None
    for i, value in before.items():
        assert value.dtype == expected[i].dtype and torch.equal(value, expected[i])
        assert not value.requires_grad


def test_values_before_of_variables_written_in_place_come_from_their_starts() -> None:
    """Buffers that a worker's replicas wrote in place hold their new values already: their
    values from before come from the copies the run kept (``starts``), copied again, and
    the others' from the variables."""
    tensors = [torch.tensor([7.0, 8.0]), torch.tensor([1.0, 2.0]), torch.tensor(5)]
    starts = {0: torch.tensor([3.0, 4.0]), 2: torch.tensor(4)}
    before = ValuesBefore(tensors, [0, 1, 2], starts)
    expected = {0: starts[0].clone(), 1: tensors[1].clone(), 2: starts[2].clone()}
    for start in starts.values():
        start.zero_()  # (the run's copies are reused by the next run)
    for i, value in before.items():
        assert torch.equal(value, expected[i]), i


class _Counted(Mapping[int, torch.Tensor]):
    """The values from before, counting which ones are read."""

    def __init__(self, values: dict[int, torch.Tensor]) -> None:
        self.values, self.read = values, []

    def __getitem__(self, index: int) -> torch.Tensor:
        self.read.append(index)
        return self.values[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def test_final_values_combine_without_reading_the_values_from_before() -> None:
    """MEAN and ONLY_FIRST_REPLICA writes combine from every worker's final values, so
    ``combine`` reads none of the values from before the fold for them (batch norm's
    statistics and counts, at every step); a SUM's changes read its own."""
    records: Any = [SimpleNamespace(aggregation=a) for a in (MEAN, FIRST, SUM, MEAN)]
    starts = [torch.zeros(2), torch.tensor(7), torch.tensor([10.0]), torch.ones(3)]
    finals = [  # each worker's values after its fold; variable 3 is carried, not written
        [torch.tensor([1.0, 3.0]), torch.tensor(8), torch.tensor([12.0]), torch.ones(3)],
        [torch.tensor([3.0, 5.0]), torch.tensor(8), torch.tensor([11.0]), torch.ones(3)],
    ]
    carried = CarriedWrites.of(records, finals[0], [0, 1, 2, 3], workers=2)
    assert carried is not None
    rows = torch.stack([carried.payload(records, tensors) for tensors in finals])  # type: ignore[misc]
    writers = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    assigned = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    for tensors in finals:
        before = _Counted({i: starts[i].clone() for i in range(3)})
        carried.combine(rows, tensors, records, before, writers, assigned)
        assert before.read == [2]
        assert torch.equal(tensors[0], torch.tensor([2.0, 4.0]))
        assert torch.equal(tensors[1], torch.tensor(8))
        assert torch.equal(tensors[2], torch.tensor([13.0]))  # 10 + 2 + 1
        assert torch.equal(tensors[3], torch.ones(3))


class _OneWorker:
    """The collectives of a single worker: a sum across workers is its own terms."""

    worker_index = 0

    def sum_across(self, what: str, terms: list[torch.Tensor], widen: bool) -> list[torch.Tensor]:
        return list(terms)


def test_summed_writes_read_the_values_from_before_only_for_sum() -> None:
    """``exchange_writes`` (writes not carried) follows ``combine``'s rule: final values
    need no start, a SUM's changes read its own."""
    records: Any = [SimpleNamespace(aggregation=a) for a in (MEAN, FIRST, SUM)]
    tensors = [torch.tensor([1.0, 3.0]), torch.tensor(8), torch.tensor([12.0])]
    before = _Counted({0: torch.zeros(2), 1: torch.tensor(7), 2: torch.tensor([10.0])})
    writers = torch.tensor([[1, 1, 1]])
    assigned = torch.tensor([[1, 1, 0]])
    workers: Any = _OneWorker()
    _writes.exchange_writes(workers, tensors, records, before, writers, assigned)
    assert before.read == [2]
    assert torch.equal(tensors[0], torch.tensor([1.0, 3.0]))
    assert torch.equal(tensors[1], torch.tensor(8))
    assert torch.equal(tensors[2], torch.tensor([12.0]))  # 10 + (12 - 10)


@pytest.mark.parametrize("shapes", [[(3,), (1,), (4,)], [(3,), (), (2, 2)]])
def test_unpack_copies_each_piece_into_its_tensor(shapes: list[tuple[int, ...]]) -> None:
    """``unpack`` undoes ``pack`` into the tensors themselves, vectors (one
    ``split_with_sizes_copy``) or any other shapes (a view of each piece copied)."""
    sources = [torch.randn(shape) for shape in shapes]
    targets = [torch.zeros(shape) for shape in shapes]
    unpack(pack(sources), targets)
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target, source)
