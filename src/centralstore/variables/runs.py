"""A run of a store's variables, as an object of one of three modes.

The store opens one per ``strategy.run`` (``VariableStore.open_run``); it holds what that run
changed and exposes one small interface, whatever the mode:

* ``enter`` / ``leave``: a replica starts or ends, on whichever thread it runs;
* ``suspend`` / ``resume``: the replica hands the baton on at a rendezvous, or gets it back
  (``_replicas.py``): its state is taken off the modules and the parameters, and put back;
* ``cross_replica``: the region of ``merge_call``, where the variables are themselves;
* ``commit`` / ``rollback``: the run's sync point keeps its work, or drops it.

The modes:

* ``EmptyRun``: the store has no variables.
* ``OwnRun``: one replica computing where every variable lives (R = 1 on the parameter
  device): it uses them directly and keeps only an ``Undo`` record.
* ``DirectRun``: several replicas, each computing where every variable lives, on variables
  that are parameters no replica may write, integer buffers, batch norm's running
  statistics and small floating buffers (logical CPU devices, usual models): every replica
  uses them directly (``DirectReplicas``, ``direct_buffers.py``), without views.
* ``ReplicasRun``: several replicas otherwise, or one away from the variables. A replica that
  computes where the parameters live uses those no replica may write directly
  (``DirectReplicas``); where every local replica computes where the variables live (a
  worker's, too), they share those buffers as well; every other variable, and every
  variable of the other replicas, is seen through views, in the module slots
  (``modules.py``) and through the variables' class (``views.py``).

Replicas run one at a time, so each mode's state is that of the replica holding the baton.
"""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter, call
from typing import Protocol, final

import torch
from torch._C import DisableTorchFunctionSubclass

from . import folding
from .direct import Copier, DirectReplicas, SharedBuffers, Undo, shared_parameters
from .direct_buffers import BufferGroups, SharedFloats, SharedIntegers, Written
from .modules import (
    Filled,
    Replaced,
    Slots,
    keep_replaced,
    put_back,
    raise_shared_write,
    slots_of,
)
from .records import Central, alive
from .views import EXACT_CLASSES, ReplicaViews, lend_class, resolving, restore_class


class Store(Protocol):
    """What a run needs of its ``VariableStore``."""

    records: dict[int, Central]
    replicas: list[ReplicaViews]
    on_parameters: tuple[bool, ...]
    on_storage: tuple[bool, ...]
    copier: Copier

    def refs(self) -> list[weakref.ref[torch.Tensor]]: ...


