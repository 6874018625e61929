"""Central variables: which tensors belong to a strategy, and with what aggregation.

A central variable lives once, on the parameter device. Inside ``strategy.scope()`` every
parameter and buffer registered on a module, and every tensor created with
``requires_grad=True``, becomes one. The store holds them weakly (a dropped model leaves no
trace) and hands out the per-replica machinery: views (``_views.py``) and the sync point
(``_folding.py``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from . import _context
from ._aggregation import VariableAggregation
from ._folding import sync, track
from ._views import ReplicaViews, ResolutionMode, View

if TYPE_CHECKING:
    from .strategies.base import Strategy


class Central:
    """The record of one central variable: a weak reference and its aggregation."""

    __slots__ = ("aggregation", "is_buffer", "key", "ref")

    def __init__(
        self, key: int, ref: weakref.ref[torch.Tensor], aggregation: VariableAggregation,
        is_buffer: bool,
    ) -> None:
        self.key = key
        self.ref = ref
        self.aggregation = aggregation
        self.is_buffer = is_buffer


def _check_aggregation(tensor: torch.Tensor, aggregation: VariableAggregation) -> None:
    if aggregation is VariableAggregation.MEAN and not (
        tensor.is_floating_point() or tensor.is_complex()
    ):
        raise ValueError(
            f"An integer variable (dtype {tensor.dtype}) cannot be MEAN-aggregated: the mean of "
            "integers is not an integer. Use SUM or ONLY_FIRST_REPLICA, or a floating dtype."
        )


class VariableStore:
    """The central variables of one strategy, and its replicas' views of them."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self.num_replicas = strategy.num_replicas_in_sync
        self.parameter_device = strategy._parameter_storage
        self.compute_devices = strategy._storage_devices
        self.records: dict[int, Central] = {}
        self.replicas = [ReplicaViews(self, r, d) for r, d in enumerate(self.compute_devices)]
        self.modes = [ResolutionMode(views) for views in self.replicas]
        self.in_run = False
        self.epoch = 0  # views are validated once per epoch; each run and sync point starts one
        self.pending: list[View] = []  # views with gradient copies started outside run
        self._foreign = 0  # variables off the only compute device (R = 1 then needs views)
        # Multi-worker extension point (strategies/_exchange.py): when set, every sync
        # point calls it with the local fold, and gradients that arrive outside run wait in
        # ``pending`` for the next sync point, where they are exchanged with the other workers.
        self.cross_worker: Callable[[Callable[[], None]], None] | None = None

    # -- registration ------------------------------------------------------------------------

    def register(
        self, tensor: torch.Tensor, aggregation: VariableAggregation, is_buffer: bool = False
    ) -> None:
        """Make ``tensor`` a central variable (again: its aggregation is updated)."""
        _check_aggregation(tensor, aggregation)
        key = id(tensor)
        record = self.records.get(key)
        if record is not None:
            record.aggregation = aggregation
            return
        ref = weakref.ref(tensor, functools.partial(self._forget_ref, key))
        self.records[key] = Central(key, ref, aggregation, is_buffer)
        if tensor.device != self.compute_devices[0]:
            self._foreign += 1
        if self.parameter_device.type == "cpu" and any(
            d.type == "cuda" for d in self.compute_devices
        ):
            with torch.no_grad():  # pinned, so that copies to the GPUs are asynchronous
                tensor.data = tensor.data.pin_memory()
        track(self)

    def _forget_ref(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        self._forget(key)

    def _forget(self, key: int) -> None:
        self.records.pop(key, None)
        for views in self.replicas:
            views.forget(key)

    def record(self, tensor: Any) -> Central | None:
        return self.records.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None

    def view_owner(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The central variable of which ``tensor`` is a replica view, if any."""
        for views in self.replicas:
            central = views.central_of(tensor)
            if central is not None:
                return central
        return None

    # -- scope -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Register what modules and factories create while this strategy's scope is on top."""
        strategy = self._strategy_ref()

        def mine() -> bool:
            entry = _context.current()
            return entry.strategy is strategy and entry.replica_context is None

        def on_parameter(module: Any, name: str, param: Any) -> None:
            if param is not None and mine():
                self.register(param, VariableAggregation.NONE)

        def on_buffer(module: Any, name: str, buffer: Any) -> None:
            if isinstance(buffer, torch.Tensor) and mine():
                floating = buffer.is_floating_point() or buffer.is_complex()
                default = VariableAggregation.MEAN if floating else (
                    VariableAggregation.ONLY_FIRST_REPLICA
                )
                record = self.record(buffer)
                self.register(buffer, record.aggregation if record else default, is_buffer=True)

        handles = [
            _module.register_module_parameter_registration_hook(on_parameter),
            _module.register_module_buffer_registration_hook(on_buffer),
        ]
        try:
            with _RegistrationMode(self, mine):
                yield
        finally:
            for handle in handles:
                handle.remove()

    # -- run ---------------------------------------------------------------------------------

    def replica_mode(self, replica: int) -> contextlib.AbstractContextManager[Any]:
        """The resolution mode for ``replica``, or a no-op when views are not needed: one
        replica computing where the variables live uses them directly."""
        if (self.num_replicas == 1 and not self._foreign) or not self.records:
            return contextlib.nullcontext()
        return self.modes[replica]

    @contextlib.contextmanager
    def cross_replica(self) -> Iterator[None]:
        """Central variables as themselves, for ``merge_call`` on a replica's thread."""
        for mode in self.modes:
            mode.suspended = True
        try:
            yield
        finally:
            for mode in self.modes:
                mode.suspended = False

    def begin_run(self) -> None:
        self.in_run = True
        self.epoch += 1

    def end_run(self) -> None:
        self.in_run = False
        self.sync()

    def sync(self) -> None:
        """The sync point: fold gradients and aggregated writes into the central variables."""
        sync(self)


class _RegistrationMode(TorchFunctionMode):
    """Registers leaf tensors created with ``requires_grad=True`` inside the scope."""

    def __init__(self, store: VariableStore, mine: Any) -> None:
        super().__init__()
        self._store = store
        self._mine = mine

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            isinstance(out, torch.Tensor)
            and out.requires_grad
            and out.is_leaf
            and id(out) not in self._store.records
            and self._mine()
        ):
            self._store.register(out, VariableAggregation.NONE)
        return out


def Variable(
    initial_value: Any,
    aggregation: VariableAggregation | str = VariableAggregation.NONE,
    trainable: bool = True,
) -> torch.Tensor:
    """A central variable of the current strategy, stored once on its parameter device.

    ``trainable`` means ``requires_grad`` (floating dtypes only). ``aggregation`` says how
    writes from several replicas combine.

    >>> import centralstore as cs
    >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     steps = cs.Variable(0, aggregation="ONLY_FIRST_REPLICA", trainable=False)
    >>> _ = strategy.run(lambda: steps.add_(1))
    >>> int(steps)
    1
    """
    strategy = _context.get_strategy()
    value = torch.from_numpy(initial_value) if isinstance(initial_value, np.ndarray) else (
        torch.as_tensor(initial_value)
    )
    tensor = value.detach().to(strategy._parameter_storage, copy=True)
    if trainable and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    strategy._variables.register(tensor, VariableAggregation.parse(aggregation))
    return tensor


def set_aggregation(tensor: torch.Tensor, aggregation: VariableAggregation | str) -> None:
    """Give a central variable of the current strategy an aggregation for writes in ``run``.

    >>> import centralstore as cs
    >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     total = torch.zeros((), requires_grad=True)
    ...     cs.set_aggregation(total, "SUM")
    >>> with torch.no_grad():
    ...     _ = strategy.run(lambda: total.add_(1.0))
    >>> total.item()
    2.0
    """
    strategy = _context.get_strategy()
    store = strategy._variables
    if store.record(tensor) is None:
        raise ValueError(
            f"set_aggregation needs a central variable of {strategy!r}, but got a tensor of "
            f"shape {tuple(tensor.shape)} that is not one. Create it inside strategy.scope() "
            "(on a module, with requires_grad=True, or with cs.Variable) and call "
            "set_aggregation inside that scope."
        )
    store.register(tensor, VariableAggregation.parse(aggregation))
