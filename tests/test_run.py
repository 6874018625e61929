"""``strategy.run`` (docs/design.md §3.3): arguments, regrouping, dispatch, inherited
state, faults."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from paths import each_path, run_on, step_on, strategy_on
from replicas import context, local, replica_id, strategy_of

import centralstore as cs
from centralstore import _replicas

REPLICAS = [1, 2, 3, 4]


# -- arguments (3.3.1) -------------------------------------------------------------------------


@pytest.mark.parametrize("args", [None, 1, "ab", torch.ones(2), {"x": 1}, iter([1])])
def test_args_must_be_a_list_or_tuple(args: Any) -> None:
    with pytest.raises(ValueError, match="args must be a list or a tuple") as info:
        strategy_of(2).run(lambda *a: a, args=args)
    assert f"args={args!r}" in str(info.value)


@pytest.mark.parametrize("kwargs", [[("x", 1)], (), "x", 3])
def test_kwargs_must_be_a_dict(kwargs: Any) -> None:
    with pytest.raises(ValueError, match="kwargs must be a dict"):
        strategy_of(2).run(lambda **k: k, kwargs=kwargs)


def test_args_may_be_a_list_and_kwargs_none() -> None:
    strategy = strategy_of(2)
    assert strategy.run(lambda a, b: a + b, args=[1, 2], kwargs=None) == 3


@each_path
@pytest.mark.parametrize("replicas", [1, 2])
def test_flat_keyword_arguments_reach_each_replica_as_positional_ones_do(
    path: str, replicas: int
) -> None:
    """``run(fn, args=..., kwargs=...)`` with a ``PerReplica``, a tensor and Python scalars
    among the keywords: each replica gets its component and the shared values themselves."""
    strategy = strategy_on(path, replicas)
    shared = torch.ones(1)
    x = cs.PerReplica([torch.full((1,), float(r)) for r in range(replicas)])
    labels = cs.PerReplica([10 * r for r in range(replicas)])

    def step(xs: torch.Tensor, *, labels: int, scale: float, mask: torch.Tensor,
             note: str | None) -> tuple[int, float, int, bool, str | None]:
        return replica_id(), float(xs) * scale, labels, mask is shared, note

    out = strategy.run(
        step_on(path, step), args=(x,),
        kwargs={"labels": labels, "scale": 2.0, "mask": shared, "note": None},
    )
    assert list(local(strategy, out)) == [(r, 2.0 * r, 10 * r, True, None) for r in range(replicas)]


@pytest.mark.parametrize("replicas", REPLICAS)
def test_per_replica_leaves_are_unwrapped_anywhere(replicas: int) -> None:
    strategy = strategy_of(replicas)
    shared = object()
    a = cs.PerReplica([10 * r for r in range(replicas)])
    b = cs.PerReplica([f"b{r}" for r in range(replicas)])

    def step(x: int, nested: Any, *, key: Any, plain: object) -> Any:
        return (replica_id(), x, nested["deep"][1], key.field, plain is shared)

    Pair = namedtuple("Pair", "field other")
    out = strategy.run(
        step,
        args=(a, {"deep": [0, b]}),
        kwargs={"key": Pair(a, 1), "plain": shared},
    )
    rows = local(strategy, out)
    assert len(rows) == replicas
    for r, row in enumerate(rows):
        assert row == (r, 10 * r, f"b{r}", 10 * r, True)


# -- outputs (3.3.2, 3.3.3, 3.8.5) --------------------------------------------------------------


def test_one_replica_returns_the_output_unwrapped() -> None:
    strategy = strategy_of(1)
    tensor = torch.ones(2)
    output = {"a": [tensor], "b": (1, "x")}
    assert strategy.run(lambda: output) is output
    assert strategy.run(lambda t: t, args=(tensor,)) is tensor
    assert strategy.run(lambda: cs.PerReplica([1])).values == (1,)  # not unwrapped either
    assert cs.OneDeviceStrategy("cpu:1").run(replica_id) == 0


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_structures_are_regrouped_leaf_by_leaf(replicas: int) -> None:
    strategy = strategy_of(replicas)
    Point = namedtuple("Point", "x y")
    shared = torch.zeros(1)

    def step() -> Any:
        r = replica_id()
        return {"t": (r, [r * 2, shared]), "p": Point(x=r, y="same"), "l": [torch.full((1,), r)]}

    out = strategy.run(step)
    assert set(out) == {"t", "p", "l"}
    assert isinstance(out["t"], tuple) and isinstance(out["t"][1], list)
    assert isinstance(out["p"], Point)
    assert out["t"][0].values == tuple(range(replicas))
    assert out["t"][1][0].values == tuple(2 * r for r in range(replicas))
    assert out["t"][1][1] is shared
    assert out["p"].x.values == tuple(range(replicas))
    assert out["p"].y == "same"
    assert [int(t) for t in out["l"][0].values] == list(range(replicas))


@dataclasses.dataclass
class Stats:
    loss: Any
    name: str


pytree.register_dataclass(Stats)


def test_registered_dataclasses_are_regrouped() -> None:
    strategy = strategy_of(2)
    out = strategy.run(lambda: Stats(loss=replica_id(), name="n"))
    assert isinstance(out, Stats)
    assert out.loss.values == (0, 1)
    assert out.name == "n"


@pytest.mark.parametrize("replicas", [2, 3])
def test_the_same_object_from_every_replica_is_returned_unwrapped(replicas: int) -> None:
    strategy = strategy_of(replicas)
    shared = [torch.ones(1)]
    assert strategy.run(lambda: shared) is shared
    assert strategy.run(lambda: None) is None
    out = strategy.run(lambda: [shared[0], torch.ones(1)])
    assert out[0] is shared[0]
    assert isinstance(out[1], cs.PerReplica)


def test_equal_but_distinct_objects_become_per_replica() -> None:
    strategy = strategy_of(2)
    out = strategy.run(lambda: torch.ones(1))
    assert isinstance(out, cs.PerReplica)
    assert out[0] is not out[1]


@pytest.mark.parametrize(
    "outputs",
    [(1, (1,)), ((1, 2), (1, 2, 3)), ({"a": 1}, {"b": 1}), ([1], (1,)), ((None,), None)],
)
def test_differing_structures_raise(outputs: tuple[Any, Any]) -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match="Every replica must return the same structure") as info:
        strategy.run(lambda: outputs[replica_id()])
    assert "replica 0 returned" in str(info.value) and "replica 1 returned" in str(info.value)


def test_none_from_one_replica_and_a_value_from_another_is_a_structure_mismatch() -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match="replica 0 returned None and replica 1 returned int"):
        strategy.run(lambda: (None, 1)[replica_id()])
    assert strategy.run(lambda: None) is None


@each_path
@pytest.mark.parametrize("replicas", [1, 2])
def test_evaluation_outside_run_uses_the_variables_themselves(path: str, replicas: int) -> None:
    """The README's advice for evaluation where the variables live on the device that
    computes: outside ``run`` the model's parameters and buffers are plain ones, so one
    pass over the whole batch gives what the replicas' passes give, and neither changes
    them."""
    strategy = strategy_on(path, replicas)
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
        ).eval()
    model[1].running_mean.fill_(0.5)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    x = torch.randn(4 * replicas, 3)

    @torch.no_grad()
    def loss(xs: torch.Tensor) -> torch.Tensor:
        return model(xs).pow(2).sum()

    inside = strategy.reduce(
        "SUM", run_on(path, strategy, loss, args=(cs.PerReplica(list(x.chunk(replicas))),)),
        axis=None,
    )
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(type(b) is torch.Tensor for b in model.buffers())
    outside = loss(x)
    torch.testing.assert_close(outside, inside)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_experimental_run_v2_is_run() -> None:
    assert cs.CentralStorageStrategy.experimental_run_v2 is cs.CentralStorageStrategy.run
    strategy = strategy_of(2)
    assert strategy.experimental_run_v2(lambda x: x + 1, args=(1,)) == 2
    assert strategy.experimental_run_v2(replica_id).values == (0, 1)


# -- dispatch (3.3.4) --------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", REPLICAS)
def test_replicas_run_in_order_on_the_calling_thread(replicas: int) -> None:
    strategy = strategy_of(replicas)
    order: list[tuple[int, threading.Thread]] = []
    strategy.run(lambda: order.append((replica_id(), threading.current_thread())))
    assert order == [(r, threading.current_thread()) for r in range(replicas)]


@pytest.mark.parametrize("replicas", REPLICAS)
def test_each_replica_has_its_device(replicas: int) -> None:
    strategy = strategy_of(replicas)
    devices = local(strategy, strategy.run(lambda: context().device))
    assert devices == tuple(torch.device("cpu", r) for r in range(replicas))


@pytest.mark.parametrize("rendezvous", ["all_reduce", "all_gather", "merge_call"])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_a_rendezvous_moves_the_replicas_after_the_first_to_worker_threads(
    rendezvous: str, replicas: int
) -> None:
    strategy = strategy_of(replicas)
    calls = {
        "all_reduce": lambda rc: rc.all_reduce("SUM", torch.ones(1)),
        "all_gather": lambda rc: rc.all_gather(torch.ones(1), 0),
        "merge_call": lambda rc: rc.merge_call(lambda s: None),
    }

    def step() -> Any:
        before = threading.current_thread()
        calls[rendezvous](context())
        return before, threading.current_thread(), context().device

    out = strategy.run(step)
    befores, afters, devices = (local(strategy, leaf) for leaf in out)
    assert befores == afters
    assert befores[0] is threading.current_thread()
    workers = befores[1:]
    assert all(t is not threading.current_thread() for t in workers)
    assert len({id(t) for t in workers}) == replicas - 1
    assert devices == tuple(torch.device("cpu", r) for r in range(replicas))
    # The worker threads persist: the next threaded run uses the same ones.
    again = local(strategy, strategy.run(step)[0])
    assert again[1:] == workers


def test_one_replica_meets_a_rendezvous_without_a_thread() -> None:
    strategy = strategy_of(1)
    out = strategy.run(lambda: (context().all_reduce("SUM", 2.0), threading.current_thread()))
    assert float(out[0]) == 2.0
    assert out[1] is threading.current_thread()


@pytest.mark.parametrize("grad", [True, False])
def test_worker_threads_inherit_grad_mode(grad: bool) -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        context().all_reduce("SUM", 1.0)
        return torch.is_grad_enabled(), threading.current_thread()

    with torch.set_grad_enabled(grad):
        modes, threads = strategy.run(step)
    assert modes is grad  # the same object from every replica
    assert local(strategy, threads)[2] is not threading.current_thread()
    assert torch.is_grad_enabled()


def test_worker_threads_inherit_inference_mode() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        context().all_reduce("SUM", 1.0)
        return torch.is_inference_mode_enabled()

    with torch.inference_mode():
        assert strategy.run(step) is True
    assert strategy.run(step) is False


def test_worker_threads_inherit_autocast() -> None:
    strategy = strategy_of(2)
    a, b = torch.ones(2, 2), torch.ones(2, 2)

    def step() -> Any:
        context().all_reduce("SUM", 1.0)
        return (
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), (a @ b).dtype,
        )

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = strategy.run(step)
    assert out == (True, torch.bfloat16, torch.bfloat16)
    enabled, _, dtype = strategy.run(step)
    assert (enabled, dtype) == (False, torch.float32)


# -- faults (3.3.5, 3.8.6) ---------------------------------------------------------------------


class ReplicaError(Exception):
    pass


def failing_step(failing: set[int], errors: dict[int, BaseException], where: str) -> Any:
    """A step whose ``failing`` replicas raise while the others wait: in ``all_reduce``
    (``where="all_reduce"``), or in ``merge_call`` after one ``all_reduce`` together."""

    def step() -> Any:
        rc = context()
        r = rc.replica_id_in_sync_group
        if where == "merge_call":
            rc.all_reduce("SUM", torch.ones(1))
        if r in failing:
            raise errors[r]
        rc.all_reduce("SUM", torch.ones(1))
        rc.merge_call(lambda s: None)
        return r

    return step


FAULTS = [
    (replicas, failing)
    for replicas in (2, 3, 4)
    for failing in ({0}, {1}, {2}, {3}, {1, 2}, {0, 3}, {2, 3}, set(range(replicas)))
    if max(failing) < replicas
]


@pytest.mark.parametrize(("replicas", "failing"), FAULTS)
@pytest.mark.parametrize("where", ["all_reduce", "merge_call"])
def test_the_lowest_failing_replica_raises_and_the_strategy_stays_usable(
    replicas: int, failing: set[int], where: str
) -> None:
    strategy = strategy_of(replicas)
    errors: dict[int, BaseException] = {r: ReplicaError(f"replica {r}") for r in failing}
    start = time.monotonic()
    with pytest.raises(ReplicaError) as info:
        strategy.run(failing_step(failing, errors, where))
    assert time.monotonic() - start < 5
    lowest = min(failing)
    assert info.value is errors[lowest]
    assert info.value.__notes__ == [f"(raised in replica {lowest} on device cpu:{lowest})"]
    expected = tuple(range(replicas))
    assert local(strategy, strategy.run(replica_id)) == expected
    assert local(strategy, strategy.run(failing_step(set(), {}, "all_reduce"))) == expected


def test_replicas_after_a_failing_one_do_not_run_sequentially() -> None:
    strategy = strategy_of(3)
    ran: list[int] = []

    def step() -> None:
        ran.append(replica_id())
        if replica_id() == 1:
            raise KeyError("k")

    with pytest.raises(KeyError) as info:
        strategy.run(step)
    assert ran == [0, 1]
    assert info.value.__notes__ == ["(raised in replica 1 on device cpu:1)"]


def test_an_error_in_combine_fails_replica_zero_and_releases_the_others() -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        return context().all_reduce("SUM", torch.ones(replica_id() + 1))

    with pytest.raises(ValueError, match="same shape") as info:
        strategy.run(step)
    assert info.value.__notes__ == ["(raised in replica 0 on device cpu:0)"]


def test_an_error_in_backward_through_all_reduce_releases_the_others() -> None:
    strategy = strategy_of(3)

    def step(fail: bool) -> Any:
        w = torch.ones(1, requires_grad=True)
        y = context().all_reduce("SUM", w * 2)
        if fail and replica_id() == 2:
            raise ReplicaError("in backward's place")
        y.sum().backward()
        return w.grad

    with pytest.raises(ReplicaError):
        strategy.run(step, args=(True,))
    grads = local(strategy, strategy.run(step, args=(False,)))
    assert [float(g) for g in grads] == [6.0, 6.0, 6.0]


def new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads alive now that were not in ``before`` (other tests' threads may end meanwhile)."""
    return set(threading.enumerate()) - before