class Plan:
    """How the replicas of a run see the records, kept while the records stay the same:
    the module slots (``slots``); the parameters that replicas computing where they live
    use directly (``shared``, ``DirectReplicas``) and the other records (``others``).
    ``shared_refs`` and ``others_refs`` are the records' weak references, which every run
    follows in one pass in C. When every local replica computes where the variables live
    (``on_storage``), ``buffers`` are the others that they may share as well (integers,
    running statistics, small floats: ``direct_buffers.py``), and ``direct`` says whether
    those are all the others (``DirectRun``); ``viewed_refs`` are the others without them.
    The slots that a replica computing where the variables live fills: ``direct_slots``
    without the shared parameters and buffers, ``direct_slots_with_buffers`` without the
    shared parameters only (for a run whose buffers turned out not to be plain tensors).

    A replica that sees views fills ``view_slots``: every slot, until a sync point learns
    which trainable parameters are ``idle`` (``settle_idle``): those no optimizer holds and
    no run gave a gradient, such as an EMA copy of the model. A GPU replica would get a copy
    of each at every run, though none reads it. Leaving a slot as it is stays correct: a
    replica that does read the variable gets its view through the variables' class, and the
    next sync point puts it back in."""

    __slots__ = (
        "_learnt", "buffers", "direct", "direct_slots", "direct_slots_with_buffers", "idle",
        "others", "others_refs", "shared", "shared_refs", "slots", "view_slots", "viewed_refs",
    )

    def __init__(
        self, records: dict[int, Central], on_parameters: Sequence[bool],
        on_storage: Sequence[bool], parameter_storage: torch.device,
    ) -> None:
        _refuse_sparse(records.values())
        slots = slots_of(records)
        self.slots = Slots(slots)
        self.view_slots = self.slots
        self.idle: frozenset[int] = frozenset()  # keys of records left out of ``view_slots``
        self._learnt = False
        self.shared: list[Central] = []
        if any(on_parameters):
            with DisableTorchFunctionSubclass():  # the devices of the variables themselves
                self.shared = shared_parameters(list(records.values()), parameter_storage)
        self.shared_refs = [record.ref for record in self.shared]
        keys = {record.key for record in self.shared}
        self.others = [record for record in records.values() if record.key not in keys]
        self.others_refs = [record.ref for record in self.others]
        self.buffers: BufferGroups | None = None
        if on_storage and all(on_storage):
            with DisableTorchFunctionSubclass():
                self.buffers = BufferGroups(self.others, parameter_storage)
        buffer_keys = {r.key for r in self.buffers.records} if self.buffers else set()
        self.direct = self.buffers is not None and len(buffer_keys) == len(self.others)
        self.viewed_refs = [r.ref for r in self.others if r.key not in buffer_keys]
        self.direct_slots_with_buffers = Slots([slot for slot in slots if slot[2].key not in keys])
        self.direct_slots = self.direct_slots_with_buffers
        if buffer_keys:
            keys |= buffer_keys
            self.direct_slots = Slots([slot for slot in slots if slot[2].key not in keys])

    def settle_idle(self, received: list[torch.Tensor], replicas: Sequence[ReplicaViews]) -> None:
        """What a sync point of replicas that saw views teaches (``received``: the variables
        it gave gradients). The first that received some after an optimizer stepped the
        plan's parameters finds the idle ones: trainable parameters in plain slots that no
        optimizer holds and that it gave no gradient. Their views are dropped (a GPU
        replica's copies freed) and no replica fills their slots. Every later one puts back
        in the slots an idle variable that some replica read (its view was made again,
        through the variables' class)."""
        if self._learnt:
            if self.idle:
                read = set().union(*(views.views.keys() & self.idle for views in replicas))
                if read:
                    self._leave_out(self.idle - read, replicas)
            return
        plain = self.slots.plain
        if plain is None:
            self._learnt = True
            return
        records = plain.records
        if not received or not any(map(_optimized_of, records)):
            return  # no optimizer has stepped yet: an idle variable cannot be told apart
        self._learnt = True
        given = set(map(id, received))
        idle = frozenset(
            record.key for record in records
            if not record.optimized and record.key not in given
            and (central := record.ref()) is not None and central.requires_grad
        )
        if idle:
            self._leave_out(idle, replicas)

    def _leave_out(self, idle: frozenset[int], replicas: Sequence[ReplicaViews]) -> None:
        """Replicas fill every slot but those of ``idle``; the views of those are dropped."""
        fresh = idle - self.idle
        self.idle = idle
        self.view_slots = (
            Slots([slot for slot in self.slots.items if slot[2].key not in idle])
            if idle else self.slots
        )
        for views in replicas:
            for key in fresh:
                views.forget(key)


_optimized_of = attrgetter("optimized")


