"""Helpers shared by the tests that run replicas on logical CPU devices."""

from __future__ import annotations

from typing import Any

import centralstore as cs


def strategy_of(replicas: int, direct: bool = True) -> cs.CentralStorageStrategy:
    """A strategy with ``replicas`` replicas on ``cpu:0``, ``cpu:1``, ...; ``direct=False``:
    its replicas see views of every parameter, as replicas on GPUs other than the parameter
    device do, instead of using the parameters directly (``variables/direct.py``)."""
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    if not direct:
        see_views(strategy)
    return strategy


def see_views(strategy: cs.CentralStorageStrategy) -> None:
    """Make ``strategy``'s replicas see views of every parameter and buffer
    (``strategy_of``'s ``direct=False``), for a strategy made elsewhere (by an
    integration's tests)."""
    store = strategy._store
    store.on_parameters = (False,) * len(store.on_parameters)
    store.on_storage = (False,) * len(store.on_storage)
    store._plan = None


def context() -> cs.ReplicaContext:
    """The running replica's context (never None inside ``run``)."""
    rc = cs.get_replica_context()
    assert rc is not None
    return rc


def replica_id() -> int:
    return context().replica_id_in_sync_group


def local(strategy: cs.Strategy, value: Any) -> tuple[Any, ...]:
    return strategy.experimental_local_results(value)