def test_two_hundred_faults_leave_no_hang_and_no_leaked_thread() -> None:
    strategy = strategy_of(3)
    strategy.run(lambda: context().all_reduce("SUM", 1.0))  # start the workers
    threads = set(threading.enumerate())
    start = time.monotonic()
    for i in range(200):
        failing = i % 3
        where = ("all_reduce", "merge_call")[i % 2]
        error = ReplicaError(str(i))
        with pytest.raises(ReplicaError) as info:
            strategy.run(failing_step({failing}, {failing: error}, where))
        assert info.value is error
        assert info.value.__notes__ == [f"(raised in replica {failing} on device cpu:{failing})"]
        assert not new_threads(threads)
    total = strategy.run(lambda: context().all_reduce("SUM", 1.0))
    assert [float(t) for t in local(strategy, total)] == [3.0, 3.0, 3.0]
    assert not new_threads(threads)
    assert time.monotonic() - start < 60


def test_worker_threads_stop_when_the_strategy_is_collected() -> None:
    before = set(threading.enumerate())
    strategy = strategy_of(3)
    strategy.run(lambda: context().all_reduce("SUM", 1.0))
    workers = new_threads(before)
    assert len(workers) == 2
    del strategy
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in workers)


def test_replica_zero_waits_while_replica_one_returns() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        if replica_id() == 1:
            return 1
        return context().all_reduce("SUM", 1.0)

    with pytest.raises(RuntimeError) as info:
        strategy.run(step)
    assert str(info.value).startswith(
        "Replica 1 returned without calling all_reduce, which replica 0 called."
    )
    assert info.value.__notes__ == ["(raised in replica 1 on device cpu:1)"]
    assert strategy.run(replica_id).values == (0, 1)


