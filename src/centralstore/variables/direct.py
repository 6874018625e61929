"""Runs without views: replicas computing on the variables themselves.

Views cost a scan of every torch call's arguments, so one replica on the device of its
variables uses them directly (its writes apply at once, as in TensorFlow). Such a run is still
a transaction: at its start ``Undo`` sets the gradients already in ``.grad`` aside and copies
the variables that do not require grad and are not parameters (buffers, counters), both small
next to a step; the sync point adds the gradients back (commit) or restores both (rollback).
A parameter written in place by a failed run (``p.clamp_()``, or a frozen weight) is the one
thing not undone: copying every frozen weight at every step would cost what fine-tuning a
large frozen model cannot afford.

Several replicas in one process that compute where the parameters live (logical CPU devices,
or the GPU that holds them) also use directly the parameters that no replica may write
(``DirectReplicas``), one after another on the calling thread, with ``.grad`` holding one
replica's gradients at a time: no views, slots or folding for them, and a ``torch.compile``d
model sees the same parameters in every replica. Where every replica does (``DirectRun``),
they share the integer buffers and batch norm's running statistics too, each finding them as
before the run (``direct_buffers.py``). Other buffers and variables whose writes aggregate
keep their views.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import itemgetter, not_
from typing import Protocol

import torch

from .._aggregation import VariableAggregation
from .._autograd import grad_of as _grad
from .._autograd import hooks_of as _hooks
from .._autograd import no_grad, set_grads
from .._autograd import requires_grad_of as _requires_grad
from .._autograd import some as _any
from .._autograd import version_of as _version
from .folding import HeldHooks, add_in_order, all_dense, plus
from .records import Central

_NO_HOOKS = HeldHooks([])  # shared: it holds nothing, and releasing it is skipped


def _held_hooks(tensors: list[torch.Tensor]) -> HeldHooks:
    """``HeldHooks`` of ``tensors``, asked first in one pass whether any has a hook."""
    return HeldHooks(tensors) if any(map(_hooks, tensors)) else _NO_HOOKS


def _hooked(hooks: HeldHooks) -> list[torch.Tensor]:
    """The tensors with held hooks that now have a gradient."""
    return [tensor for tensor in hooks.tensors if tensor.grad is not None]


_CAT, _STACK, _CLONE = range(3)
Copy = torch.Tensor | list[torch.Tensor]  # a group's copy: one flat tensor, or a clone each


class _Group:
    """Tensors copied together (``Copier``): vectors of one dtype by one ``cat``, scalars of
    one dtype by one ``stack``, or (``_CLONE``) the others, one clone each."""

    __slots__ = ("dtype", "indices", "kind", "sizes", "take", "total")

    def __init__(self, kind: int, indices: list[int], tensors: list[torch.Tensor]) -> None:
        self.kind = kind
        self.indices = indices
        self.take = itemgetter(*indices) if len(indices) > 1 else None
        self.dtype = tensors[indices[0]].dtype
        self.sizes = [tensors[i].numel() for i in indices]
        self.total = sum(self.sizes)

    def copy(self, tensors: list[torch.Tensor]) -> tuple[Sequence[torch.Tensor], Copy]:
        """The group's tensors in ``tensors``, and their copy."""
        members = [tensors[self.indices[0]]] if self.take is None else self.take(tensors)
        if self.kind == _CLONE:
            return members, list(map(torch.Tensor.clone, members))
        flat = torch.cat(members) if self.kind == _CAT else torch.stack(members)
        if flat.dtype is not self.dtype or flat.numel() != self.total:
            raise _Changed
        return members, flat

    def pieces(self, copy: Copy) -> Sequence[torch.Tensor]:
        """Each member's copy, in order: views of a flat copy, or the clones."""
        if isinstance(copy, list):
            return copy
        return torch.split(copy, self.sizes) if self.kind == _CAT else copy.unbind()


class _Changed(Exception):
    """A tensor of a ``Copier``'s list changed its dtype or size in place."""


def _groups(tensors: list[torch.Tensor]) -> list[_Group]:
    """How ``tensors`` are copied: plain dense vectors and scalars together by dtype and
    device (a group of one is cloned), the rest (matrices, subclasses, sparse or quantized
    tensors) cloned."""
    together: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    alone: list[int] = []
    for i, tensor in enumerate(tensors):
        rank = tensor.dim()
        if (
            rank < 2 and type(tensor) is torch.Tensor and tensor.layout is torch.strided
            and not tensor.is_quantized
        ):
            together.setdefault((rank, tensor.dtype, tensor.device), []).append(i)
        else:
            alone.append(i)
    groups = []
    for (rank, _, _), indices in together.items():
        if len(indices) > 1:
            groups.append(_Group(_CAT if rank else _STACK, indices, tensors))
        else:
            alone += indices
    if alone:
        groups.append(_Group(_CLONE, sorted(alone), tensors))
    return groups