def _refuse_sparse(records: Iterable[Central]) -> None:
    """Replicas that see variables through views of their own (several replicas, or one
    away from its variables) need dense variables: centralstore makes views of strided
    tensors only. (One replica on the variables' device uses them as they are.)"""
    for record in records:
        tensor = record.ref()
        if tensor is None or tensor.layout is torch.strided:
            continue
        module = record.owners[0][0]() if record.owners else None
        what = "buffer" if record.is_buffer else "variable"
        if module is not None:
            what += f" {record.owners[0][1]!r} of {type(module).__name__}"
        instead = (
            ", or, if the replicas only read it, keep it as a plain attribute "
            "(module.adjacency = tensor) instead of a buffer, so that every replica reads "
            "the same tensor" if record.is_buffer else ""
        )
        raise ValueError(
            f"The {what} is a {tensor.layout} tensor of shape {tuple(tensor.shape)}, but "
            "replicas that see the variables through copies of their own (several "
            "replicas, or one on another device than its variables) need dense variables: "
            "centralstore makes those copies of dense tensors only. Make it dense "
            f"(tensor.to_dense()){instead}."
        )


def _all_of(refs: list[weakref.ref[torch.Tensor]], kind: type) -> list[torch.Tensor] | None:
    """The tensors of ``refs`` if every one is alive and of class ``kind`` exactly (one
    pass in C; ``EXACT_CLASSES``), else None."""
    tensors = list(map(call, refs))
    if set(map(type, tensors)) <= EXACT_CLASSES[kind]:
        return tensors  # type: ignore[return-value]
    return None


class Run(abc.ABC):
    """The variables of one ``run``: how its replicas see them, and what its sync point does
    with their work."""

    # -- what each mode supplies ---------------------------------------------------------


    @abc.abstractmethod
    def cross_replica(self) -> contextlib.AbstractContextManager[None]:
        """The cross-replica region of ``merge_call`` (every replica suspended): central
        variables are themselves, and the region's sync point starts the run afresh."""

    @abc.abstractmethod
    def commit(self) -> list[torch.Tensor]:
        """The sync point keeps what the run's replicas did to the variables themselves;
        returns the variables whose ``.grad`` received gradients."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """The run failed: the variables themselves, and their ``.grad``, as before it."""

    def commit_buffers(self) -> dict[int, Written]:
        """The part of ``commit`` for the buffers that the replicas wrote in place, which a
        sync point across workers makes before the rest, to combine their writes with the
        other workers': each such buffer by record key, with how its replicas wrote it and
        its value from before the run. (The other modes have none.)"""
        return {}

    # -- defaults: a mode whose replicas use the variables themselves, untouched ------------

    def enter(self, replica: int) -> None:  # noqa: B027 (a default, not abstract)
        """Replica ``replica`` starts, on the current thread."""

    def leave(self, replica: int, finished: bool) -> None:  # noqa: B027
        """Replica ``replica`` ends (``finished``: it returned). Its writes are recorded,
        which raises for a write its variable's aggregation forbids."""

    def suspend(self, replica: int) -> None:  # noqa: B027
        """Replica ``replica`` waits in a rendezvous: its state comes off."""

    def resume(self, replica: int) -> None:  # noqa: B027
        """Replica ``replica`` runs on after a rendezvous: its state goes back."""

    def waits(self, replica: int) -> bool:
        """Whether replica ``replica`` waits in a rendezvous, to run on later."""
        return False

    def settle_idle(  # noqa: B027 (a default, not abstract)
        self, received: list[torch.Tensor], replicas: Sequence[ReplicaViews]
    ) -> None:
        """The run's sync point folded its replicas' views (``received``: the variables
        given gradients): what its plan learns from that (``Plan.settle_idle``)."""

    def close(self) -> None:  # noqa: B027
        """The replicas are done (before the sync point): variables are plain again."""

    # Whether some replica sees views (whose gradients a backward after ``run`` may still
    # reach): an attribute, set by the modes that have views.
    uses_views = False

    def replica(self, replica: int) -> contextlib.AbstractContextManager[None]:
        """While replica ``replica``'s code runs: entered, then left (a forbidden write
        found when it leaves raises here, as the replica's error)."""
        return _InReplica(self, replica)


NOTHING = contextlib.nullcontext()  # reusable: a replica with nothing to enter