@pytest.mark.parametrize("replicas", [2, 3])
def test_replica_zero_returns_while_replica_one_calls_all_reduce(replicas: int) -> None:
    strategy = strategy_of(replicas)

    def step() -> Any:
        if replica_id() == 0:
            return 0
        return context().all_reduce("SUM", 1.0)

    with pytest.raises(RuntimeError) as info:
        strategy.run(step)
    assert str(info.value).startswith(
        "Replica 0 returned without calling all_reduce, which replica 1 called."
    )
    assert info.value.__notes__ == ["(raised in replica 0 on device cpu:0)"]
    assert local(strategy, strategy.run(replica_id)) == tuple(range(replicas))


@pytest.mark.parametrize("early", [0, 1, 2])
def test_a_replica_that_returns_before_a_second_rendezvous_is_blamed_whatever_the_timing(
    early: int,
) -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        rc = context()
        rc.all_reduce("SUM", 1.0)
        if rc.replica_id_in_sync_group == early:
            return 0
        return rc.merge_call(lambda s: 1)

    for _ in range(20):  # the returning and the calling replicas race; the verdict must not
        with pytest.raises(RuntimeError, match=r"which replica \d called") as info:
            strategy.run(step)
        assert str(info.value).startswith(f"Replica {early} returned without calling merge_call")
        assert info.value.__notes__ == [f"(raised in replica {early} on device cpu:{early})"]