class Copies:
    """One copy of some tensors, in fresh memory (``Copier.copy``), which ``restore`` puts
    back in them."""

    __slots__ = ("_parts", "tensors")

    def __init__(
        self, tensors: list[torch.Tensor], parts: list[tuple[_Group, Sequence[torch.Tensor], Copy]]
    ) -> None:
        self.tensors = tensors
        self._parts = parts

    def restore(self) -> None:
        """The tensors take back the copied values."""
        with no_grad():
            for group, members, copy in self._parts:
                if isinstance(copy, list):  # clones: a ``copy_`` each, which any layout has
                    for tensor, value in zip(members, copy, strict=True):
                        tensor.copy_(value)
                else:
                    torch._foreach_copy_(list(members), list(group.pieces(copy)))


class Copier:
    """Copies of the same tensors run after run (the buffers of a one-replica run: running
    statistics, counters), in few kernels: the vectors of one dtype in one ``cat``, the
    scalars of one dtype in one ``stack``, each tensor's copy a view of the result; any
    other tensor cloned. (A clone each costs a kernel per tensor: 30 for ten batch-norm
    layers, a launch each on a GPU.) How they group is worked out again whenever the list
    holds other tensors (by identity) or one of them changed its dtype or size in place."""

    __slots__ = ("_groups", "_ids")

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._groups: list[_Group] = []

    def copy(self, tensors: list[torch.Tensor]) -> Copies:
        """A copy of ``tensors`` as they are now."""
        ids = list(map(id, tensors))
        if ids != self._ids:
            self._groups, self._ids = _groups(tensors), ids
        try:
            parts = [(group, *group.copy(tensors)) for group in self._groups]
        except (_Changed, RuntimeError):  # (a stack of tensors whose shapes now differ)
            self._groups = _groups(tensors)
            parts = [(group, *group.copy(tensors)) for group in self._groups]
        return Copies(tensors, parts)


class Undo:
    """What one run without views changed, and how to take it back."""

    __slots__ = ("_copies", "_held", "_hooks", "_old", "_tensors")

    def __init__(self, tensors: list[torch.Tensor], copier: Copier) -> None:
        self._copies: Copies | None = None
        flags = list(map(_requires_grad, tensors))
        if all(flags):  # a model of parameters only: passes in C
            learned = tensors
        else:
            learned = list(compress(tensors, flags))
            others = list(compress(tensors, map(not_, flags)))
            # frozen weights are not copied (passes in C: ``isinstance`` of a Parameter
            # runs its metaclass's Python)
            state = list(compress(others, map(
                not_, map(issubclass, map(type, others), repeat(torch.nn.Parameter))
            )))
            if state:
                self._copies = copier.copy(state)
        self._tensors = learned
        self._old: list[torch.Tensor | None] = list(map(_grad, learned))
        self._held = _any(self._old)  # whether some .grad was set aside
        if self._held:
            set_grads(learned, repeat(None))
        self._hooks = _held_hooks(learned)

    def commit(self) -> list[torch.Tensor]:
        """Keep the run's work: its gradients are added to the set-aside ones, in place (a
        ``.grad`` that existed before the run stays the same tensor, as in plain PyTorch).
        Returns the tensors with post-accumulate-grad hooks that received gradients."""
        hooked = _hooked(self._hooks) if self._hooks.tensors else []
        if self._held:
            sums = list(self._old)
            add_in_order(sums, list(map(_grad, self._tensors)))
            set_grads(self._tensors, sums)
        self._forget()
        return hooked

    def rollback(self) -> None:
        """Drop the run's work: gradients and the variables without grad as before it."""
        set_grads(self._tensors, self._old)
        if self._copies is not None:
            self._copies.restore()
        self._forget()

    def _forget(self) -> None:
        self._tensors, self._old, self._copies, self._held = [], [], None, False
        if self._hooks.tensors:
            self._hooks.release()


def shared_parameters(records: list[Central], storage: torch.device) -> list[Central]:
    """The variables that replicas computing on ``storage``, the parameter device, use
    directly in a run of several: module parameters stored there with aggregation NONE,
    which no replica may write. (Buffers and variables whose writes aggregate keep views:
    a replica may not write what the next one reads.)"""
    return [
        record
        for record in records
        if record.owners
        and not record.is_buffer
        and record.aggregation is VariableAggregation.NONE
        and (tensor := record.ref()) is not None
        and tensor.device == storage
    ]


class SharedBuffers(Protocol):
    """Buffers that the replicas of a run share (``direct_buffers.py``)."""

    tensors: list[torch.Tensor]

    def take(self, replica: int, last: bool) -> None: ...
    def put_back(self, replica: int) -> None: ...
    def commit(self) -> None: ...
    def restore(self) -> None: ...
    def again(self) -> SharedBuffers: ...


