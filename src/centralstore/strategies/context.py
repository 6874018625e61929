"""The context functions: which strategy and which replica context are current.

They read this thread's context stack (``_context.py``): ``scope()`` and ``merge_call`` are
cross-replica context, a replica of ``run`` is replica context, and outside everything the
default strategy (a ``OneDeviceStrategy`` on ``cpu:0``) is current with its default replica
context.
"""

from __future__ import annotations

from .. import _context
from .._replica_context import ReplicaContext
from .base import Strategy


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope or ``run`` we are in, else the default.

    >>> import centralstore as cs
    >>> cs.get_strategy().num_replicas_in_sync
    1
    """
    return _context.current().strategy  # type: ignore[return-value]


def has_strategy() -> bool:
    """Whether a strategy other than the default is current (in a scope, ``run`` or merge).

    >>> import centralstore as cs
    >>> cs.has_strategy()
    False
    """
    return _context.current().strategy is not _context.default().strategy


def in_cross_replica_context() -> bool:
    """True inside ``scope()`` and ``merge_call``; False outside everything and in a replica.

    >>> import centralstore as cs
    >>> with cs.CentralStorageStrategy(["cpu:0", "cpu:1"]).scope():
    ...     cs.in_cross_replica_context()
    True
    """
    return _context.current().replica_context is None


def get_replica_context() -> ReplicaContext[Strategy] | None:
    """The ``ReplicaContext`` of the running replica, the default one outside every scope, or
    ``None`` in cross-replica context.

    >>> import centralstore as cs
    >>> cs.get_replica_context().replica_id_in_sync_group
    0
    """
    return _context.current().replica_context  # type: ignore[return-value]
