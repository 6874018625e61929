"""Runs are transactions: a run in which any replica raises, or that is interrupted, leaves
the central variables, their ``.grad`` and their buffers exactly as before it."""

from __future__ import annotations

import operator
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from replicas import context, replica_id, strategy_of
from torch import nn

import centralstore as cs
from centralstore._aggregation import VariableAggregation, sum_in_order, write_term, written_value
from centralstore.variables import folding
from centralstore.variables.folding import (
    _block_width,
    _brought,
    _fold_in_rounds,
    add_in_order,
    fold_gradients,
)
from centralstore.variables.records import Central
from centralstore.variables.runs import OwnRun
from centralstore.variables.views import View


class Failure(Exception):
    pass


def build(strategy: cs.Strategy) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps = cs.Variable(0, aggregation="SUM", trainable=False)
    return model, optimizer, steps


def snapshot(model: nn.Module, steps: torch.Tensor) -> dict[str, torch.Tensor | None]:
    state: dict[str, torch.Tensor | None] = {
        k: v.detach().clone() for k, v in model.state_dict().items()
    }
    for name, p in model.named_parameters():
        state[f"{name}.grad"] = None if p.grad is None else p.grad.clone()
    state["steps"] = steps.detach().clone()
    return state


def assert_same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert (x is None) == (y is None), key
        if x is not None and y is not None:
            assert torch.equal(x, y), key


def batches(replicas: int) -> cs.PerReplica[torch.Tensor]:
    x = torch.randn(4 * replicas, 4, generator=torch.Generator().manual_seed(1))
    return cs.PerReplica(x.chunk(replicas))


