"""The thread-local context stack.

Each thread has a stack whose bottom entry is the default strategy with its default replica
context. ``strategy.scope()`` and ``merge_call`` push cross-replica entries (no replica
context); each replica of ``run`` pushes an entry with its ``ReplicaContext``. An entry also
carries its strategy's variable store, so that code below the strategy reaches the store of
the current strategy without knowing the strategy.

The default entry is installed from above (``strategies/one_device.py``), the only module
that knows which strategy is the default; the public context functions that type the
entries live in ``strategies/context.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple


class Entry(NamedTuple):
    strategy: object  # a Strategy: typed where it is read (strategies/context.py)
    replica_context: object | None  # its ReplicaContext; None in cross-replica context
    store: object  # the strategy's VariableStore: typed where it is read (variables/store.py)


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Entry] = []


_local = _Local()
_default: list[Entry] = []
_make_default: list[Callable[[], Entry]] = []


def install_default(make: Callable[[], Entry]) -> None:
    """Say how the default entry is made (on first use, once per process)."""
    _make_default[:] = [make]


def _default_entry() -> Entry:
    if not _default:
        if not _make_default:  # pragma: no cover - importing centralstore installs it
            raise RuntimeError("centralstore's default strategy is not installed")
        _default.append(_make_default[0]())
    return _default[0]


def current() -> Entry:
    """The top of this thread's stack."""
    stack = _local.stack
    return stack[-1] if stack else _default_entry()


def push(entry: Entry) -> None:
    _local.stack.append(entry)


def pop() -> None:
    _local.stack.pop()


def default() -> Entry:
    """The entry in force outside every scope."""
    return _default_entry()


def stack() -> list[Entry]:
    """This thread's stack (the default entry is not in it), for a caller that checks it and
    pushes on it in one go: right after an optimizer step, each access to the thread-local
    state costs about a microsecond."""
    return _local.stack


def in_replica_of_strategy(stack: list[Entry] | None = None) -> bool:
    """Whether this thread runs a replica of a non-default strategy (cross-replica calls such
    as ``run``, ``reduce`` and ``scope`` are errors there). ``stack``: this thread's, where
    the caller holds it (``stack()``)."""
    if stack is None:
        stack = _local.stack
    if not stack:  # the default replica context
        return False
    entry = stack[-1]
    return entry.replica_context is not None and entry.strategy is not _default_entry().strategy