class _InReplica:
    __slots__ = ("_replica", "_run")

    def __init__(self, run: Run, replica: int) -> None:
        self._run = run
        self._replica = replica

    def __enter__(self) -> None:
        self._run.enter(self._replica)

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._run.leave(self._replica, finished=kind is None)


@final
class EmptyRun(Run):
    """A run of a store without variables."""

    def replica(self, replica: int) -> contextlib.AbstractContextManager[None]:
        return NOTHING

    def cross_replica(self) -> contextlib.AbstractContextManager[None]:
        return NOTHING

    def commit(self) -> list[torch.Tensor]:
        return []

    def rollback(self) -> None:
        pass


EMPTY = EmptyRun()


@final
class OwnRun(Run):
    """One replica on the device of every variable: it computes on them directly, as on one
    device, and its writes apply at once (R = 1). ``Undo`` sets ``.grad`` aside and copies
    the small state without gradients, so that a failed run can be rolled back."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._undo = Undo(store.refs(), store.copier)

    def replica(self, replica: int) -> contextlib.AbstractContextManager[None]:
        return NOTHING  # nothing to do on entry or exit: the variables are the replica's own

    @contextlib.contextmanager
    def cross_replica(self) -> Iterator[None]:
        try:
            with resolving(None):
                yield
        finally:  # the merge's sync point committed
            self._undo = Undo(self._store.refs(), self._store.copier)

    def commit(self) -> list[torch.Tensor]:
        return self._undo.commit()

    def rollback(self) -> None:
        self._undo.rollback()


@final
class DirectRun(Run):
    """Several replicas, each computing where every variable lives, on variables that are
    all parameters no replica may write (``Plan.others`` is empty): each replica uses them
    directly, one after another, and finds only its own gradients in ``.grad``
    (``DirectReplicas``). Nothing is lent a class or put in a slot, so a replica's entry
    costs nothing and its exit a version check and, when it left gradients, their removal.
    ``open`` gives None when a variable has died or is not a plain ``nn.Parameter`` (a
    buffer, ``torch.Tensor``): such a run is a ``ReplicasRun``."""

    def __init__(
        self, store: Store, plan: Plan, tensors: list[torch.Tensor], buffers: list[SharedBuffers]
    ) -> None:
        self._store = store
        self._slots = plan.slots
        self._shared = DirectReplicas(tensors, buffers)
        # what each suspended replica's own code had put in module slots (functional_call)
        self._kept: dict[int, list[Replaced]] = {}

    @classmethod
    def open(cls, store: Store, plan: Plan) -> DirectRun | None:
        if not plan.direct or not all(store.on_parameters):
            return None
        tensors = _all_of(plan.shared_refs, torch.nn.Parameter)
        if tensors is None:
            return None
        buffers = _shared_buffers(store, plan.buffers)  # type: ignore[arg-type]
        if buffers is None:
            return None
        return cls(store, plan, tensors, buffers)

    def replica(self, replica: int) -> contextlib.AbstractContextManager[None]:
        return _Finishing(self, replica)  # entering costs nothing: no views, no class lent

    def suspend(self, replica: int) -> None:
        self._kept[replica] = keep_replaced(self._slots)
        _park_shared(self._store, self._shared, replica)

    def resume(self, replica: int) -> None:
        self._shared.unpark(replica)
        put_back(self._kept.pop(replica, []))

    @contextlib.contextmanager
    def cross_replica(self) -> Iterator[None]:
        try:
            with resolving(None):
                yield
        finally:  # the merge's sync point committed what came before
            self._shared = self._shared.again()

    def commit(self) -> list[torch.Tensor]:
        return self._shared.commit()

    def rollback(self) -> None:
        self._shared.rollback()


def _shared_buffers(store: Store, groups: BufferGroups) -> list[SharedBuffers] | None:
    """The buffers of ``groups`` that a run's replicas share, or None when one has died, is
    not a plain ``torch.Tensor``, or is a floating buffer of another shape or dtype than its
    group's memory (then they keep their views)."""
    buffers: list[SharedBuffers] = []
    if groups.integer_refs:
        integers = _all_of(groups.integer_refs, torch.Tensor)
        if integers is None:
            return None
        buffers.append(SharedIntegers(groups, integers))
    if not groups.floats:
        return buffers
    floats: list[list[torch.Tensor]] = []
    for group in groups.floats:
        tensors = _all_of(group.refs, torch.Tensor)
        if tensors is None or not group.memory.fits(tensors):
            return None
        floats.append(tensors)
    # (each lends rows of its memory, which it alone gives back: made once all fit)
    buffers += map(SharedFloats, groups.floats, floats, repeat(store.replicas))
    return buffers


