"""Every optimizer step is a sync point of the stores that own its parameters.

One global ``register_optimizer_step_pre_hook`` serves every store, and lives while some store
with variables does. It syncs only the stores holding the optimizer's parameters, so
strategies stay isolated (and, across workers, no process enters another store's exchange);
inside ``run`` it refuses the step, which would update the variables once per replica.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, cast

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .. import _context


class Store(Protocol):
    """What the hook needs of a ``VariableStore``."""

    def owns_any(self, tensors: list[torch.Tensor]) -> bool: ...
    def stamp(self, tensors: list[torch.Tensor]) -> None: ...
    def claim(self, doing: str) -> None: ...
    def release(self) -> None: ...
    def sync(self) -> None: ...


_stores: weakref.WeakSet[Store] = weakref.WeakSet()
_handle: list[Any] = []


def track(store: Store) -> None:
    """Make optimizer steps sync points for ``store``."""
    if store in _stores:
        return
    _stores.add(store)
    weakref.finalize(store, _release)
    if not _handle:
        _handle.append(register_optimizer_step_pre_hook(_before_step))
        _handle.append(register_optimizer_step_post_hook(_after_step))


def _release() -> None:
    while not _stores and _handle:
        _handle.pop().remove()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _context.in_replica_of_strategy():
        if cast(Store, _context.current().store).owns_any(params):
            raise RuntimeError(
                "optimizer.step() was called inside strategy.run (replica context), where it "
                "would update the central variables once per replica. Call it after run, or "
                "inside the step function as "
                "get_replica_context().merge_call(lambda strategy: optimizer.step())."
            )
        return
    for store in list(_stores):
        if store.owns_any(params):
            store.claim("optimizer.step()")
            try:
                store.sync()
            finally:
                store.release()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step changed its parameters, perhaps without moving their version counters (fused
    kernels): the stores' views of them refresh before their next use."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for store in list(_stores):
        store.stamp(params)