def step_fn(
    model: nn.Module, steps: torch.Tensor, fail: Callable[[str], None]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        fail("start")
        loss = model(x).pow(2).mean()
        steps.add_(1)
        fail("before backward")
        loss.backward()
        fail("after backward")
        total = context().all_reduce("sum", loss.detach())
        fail("after all_reduce")
        return total

    return step


WHERE = ["start", "before backward", "after backward", "after all_reduce"]


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("failing", ["first", "last"])
def test_a_failed_run_leaves_variables_grads_and_buffers_as_before(
    replicas: int, where: str, failing: str
) -> None:
    strategy = strategy_of(replicas)
    model, optimizer, steps = build(strategy)
    failed = 0 if failing == "first" else replicas - 1
    data = batches(replicas)
    ok = step_fn(model, steps, lambda at: None)
    strategy.run(ok, args=(data,))  # .grad and buffers are not pristine: accumulation counts
    before = snapshot(model, steps)

    def fail(at: str) -> None:
        if at == where and replica_id() == failed:
            raise Failure(at)

    with pytest.raises(Failure):
        strategy.run(step_fn(model, steps, fail), args=(data,))
    assert_same(snapshot(model, steps), before)

    # The strategy stays usable: the next run gives what it gives without the failed one.
    strategy.run(ok, args=(data,))
    optimizer.step()
    twin = strategy_of(replicas)
    model2, optimizer2, steps2 = build(twin)
    ok2 = step_fn(model2, steps2, lambda at: None)
    twin.run(ok2, args=(data,))
    twin.run(ok2, args=(data,))
    optimizer2.step()
    assert_same(snapshot(model, steps), snapshot(model2, steps2))


def test_a_failed_run_discards_writes_of_every_aggregation() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        variables = {
            agg: cs.Variable(10.0, aggregation=agg, trainable=False)
            for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA")
        }

    def step() -> None:
        for v in variables.values():
            v.add_(1.0)
            v.copy_(torch.tensor(5.0))
        if replica_id() == 1:
            raise Failure()

    with pytest.raises(Failure):
        strategy.run(step)
    assert [float(v) for v in variables.values()] == [10.0, 10.0, 10.0]


def test_an_interrupted_run_returns_after_every_replica_thread_left_and_lands_nothing() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    strategy = strategy_of(2)
    with strategy.scope():
        w = torch.ones(1, requires_grad=True)
    finished = threading.Event()

    def step() -> None:
        context().all_reduce("sum", 1.0)  # replica 1 now runs on its thread
        if replica_id() == 1:
            time.sleep(0.6)  # still computing when the interrupt arrives
            (w * 100).sum().backward()
            finished.set()
        else:
            (w * 1).sum().backward()  # replica 0 returns; run waits for replica 1

    main = threading.main_thread().ident
    assert main is not None
    # Python's own handler, even in a process started with SIGINT ignored (a background job)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            strategy.run(step)
        assert finished.is_set()  # replica 1 had left its code before run raised
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    assert w.grad is None  # nothing of the interrupted run, nor later
    strategy.run(lambda: (w * 2).sum().backward())
    assert w.grad is not None
    assert w.grad.tolist() == [4.0]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_merge_call_commits_what_came_before_and_a_later_failure_drops_only_the_rest(
    replicas: int,
) -> None:
    strategy = strategy_of(replicas)
    with strategy.scope():
        w = torch.ones(2, requires_grad=True)
        optimizer = torch.optim.SGD([w], lr=1.0)

    def step() -> None:
        w.sum().backward()
        context().merge_call(lambda s: optimizer.step())  # a sync point: committed
        (w * 10).sum().backward()
        raise Failure()

    with pytest.raises(Failure):
        strategy.run(step)
    assert w.tolist() == [1.0 - replicas, 1.0 - replicas]
    assert w.grad is not None and w.grad.tolist() == [replicas, replicas]  # not the 10s


def test_a_one_replica_run_copies_no_frozen_weight() -> None:
    strategy = strategy_of(1)
    with strategy.scope():
        frozen = nn.Linear(64, 64).requires_grad_(False)
        norm = nn.BatchNorm1d(64)

    def step() -> None:
        run = strategy._store.run
        assert isinstance(run, OwnRun)
        undo = run._undo
        assert undo._copies is not None
        copied = set(map(id, undo._copies.tensors))
        assert id(frozen.weight) not in copied and id(norm.running_mean) in copied
        norm(frozen(torch.randn(4, 64))).sum().backward()

    strategy.run(step)


def test_a_sparse_gradient_is_not_copied_early_but_left_for_the_fold() -> None:
    from centralstore.variables import folding
    from centralstore.variables.buckets import GradientBuckets
    from centralstore.variables.records import Central
    from centralstore.variables.views import View

    weight = torch.zeros(4, 2, requires_grad=True)
    record = Central(id(weight), weakref.ref(weight), cs.VariableAggregation.NONE, False)
    view = View(record, weight, private=True)
    grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
    weight.grad = grad
    buckets = GradientBuckets()
    folding.start_copy(buckets, view, weight)  # no CUDA call: the sparse gradient stays
    assert weight.grad is grad and not view.pending and buckets.synced  # nothing arrived


# -- the arithmetic: add_in_order and fold_gradients -------------------------------------------


def test_add_in_order_adds_in_place_where_a_sum_exists_and_skips_missing_gradients() -> None:
    held = torch.ones(3)
    grad = torch.full((3,), 2.0)
    sums: list[torch.Tensor | None] = [held, None, None, torch.ones(2)]
    assert add_in_order(sums, [grad, None, grad, None])  # sums[2] is a new tensor
    assert sums[0] is held and torch.equal(held, torch.full((3,), 3.0))  # in place
    assert sums[1] is None  # no gradient, nothing held
    assert sums[2] is grad  # nothing held: the gradient is the sum
    assert torch.equal(sums[3], torch.ones(2))  # held, no gradient: unchanged
    empty: list[torch.Tensor | None] = [None, None]
    assert add_in_order(empty, [None, grad])  # nothing held at all: the gradients are the sums
    assert empty[0] is None and empty[1] is grad
    every: list[torch.Tensor | None] = [torch.ones(3), torch.ones(2)]
    before = list(every)
    # every sum added in place: False, so a caller that took them from .grad keeps it
    assert not add_in_order(every, [grad, torch.ones(2)])
    assert all(map(operator.is_, every, before))
    assert torch.equal(before[0], torch.full((3,), 3.0))
    assert torch.equal(before[1], 2 * torch.ones(2))
    assert not add_in_order(every, [None, torch.ones(2)])


def test_add_in_order_adds_sparse_and_dense_in_either_order() -> None:
    """A sparse sum held and a dense gradient (a table looked up on one replica and also
    read densely on the next) add up dense, as autograd accumulates them: torch adds the
    two only as dense + sparse."""
    rows = torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 0]]), torch.ones(3, 2), (4, 2), check_invariants=True
    )
    dense = torch.arange(8.0).view(4, 2)
    for held, grad in ((rows, dense), (dense.clone(), rows), (rows, rows)):
        sums: list[torch.Tensor | None] = [held]
        assert add_in_order(sums, [grad])  # a new tensor: a sparse sum is never in place
        assert sums[0] is not None and sums[0].is_sparse == (held.is_sparse and grad.is_sparse)
        torch.testing.assert_close(sums[0].to_dense(), held.to_dense() + grad.to_dense())