def test_replicas_that_meet_in_different_collectives_raise() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        rc = context()
        if rc.replica_id_in_sync_group == 0:
            return rc.all_reduce("SUM", 1.0)
        return rc.merge_call(lambda s: 1)

    with pytest.raises(RuntimeError, match="different collective calls"):
        strategy.run(step)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_collective_after_run_returned_raises(replicas: int, direct: bool) -> None:
    """(One replica runs on the calling thread without the dispatcher's loop: its run
    state is closed all the same, whether the replicas use the weight or views of it. From
    its second run it takes the short path, whose state and replica context serve every
    such run: the backward of an earlier run's collective raises inside a later run too.)"""
    strategy = strategy_of(replicas, direct=direct)
    with strategy.scope():
        layer = torch.nn.Linear(1, 1)

    def step() -> Any:
        return context().all_reduce("SUM", layer(torch.ones(1)))

    outs = [strategy.experimental_local_results(strategy.run(step)) for _ in range(4)]
    for out in outs[:3]:  # the first run on the general path, then (R = 1) the short one
        with pytest.raises(RuntimeError, match="run has already returned"):
            out[0].backward()
    with pytest.raises(RuntimeError, match="run has already returned"):
        strategy.run(lambda: outs[3][0].backward())
    assert layer.weight.grad is None  # (the failed run left .grad as it was)
    strategy.run(lambda: step().backward())  # a collective's own backward still meets
    assert layer.weight.grad is not None


