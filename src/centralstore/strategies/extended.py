"""``strategy.extended``: the lower-level calls that custom training code uses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import _context, _devices
from .._autograd import no_grad
from .._placement import Placement
from .._reduce import Axis, ReduceOp
from .._workers import Workers
from ..variables.store import VariableStore

# The strategy's ``reduce(reduce_op, value, axis=None)``.
Reduce = Callable[..., Any]


def _destination_device(destinations: Any) -> torch.device:
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if isinstance(destinations, (str, torch.device)):
        return _devices.storage_device(_devices.canonical(destinations))
    raise ValueError(
        "destinations must be a device name, a torch.device or a tensor whose device is the "
        f"destination. Received: destinations={destinations!r}"
    )


class StrategyExtended:
    """TensorFlow's ``strategy.extended`` for this strategy.

    >>> import centralstore as cs
    >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> s.extended.worker_devices, s.extended.parameter_devices
    (('cpu:0', 'cpu:1'), ('cpu:0',))
    """

    def __init__(
        self, placement: Placement, store: VariableStore, workers: Workers, reduce: Reduce
    ) -> None:
        self._placement = placement
        self._store = store
        self._workers = workers
        self._reduce = reduce

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's compute devices, in replica order."""
        return self._placement.compute_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices that store variables: the parameter device."""
        return (self._placement.parameter_device,)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should write checkpoints: the chief (rank 0) only, so that
        several workers never write the same file. True with one worker.

        >>> import centralstore as cs
        >>> cs.CentralStorageStrategy(["cpu:0"]).extended.should_checkpoint
        True
        """
        return self._workers.worker_index == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries and logs: the chief only."""
        return self._workers.worker_index == 0

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """Reduce ``value`` (as ``strategy.reduce``) and place it on ``destinations``."""
        device = _destination_device(destinations)
        with torch.device(device):
            return self._reduce(reduce_op, value)

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """``reduce_to`` over ``(value, destinations)`` pairs; a list back."""
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]

    def update(
        self,
        var: torch.Tensor,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Apply ``fn(var, *args, **kwargs)`` once to a central variable, without gradient
        tracking, in cross-replica context.

        >>> import centralstore as cs
        >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> with s.scope():
        ...     v = cs.Variable(1.0)
        >>> _ = s.extended.update(v, lambda var, x: var.add_(x), args=(2.0,))
        >>> v.item()
        3.0
        """
        if _context.in_replica_of_strategy():
            raise RuntimeError(
                "extended.update is a cross-replica call; from a replica use "
                "get_replica_context().merge_call(lambda s: s.extended.update(...))."
            )
        with no_grad():
            return fn(var, *args, **(kwargs or {}))

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a central variable of this strategy."""
        return self._store.record(v) is not None

    def value_container(self, value: Any) -> Any:
        """The central variable behind a replica view, or ``value`` itself."""
        if isinstance(value, torch.Tensor):
            central = self._store.view_owner(value)
            if central is not None:
                return central
        return value

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: torch.Tensor) -> Iterator[None]:
        """Create tensors on the device of ``colocate_with_variable`` inside the block."""
        with torch.device(colocate_with_variable.device):
            yield

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Axis = None) -> Any:
        return self._reduce(reduce_op, value, axis)