class DirectReplicas:
    """The parameters that the replicas of a run of several compute on directly, one at a
    time, when they compute where the parameters live.

    Each replica finds only its own gradients in ``.grad``, as it would alone: the gradients
    already there are set aside when the run begins, and each replica's are taken off when
    it finishes (or parked while it waits in a rendezvous, and put back when it runs on).
    The sync point adds them, in replica order, to the set-aside gradients, in place where
    those exist (commit), or puts the set-aside gradients back untouched (rollback). No
    replica may write these parameters: a moved version counter raises when the replica
    finishes or hands the baton on. ``buffers``: the buffers they share too, if any.
    """

    __slots__ = ("_grads", "_held", "_hooks", "_old", "_open", "_versions", "buffers", "tensors")

    def __init__(
        self, tensors: list[torch.Tensor], buffers: Sequence[SharedBuffers] = ()
    ) -> None:
        self.tensors = tensors
        self.buffers = buffers
        self._versions = list(map(_version, tensors))
        self._old: list[torch.Tensor | None] = list(map(_grad, tensors))
        self._held = _any(self._old)  # whether some gradient was set aside
        if self._held:
            set_grads(tensors, repeat(None))
        self._grads: dict[int, list[torch.Tensor | None]] = {}  # replica -> its gradients
        self._open = True  # until the sync point commits or rolls back
        self._hooks = _held_hooks(tensors)

    def again(self) -> DirectReplicas:
        """The same variables, used afresh from a sync point on (a merge's, which committed
        what came before)."""
        return DirectReplicas(self.tensors, [shared.again() for shared in self.buffers])

    def written(self) -> torch.Tensor | None:
        """A parameter whose version counter moved since the run began, if any."""
        if list(map(_version, self.tensors)) == self._versions:
            return None
        return next(
            t for t, v in zip(self.tensors, self._versions, strict=True) if t._version != v
        )

    def park(self, replica: int) -> None:
        """Replica ``replica`` finished, or waits in a rendezvous: its gradients, if it has
        any (none in evaluation), are kept for the sync point or until it runs on, and
        ``.grad`` is empty for the next one."""
        grads = list(map(_grad, self.tensors))
        if _any(grads):
            set_grads(self.tensors, repeat(None))
            self._grads[replica] = grads
        for shared in self.buffers:
            shared.take(replica, last=False)

    def finish(self, replica: int) -> None:
        """The last replica finished: its gradients stay in ``.grad`` for the sync point,
        its values in the shared buffers."""
        for shared in self.buffers:
            shared.take(replica, last=True)

    def unpark(self, replica: int) -> None:
        """Replica ``replica`` runs on: its own gradients, and its values of the shared
        buffers, are back."""
        grads = self._grads.pop(replica, None)
        if grads is not None:
            set_grads(self.tensors, grads)
        for shared in self.buffers:
            shared.put_back(replica)

    def commit(self) -> list[torch.Tensor]:
        """Each replica's gradients, in replica order, added to the set-aside ones (in
        place: a ``.grad`` that existed stays the same tensor) and put in ``.grad``.
        Returns the parameters with post-accumulate-grad hooks that received gradients."""
        if not self._open:  # committed already at this sync point
            return []
        for shared in self.buffers:
            shared.commit()
        taken = [self._grads[r] for r in sorted(self._grads)]
        if self._held:
            sums = list(self._old)
            # the last replica's too (and a backward's since it finished), read in place
            for grads in [*taken, list(map(_grad, self.tensors))]:
                add_in_order(sums, grads)
            set_grads(self.tensors, sums)
        elif taken:
            self._add_to_last(taken)
        hooked = _hooked(self._hooks) if self._hooks.tensors else []
        self._forget()
        return hooked

    def _add_to_last(self, taken: list[list[torch.Tensor | None]]) -> None:
        """Nothing was set aside: the earlier replicas' gradients, summed in replica order,
        are added to the last replica's where it left them, in ``.grad`` (``last + earlier``
        is ``earlier + last`` bit for bit), so that ``.grad`` is set only where the last
        replica has none."""
        earlier: list[torch.Tensor | None]
        if len(taken) == 1:  # two replicas
            earlier = taken[0]
        else:
            earlier = [None] * len(self.tensors)
            for grads in taken:
                add_in_order(earlier, grads)
        lasts = list(map(_grad, self.tensors))
        if all_dense(lasts, earlier):  # the usual case, checked in C
            with no_grad():
                torch._foreach_add_(lasts, earlier)  # type: ignore[arg-type]
            return
        targets, sources = [], []
        for tensor, total in zip(self.tensors, earlier):
            if total is None:
                continue
            last = tensor.grad
            if last is None:
                tensor.grad = total
            elif last.is_sparse or total.is_sparse:
                tensor.grad = plus(total, last)
            else:
                targets.append(last)
                sources.append(total)
        if targets:
            with no_grad():
                torch._foreach_add_(targets, sources)

    def rollback(self) -> None:
        """The run failed: ``.grad`` and the shared buffers as before it."""
        if not self._open:
            return
        set_grads(self.tensors, self._old)
        for shared in self.buffers:
            shared.restore()
        self._forget()

    def _forget(self) -> None:
        self._old, self._grads, self._open = [], {}, False
        if self._hooks.tensors:
            self._hooks.release()
