"""Runs without views: replicas computing on the variables themselves.

Views cost a scan of every torch call's arguments, so one replica on the device of its
variables uses them directly (its writes apply at once, as in TensorFlow). Such a run is still
a transaction: at its start ``Undo`` sets the gradients already in ``.grad`` aside and copies
the variables that do not require grad and are not parameters (buffers, counters), both small
next to a step; the sync point adds the gradients back (commit) or restores both (rollback).
A parameter written in place by a failed run (``p.clamp_()``, or a frozen weight) is not
undone: copying every frozen weight at every step would cost what fine-tuning a large frozen
model cannot afford. Nor is a write through ``.data`` to a buffer of integers, whose copy is
kept from run to run while no version counter moves (``_Group``).

Several replicas in one process that compute where the parameters live (logical CPU devices,
or the GPU that holds them) also use directly the parameters that no replica may write
(``DirectReplicas``), one after another on the calling thread, with ``.grad`` holding one
replica's gradients at a time: no views, slots or folding for them, and a ``torch.compile``d
model sees the same parameters in every replica. Where every replica computes where the
variables live (``DirectRun``, and a worker's replicas, which see views of the parameters),
they share the integer buffers, batch norm's running statistics and small floating buffers
too, each finding them as before the run (``direct_buffers.py``). Other buffers and
variables whose writes aggregate keep their views.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Protocol

import torch

from .._aggregation import VariableAggregation
from .._autograd import grad_of as _grad
from .._autograd import hooks_of as _hooks
from .._autograd import no_grad, set_grads
from .._autograd import requires_grad_of as _requires_grad
from .._autograd import some as _any
from .._autograd import version_of as _version
from .direct_buffers import Written
from .folding import HeldHooks, add_in_order, all_dense, plus
from .records import Central, alive
from .views import EXACT_CLASSES

_NO_HOOKS = HeldHooks([])  # shared: it holds nothing, and releasing it is skipped


def _held_hooks(tensors: list[torch.Tensor]) -> HeldHooks:
    """``HeldHooks`` of ``tensors``, asked first in one pass whether any has a hook."""
    return HeldHooks(tensors) if any(map(_hooks, tensors)) else _NO_HOOKS


def _hooked(hooks: HeldHooks) -> list[torch.Tensor]:
    """The tensors with held hooks that now have a gradient."""
    return [tensor for tensor in hooks.tensors if tensor.grad is not None]


Copy = torch.Tensor | list[torch.Tensor]  # a group's copy: the bytes of all, or a clone each
_address = torch.Tensor.data_ptr
_size_in_bytes = attrgetter("nbytes")


def _stamps(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Where each tensor's memory starts, and how many bytes it holds."""
    return list(map(_address, tensors)), list(map(_size_in_bytes, tensors))