def _views(*specs: tuple[torch.Tensor, torch.Tensor | None]) -> list[View]:
    """A View per (central, gradient on the view), sharing the central's storage."""
    views = []
    for central, grad in specs:
        record = Central(id(central), weakref.ref(central), VariableAggregation.NONE, False)
        tensor = central.detach().requires_grad_(True)
        tensor.grad = grad
        views.append(View(record, tensor, private=False))
    return views


def test_fold_gradients_sums_each_variable_in_view_order_onto_its_grad() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    a.grad = torch.ones(2)
    held = a.grad
    g_a, g_b = torch.full((2,), 2.0), torch.full((3,), 5.0)
    views = _views((a, g_a), (b, g_b), (b, None))
    received = fold_gradients(views, distinct=False)
    assert received == [a, b]
    assert a.grad is held and torch.equal(a.grad, torch.full((2,), 3.0))  # in place
    assert b.grad is g_b
    assert all(v.tensor.grad is None for v in views)
    # the same variable through two views (a pending list): added in order
    c = nn.Parameter(torch.zeros(2))
    first, second = torch.ones(2), torch.full((2,), 4.0)
    assert fold_gradients(_views((c, first), (c, second))) == [c]
    assert torch.equal(c.grad, torch.full((2,), 5.0))


def test_fold_gradients_of_a_routed_view_after_plain_ones_keeps_the_earlier_gradients() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    views = _views((a, torch.ones(2)), (b, torch.full((2,), 2.0)))
    routed = views[1]
    private = b.detach().clone().requires_grad_(True)
    private.grad = torch.full((2,), 3.0)  # the routed copy's gradient, and the shared view's
    routed.alias, routed.tensor = routed.tensor, private
    assert fold_gradients(views) == [a, b]
    assert torch.equal(a.grad, torch.ones(2))
    assert torch.equal(b.grad, torch.full((2,), 5.0))


# float32 sums that depend on their order: (1e8 + 1) - 1e8 == 0, (-1e8 + 1e8) + 1 == 1
_A_ORDER, _B_ORDER = (1e8, 1.0, -1e8), (-1e8, 1e8, 1.0)


@pytest.mark.parametrize("layout", ["blocks", "mixed"])
def test_fold_in_rounds_adds_each_variables_gradients_in_their_order(layout: str) -> None:
    """Three replicas' gradients of two variables: in blocks (each replica's in the same
    order, the GPU replicas' usual step, taken in passes) or mixed (the general loop), each
    variable's gradients are added in the order they come, onto its ``.grad``."""
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    held = a.grad = torch.zeros(1)
    order = [a, b] * 3 if layout == "blocks" else [a, b, b, a, a, b]
    values = {id(a): iter(_A_ORDER), id(b): iter(_B_ORDER)}
    gradients = [(torch.tensor([next(values[id(t)])]),) for t in order]
    assert _block_width(order, gradients) == (2 if layout == "blocks" else 0)
    assert _fold_in_rounds(order, list(gradients), set()) == [a, b]
    assert a.grad is held and a.grad.item() == 0.0  # in place, in order
    assert b.grad is not None and b.grad.item() == 1.0


@pytest.mark.parametrize("layout", ["blocks", "mixed"])
def test_fold_in_rounds_lends_bucket_views_to_grad(layout: str) -> None:
    """Gradients that are views of a bucket's buffer (``borrowed``) are not copied: a
    variable's only one becomes its ``.grad`` as a tensor of its own on the same memory, so
    that the bucket sees the buffer in use (``buckets.lend``); a first one that others are
    added to takes their sum in place."""
    bucket = torch.arange(6.0)
    alone, first, other = bucket[:2], bucket[2:4], torch.ones(2)
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    centrals = [a, b, a, b] if layout == "blocks" else [a, b, b]
    gradients = (
        [(alone,), (first,), (torch.zeros(2),), (other,)] if layout == "blocks"
        else [(alone,), (first,), (other,)]
    )
    uses = torch._C._storage_Use_Count(bucket.untyped_storage()._cdata)
    assert _fold_in_rounds(centrals, list(gradients), {id(alone), id(first)}) == [a, b]
    assert a.grad is not None and b.grad is not None
    assert a.grad is not alone and a.grad.data_ptr() == alone.data_ptr()
    assert b.grad is not first and b.grad.data_ptr() == first.data_ptr()
    assert torch.equal(a.grad, torch.tensor([0.0, 1.0]))
    assert torch.equal(b.grad, torch.tensor([3.0, 4.0]))  # (2, 3) + (1, 1), in the buffer
    assert torch.equal(bucket, torch.tensor([0.0, 1.0, 3.0, 4.0, 4.0, 5.0]))
    assert torch._C._storage_Use_Count(bucket.untyped_storage()._cdata) == uses + 2


