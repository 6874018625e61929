"""The arithmetic of a sync point: replicas' gradients and writes folded into the central
variables, or discarded when the run failed.

Gradients are summed in replica order onto the parameter device and added to what ``.grad``
already holds, one ``torch._foreach_add_`` per replica. Writes combine by each variable's
aggregation. From CUDA replicas to a CPU parameter device, each gradient's copy starts from
its post-accumulate-grad hook while backward is still running: it lands in the replica's
pinned gradient buckets, copied on a side stream a bucket at a time (``buckets.py``), and
the sync point only waits for them. Those gradients are views of buffers the next step
reuses: a sum is never written into them, and a sum that is one of them alone is copied.
When the sync point happens is the store's business (``store.py``).
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Sequence
from itertools import compress, count, repeat, zip_longest
from operator import and_, attrgetter, call, eq, is_, is_not, itemgetter, ne, not_, or_
from typing import Any

import torch

from .._aggregation import (
    VariableAggregation,
    by_value,
    sum_in_order,
    write_term,
    written_value,
)
from .._autograd import grad_of, hooks_of, no_grad, set_grads, some
from .buckets import GradientBuckets, GradientCopy, lend, standing, take_all
from .records import Central
from .views import EXACT_CLASSES, ReplicaViews, View


def overlapped(device: torch.device, parameter_device: torch.device) -> bool:
    """Whether the copies of gradients computed on ``device`` to the parameter device start
    from a hook while backward runs."""
    return device.type == "cuda" and parameter_device.type == "cpu"


def start_copy(buckets: GradientBuckets, view: View, tensor: torch.Tensor) -> None:
    """Start copying the gradient just accumulated on ``tensor`` to pinned host memory: into
    its slot of the replica's ``buckets``, on the side stream of its GPU; unless it stays
    there for the next pass of a loop of micro-batches to add to (``GradientBuckets.holds``).
    The gradient stays in ``.grad`` for the replica's code (the copy stands for it while it
    is unchanged: ``gradients_of``), and the backward's end orders the replica's later work
    after the copies (``GradientBuckets.after_backward``)."""
    grad = tensor.grad
    if grad is None or grad.is_sparse:  # a sparse gradient waits on the view for the fold
        return
    if (buckets.synced or buckets.passes) and buckets.holds(view.record.key):
        return
    side = _side_streams.get(grad.device) or _side_stream(grad.device)
    view.pending.append(buckets.copy(view.record.key, grad, side))
    if not buckets.ordered:  # (the gradient stays in .grad, as on one device)
        buckets.ordered = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(
            _after_backward, weakref.ref(buckets), grad.device, side
        ))


def _after_backward(
    buckets_ref: weakref.ref[GradientBuckets], device: torch.device, side: Any
) -> None:
    """(A backward's final callback, which autograd runs on the streams current around the
    call to ``backward()``, after it synchronized them with backward's own: the streams
    the replica's later work goes to.)"""
    buckets = buckets_ref()
    if buckets is not None:
        buckets.after_backward(device, side)


def copy_held(replica: ReplicaViews) -> None:
    """``replica`` returned: the gradients it held on its GPU for a pass that did not come
    (fewer than at the step before) start their copies, while the other replicas compute."""
    buckets = replica.gradient_buckets
    side = None
    for key in buckets.release():
        view = replica.views.get(key)
        if view is not None:
            for tensor in (view.tensor, view.alias):
                grad = None if tensor is None else tensor.grad
                if grad is not None and not grad.is_sparse:
                    side = _side_streams.get(grad.device) or _side_stream(grad.device)
                    view.pending.append(buckets.copy(key, grad, side))
    if side is not None:  # (a backward after ``run`` may add to them in place: after the copies)
        buckets.after_copies(replica.device, side)


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def gradients_of(view: View, borrowed: set[int] | None = None) -> list[torch.Tensor]:
    """The view's gradients, taken off it: for each of its tensors (the view, and the
    shared one while routed to a private copy), the copy to host memory of its ``.grad``
    if one still stands for it (the latest copy of that tensor, unchanged since), else
    the ``.grad`` itself; the other copies are taken and dropped. The ids of those that are
    views of a gradient bucket's buffer, which the sync point lends to ``.grad``, go to
    ``borrowed``."""
    copies, view.pending = view.pending, []
    sources = [(copy.source, copy.version) for copy in copies]  # (``take`` forgets them)
    taken = [copy.take() for copy in copies]  # (every copy, for its bucket's accounting)
    grads = []
    for tensor in (view.tensor, view.alias):
        if tensor is None or tensor.grad is None:
            continue
        grad, tensor.grad = tensor.grad, None
        kept = None  # the copy that stands for it
        for i in range(len(copies) - 1, -1, -1):
            source, version = sources[i]
            if source is grad:
                kept = i if version == grad._version else None
                break
        if kept is None:
            grads.append(grad)
            continue
        if copies[kept].borrowed and borrowed is not None:
            borrowed.add(id(taken[kept]))
        grads.append(taken[kept])
    return grads


def all_dense(first: list[torch.Tensor | None], second: list[torch.Tensor | None]) -> bool:
    """Whether every entry of both lists is a tensor and none is sparse: pairs that one
    ``_foreach_add_`` can add. Passes in C: a loop in Python costs more than the addition on
    small models."""
    return (
        all(map(is_not, first, repeat(None))) and all(map(is_not, second, repeat(None)))
        and not any(map(_is_sparse, first)) and not any(map(_is_sparse, second))
    )


_is_sparse = attrgetter("is_sparse")


def plus(held: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``held + grad`` as a new tensor, either of them sparse: a dense tensor plus a sparse
    one is dense, and torch adds them only in that order (autograd's accumulation does the
    same); each element's sum is the same in either order."""
    if held.is_sparse and not grad.is_sparse:
        return grad + held
    return held + grad


def add_in_order(sums: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> bool:
    """Add ``grads`` to ``sums`` element by element, in place where a sum exists and is dense
    (one ``_foreach_add_``); the first gradient of an empty sum becomes the sum. False when
    every sum was added to in place (``sums`` holds the same tensors as before, so a caller
    that took them from ``.grad`` need not set it again), True otherwise."""
    if not some(sums):  # nothing held: the gradients are the sums
        sums[:] = grads
        return True
    if all_dense(sums, grads):  # the usual case, checked in C
        with no_grad():
            torch._foreach_add_(sums, grads)  # type: ignore[arg-type]
        return False
    targets, sources = [], []
    replaced = False
    for i in compress(count(), map(is_not, grads, repeat(None))):  # skipping Nones in C
        grad: torch.Tensor = grads[i]  # type: ignore[assignment]
        held = sums[i]
        if held is None:
            sums[i] = grad
            replaced = True
        elif held.is_sparse or grad.is_sparse:
            sums[i] = plus(held, grad)
            replaced = True
        else:
            targets.append(held)
            sources.append(grad)
    if targets:
        with no_grad():
            torch._foreach_add_(targets, sources)
    return replaced


def fold_gradients(views: list[View], distinct: bool = False) -> list[torch.Tensor]:
    """Add the views' gradients to their central ``.grad`` (in place where it exists: one
    ``_foreach_add_`` per round of gradients); returns the central variables that received
    some. ``distinct``: the views are of different variables (one replica's)."""
    if not any(map(_pending_of, views)) and all(map(is_, map(_alias_of, views), repeat(None))):
        return _fold_one_each(views, distinct)
    received: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for n, view in enumerate(views):
        if view.pending or view.alias is not None:  # several gradients per view: in rounds
            return _fold_rounds(views[n:], received, [[g] for g in _moved(received, grads)])
        tensor = view.tensor
        grad = tensor.grad
        if grad is None:
            continue
        central = view.record.ref()
        tensor.grad = None
        if central is None:
            continue
        received.append(central)
        grads.append(grad)
    grads = _moved(received, grads)
    if not distinct and len(set(map(id, received))) < len(received):  # one variable twice
        return _fold_in_rounds(received, [[g] for g in grads], set())
    sums: list[torch.Tensor | None] = list(map(grad_of, received))
    add_in_order(sums, grads)  # type: ignore[arg-type]
    for central, total in zip(received, sums):
        central.grad = total
    return received


def _moved(centrals: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient on its variable's device and in its dtype: those of a private copy on
    another device (a GPU replica's) brought together (``_brought``)."""
    if (
        list(map(_device_of, grads)) == list(map(_device_of, centrals))
        and list(map(_dtype_of, grads)) == list(map(_dtype_of, centrals))
    ):
        return grads
    dense = list(map(not_, map(_is_sparse, grads)))
    if not all(dense):  # sparse ones one by one
        return [g.to(c.device, c.dtype) for g, c in zip(grads, centrals, strict=True)]
    grads = _brought(centrals, grads)
    if list(map(_dtype_of, grads)) == list(map(_dtype_of, centrals)):
        return grads
    return [g if g.dtype == c.dtype else g.to(c.dtype) for g, c in zip(grads, centrals)]


def _fold_one_each(views: list[View], distinct: bool) -> list[torch.Tensor]:
    """``fold_gradients`` of views that hold one gradient each at most (none in flight from
    a GPU, no routed copy), in passes in C: every step of a replica without GPU copies, and
    of GPU replicas whose variables are on a GPU (one view of each variable per replica,
    folded in rounds)."""
    tensors = list(map(_tensor_of, views))
    grads = list(map(grad_of, tensors))
    have = list(map(is_not, grads, repeat(None)))
    if not any(have):
        return []
    if not all(have):
        views, tensors, grads = (
            list(compress(views, have)), list(compress(tensors, have)), list(compress(grads, have))
        )
    set_grads(tensors, repeat(None))
    centrals = list(map(call, map(_record_ref_of, views)))
    if not all(map(is_not, centrals, repeat(None))):  # a variable dying right now
        alive = list(map(is_not, centrals, repeat(None)))
        views, centrals, grads = (
            list(compress(views, alive)), list(compress(centrals, alive)),
            list(compress(grads, alive)),
        )
    if any(map(_private_of, views)):  # a copy's gradient to its variable's device and dtype
        grads = _moved(centrals, grads)
    if not distinct and len(set(map(id, centrals))) < len(centrals):  # several replicas'
        return _fold_in_rounds(centrals, list(zip(grads)), set())
    sums: list[torch.Tensor | None] = list(map(grad_of, centrals))
    if add_in_order(sums, grads):  # (added in place: ``.grad`` holds the sums already)
        set_grads(centrals, sums)
    return centrals


_private_of = attrgetter("private")
_pending_of = attrgetter("pending")
_first = itemgetter(0)
_second = itemgetter(1)
_start_of = attrgetter("start")
_assigned_of = attrgetter("assigned")
_version_of = attrgetter("_version")
_start_version_of = attrgetter("start_version")
_borrowed_of = attrgetter("borrowed")
_device_of = attrgetter("device")
_dtype_of = attrgetter("dtype")
_alias_of = attrgetter("alias")
_tensor_of = attrgetter("tensor")
_shape_of = attrgetter("shape")
_numel = torch.Tensor.numel
_key_of = attrgetter("record.key")
_layout_of = attrgetter("layout")
_on_read_of = attrgetter("record.on_read")
_aggregation_of = attrgetter("record.aggregation")
_record_ref_of = attrgetter("record.ref")
_record_of = attrgetter("record")
_is_floating_point = torch.Tensor.is_floating_point


def _fold_rounds(
    views: list[View], centrals: list[torch.Tensor], gradients: list[Sequence[torch.Tensor]]
) -> list[torch.Tensor]:
    """``fold_gradients`` of views that may hold several gradients each (copies from a GPU,
    a routed copy and its shared view), after ``centrals`` and their ``gradients``, taken
    off the views before them."""
    borrowed: set[int] = set()  # ids of gradients that are views of a bucket
    pendings = list(map(_pending_of, views))
    counts = list(map(len, pendings))
    if (  # the usual step of GPU replicas: a copy each or none, standing for the view's
        # gradient (``gradients_of``), in C passes
        set(counts) <= {0, 1}
        and all(map(is_, map(_alias_of, views), repeat(None)))
        and _standing(views, pendings, counts)
    ):
        if not all(counts):  # (views without a gradient: buffers, unused parameters)
            views, pendings = list(compress(views, counts)), list(compress(pendings, counts))
        set_grads(list(map(_tensor_of, views)), repeat(None))
        copies = list(map(_first, pendings))
        taken = take_all(copies)  # in order, as below
        borrowed.update(map(id, compress(taken, map(_borrowed_of, copies))))
        deque(map(list.clear, pendings), maxlen=0)
        found = list(map(call, map(_record_ref_of, views)))
        alive = list(map(is_not, found, repeat(None)))
        if not all(alive):  # a variable dying right now
            found, taken = list(compress(found, alive)), list(compress(taken, alive))
        if (
            list(map(_device_of, taken)) != list(map(_device_of, found))
            or list(map(_dtype_of, taken)) != list(map(_dtype_of, found))
        ):
            taken = [g.to(c.device, c.dtype) for g, c in zip(taken, found, strict=True)]
        centrals += found
        gradients += zip(taken)  # one gradient each
        return _fold_in_rounds(centrals, gradients, borrowed)
    for view in views:
        grads = gradients_of(view, borrowed)
        central = view.record.ref()
        if grads and central is not None:
            centrals.append(central)
            gradients.append([
                g if g.device == central.device and g.dtype == central.dtype
                else g.to(central.device, central.dtype)
                for g in grads
            ])
    return _fold_in_rounds(centrals, gradients, borrowed)


def _standing(views: list[View], pendings: list[list[GradientCopy]], counts: list[int]) -> bool:
    """Whether each view's one copy stands for its ``.grad`` (``buckets.standing``), and
    the views without a copy have none. (Passes in C.)"""
    tensors = list(map(_tensor_of, views))
    if all(counts):
        return standing(tensors, list(map(_first, pendings)))
    return not some(list(map(grad_of, compress(tensors, map(not_, counts))))) and standing(
        list(compress(tensors, counts)), list(map(_first, compress(pendings, counts)))
    )


def _fold_in_rounds(
    centrals: list[torch.Tensor], gradients: list[Sequence[torch.Tensor]], borrowed: set[int]
) -> list[torch.Tensor]:
    """Add ``gradients[i]`` (in order) to ``centrals[i].grad``, where a variable may come
    several times: round k adds each variable's k-th gradient, one ``_foreach_add_``."""
    width = _block_width(centrals, gradients)
    if width:  # every replica's gradients of the same variables, one each: rounds in C
        received = centrals[:width]
        sums: list[torch.Tensor | None] = list(map(grad_of, received))
        for k in range(0, len(centrals), width):
            add_in_order(sums, list(map(_first, gradients[k:k + width])))
    else:
        received = []
        each: dict[int, list[torch.Tensor]] = {}  # id of a central variable -> its gradients
        for central, grads in zip(centrals, gradients):
            held = each.get(id(central))
            if held is None:
                held = each[id(central)] = []
                received.append(central)
            held += grads
        if not received:
            return received
        lists = list(each.values())  # in the order of ``received``
        sums = list(map(grad_of, received))
        for grads_k in zip_longest(*lists):  # round k: each variable's k-th gradient, or None
            add_in_order(sums, list(grads_k))
    if borrowed and not borrowed.isdisjoint(map(id, sums)):  # sums in a bucket's buffer
        lent = list(map(borrowed.__contains__, map(id, sums)))
        if all(lent):  # every variable's (GPU replicas' usual step): in a pass in C
            sums[:] = lend(sums)  # type: ignore[arg-type]
        else:
            sums = [
                lend([total])[0] if is_lent and total is not None else total
                for total, is_lent in zip(sums, lent, strict=True)
            ]
    set_grads(received, sums)
    return received


def _block_width(centrals: list[torch.Tensor], gradients: list[Sequence[torch.Tensor]]) -> int:
    """The number of variables in each block if ``centrals`` is one block of distinct
    variables repeated (each replica's, in the same order), each entry with one gradient
    (GPU replicas' usual step); 0 otherwise. Passes in C."""
    ids = list(map(id, centrals))
    width = len(set(ids))
    if not width or len(ids) % width or set(map(len, gradients)) != {1}:
        return 0
    first = ids[:width]
    if all(ids[k:k + width] == first for k in range(width, len(ids), width)):
        return width
    return 0


class HeldHooks:
    """The post-accumulate-grad hooks of tensors that replicas compute on directly, kept from
    firing at each replica's backward: they fire once, when the sync point has accumulated
    the replicas' gradients into ``.grad`` (``run_post_accumulate_hooks``), as once per
    backward on one device. (Their dicts are emptied and refilled by ``release``, since the
    hook that autograd calls holds the dict itself.) ``tensors``: those that have hooks."""

    __slots__ = ("_saved", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor] = []
        self._saved: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
        for tensor in tensors:
            hooks = tensor._post_accumulate_grad_hooks
            if hooks:
                self.tensors.append(tensor)
                self._saved.append((hooks, dict(hooks)))
                hooks.clear()

    def release(self) -> None:
        for hooks, saved in self._saved:
            hooks.update(saved)
        self._saved, self.tensors = [], []


def run_post_accumulate_hooks(tensors: list[torch.Tensor]) -> None:
    """Call the post-accumulate-grad hooks of the central variables whose ``.grad`` a sync
    point has just accumulated into, once each, in cross-replica context (an optimizer step
    in such a hook updates the variable once, with the replicas' summed gradient)."""
    if not any(map(hooks_of, tensors)):  # the usual case, one pass in C
        return
    seen: set[int] = set()
    for tensor in tensors:
        hooks = tensor._post_accumulate_grad_hooks
        if hooks and id(tensor) not in seen:
            seen.add(id(tensor))
            for hook in list(hooks.values()):
                hook(tensor)


def apply_writes(touched: list[list[View]], num_replicas: int, offset: int = 0) -> None:
    """Combine the replicas' writes into each central variable by its aggregation
    (``offset``: the global id of the first of these replicas). Each replica that wrote is
    one group of ``_aggregation.write_term``, in replica order. Called under ``no_grad``:
    the views' tensors are read as they are, without a ``detach`` each."""
    writes: list[tuple[int, list[View]]] = []  # each replica that wrote: what it wrote
    for replica, views in enumerate(touched):
        if not any(map(_private_of, views)):  # only a private copy can be written
            continue
        if not any(map(_assigned_of, views)) and list(
            map(_version_of, map(_tensor_of, views))
        ) == list(map(_start_version_of, views)):  # nothing written: checked in C
            continue
        written = map(and_, map(_private_of, views), map(or_, map(_assigned_of, views), map(
            ne, map(_version_of, map(_tensor_of, views)), map(_start_version_of, views)
        )))  # view.written() of each, in C
        writes.append((replica, list(compress(views, written))))
    if not writes or _apply_aligned([views for _, views in writes], num_replicas, len(touched)):
        return
    writers: dict[int, list[View]] = {}
    on_read: dict[int, list[tuple[int, View]]] = {}
    for replica, views in writes:
        for view in views:
            if view.record.on_read:
                on_read.setdefault(view.record.key, []).append((offset + replica, view))
            else:
                writers.setdefault(view.record.key, []).append(view)
    if on_read:
        _reduce_all_copies(list(on_read.values()), len(touched))
    batched: dict[tuple[Any, ...], list[tuple[torch.Tensor, list[View]]]] = {}
    alone: list[tuple[torch.Tensor, torch.Tensor]] = []  # one replica: its values, as written
    plain = _plain_classes()
    for views in writers.values():
        record = views[0].record
        central = record.ref()
        aggregation = record.aggregation
        if central is None:
            continue
        if num_replicas > 1 and aggregation is VariableAggregation.NONE:
            continue  # the replica that wrote has already raised
        if num_replicas == 1:
            alone.append((central, views[0].tensor))
            continue
        any_assigned = any(map(_assigned_of, views))
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            views = views[:1]
        if _combinable(aggregation, central, plain):  # the usual writes, batch norm's statistics
            # and counters: with the others like them
            batched.setdefault(
                (aggregation, len(views), any_assigned, central.dtype), []
            ).append((central, views))
            continue
        finals = [view.tensor.to(central.device) for view in views]
        if (
            aggregation is _MEAN and len(views) > 2 and central.is_floating_point()
            and central.layout is torch.strided and _left_alike([[final] for final in finals])
        ):
            central.copy_(finals[0])
            continue
        terms = [
            write_term(aggregation, central, final, 1, view.assigned, any_assigned)
            for view, final in zip(views, finals, strict=True)
        ]
        central.copy_(
            written_value(aggregation, central, sum_in_order(terms), len(views), any_assigned)
        )
    for (aggregation, writers_count, assigned, _), entries in batched.items():
        centrals = [central for central, _ in entries]
        values = [
            [views[k].tensor for _, views in entries] for k in range(writers_count)
        ]
        _apply_together(aggregation, assigned, centrals, values)
    if alone:  # brought from a GPU in one copy per dtype
        centrals, moved = map(list, zip(*alone, strict=True))
        torch._foreach_copy_(centrals, _brought(centrals, moved))


_BATCHED = (
    VariableAggregation.SUM, VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA
)
_MEAN = VariableAggregation.MEAN
_ONLY_FIRST = VariableAggregation.ONLY_FIRST_REPLICA


def _plain_classes() -> frozenset[type]:
    """The classes of the variables whose writes may combine in ``_foreach`` kernels:
    ``torch.Tensor`` and ``nn.Parameter`` exactly (``EXACT_CLASSES``; a subclass may
    dispatch otherwise; a Keras variable's value is a Parameter)."""
    return EXACT_CLASSES[torch.Tensor] | EXACT_CLASSES[torch.nn.Parameter]


def _combinable(
    aggregation: VariableAggregation, central: torch.Tensor, plain: frozenset[type]
) -> bool:
    """Whether writes to ``central`` combine with those to other variables like it in
    ``_foreach`` kernels: a dense tensor of a ``plain`` class (``_plain_classes``), not
    boolean, of an aggregation that adds (an integer MEAN rounds its quotient, which
    ``copy_`` does one variable at a time)."""
    if aggregation not in _BATCHED or type(central) not in plain:
        return False
    return central.layout is torch.strided and central.dtype is not torch.bool and (
        central.is_floating_point() or aggregation is not _MEAN
    )


def _apply_aligned(writes: list[list[View]], num_replicas: int, local_replicas: int) -> bool:
    """``apply_writes`` in passes in C when every replica that wrote wrote the same
    variables in the same order (each replica's batch norms, every step), none dying, each
    one that ``_apply_together`` combines, or there is one replica; or, all ON_READ, their
    copies' changes that ``_reduce_aligned`` takes. False, with nothing applied, otherwise."""
    first = writes[0]
    keys = list(map(_key_of, first))
    if any(list(map(_key_of, views)) != keys for views in writes[1:]):
        return False
    centrals = list(map(call, map(_record_ref_of, first)))
    if not all(map(is_not, centrals, repeat(None))):
        return False
    on_read = list(map(_on_read_of, first))
    if any(on_read):
        return all(on_read) and _reduce_aligned(writes, centrals, local_replicas)
    if num_replicas == 1:  # its values, as written, brought in one copy per dtype
        values = list(map(_tensor_of, first))
        torch._foreach_copy_(centrals, _brought(centrals, values))
        return True
    aggregations = list(map(_aggregation_of, first))
    dtypes = list(map(_dtype_of, centrals))
    if not _all_combinable(aggregations, centrals, dtypes):
        return False
    assigned = list(map(any, zip(*[list(map(_assigned_of, views)) for views in writes])))
    counts = list(map((len(writes), 1).__getitem__, map(is_, aggregations, repeat(_ONLY_FIRST))))
    groups = list(zip(aggregations, counts, assigned, dtypes))
    for group in dict.fromkeys(groups):
        chosen = list(map(eq, groups, repeat(group)))
        aggregation, count, any_assigned, _ = group
        _apply_together(aggregation, any_assigned, list(compress(centrals, chosen)), [
            list(map(_tensor_of, compress(views, chosen)))
            for views in writes[:count]
        ])
    return True


def _all_combinable(
    aggregations: list[VariableAggregation], centrals: list[torch.Tensor],
    dtypes: list[torch.dtype],
) -> bool:
    """``_combinable`` of each variable (``dtypes``: theirs), in passes in C."""
    return all(map(all, zip(
        map(_BATCHED.__contains__, aggregations),
        map(_plain_classes().__contains__, map(type, centrals)),
        map(is_, map(_layout_of, centrals), repeat(torch.strided)),
        map(is_not, dtypes, repeat(torch.bool)),
        map(or_, map(_is_floating_point, centrals), map(is_not, aggregations, repeat(_MEAN))),
    )))


def _apply_together(
    aggregation: VariableAggregation, assigned: bool, centrals: list[torch.Tensor],
    values: list[list[torch.Tensor]],
) -> None:
    """The writes of ``len(values)`` replicas (each replica's ``values``, in replica order)
    to ``centrals``, of one dtype and aggregation (SUM, MEAN of floating point, or
    ONLY_FIRST_REPLICA: the first writer's): the arithmetic of ``write_term``,
    ``sum_in_order`` and ``written_value`` in a few ``_foreach`` kernels per replica for all
    of them, each replica's values brought to the variables' device in one copy. Under SUM
    without an assignment each variable moves by the sum of the replicas' moves in replica
    order; with one (``assigned``), and always under MEAN (``by_value``), it becomes the
    sum of their values (their mean), and under MEAN variables that three or more writers
    left at the same values take them (``_left_alike``)."""
    assigned = assigned or by_value(aggregation)
    if aggregation is _MEAN and len(values) > 2:
        values = [_brought(centrals, replica_values) for replica_values in values]
        if _left_alike(values):
            torch._foreach_copy_(centrals, values[0])
            return
    total: Sequence[torch.Tensor] = ()
    for replica_values in values:  # (out of place: a replica's values may be its own tensors)
        brought = _brought(centrals, replica_values)
        terms = brought if assigned else torch._foreach_sub(brought, centrals)
        total = torch._foreach_add(list(total), terms) if total else terms
    if aggregation is VariableAggregation.MEAN and len(values) > 1:  # (x / 1 is x)
        torch._foreach_div_(list(total), len(values))  # the sums are fresh tensors
    if assigned:
        torch._foreach_copy_(centrals, list(total))
    else:
        torch._foreach_add_(centrals, list(total))


def _left_alike(values: list[list[torch.Tensor]]) -> bool:
    """Whether every replica (each one's ``values``, on one device) left the variables at the
    same values, element for element: a write the replicas repeat alike (a power
    iteration's vectors, a constant) then folds to its value exactly, as on one device,
    where the mean of three equal values, ``((a + a) + a) / 3``, can miss ``a`` in the last
    bit (the mean of two cannot). One comparison per replica, of its values laid end to
    end."""
    flats = [
        torch.cat(list(map(torch.ravel, replica_values))) if len(replica_values) > 1
        else replica_values[0].ravel()
        for replica_values in values
    ]
    return all(map(torch.equal, repeat(flats[0]), flats[1:]))


def _brought(centrals: list[torch.Tensor], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values[i]`` on the device of ``centrals[i]`` (all on one device). The values of one
    dtype on one other device (a GPU replica's) come in one copy: a copy each would cost
    its start each time, and from a GPU to the host a wait for the GPU each time."""
    devices = list(map(_device_of, values))
    if devices == list(map(_device_of, centrals)):
        return values
    if len(set(map(_device_of, centrals))) > 1:
        return [value.to(central.device) for central, value in zip(centrals, values)]
    return brought_to(centrals[0].device, values, devices)


def brought_to(
    target: torch.device, values: list[torch.Tensor], devices: list[torch.device] | None = None
) -> list[torch.Tensor]:
    """``values`` on ``target`` (``devices``: theirs, if known): those there already as they
    are, those of one dtype on one other device in one copy, viewed in pieces of their
    shapes (``_brought``'s transfers, for a caller without tensors on ``target``)."""
    if devices is None:
        devices = list(map(_device_of, values))
    kinds = list(zip(devices, map(_dtype_of, values)))
    brought = list(values)
    for device, dtype in dict.fromkeys(kinds):
        if device == target:
            continue
        chosen = list(map(eq, kinds, repeat((device, dtype))))
        mine = list(compress(values, chosen))
        numels = list(map(_numel, mine))
        flat = torch.cat(list(map(torch.reshape, mine, repeat((-1,))))).to(target)
        pieces = map(torch.Tensor.view, flat.split_with_sizes(numels), map(_shape_of, mine))
        deque(map(brought.__setitem__, compress(count(), chosen), pieces), maxlen=0)
    return brought


def _reduce_all_copies(every: list[list[tuple[int, View]]], local_replicas: int) -> None:
    """``_reduce_copies`` of every ON_READ variable whose copies a run wrote. Those of one
    aggregation, dtype and device whose copies the same replicas wrote (a Keras model's
    metrics, at every step) are reduced together, the same arithmetic in a few kernels for
    all of them: each replica's copies and their starting values brought from its device
    in one copy per dtype, its changes in one ``_foreach_sub``, summed in replica order and
    added to the central values. The others are reduced one by one."""
    together: dict[tuple[Any, ...], list[tuple[torch.Tensor, Central, list[View]]]] = {}
    plain = _plain_classes()
    for copies in every:
        record = copies[0][1].record
        central = record.ref()
        if central is None or not _combinable(record.aggregation, central, plain):
            _reduce_copies(copies, local_replicas)
            continue
        if record.aggregation is _ONLY_FIRST:  # (in replica order: global replica 0 first)
            copies = copies[:1] if copies[0][0] == 0 else []
        if any(map(is_, map(_start_of, map(_second, copies)), repeat(None))):  # not started
            copies = [(replica, view) for replica, view in copies if view.start is not None]
        key = (record.aggregation, central.dtype, central.device, tuple(map(_first, copies)))
        together.setdefault(key, []).append((central, record, list(map(_second, copies))))
    for (aggregation, _, _, replicas), entries in together.items():
        _reduce_together(
            aggregation, [central for central, _, _ in entries],
            [record for _, record, _ in entries],
            [[copies[k] for _, _, copies in entries] for k in range(len(replicas))],
            local_replicas,
        )


def _reduce_aligned(
    writes: list[list[View]], centrals: list[torch.Tensor], local_replicas: int
) -> bool:
    """``_reduce_all_copies`` in passes in C for replicas that each wrote the copies of the
    same ON_READ variables, ``centrals``, in the same order (a Keras model's metrics, at
    every step), all of one aggregation that adds (SUM, or MEAN of floating point), one
    dtype and one device, of a plain class, each copy started: one group of
    ``_reduce_together``, as the variable-by-variable sort would make it. False, with
    nothing done, otherwise."""
    aggregations = list(map(_aggregation_of, writes[0]))
    dtypes = list(map(_dtype_of, centrals))
    if (
        len(set(aggregations)) != 1 or aggregations[0] is _ONLY_FIRST
        or len(set(dtypes)) != 1 or len(set(map(_device_of, centrals))) != 1
        or not _all_combinable(aggregations, centrals, dtypes)
        or not all(all(map(is_not, map(_start_of, views), repeat(None))) for views in writes)
    ):
        return False
    aggregation = aggregations[0]
    _reduce_together(aggregation, centrals, list(map(_record_of, writes[0])), writes,
                     local_replicas)
    return True


def _reduce_together(
    aggregation: VariableAggregation, centrals: list[torch.Tensor], records: list[Central],
    each: list[list[View]], local_replicas: int,
) -> None:
    """The changes of the copies of ``centrals`` (``records``' variables) that each replica
    in ``each`` made (its views of them, in their order, in replica order), of one
    aggregation that adds, dtype and device: ``_reduce_copies``' arithmetic in a few kernels
    for all of them. Each replica's copies and starts come from its device in one copy per
    dtype, its changes are one ``_foreach_sub``, and their sums in replica order move the
    central values."""
    total: list[torch.Tensor] = []
    for views in each:  # (read under ``no_grad``)
        both = _brought(centrals * 2, [*map(_tensor_of, views), *map(_start_of, views)])
        terms = list(torch._foreach_sub(both[:len(views)], both[len(views):]))
        total = list(torch._foreach_add(total, terms)) if total else terms
    if total:
        if aggregation is _MEAN:
            total = list(torch._foreach_div(total, local_replicas))
        torch._foreach_add_(centrals, total)
    for views in each:  # (one replica's copies live on its device)
        _restart(views)
    for central, record in zip(centrals, records, strict=True):
        record.synced = (central._version, central.data_ptr())


def _restart(views: list[View]) -> None:
    """The copies' changes are folded: each start takes its copy's value, so that the next
    epoch counts the copy's writes from here without a clone of it
    (``ReplicaViews._validate_on_read``)."""
    tensors = list(map(_tensor_of, views))
    torch._foreach_copy_(list(map(_start_of, views)), tensors)
    deque(map(setattr, views, repeat("start_at"), map(_version_of, tensors)), maxlen=0)


def _reduce_copies(copies: list[tuple[int, View]], local_replicas: int) -> None:
    """The central value of an ON_READ variable follows its replicas' copies: it is their
    reduction, and moves by what the replicas that wrote changed in their copies since the
    epoch began (SUM: the sum of the changes; MEAN: that over this process's replicas;
    ONLY_FIRST_REPLICA: replica 0's), the arithmetic of writes that add, each copy's change
    one term. Across workers the exchange then combines the workers' values as writes of the
    aggregation: SUM adds the workers' changes, MEAN averages the workers' values weighted by
    their writers (exact when every replica wrote), and ONLY_FIRST_REPLICA takes the first
    worker's."""
    record = copies[0][1].record
    central = record.ref()
    if central is None:
        return
    aggregation = record.aggregation
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        copies = [(replica, view) for replica, view in copies if replica == 0]
    started = [(view, view.start) for _, view in copies if view.start is not None]
    terms = [
        write_term(
            aggregation, start.to(central.device), view.tensor.to(central.device),
            1, False, False,
        )
        for view, start in started
    ]
    if terms:
        central.copy_(
            written_value(aggregation, central, sum_in_order(terms), local_replicas, False)
        )
        for view, start in started:  # (a tensor subclass, a sparse or boolean copy: alone)
            start.copy_(view.tensor)
            view.start_at = view.tensor._version
    record.synced = (central._version, central.data_ptr())


def finish(touched: list[list[View]]) -> None:
    """Close the replicas' views after a sync point: routed copies go back to the shared
    views, and the touched lists are emptied."""
    for views in touched:
        if not all(map(is_, map(_alias_of, views), repeat(None))):  # some routed copy
            for view in views:
                if view.alias is not None:
                    view.tensor, view.alias, view.private = view.alias, None, False
        views.clear()


def discard(touched: list[list[View]]) -> None:
    """Drop what a failed run left in the views (gradients, gradient copies in flight,
    writes), so that the central variables, their ``.grad`` and buffers stay as before it.
    Private copies are refreshed from the central value on next use: a kernel may have
    written them without a trace."""
    for views in touched:
        for view in views:
            gradients_of(view)  # taken off the view, and dropped
            if view.record.on_read:  # the replica's copy as before the run
                if view.start is not None:
                    with no_grad():
                        view.tensor.copy_(view.start)
                    view.start_at = view.tensor._version
            elif view.private:
                view.central_version = -1
    finish(touched)
