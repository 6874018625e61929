"""The context functions (docs/design.md §3.2): the table for all four places, scopes,
threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from paths import PATHS, run_on, strategy_on

import centralstore as cs
from centralstore import _context


def strategy_of(replicas: int) -> cs.CentralStorageStrategy:
    return cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])


def observe() -> dict[str, Any]:
    return {
        "strategy": cs.get_strategy(),
        "has_strategy": cs.has_strategy(),
        "cross_replica": cs.in_cross_replica_context(),
        "replica_context": cs.get_replica_context(),
    }


# -- the table ---------------------------------------------------------------------------------


def test_outside_everything() -> None:
    seen = observe()
    assert isinstance(seen["strategy"], cs.OneDeviceStrategy)
    assert seen["strategy"].compute_devices == ("cpu:0",)
    assert seen["strategy"] is _context.default().strategy
    assert seen["has_strategy"] is False
    assert seen["cross_replica"] is False
    context = seen["replica_context"]
    assert isinstance(context, cs.ReplicaContext)
    assert context.strategy is seen["strategy"]
    assert context.replica_id_in_sync_group == 0
    assert context.num_replicas_in_sync == 1


def test_inside_scope() -> None:
    strategy = strategy_of(2)
    with strategy.scope() as entered:
        seen = observe()
    assert entered is strategy
    assert seen == {
        "strategy": strategy, "has_strategy": True, "cross_replica": True, "replica_context": None,
    }
    assert observe()["strategy"] is _context.default().strategy


@pytest.mark.parametrize("in_scope", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_inside_run(in_scope: bool, replicas: int) -> None:
    strategy = strategy_of(replicas)

    def run() -> Any:
        return strategy.run(observe)

    if in_scope:
        with strategy.scope():
            out = run()
    else:
        out = run()
    seen = strategy.experimental_local_results(out["replica_context"])
    assert [rc.replica_id_in_sync_group for rc in seen] == list(range(replicas))
    for rc in seen:
        assert isinstance(rc, cs.ReplicaContext)
        assert rc.strategy is strategy
    assert out["strategy"] is strategy
    assert out["has_strategy"] is True
    assert out["cross_replica"] is False


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_inside_merge_call(replicas: int) -> None:
    strategy = strategy_of(replicas)
    merged: list[dict[str, Any]] = []

    def step() -> None:
        context = cs.get_replica_context()
        assert context is not None
        context.merge_call(lambda s: merged.append({**observe(), "argument": s}))

    strategy.run(step)
    assert len(merged) == 1
    assert merged[0] == {
        "strategy": strategy, "has_strategy": True, "cross_replica": True,
        "replica_context": None, "argument": strategy,
    }


def test_after_run_and_merge_call_the_outer_context_is_back() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        strategy.run(lambda: cs.get_replica_context().merge_call(lambda s: None))  # type: ignore[union-attr]
        assert cs.in_cross_replica_context()
        assert cs.get_strategy() is strategy
    assert not cs.has_strategy()


def test_an_explicit_one_device_strategy_is_not_the_default() -> None:
    strategy = cs.OneDeviceStrategy("cpu:0")
    assert strategy is not _context.default().strategy
    with strategy.scope():
        assert cs.has_strategy()
    assert strategy.run(cs.has_strategy) is True


def test_the_default_strategy_can_run_and_nest_its_run() -> None:
    default = cs.get_strategy()
    assert default.run(lambda: default.run(lambda: 3) + 1) == 4
    assert default.run(cs.has_strategy) is False


# -- scopes ------------------------------------------------------------------------------------


def test_reentering_the_same_scope_is_fine() -> None:
    strategy = strategy_of(2)
    with strategy.scope(), strategy.scope():
        assert cs.get_strategy() is strategy
    with strategy.scope():
        assert cs.get_strategy() is strategy
        with strategy.scope():
            assert cs.in_cross_replica_context()
        assert cs.get_strategy() is strategy
    assert not cs.has_strategy()


def test_mixing_strategies_raises() -> None:
    outer, inner = strategy_of(2), strategy_of(2)
    with outer.scope():
        with pytest.raises(RuntimeError, match="Mixing different strategies") as info:
            inner.scope().__enter__()
        assert cs.get_strategy() is outer  # the failed entry left nothing behind
    assert repr(outer) in str(info.value)
    assert not cs.has_strategy()


def test_mixing_strategies_inside_merge_call_raises() -> None:
    outer, inner = strategy_of(2), strategy_of(2)

    def merge(strategy: cs.Strategy) -> None:
        with inner.scope():
            pass  # pragma: no cover

    with pytest.raises(RuntimeError, match="Mixing different strategies"):
        outer.run(lambda: cs.get_replica_context().merge_call(merge))  # type: ignore[union-attr]
    assert outer.run(lambda: 1) == 1


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda s: s.run(lambda: None), "run()"),
        (lambda s: s.reduce("SUM", cs.PerReplica([1, 2])), "reduce()"),
        (lambda s: s.scope().__enter__(), "scope()"),
        (lambda s: s.experimental_run_v2(lambda: None), "run()"),
    ],
)
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("after_a_run", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_cross_replica_calls_in_a_replica_raise(
    call: Any, name: str, replicas: int, after_a_run: bool, path: str
) -> None:
    """On every path, in a strategy's first run and in later ones (where one replica's runs
    take the short path)."""
    strategy = strategy_on(path, replicas)
    if after_a_run:
        run_on(path, strategy, lambda: None)
    with pytest.raises(RuntimeError, match="merge_call") as info:
        run_on(path, strategy, lambda: call(strategy))
    assert f"strategy.{name} was called in replica context" in str(info.value)
    assert info.value.__notes__ == ["(raised in replica 0 on device cpu:0)"]
    assert strategy.run(lambda: 5) == 5


def test_cross_replica_calls_work_in_merge_call() -> None:
    strategy = strategy_of(2)

    def merge(s: cs.Strategy, value: cs.PerReplica[int]) -> Any:
        with s.scope():
            return s.reduce("SUM", value)

    total = strategy.run(
        lambda: cs.get_replica_context().merge_call(  # type: ignore[union-attr]
            merge, args=(cs.get_replica_context().replica_id_in_sync_group + 1,)  # type: ignore[union-attr]
        )
    )
    assert int(total) == 3


# -- threads -----------------------------------------------------------------------------------


def test_the_context_is_per_thread() -> None:
    strategy = strategy_of(2)
    seen: list[dict[str, Any]] = []
    with strategy.scope():
        thread = threading.Thread(target=lambda: seen.append(observe()))
        thread.start()
        thread.join()
        assert cs.get_strategy() is strategy
    assert seen[0]["strategy"] is _context.default().strategy
    assert seen[0]["has_strategy"] is False
    assert isinstance(seen[0]["replica_context"], cs.ReplicaContext)


def test_a_thread_started_in_a_replica_does_not_see_the_replica_context() -> None:
    strategy = strategy_of(2)

    def step() -> bool:
        seen: list[bool] = []
        thread = threading.Thread(target=lambda: seen.append(cs.has_strategy()))
        thread.start()
        thread.join()
        return seen[0]

    assert strategy.experimental_local_results(strategy.run(step)) == (False,)
    assert strategy.run(step) is False  # the same object from every replica is unwrapped