def _written(
    kind: VariableAggregation, centrals: list[torch.Tensor], values: list[list[torch.Tensor]],
    assigned: bool, aligned: bool,
) -> list[list[View]]:
    """Each replica's views of ``centrals`` holding its ``values``, written (assigned, or
    moved by their version counter): in the same order for every replica (``aligned``,
    ``folding._apply_aligned``'s case) or the last replica's reversed (the general one)."""
    records = [Central(id(c), weakref.ref(c), kind, False) for c in centrals]
    touched = []
    for r, mine in enumerate(values):
        views = [View(record, value, private=True) for record, value in zip(records, mine)]
        for view in views:
            view.assigned = assigned
            view.start_version -= 0 if assigned else 1
        if not aligned and r == len(values) - 1:
            views.reverse()
        touched.append(views)
    return touched


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
@pytest.mark.parametrize("aggregation", ["SUM", "MEAN"])
@pytest.mark.parametrize("assigned", [False, True], ids=["moved", "assigned"])
def test_writes_combined_together_match_each_variables_own_arithmetic(
    aggregation: str, assigned: bool, aligned: bool
) -> None:
    """Three replicas' writes to two floating-point variables, combined for all variables at
    once (``_apply_together``): bit for bit what ``write_term``, ``sum_in_order`` and
    ``written_value`` give each variable, with values whose sums depend on their order."""
    kind = VariableAggregation[aggregation]
    starts = [torch.tensor([0.0, 3.0]), torch.tensor([0.0])]
    values = [  # per replica, per variable: in replica order 1e8 - 1e8 + 1 == 1, reversed 0
        [torch.tensor([1e8, 1.0]), torch.tensor([1.0])],
        [torch.tensor([-1e8, 1e-8]), torch.tensor([1e8])],
        [torch.tensor([1.0, 7.0]), torch.tensor([-1e8])],
    ]
    expected = []
    for v, start in enumerate(starts):
        terms = [
            write_term(kind, start, values[r][v], 1, assigned, assigned) for r in range(3)
        ]
        expected.append(written_value(kind, start, sum_in_order(terms), 3, assigned))
    centrals = [start.clone() for start in starts]
    folding.apply_writes(_written(kind, centrals, values, assigned, aligned), 3)
    for central, value in zip(centrals, expected, strict=True):
        assert torch.equal(central, value)
    assert values[0][0].tolist() == [1e8, 1.0]  # a replica's own tensors are not written
    assert centrals[0][0].item() == pytest.approx(1.0 if aggregation == "SUM" else 1.0 / 3)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_mean_and_first_replica_writes_fold_the_same_bits_as_assignments_or_moves(
    replicas: int, aligned: bool
) -> None:
    """A write read off a module slot is a moved counter, the same write through the
    variables' class an assignment (``out=``, ``copy_``): under MEAN and ONLY_FIRST_REPLICA
    both fold the replicas' final values, bit for bit alike, where the mean of their moves
    from the start, ``c + ((a0 - c) + (a1 - c)) / 2``, differs in the last bit."""
    starts = [torch.tensor([1.0, -3.0, 0.5]), torch.tensor([2.0])]
    values = [
        [torch.tensor([1e-8, 0.7, -2.9]) * (r + 1), torch.tensor([0.1 + r])]
        for r in range(replicas)
    ]
    moves = starts[0] + sum_in_order([v[0] - starts[0] for v in values]) / replicas
    finals = sum_in_order([v[0] for v in values]) / replicas
    assert not torch.equal(moves, finals)  # the arithmetic of moves would differ
    for kind in (VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA):
        folded = []
        for assigned in (False, True):
            centrals = [start.clone() for start in starts]
            folding.apply_writes(_written(kind, centrals, values, assigned, aligned), replicas)
            folded.append(centrals)
        for moved, assigned_ in zip(*folded, strict=True):
            assert torch.equal(moved, assigned_)
        expected = finals if kind is VariableAggregation.MEAN else values[0][0]
        assert torch.equal(folded[0][0], expected)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