class _Finishing:
    """``DirectRun.replica``: nothing to enter; a replica that returns has its writes checked
    and leaves its gradients and its shared buffers' values for the sync point (read from
    the run as it is then: a merge inside the replica starts its ``DirectReplicas`` afresh)."""

    __slots__ = ("_replica", "_run")

    def __init__(self, run: DirectRun, replica: int) -> None:
        self._run = run
        self._replica = replica

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            run = self._run
            _finish_shared(run._store, run._shared, self._replica)


def _raise_written(store: Store, written: torch.Tensor, replica: int) -> None:
    """Replica ``replica`` wrote ``written``, a parameter it used directly."""
    raise_shared_write(replica, store.records[id(written)].owners[0][1], written)


def _finish_shared(store: Store, shared: DirectReplicas, replica: int) -> None:
    """Replica ``replica``, which used ``shared`` directly, returned: its writes are checked
    and its gradients kept for the sync point (the last replica's stay in ``.grad``)."""
    written = shared.written()
    if written is not None:
        _raise_written(store, written, replica)
    if replica < len(store.replicas) - 1:
        shared.park(replica)
    elif shared.buffers:
        shared.finish(replica)


def _park_shared(store: Store, shared: DirectReplicas, replica: int) -> None:
    """Replica ``replica``, which used ``shared`` directly, waits in a rendezvous: its writes
    are checked and its gradients parked until it runs on."""
    written = shared.written()
    if written is not None:
        _raise_written(store, written, replica)
    shared.park(replica)