def test_a_worker_that_cannot_start_fails_the_run_without_a_hang() -> None:
    strategy = strategy_of(3)
    pool = strategy._pool
    submit = pool.submit

    def refuse(crew: int, replica: int, task: Any) -> None:
        if replica == 2:
            raise RuntimeError("can't start new thread")
        submit(crew, replica, task)

    pool.submit = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="can't start new thread") as info:
            strategy.run(lambda: context().all_reduce("SUM", 1.0))
        assert info.value.__notes__ == ["(raised in replica 0 on device cpu:0)"]
    finally:
        del pool.submit
    total = strategy.run(lambda: context().all_reduce("SUM", 1.0))
    assert [float(t) for t in local(strategy, total)] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("rendezvous", [False, True])
def test_a_run_inside_merge_call_gets_its_own_workers(rendezvous: bool) -> None:
    strategy = strategy_of(3)

    def inner() -> Any:
        return context().all_reduce("SUM", 1.0) if rendezvous else replica_id()

    def step() -> Any:
        nested = context().merge_call(lambda s: s.experimental_local_results(s.run(inner)))
        return [float(x) for x in nested]

    expected = [3.0] * 3 if rendezvous else [0.0, 1.0, 2.0]
    start = time.monotonic()
    assert local(strategy, strategy.run(step)) == (expected,) * 3  # every replica saw it
    assert time.monotonic() - start < 5
    assert local(strategy, strategy.run(step)) == (expected,) * 3