@pytest.mark.parametrize("assigned", [False, True], ids=["moved", "assigned"])
def test_mean_writes_three_replicas_left_alike_take_their_value_exactly(
    assigned: bool, aligned: bool
) -> None:
    """Three replicas that leave a MEAN variable at the same value (a power iteration's
    vector, a constant): the variable takes that value bit for bit, as on one device, where
    the mean of three equal values misses it in the last bit; left apart, the mean."""
    kind = VariableAggregation.MEAN
    starts = [torch.tensor([1.0, -3.0, 0.5, 0.0]), torch.tensor([2.0])]
    alike = [torch.tensor([1e-8, 0.7, -2.9, 0.1]), torch.tensor([0.1])]
    assert not torch.equal(sum_in_order([alike[0]] * 3) / 3, alike[0])
    centrals = [start.clone() for start in starts]
    values = [[a.clone() for a in alike] for _ in range(3)]
    folding.apply_writes(_written(kind, centrals, values, assigned, aligned), 3)
    for central, value in zip(centrals, alike, strict=True):
        assert torch.equal(central, value)
    values[-1][1] += 1.0  # one replica left one variable elsewhere: the mean, as before
    centrals = [start.clone() for start in starts]
    folding.apply_writes(_written(kind, centrals, values, assigned, aligned), 3)
    for central, v in zip(centrals, range(2), strict=True):
        assert torch.equal(central, sum_in_order([values[r][v] for r in range(3)]) / 3)


def test_values_on_gpus_come_to_their_variables_in_one_copy_per_device_and_dtype(
    fake_gpus: Any,
) -> None:
    """Values on the variables' device stay as they are; the others come in one copy for
    each device and dtype they are on, each to its own place in the list."""
    centrals = [torch.zeros(2, 2), torch.zeros(3), torch.zeros(1), torch.zeros(2),
                torch.zeros(0), torch.zeros(2)]
    values = [
        torch.arange(4.0).view(2, 2).to("cuda:0"), torch.ones(3, device="cuda:1"),
        torch.full((1,), 7.0, device="cuda:0"), torch.ones(2, dtype=torch.float64,
                                                            device="cuda:0"),
        torch.zeros(0, device="cuda:1"), torch.tensor([4.0, 5.0]),
    ]
    copies = sum(n for (what, _), n in fake_gpus.calls.items() if what == "copy to host")
    brought = _brought(centrals, values)
    assert sum(n for (what, _), n in fake_gpus.calls.items() if what == "copy to host") == (
        copies + 3
    )
    assert [b.device.type for b in brought] == ["cpu"] * 6
    assert [b.dtype for b in brought] == [torch.float32] * 3 + [torch.float64] + [
        torch.float32] * 2
    for got, value in zip(brought, values, strict=True):
        assert got.shape == value.shape and torch.equal(got, value.cpu())
    assert brought[5] is values[5]
    assert _brought(centrals, centrals) is centrals  # already there: as they are


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
@pytest.mark.parametrize("aggregation", ["SUM", "ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("assigned", [False, True], ids=["moved", "assigned"])
def test_integer_writes_combined_together_match_each_variables_own_arithmetic(
    aggregation: str, assigned: bool, aligned: bool
) -> None:
    """Counters (``num_batches_tracked``) written by two replicas: combined with the other
    counters at once, the value each variable's own arithmetic gives (the first writer's
    alone for ONLY_FIRST_REPLICA)."""
    kind = VariableAggregation[aggregation]
    starts = [torch.tensor(5), torch.tensor([1, 2])]
    values = [[torch.tensor(6), torch.tensor([3, 2])], [torch.tensor(9), torch.tensor([1, 7])]]
    writers = 1 if kind is VariableAggregation.ONLY_FIRST_REPLICA else 2
    expected = []
    for v, start in enumerate(starts):
        terms = [
            write_term(kind, start, values[r][v], 1, assigned, assigned) for r in range(writers)
        ]
        expected.append(written_value(kind, start, sum_in_order(terms), writers, assigned))
    centrals = [start.clone() for start in starts]
    folding.apply_writes(_written(kind, centrals, values, assigned, aligned), 2)
    for central, value in zip(centrals, expected, strict=True):
        assert central.dtype == torch.int64 and torch.equal(central, value)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
def test_writes_to_a_sparse_buffer_combine_as_dense_ones_do(aligned: bool) -> None:
    """Two replicas assigning a sparse SUM buffer: the sum of their values, on either path
    (a sparse variable is combined on its own, not with the dense ones)."""
    central = torch.zeros(3, 3).to_sparse()
    dense = torch.zeros(2)
    values = [[torch.eye(3).to_sparse(), torch.ones(2)],
              [2 * torch.eye(3).to_sparse(), torch.ones(2)]]
    folding.apply_writes(
        _written(VariableAggregation.SUM, [central, dense], values, True, aligned), 2
    )
    assert torch.equal(central.to_dense(), 3 * torch.eye(3))
    assert torch.equal(dense, torch.full((2,), 2.0))
