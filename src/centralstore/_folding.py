"""The sync point: replicas' gradients and writes folded into the central variables.

Gradients are summed in replica order onto the parameter device and added to what ``.grad``
already holds, one ``torch._foreach_add_`` per replica. Writes combine by each variable's
aggregation. A gradient that reaches a view outside ``run`` (a backward on a reduced loss) is
forwarded at once. From CUDA replicas to a CPU parameter device, each gradient's copy starts
from its post-accumulate-grad hook, on a side stream into pinned memory, while backward is
still running; the sync point only waits for it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _context
from ._aggregation import VariableAggregation

if TYPE_CHECKING:
    from ._variables import VariableStore
    from ._views import View


def _overlapped(tensor: torch.Tensor, parameter_device: torch.device) -> bool:
    """Whether the gradient's copy to the parameter device starts from the hook."""
    return tensor.device.type == "cuda" and parameter_device.type == "cpu"


def on_gradient(store: VariableStore, view: View, tensor: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a view: start its copy, or forward it outside ``run``."""
    if _overlapped(tensor, store.parameter_device):
        _start_copy(view, tensor)
        if not store.in_run:
            store.pending.append(view)
        return
    if not store.in_run:
        if store.cross_worker is not None:  # multi-worker: exchanged at the next sync point
            store.pending.append(view)
            return
        with torch.no_grad():
            _fold_views(store, [view])


def _start_copy(view: View, tensor: torch.Tensor) -> None:
    grad = tensor.grad
    if grad is None:
        return
    tensor.grad = None
    stream = _side_stream(grad.device)
    stream.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(stream):
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        host.copy_(grad, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    grad.record_stream(stream)
    view.pending.append((host, event))


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def _gradients(view: View) -> list[torch.Tensor]:
    """The view's gradients, in order, taken off it."""
    grads = []
    for host, event in view.pending:
        event.synchronize()
        grads.append(host)
    view.pending.clear()
    for tensor in (view.tensor, view.alias):
        if tensor is not None and tensor.grad is not None:
            grads.append(tensor.grad)
            tensor.grad = None
    return grads


def _fold_views(store: VariableStore, views: list[View]) -> None:
    """Add the views' gradients to their central ``.grad`` (one ``_foreach_add_``)."""
    targets, sources = [], []
    queued: set[int] = set()
    for view in views:
        central = view.record.ref()
        for grad in _gradients(view):
            if central is None:
                continue
            grad = grad.to(central.device, central.dtype, non_blocking=False)
            if central.grad is None:
                central.grad = grad
            elif grad.is_sparse or central.grad.is_sparse or id(central) in queued:
                central.grad = central.grad + grad
            else:
                queued.add(id(central))
                targets.append(central.grad)
                sources.append(grad)
    if targets:
        torch._foreach_add_(targets, sources)


def sync(store: VariableStore) -> None:
    """Fold everything the replicas left since the last sync point, in replica order."""
    if store.cross_worker is not None:  # multi-worker: the exchange wraps the local fold
        store.cross_worker(lambda: _sync_local(store))
        return
    _sync_local(store)


def _sync_local(store: VariableStore) -> None:
    if store.pending:
        with torch.no_grad():
            _fold_views(store, store.pending)
        store.pending.clear()
    touched = [replica.touched for replica in store.replicas]
    if not any(touched):
        return
    with torch.no_grad():
        for views in touched:
            _fold_views(store, views)
        _apply_writes(store, touched)
    for views in touched:
        for view in views:
            if view.alias is not None:
                view.tensor, view.alias, view.private = view.alias, None, False
        views.clear()
    store.epoch += 1


def _apply_writes(store: VariableStore, touched: list[list[View]]) -> None:
    writers: dict[int, list[View]] = {}
    for views in touched:
        for view in views:
            if view.written():
                writers.setdefault(view.record.key, []).append(view)
    for views in writers.values():
        record = views[0].record
        central = record.ref()
        aggregation = record.aggregation
        if central is None:
            continue
        if store.num_replicas > 1 and aggregation is VariableAggregation.NONE:
            continue  # the replica that wrote has already raised
        finals = [view.tensor.detach().to(central.device) for view in views]
        if store.num_replicas == 1:
            value = finals[0]
        elif any(view.assigned for view in views):
            value = _combine(aggregation, finals)
        else:
            value = central + _combine(aggregation, [final - central for final in finals])
        central.copy_(value)


def _combine(aggregation: Any, values: list[torch.Tensor]) -> torch.Tensor:
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        return values[0]
    total = values[0]
    for value in values[1:]:
        total = total + value
    if aggregation is VariableAggregation.MEAN:
        return total / len(values)
    return total


# -- every optimizer step is a sync point --------------------------------------------------

_stores: weakref.WeakSet[VariableStore] = weakref.WeakSet()
_handle: list[Any] = []


def track(store: VariableStore) -> None:
    """Make optimizer steps sync points for ``store``; the global hook lives while some
    store with variables does."""
    if store in _stores:
        return
    _stores.add(store)
    weakref.finalize(store, _release)
    if not _handle:
        _handle.append(register_optimizer_step_pre_hook(_before_step))


def _release() -> None:
    if not _stores and _handle:
        _handle.pop().remove()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    entry = _context.current()
    if _context.in_replica_of_strategy():
        records = entry.strategy._variables.records
        if any(id(p) in records for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                "optimizer.step() was called inside strategy.run (replica context), where it "
                "would update the central variables once per replica. Call it after run, or "
                "inside the step function as "
                "get_replica_context().merge_call(lambda strategy: optimizer.step())."
            )
        return
    for store in list(_stores):
        # A multi-worker store's sync point is a collective: only this optimizer's own
        # stores sync here, so that workers never meet in another store's exchange (this
        # WeakSet's order differs between processes).
        if store.cross_worker is not None and not any(
            id(p) in store.records for group in optimizer.param_groups for p in group["params"]
        ):
            continue
        sync(store)