def test_an_error_escaping_a_thread_body_is_recorded_not_lost() -> None:
    pool = _replicas.ThreadPool("test")
    escaped = ReplicaError("escaped")

    def body(state: _replicas.RunState, replica: int) -> None:
        if replica == 0:
            try:
                state.meet(0, "all_reduce", None, lambda values: values)
            except _replicas.ReplicaAborted:
                return
        raise escaped

    try:
        state = _replicas.execute(2, pool, body)
        assert state.errors == [None, escaped]
        state = _replicas.execute(2, pool, body)  # the replica thread survived
        assert state.errors == [None, escaped]
    finally:
        pool.close()


def test_a_replica_returning_while_others_wait_marks_the_run_failed() -> None:
    pool = _replicas.ThreadPool("test")

    def body(state: _replicas.RunState, replica: int) -> None:
        try:
            if replica == 0:
                state.meet(0, "merge_call", None, lambda values: values)
        except _replicas.ReplicaAborted:
            return
        state.returned(replica, replica)

    try:
        state = _replicas.execute(2, pool, body)
    finally:
        pool.close()
    assert state.any_failed
    assert state.errors[0] is None
    assert isinstance(state.errors[1], RuntimeError)
    assert "Replica 1 returned without calling merge_call" in str(state.errors[1])


def test_replica_threads_use_every_intra_op_thread_since_they_run_one_at_a_time() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    before = torch.get_num_threads()

    def step() -> tuple[int, int]:
        cs.get_replica_context().all_reduce("sum", 1.0)  # threads start here
        return replica_id(), torch.get_num_threads()

    counts = strategy.experimental_local_results(strategy.run(step))
    assert counts == ((0, before), (1, before))
    assert torch.get_num_threads() == before  # the caller's count is untouched


def test_per_replica_with_the_wrong_number_of_components_raises() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with pytest.raises(ValueError, match="PerReplica of 2 components, but this strategy runs 3"):
        strategy.run(lambda x: x, args=(cs.PerReplica([1, 2]),))
    with pytest.raises(ValueError, match="one component per replica"):
        strategy.run(lambda x: x, kwargs={"x": [cs.PerReplica([1, 2, 3, 4])]})
    with pytest.raises(ValueError, match="reduce's value"):
        strategy.reduce("MEAN", cs.PerReplica([1.0, 2.0]))


def test_a_reraised_exception_gets_one_note_per_replica() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    error = KeyError("same object")

    def step() -> None:
        raise error

    for _ in range(2):
        with pytest.raises(KeyError):
            strategy.run(step)
    assert error.__notes__ == ["(raised in replica 0 on device cpu:0)"]


@pytest.mark.parametrize("devices", [("cpu:0", "cpu:1"), ("cuda:0", "cuda:1")],
                         ids=["logical", "fake-gpus"])