def _is_integral(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex()


class _Group:
    """Tensors copied together (``Copier``): plain dense contiguous tensors of one device,
    whose bytes one ``cat`` joins, read through views of them as bytes that are kept from
    run to run (``views``); or (``views`` None) the others, a clone each.

    A group of integers only (position ids, ``token_type_ids``, step counters) keeps its
    copy too, while no member's version counter moves: every write to an integer moves it
    (one through ``.data`` moves none: it applies at once, as on one device, and as the
    integers shared by several replicas do, ``direct_buffers.py``). Floating buffers are
    copied at every run: batch norm's kernel writes its statistics behind the counters."""

    __slots__ = ("_kept", "_stamps", "_versions", "indices", "sizes", "take", "views")

    def __init__(self, indices: list[int], tensors: list[torch.Tensor], as_bytes: bool) -> None:
        self.indices = indices
        self.take = itemgetter(*indices) if len(indices) > 1 else None
        self.views: list[torch.Tensor] | None = None
        self.sizes: list[int] = []
        self._stamps: tuple[list[int], list[int]] = ([], [])
        self._kept: torch.Tensor | None = None  # the copy an integer group keeps
        self._versions: list[int] | None = None  # its members' counters when copied
        if as_bytes:
            members = self.members(tensors)
            with no_grad(), torch.inference_mode(False):  # a rollback writes them in any mode
                self.views = [tensor.view(-1).view(torch.uint8) for tensor in members]
            self.sizes = [view.numel() for view in self.views]
            self._stamps = _stamps(members)
            if all(map(_is_integral, members)):
                self._versions = []  # an integer group, not copied yet

    def members(self, tensors: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        return [tensors[self.indices[0]]] if self.take is None else self.take(tensors)

    def reads(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the views still read the group's tensors in ``tensors``: each begins
        where its view does and holds as many bytes. (The views keep the memory they read
        alive, so no other memory begins there; ``.data =``, ``set_`` or a ``resize_`` that
        moves a tensor shows.) Raises ``RuntimeError`` for a tensor without storage."""
        return self.views is None or _stamps(self.members(tensors)) == self._stamps

    def copy(
        self, tensors: list[torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], Copy, list[int] | None]:
        """The tensors that a restore writes (the views, or the group's tensors in
        ``tensors``), their copy, and for an integer group the version counters it was
        copied at (its views share their tensors' counters)."""
        if self.views is None:
            members = self.members(tensors)
            return members, list(map(torch.Tensor.clone, members)), None
        if self._versions is None:
            return self.views, torch.cat(self.views), None
        versions = list(map(_version, self.views))
        if versions != self._versions or self._kept is None:  # written since its last copy
            self._kept, self._versions = torch.cat(self.views), versions
        return self.views, self._kept, versions

    def pieces(self, copy: Copy) -> Sequence[torch.Tensor]:
        """Each member's copy, in order: pieces of the joined bytes, or the clones."""
        return copy if isinstance(copy, list) else torch.split(copy, self.sizes)


def _groups(tensors: list[torch.Tensor]) -> list[_Group]:
    """How ``tensors`` are copied: the bytes of plain dense contiguous tensors together by
    device, whatever their dtypes and shapes; the rest (subclasses, sparse, quantized,
    strided or conjugated views, tensors that require grad) cloned."""
    together: dict[torch.device, list[int]] = {}
    alone: list[int] = []
    plain = EXACT_CLASSES[torch.Tensor]
    for i, tensor in enumerate(tensors):
        if (
            type(tensor) in plain and tensor.layout is torch.strided
            and not tensor.is_quantized and tensor.is_contiguous() and not tensor.is_conj()
            and not tensor.is_neg() and not tensor.requires_grad
        ):
            together.setdefault(tensor.device, []).append(i)
        else:
            alone.append(i)
    groups = [_Group(indices, tensors, as_bytes=True) for indices in together.values()]
    if alone:
        groups.append(_Group(alone, tensors, as_bytes=False))
    return groups


class Copies:
    """One copy of some tensors, in fresh memory (``Copier.copy``), which ``restore`` puts
    back in them."""

    __slots__ = ("_parts", "tensors")

    def __init__(
        self,
        tensors: list[torch.Tensor],
        parts: list[tuple[_Group, Sequence[torch.Tensor], Copy, list[int] | None]],
    ) -> None:
        self.tensors = tensors
        self._parts = parts

    def restore(self) -> None:
        """The tensors take back the copied values (integers only if one was written)."""
        with no_grad():
            for group, members, copy, versions in self._parts:
                if versions is not None and list(map(_version, members)) == versions:
                    continue
                if isinstance(copy, list):  # clones: a ``copy_`` each, which any layout has
                    for tensor, value in zip(members, copy, strict=True):
                        tensor.copy_(value)
                else:
                    torch._foreach_copy_(list(members), list(group.pieces(copy)))


class Copier:
    """What the runs of one replica over the same variables keep from run to run, so that
    setting up their ``Undo`` costs little: which variables are state to copy, and how.

    The state (running statistics, counters, masks) is copied in one kernel per device: the
    bytes of every plain dense contiguous tensor, read through views of it as bytes that
    are made once, joined by one ``cat``. (Right after a step each kernel costs about 13 us
    on the CPU, a launch on a GPU: ten batch-norm layers took two when a ``cat`` joined the
    vectors of each dtype and a ``stack`` the scalars, and a clone each would take 30.) Any
    other tensor is cloned. The views are made again when a tensor no longer begins where
    its view does or changed its size in bytes; until then they keep the memory they read
    alive, a copy's worth for a deleted model until the next run. A device's tensors that
    are all integers keep their copy while no one writes them (``_Group``): BERT's position
    ids and token types cost no kernel a run."""

    __slots__ = ("_count", "_flags", "_groups", "_key", "_state")

    def __init__(self) -> None:
        self._count = -1
        self._groups: list[_Group] = []
        self._key: object = None
        self._flags: list[bool] = []
        self._state: list[bool] = []

    def state(
        self, tensors: list[torch.Tensor], flags: list[bool], key: object
    ) -> list[torch.Tensor]:
        """The tensors of ``tensors`` that a failed run must put back: those that do not
        require grad (``flags``) and are not parameters (frozen weights are not copied:
        see the module's docstring). ``key``: an object that is the same in a later call
        only while ``tensors`` holds the same tensors (the store's weak references while
        they all live), or None; which tensors qualify is worked out again when it or
        ``flags`` differ. (A parameter of a tensor subclass is one by its flag, which
        ``isinstance`` reads.)"""
        if key is None or key is not self._key or flags != self._flags:
            self._state = [
                not learned and not isinstance(tensor, torch.nn.Parameter)
                for tensor, learned in zip(tensors, flags, strict=True)
            ]
            self._key, self._flags = key, flags
        return list(compress(tensors, self._state))

    def copy(self, tensors: list[torch.Tensor]) -> Copies:
        """A copy of ``tensors`` as they are now."""
        try:
            current = len(tensors) == self._count and all(
                map(_Group.reads, self._groups, repeat(tensors))
            )
        except RuntimeError:  # a tensor without storage where one with storage was
            current = False
        if not current:
            self._groups, self._count = _groups(tensors), len(tensors)
        return Copies(tensors, [(group, *group.copy(tensors)) for group in self._groups])


class Undo:
    """What one run without views changed, and how to take it back."""

    __slots__ = ("_copies", "_held", "_hooks", "_old", "_tensors")

    def __init__(self, refs: list[weakref.ref[torch.Tensor]], copier: Copier) -> None:
        """``refs``: the weak references of every variable, a list that stays the same
        object while the variables do (the store's)."""
        self._copies: Copies | None = None
        tensors = alive(refs)
        flags = list(map(_requires_grad, tensors))
        if all(flags):  # a model of parameters only: passes in C
            learned = tensors
        else:
            learned = list(compress(tensors, flags))
            state = copier.state(tensors, flags, refs if len(tensors) == len(refs) else None)
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
    def commit(self, report: bool) -> dict[int, Written]: ...
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

    __slots__ = (
        "_buffers_open", "_grads", "_held", "_hooks", "_old", "_open", "_versions", "buffers",
        "tensors",
    )

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
        self._buffers_open = bool(buffers)  # until the buffers are committed
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
        self.commit_buffers(report=False)
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

    def commit_buffers(self, report: bool = True) -> dict[int, Written]:
        """The shared buffers' part of ``commit``, which a sync point across workers makes
        first: it combines their writes with the other workers' (by record key; only once
        per sync point). ``report`` False: the writes are not returned (one process)."""
        if not self._buffers_open:
            return {}
        self._buffers_open = False
        written: dict[int, Written] = {}
        for shared in self.buffers:
            written.update(shared.commit(report))
        return written

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
        if self._buffers_open:  # (else the sync point puts back their values from before)
            for shared in self.buffers:
                shared.restore()
        self._forget()

    def _forget(self) -> None:
        self._old, self._grads, self._open, self._buffers_open = [], {}, False, False
        if self._hooks.tensors:
            self._hooks.release()
