"""Every optimizer step is a sync point of the stores that own its parameters.

One global ``register_optimizer_step_pre_hook`` serves every store, and lives while some store
with variables does. It syncs only the stores holding the optimizer's parameters, so
strategies stay isolated (and, across workers, no process enters another store's exchange);
inside ``run`` it refuses the step, which would update the variables once per replica. A
global post-hook joins it once some replica holds views (``stamp_after_steps``): they need
the frozen variables a step updated stamped, and until then a step pays no second hook
(10 to 20 us right after the step's sweep through memory).
"""

from __future__ import annotations

import threading
import weakref
from itertools import chain, compress, filterfalse, repeat
from operator import call, is_not, itemgetter, methodcaller
from typing import Any, Protocol, cast

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .. import _context
from .._autograd import grad_of, requires_grad_of


class Store(Protocol):
    """What the hook needs of a ``VariableStore``."""

    def owns_any(self, tensors: list[torch.Tensor]) -> bool: ...
    def stamp(self, tensors: list[torch.Tensor]) -> None: ...
    def viewed(self) -> bool: ...
    def optimized(self, tensors: list[torch.Tensor]) -> None: ...
    def settled(self) -> bool: ...
    def claim(self, doing: str) -> None: ...
    def release(self) -> None: ...
    def sync(self) -> None: ...


# The stores, held weakly, as a tuple: the hooks run at every optimizer step, where walking a
# WeakSet (a Python generator under an iteration guard) cost more than the hooks' own work.
_stores: tuple[weakref.ref[Store], ...] = ()
_handles: dict[str, Any] = {}  # "pre" while some store lives, "post" once views exist too
_lock = threading.RLock()  # (reentrant: a store's finalizer may run inside ``track``)
_params_of = itemgetter("params")
_viewed = methodcaller("viewed")
# each optimizer that stepped (by id, with a weak reference that removes it), and how many
# parameters it held then: its parameters are noted as optimized once, and again when it
# holds more (``add_param_group``); a dict, where a ``WeakKeyDictionary``'s lookup is Python
_noted: dict[int, tuple[weakref.ref[torch.optim.Optimizer], int]] = {}


def track(store: Store) -> None:
    """Make optimizer steps sync points for ``store``."""
    global _stores
    with _lock:
        if any(ref() is store for ref in _stores):
            return
        _stores = (*_stores, weakref.ref(store))
        weakref.finalize(store, _release)
        if "pre" not in _handles:
            _handles["pre"] = register_optimizer_step_pre_hook(_before_step)


def stamp_after_steps() -> None:
    """A replica made a view: from now on, while some store lives, optimizer steps stamp
    the frozen variables they update (``_after_step``)."""
    global stamping
    with _lock:
        if _stores and "post" not in _handles:
            _handles["post"] = register_optimizer_step_post_hook(_after_step)
            stamping = True


stamping = False  # whether the post-hook is in place (read where views are made)


def _release() -> None:
    global _stores, stamping
    with _lock:
        _stores = tuple(ref for ref in _stores if ref() is not None)
        if not _stores:
            for handle in _handles.values():
                handle.remove()
            _handles.clear()
            stamping = False


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, gathered in C."""
    return list(chain.from_iterable(map(_params_of, optimizer.param_groups)))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A sync point of the stores that hold the optimizer's parameters and have work left
    (a store is asked first whether it has: usually, ``run``'s own sync point did it all,
    and nothing else is looked at, not even the thread's context). Inside a replica, where
    its store's run is in progress, the step is refused instead. Then, once some replica
    holds views, the first step of an optimizer notes its parameters as optimized
    (``Central.optimized``), as does one after it gained some: for the sync points after
    this step, as if noted after it. Only the plans of replicas that see views ask
    (``Plan.settle_idle``); an optimizer that stepped before any view existed is noted at
    its next step, a step later than it could have been, which only delays what a plan
    learns."""
    params = None
    for ref in _stores:
        store = ref()
        if store is None or store.settled():
            continue
        if params is None:
            params = _parameters(optimizer)
            if _context.in_replica_of_strategy():  # no sync point in a replica
                if cast(Store, _context.current().store).owns_any(params):
                    raise RuntimeError(
                        "optimizer.step() was called inside strategy.run (replica context), "
                        "where it would update the central variables once per replica. Call "
                        "it after run, or inside the step function as "
                        "get_replica_context().merge_call(lambda strategy: optimizer.step())."
                    )
                break
        if store.owns_any(params):
            store.claim("optimizer.step()")
            try:
                store.sync()
            finally:
                store.release()
    if not stamping:  # no views: no plan asks which variables are optimized
        return
    count = sum(map(len, map(_params_of, optimizer.param_groups)))
    noted = _noted.get(id(optimizer))
    if noted is None or noted[1] != count or noted[0]() is not optimizer:
        _note(optimizer, count)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step may have changed its parameters without moving their version counters (fused
    kernels): the stores' views of them refresh before their next use. Views of a variable
    that requires grad refresh at every run anyway (and one whose ``requires_grad`` changes
    is made anew), so only the frozen ones need the stamp, and of those only the ones with a
    ``.grad``: torch's optimizers skip a parameter without one (a frozen backbone given to
    the optimizer with the rest is not copied to the GPUs again at every step), and only
    where some replica holds views: replicas that use the variables themselves (logical CPU
    devices, one GPU holding the variables) have none, and a view made later copies the
    value then; the pass over every parameter cost 39 us right after a sweep through memory,
    BERT tiny's 41. (In place once some replica made a view: ``stamp_after_steps``.)"""
    viewing = list(filter(_viewed, filter(None, map(call, _stores))))
    if not viewing:
        return
    frozen = list(filterfalse(requires_grad_of, _parameters(optimizer)))
    if frozen:
        frozen = list(compress(frozen, map(is_not, map(grad_of, frozen), repeat(None))))
    if frozen:
        for store in viewing:
            store.stamp(frozen)


def _note(optimizer: torch.optim.Optimizer, count: int) -> None:
    """A first step of ``optimizer``, or one after it gained parameters (``count`` now):
    the stores note its parameters as optimized."""
    key = id(optimizer)
    _noted[key] = (weakref.ref(optimizer, lambda _: _noted.pop(key, None)), count)
    params = _parameters(optimizer)
    for ref in _stores:
        store = ref()
        if store is not None:
            store.optimized(params)