@final
class ReplicasRun(Run):
    """Several replicas, or one computing away from its variables.

    ``_lent``: the variables with the resolving class while replica code runs;
    ``_shared``: the parameters that replicas computing where they live use directly;
    ``_filled``: the module slots the replica holding the baton has filled with its views.
    """

    def __init__(self, store: Store, plan: Plan) -> None:
        self._store = store
        self._plan = plan
        buffers = None if plan.buffers is None else _shared_buffers(store, plan.buffers)
        self._direct_slots = (
            plan.direct_slots_with_buffers if buffers is None else plan.direct_slots
        )
        lent = alive(plan.others_refs if buffers is None else plan.viewed_refs)
        found = list(map(call, plan.shared_refs))
        shared: list[torch.Tensor]
        parameters = EXACT_CLASSES[torch.nn.Parameter]
        if set(map(type, found)) <= parameters:  # the usual case, one pass in C
            shared = found  # type: ignore[assignment]
        else:  # dead ones, or another class, which must take the resolving one
            shared = [t for t in found if t is not None and type(t) in parameters]
            lent += [t for t in found if t is not None and type(t) not in parameters]
        lend_class(lent)  # TypeError for a variable of another class
        self._lent = lent
        self._shared = DirectReplicas(shared, buffers or ()) if shared or buffers else None
        self.uses_views = bool(lent) or (bool(shared) and not all(store.on_parameters))
        self._shared_lent = False  # whether the shared parameters have the class now
        self._filled: Filled | None = None
        # what each suspended replica's own code had put in module slots (functional_call)
        self._kept: dict[int, list[Replaced]] = {}

    def _direct(self, replica: int) -> bool:
        return self._shared is not None and self._store.on_storage[replica]

    def replica(self, replica: int) -> contextlib.AbstractContextManager[None]:
        return _Resolving(self, replica, resolving(self._store.replicas[replica]))

    def enter(self, replica: int) -> None:
        direct = self._direct(replica)
        if self._shared is not None:
            self._lend_shared(not direct)
        slots = self._direct_slots if direct else self._plan.view_slots
        if slots:
            self._filled = Filled(self._store.replicas[replica], slots)

    def leave(self, replica: int, finished: bool) -> None:
        filled, self._filled = self._filled, None
        try:
            if filled is not None:
                try:
                    filled.empty(check=finished)
                except BaseException:
                    finished = False
                    raise
        finally:
            shared = self._shared
            if finished and shared is not None and self._direct(replica):
                _finish_shared(self._store, shared, replica)
        if finished:
            views = self._store.replicas[replica]
            if views.gradient_buckets.holding:
                folding.copy_held(views)

    def suspend(self, replica: int) -> None:
        filled, self._filled = self._filled, None
        if filled is not None:
            filled.empty(check=True)
        self._kept[replica] = keep_replaced(self._plan.slots)
        shared = self._shared
        if shared is not None and self._direct(replica):
            _park_shared(self._store, shared, replica)

    def waits(self, replica: int) -> bool:
        return replica in self._kept  # (``suspend`` keeps its slots, ``resume`` takes them)

    def resume(self, replica: int) -> None:
        shared = self._shared
        direct = self._direct(replica)
        if shared is not None:
            self._lend_shared(not direct)
            if direct:
                shared.unpark(replica)
        slots = self._direct_slots if direct else self._plan.view_slots
        if slots:
            self._filled = Filled(self._store.replicas[replica], slots)
        put_back(self._kept.pop(replica, []))

    @contextlib.contextmanager
    def cross_replica(self) -> Iterator[None]:
        lent = self._lent + (self._shared.tensors if self._shared_lent and self._shared else [])
        restore_class(lent)
        try:
            with resolving(None):
                yield
        finally:
            lend_class(lent)
            if self._shared is not None:  # the merge's sync point committed what came before
                self._shared = self._shared.again()

    def _lend_shared(self, lent: bool) -> None:
        """Give the shared parameters the resolving class (for a replica that sees views of
        them), or take it back (for one that uses them directly)."""
        if lent == self._shared_lent or self._shared is None:
            return
        tensors = self._shared.tensors
        if lent:
            lend_class(tensors)  # their class was checked when the run began
        else:
            restore_class(tensors)
        self._shared_lent = lent

    def commit_buffers(self) -> dict[int, Written]:
        return {} if self._shared is None else self._shared.commit_buffers()

    def commit(self) -> list[torch.Tensor]:
        if self._shared is None:
            return []
        return self._shared.commit()  # before the views' gradients: replica order

    def settle_idle(self, received: list[torch.Tensor], replicas: Sequence[ReplicaViews]) -> None:
        self._plan.settle_idle(received, replicas)

    def rollback(self) -> None:
        if self._shared is not None:
            self._shared.rollback()

    def close(self) -> None:
        if self._filled is not None:  # only if interrupted between entering and leaving
            self._filled.empty(check=False)
            self._filled = None
        restore_class(self._lent)
        if self._shared is not None and self._shared_lent:
            restore_class(self._shared.tensors)
        self._shared_lent = False


class _Resolving:
    """``ReplicasRun.replica``: central variables resolve to the replica's views on this
    thread while it runs."""

    __slots__ = ("_replica", "_resolving", "_run")

    def __init__(self, run: Run, replica: int, views: resolving) -> None:
        self._run = run
        self._replica = replica
        self._resolving = views

    def __enter__(self) -> None:
        self._resolving.__enter__()
        try:
            self._run.enter(self._replica)
        except BaseException:
            self._resolving.__exit__()
            raise

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            self._run.leave(self._replica, finished=kind is None)
        finally:
            self._resolving.__exit__()