def test_a_sync_point_between_forward_and_backward_is_named_in_the_error(
    devices: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    """A merge_call between a forward and its backward writes what the backward saved (batch
    norm's statistics; on GPUs, the replicas' copies of the parameters): autograd's error
    gets a note naming the sync point and the fix. The same error from the replica's own
    in-place write, in a run without merge_call, gets none."""
    if devices[0].startswith("cuda"):
        request.getfixturevalue("fake_gpus")
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cpu")
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    xs = cs.PerReplica([torch.randn(4, 3).to(d) for d in devices])

    def merged(x: torch.Tensor) -> None:
        loss = model(x).sum()
        context().merge_call(lambda _: None)
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        strategy.run(merged, args=(xs,))
    assert any("merge_call before the forward" in n for n in raised.value.__notes__)

    def own_write(x: torch.Tensor) -> None:
        y = model[0](x).exp()  # exp's backward needs its result
        loss = y.sum()
        y.add_(1)
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        strategy.run(own_write, args=(xs,))
    assert not any("merge_call" in n for n in raised.value.__notes__)
    strategy.run(lambda x: model(x).sum().backward(), args=(xs,))  # and the next run works


# -- one replica on its variables' device: the short path after the first run -----------------


class _Counted:
    """A spy on ``Strategy._run_alone``: how many runs took the short path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = cs.Strategy._run_alone

        def counted(strategy: cs.Strategy, *args: Any) -> Any:
            self.calls += 1
            return original(strategy, *args)

        monkeypatch.setattr(cs.Strategy, "_run_alone", counted)


def _network() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )


def _trained(strategy: cs.Strategy | None, device: str = "cpu") -> dict[str, Any]:
    """Four runs of a network with batch norm on one replica (or plainly, ``strategy``
    None), between which every rule of a run is met: gradients accumulated in place into a
    filled ``.grad``, a post-accumulate-grad hook, a failed run rolled back (gradients,
    running statistics and the batch counter), an optimizer step inside ``merge_call``,
    and a run inside that ``merge_call``'s function. ``device``: where the replica
    computes, its variables beside it; the values come back in host memory."""
    torch.manual_seed(0)
    initial = _network().state_dict()  # drawn on the host: fake GPUs draw otherwise
    x = torch.randn(5, 3).to(device)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = _network().to(device)
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked: list[torch.Tensor] = []
    model[2].bias.register_post_accumulate_grad_hook(
        lambda p: hooked.append(p.grad.detach().to("cpu", copy=True))
    )

    def run(fn: Any) -> Any:
        return fn() if strategy is None else strategy.run(fn)

    def backward() -> None:
        model(x).square().sum().backward()

    def fails() -> None:
        if strategy is not None:  # (plainly: nothing to roll back)
            backward()
        raise ReplicaError("after backward")

    def steps_in_merge() -> None:
        backward()
        if strategy is None:
            optimizer.step()
        else:
            context().merge_call(lambda s: (optimizer.step(), s.run(lambda: None)))
        backward()

    run(backward)
    first = model[0].weight.grad
    run(backward)  # accumulates into the .grad the first left
    accumulated = model[0].weight.grad
    statistics = [b.clone() for b in model[1].buffers()]
    with pytest.raises(ReplicaError) as failure:
        run(fails)
    notes = getattr(failure.value, "__notes__", [])
    rolled_back = [b.clone() for b in model[1].buffers()]
    run(steps_in_merge)
    return {
        "in place": accumulated is first and model[0].weight.grad is first,
        "statistics": (statistics, rolled_back),
        "notes": notes,
        "hooked": hooked,
        "grads": [p.grad.detach().to("cpu", copy=True) for p in model.parameters()],
        "weights": [p.detach().to("cpu", copy=True) for p in model.parameters()],
    }


@pytest.mark.parametrize(
    ("short", "device"),
    [(True, "cpu:0"), (False, "cpu:0"), (True, "cuda:0"), (False, "cuda:0")],
    ids=["short path", "general path", "short path, fake GPU", "general path, fake GPU"],
)
def test_runs_of_one_replica_keep_the_rules_of_the_general_path(
    short: bool, device: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """On a logical CPU device, and on one fake GPU holding its variables (the short path's
    GPU branch: its GPU current, the GPU replicas' sync-point start)."""
    if device.startswith("cuda"):
        request.getfixturevalue("fake_gpus")
    counted = _Counted(monkeypatch)
    strategy = cs.CentralStorageStrategy([device], parameter_device=device)
    if not short:
        strategy._alone = False  # every run through the general path
    trained = _trained(strategy, device)
    plain = _trained(None)
    assert counted.calls == (3 if short else 0)  # all runs but the first (and the inner one)
    assert trained["in place"] and plain["in place"]
    before, after = trained["statistics"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trained["notes"] == [f"(raised in replica 0 on device {device})"]
    assert len(trained["hooked"]) == len(plain["hooked"]) == 4
    for ours, theirs in zip(trained["hooked"], plain["hooked"], strict=True):
        torch.testing.assert_close(ours, theirs)
    for key in ("grads", "weights"):
        for ours, theirs in zip(trained[key], plain[key], strict=True):
            torch.testing.assert_close(ours, theirs)


def test_a_second_thread_is_refused_during_a_run_of_one_replica_on_the_short_path() -> None:
    strategy = strategy_of(1)
    strategy.run(lambda: None)  # the first run, which checks the modules it calls
    inside, release = threading.Event(), threading.Event()

    def step() -> None:
        inside.set()
        release.wait(10)

    trainer = threading.Thread(target=strategy.run, args=(step,), name="the-trainer")
    trainer.start()
    try:
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match="the-trainer") as info:
            strategy.run(lambda: None)
        assert threading.current_thread().name in str(info.value)
    finally:
        release.set()
        trainer.join(10)
    assert strategy.run(lambda: 1) == 1  # released
