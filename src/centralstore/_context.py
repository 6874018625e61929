"""The thread-local context stack and the context functions.

Each thread has a stack whose bottom entry is the default strategy with its default replica
context. ``strategy.scope()`` and ``merge_call`` push cross-replica entries (no replica
context); each replica of ``run`` pushes an entry with its ``ReplicaContext``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ._replica_context import ReplicaContext
    from .strategies.base import Strategy


class Entry(NamedTuple):
    strategy: Strategy
    replica_context: ReplicaContext | None


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Entry] = []


_local = _Local()
_default: list[Entry] = []


def _default_entry() -> Entry:
    if not _default:
        from ._replica_context import ReplicaContext
        from .strategies.one_device import OneDeviceStrategy

        strategy = OneDeviceStrategy("cpu:0")
        _default.append(Entry(strategy, ReplicaContext(strategy, 0)))
    return _default[0]


def current() -> Entry:
    """The top of this thread's stack."""
    stack = _local.stack
    return stack[-1] if stack else _default_entry()


def push(entry: Entry) -> None:
    _local.stack.append(entry)


def pop() -> None:
    _local.stack.pop()


def default_strategy() -> Strategy:
    """The strategy in force outside every scope: a ``OneDeviceStrategy`` on ``cpu:0``."""
    return _default_entry().strategy


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope or ``run`` we are in, else the default.

    >>> import centralstore as cs
    >>> cs.get_strategy().num_replicas_in_sync
    1
    """
    return current().strategy


def has_strategy() -> bool:
    """Whether a strategy other than the default is current (in a scope, ``run`` or merge)."""
    return current().strategy is not default_strategy()


def in_cross_replica_context() -> bool:
    """True inside ``scope()`` and ``merge_call``; False outside everything and in a replica."""
    return current().replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The ``ReplicaContext`` of the running replica, the default one outside every scope, or
    ``None`` in cross-replica context."""
    return current().replica_context


def in_replica_of_strategy() -> bool:
    """Whether this thread runs a replica of a non-default strategy (cross-replica calls such
    as ``run``, ``reduce`` and ``scope`` are errors there)."""
    entry = current()
    return entry.replica_context is not None and entry.strategy is not default_strategy()
