"""The variable store of one strategy: which tensors are its central variables, with what
aggregation, and its sync points.

A central variable lives once, on the parameter device. Inside ``strategy.scope()`` every
parameter and buffer registered on a module, and every tensor created with
``requires_grad=True``, becomes one. The store holds them weakly (a dropped model leaves no
trace), opens a run object for each ``run`` (``runs.py``: how its replicas see the variables,
through views in the module slots and the variables' class, ``views.py`` and ``modules.py``,
or the parameters themselves, ``direct.py``), and folds their gradients and writes back at
each sync point (``folding.py``): the end of ``run`` (after ``close_run``, the strategy calls
its ``Workers.sync``), each ``merge_call``, and every step of an optimizer over its variables
(``steps.py``). A sync point after a failed run discards instead, so a run is a transaction.
Across worker processes the sync point is the ``Exchange``'s. ``cs.Variable`` and
``cs.set_aggregation`` are in ``declare.py``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Any, Protocol, cast

import torch
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from .. import _context
from .._aggregation import VariableAggregation, VariableSynchronization
from .._autograd import no_grad
from .._placement import Placement
from . import folding, steps, unscoped
from .buckets import GradientBuckets
from .direct import Copier
from .modules import record_unseen
from .records import (
    Central,
    alive,
    check_aggregation,
    check_on_read,
    default_buffer_aggregation,
)
from .runs import EMPTY, DirectRun, OwnRun, Plan, ReplicasRun, Run
from .sums import ReplicaSums
from .views import GradientReceiver, ReplicaViews, View


class Exchange(Protocol):
    """How a sync point spans the worker processes (``Workers`` in ``_workers.py``): one
    process folds locally; several also exchange with each other."""

    def sync(self, store: VariableStore, error: BaseException | None) -> None:
        """The sync point of ``store``; ``error`` is what a local replica of the run raised
        (the run's work is then discarded on every worker, and the error raised)."""

    def gradient_after_run(self, store: VariableStore, view: View) -> None:
        """A gradient reached ``view`` outside ``run`` (a backward on a reduced loss)."""

    def sync_step(self, store: VariableStore) -> None:
        """The sync point of an optimizer step over the variables of ``store``."""

    watches_gradients: bool  # whether it wants each view's gradient as it accumulates

    def on_gradient(self, buckets: GradientBuckets, view: View, tensor: torch.Tensor) -> None:
        """A replica's gradient has just accumulated on ``view`` (while backward runs): the
        views' hooks call it directly (it is their ``GradientReceiver``)."""

    def copy_gradients(
        self, copy: Callable[[GradientBuckets, View, torch.Tensor], None]
    ) -> None:
        """(When it ``watches_gradients``.) The views' gradients are on GPUs and the
        variables in host memory: ``on_gradient`` calls ``copy`` first, which starts the
        gradient's copy there."""


class FoldHook(Protocol):
    """Replica state kept outside central variables (``centralstore.metrics``: metric
    states that are lists, or reduce by max, min or concatenation), folded at the store's
    next sync point in replica order, or dropped when the run failed (``discard``)."""

    def fold(self, discard: bool) -> None: ...


class VariableStore:
    """The central variables of one strategy, its replicas' views of them, and its sync
    points.

    One thread at a time: ``claim`` makes a second thread that runs or syncs while another
    is inside a run fail loudly instead of folding half a run.
    """

    def __init__(self, placement: Placement, exchange: Exchange) -> None:
        self.placement = placement
        self.exchange = exchange
        self.records: dict[int, Central] = {}
        # whether some replica computes on a GPU (whose views may be copies still reading
        # host memory, which a sync point waits for)
        self._on_gpus = any(device.type == "cuda" for device in placement.storage_devices)
        self._overlaps = any(
            folding.overlapped(device, placement.parameter_storage)
            for device in placement.storage_devices
        )
        # who the views' gradient hooks call: across workers, the exchange (which starts its
        # buckets, after this store's copy to host memory where there is one); else on
        # GPUs, this store (which starts the copies to the parameter device)
        receiver = (
            weakref.ref(cast(GradientReceiver, exchange)) if exchange.watches_gradients
            else weakref.ref(cast(GradientReceiver, self)) if self._overlaps
            else None
        )
        if self._overlaps and exchange.watches_gradients:
            exchange.copy_gradients(self.on_gradient)
        self.replicas = [
            ReplicaViews(
                self.records, r, device, placement.num_replicas, receiver,
                offset=placement.replica_offset,
            )
            for r, device in enumerate(placement.storage_devices)
        ]
        # several GPU replicas of host variables in one process: their gradients added up
        # on the host while backward goes on
        self._sums = (
            ReplicaSums(self.replicas, functools.partial(_running, weakref.ref(self)))
            if len(self.replicas) > 1 and not exchange.watches_gradients and all(
                folding.overlapped(device, placement.parameter_storage)
                for device in placement.storage_devices
            )
            else None
        )
        self.run: Run = EMPTY  # the run in progress, or the last one
        self.in_run = False
        self._collecting = False  # a collection of gradients is queued after a backward
        self.pending: list[View] = []  # views with gradients that arrived outside run
        # the hooks given since the last sync point, by id (each folds once per sync point)
        self.fold_hooks: dict[int, FoldHook] = {}
        self._foreign: set[int] = set()  # keys of variables off the first compute device
        self._plan: Plan | None = None  # how replicas see the records, while they stay
        self._refs: list[weakref.ref[torch.Tensor]] | None = None  # theirs, while they stay
        self.copier = Copier()  # copies of the buffers a run of one replica may have to restore
        # whether each replica computes where the parameters live (and so may use them
        # directly, ``DirectReplicas``): only in one process of several replicas
        several = 1 < placement.local_replicas == placement.num_replicas
        self.on_parameters = tuple(
            several and device == placement.parameter_storage
            for device in placement.storage_devices
        )
        # whether each replica computes where the variables live in a run of several, across
        # workers too (whose replicas see views of the parameters): when all do, they write
        # the buffers they may share in place (``direct_buffers.py``)
        self.on_storage = tuple(
            placement.num_replicas > 1 and device == placement.parameter_storage
            for device in placement.storage_devices
        )
        self._lock = threading.RLock()  # held by the thread inside a run or sync point
        self._user: int | None = None  # the ident of the thread inside a run or sync point
        self._doing = ""
        self._depth = 0

    # -- registration ------------------------------------------------------------------------

    def register(
        self,
        tensor: torch.Tensor,
        aggregation: VariableAggregation,
        is_buffer: bool = False,
        synchronization: VariableSynchronization | None = None,
    ) -> None:
        """Make ``tensor`` a central variable (again: its aggregation is updated, and its
        synchronization when one is given)."""
        check_aggregation(tensor, aggregation)
        key = id(tensor)
        record = self.records.get(key)
        on_read = (
            record is not None and record.on_read if synchronization is None
            else synchronization is VariableSynchronization.ON_READ
        )
        if on_read:
            check_on_read(tensor, aggregation)
        if record is not None:
            if record.aggregation is not aggregation or record.on_read is not on_read:
                record.aggregation = aggregation
                record.on_read = on_read
                record.synced = None  # the copies start again from the central value
                self._plan = None
            return
        ref = weakref.ref(tensor, functools.partial(_forget, weakref.ref(self), key))
        record = self.records[key] = Central(key, ref, aggregation, is_buffer)
        record.on_read = on_read
        self._plan = self._refs = None
        placement = self.placement
        if tensor.device != placement.storage_devices[0]:
            self._foreign.add(key)
        if self._overlaps and tensor.device.type == "cpu":
            with no_grad():  # pinned, so that copies to the GPUs are asynchronous
                tensor.data = tensor.data.pin_memory()
        steps.track(self)

    def forget(self, key: int) -> None:
        self.records.pop(key, None)
        self._plan = self._refs = None
        self._foreign.discard(key)
        for views in self.replicas:
            views.forget(key)

    def owned(self) -> tuple[dict[int, Central], set[tuple[int, str]]]:
        """The records, and the module slots that hold them (module id, name): what a
        module built in the scope holds (``unscoped.FirstUse``)."""
        slots = {
            (id(module), name)
            for record in self.records.values()
            for ref, name in record.owners
            if (module := ref()) is not None
        }
        return self.records, slots

    def record(self, tensor: Any) -> Central | None:
        return self.records.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None

    def stamp(self, tensors: list[torch.Tensor]) -> None:
        """An optimizer stepped ``tensors``: the views of those that are central variables
        refresh before their next use."""
        records = self.records
        for tensor in tensors:
            record = records.get(id(tensor))
            if record is not None:
                record.stamp += 1

    def viewed(self) -> bool:
        """Whether some replica holds views, whose copies an optimizer step over frozen
        variables makes stale (``stamp``)."""
        return any(map(_views_of, self.replicas))

    def optimized(self, tensors: list[torch.Tensor]) -> None:
        """An optimizer that holds ``tensors`` stepped: those that are central variables are
        trained by it (``Central.optimized``)."""
        records = self.records
        for tensor in tensors:
            record = records.get(id(tensor))
            if record is not None:
                record.optimized = True

    def owns_any(self, tensors: list[torch.Tensor]) -> bool:
        return any(map(self.records.__contains__, map(id, tensors)))

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
        """Register what modules and factories create while this store's scope is on top."""

        def mine() -> bool:
            entry = _context.current()
            return entry.store is self and entry.replica_context is None

        def on_parameter(module: Any, name: str, param: Any) -> None:
            if param is not None and mine():
                self._take(module, name, param, is_buffer=False)

        def on_buffer(module: Any, name: str, buffer: Any) -> None:
            if isinstance(buffer, torch.Tensor) and mine():
                self._take(module, name, buffer, is_buffer=True)

        def on_submodule(module: Any, name: str, submodule: Any) -> None:
            # A module attached in scope may hold tensors it never registered there
            if submodule is not None:
                for owner in submodule.modules():
                    take_own(owner)

        def take_own(module: torch.nn.Module) -> None:
            # also for the modules that copy.deepcopy and torch.load restore: unpickling
            # fills their tables without registering
            if mine():
                unscoped.adopted(module)
                for key, param in module._parameters.items():
                    if param is not None:
                        self._take(module, key, param, is_buffer=False)
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        self._take(module, key, buffer, is_buffer=True)

        handles = [
            _module.register_module_parameter_registration_hook(on_parameter),
            _module.register_module_buffer_registration_hook(on_buffer),
            _module.register_module_module_registration_hook(on_submodule),
        ]
        try:
            with _RegistrationMode(self, mine), unscoped.adopting(take_own):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _take(
        self, module: torch.nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool
    ) -> None:
        """Make ``tensor``, which ``module`` registers as ``name``, a central variable (a
        known one keeps its aggregation), and note the module slot that holds it."""
        record = self.record(tensor)
        if record is None:
            aggregation = (
                default_buffer_aggregation(tensor) if is_buffer else VariableAggregation.NONE
            )
            self.register(tensor, aggregation, is_buffer=is_buffer)
            record = self.records[id(tensor)]
        if record.add_owner(module, name):
            self._plan = None

    # -- run ---------------------------------------------------------------------------------

    def claim(self, doing: str) -> None:
        """Hold the store for this thread while it is ``doing`` (a run or a sync point) until
        ``release``; the same thread may nest (``run`` inside ``merge_call``), another one
        raises."""
        if not self._lock.acquire(False):  # (positional: keywords cost a C call more)
            user = next((t.name for t in threading.enumerate() if t.ident == self._user), "?")
            raise RuntimeError(
                f"Thread {threading.current_thread().name!r} called {doing} while thread "
                f"{user!r} is inside {self._doing} of the same "
                "strategy. A strategy serves one thread at a time: its sync points would mix "
                "the two threads' gradients. Give each thread its own strategy and model, or "
                "wait for the other thread."
            )
        if not self._depth:  # (the thread's ident: ``current_thread()`` is Python)
            self._user, self._doing = _get_ident(), doing
        self._depth += 1

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._user = None
        self._lock.release()

    def refs(self) -> list[weakref.ref[torch.Tensor]]:
        """The central variables' weak references, in registration order: the same list
        while the records stay (every run of one replica follows them)."""
        refs = self._refs
        if refs is None:
            refs = self._refs = [record.ref for record in self.records.values()]
        return refs

    def live(self) -> list[torch.Tensor]:
        """The central variables still alive, in registration order."""
        return alive(self.refs())

    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(
                self.records, self.on_parameters, self.on_storage,
                self.placement.parameter_storage,
            )
        return self._plan

    def open_run(self) -> Run:
        """Begin a run: the object of its mode (``runs.py``), which holds its state until its
        sync point."""
        run: Run
        if self.placement.num_replicas == 1 and not self._foreign:  # on their device
            run = self.run = OwnRun(self) if self.records else EMPTY
            self.in_run = True
            return run
        if not self.records:
            run = EMPTY
        else:
            plan = self.plan()
            direct = DirectRun.open(self, plan)
            if direct is not None:
                run = direct
            else:  # some replica sees views: they are validated afresh
                run = ReplicasRun(self, plan)
                self._next_epoch()
        self.run = run
        self.in_run = True
        return run

    def close_run(self, error: BaseException | None) -> BaseException | None:
        """The replicas are done (``error``: one raised it); the sync point follows
        (``Workers.sync``), with the error this returns: ``error``, or else a write that a
        kernel made behind a variable's version counter and its aggregation forbids, or a
        ``.grad`` changed under the replicas' early sums (``ReplicaSums.check``)."""
        self.in_run = False
        self.run.close()
        if error is None and any(map(_unseen_of, self.replicas)):
            try:
                record_unseen(self.replicas)
            except ValueError as unseen_write:
                return unseen_write
        if error is None and self._sums is not None:  # a .grad the sums read, changed since
            return self._sums.check()
        return error

    def open_alone(self, doing: str) -> Run | None:
        """``claim`` and ``open_run`` in one call for a strategy of one replica (the short
        path's, ``Strategy._run_alone``), if its run would be one replica on the device of
        every variable (an ``OwnRun``, or ``EMPTY`` without variables) with no run in
        progress (not inside another's ``merge_call``): a run whose replica needs nothing
        entered, and whose sync point is usually its ``Undo``'s commit alone
        (``close_alone``). None, and nothing claimed, otherwise."""
        if self.run is not EMPTY or self._foreign:
            return None
        self.claim(doing)
        try:
            run = self.run = OwnRun(self) if self.records else EMPTY
        except BaseException:
            self.release()
            raise
        self.in_run = True
        return run

    def close_alone(self) -> bool:
        """The sync point of a run in one process, outside other runs, whose replicas
        returned having used the variables themselves (an ``OwnRun`` from ``open_alone`` or
        ``open_run``, a ``DirectRun``), when it has nothing to fold but the run's own work (no
        metric's copies, no views touched, no early sums): what ``close_run`` and ``fold``
        do then, with fewer calls. False, and nothing done, otherwise: the caller makes the
        general sync point."""
        if self._sums is not None or self._left_over():
            return False
        self.in_run = False
        try:
            if self._on_gpus:
                self._gpus_synced()
            if self.fold_hooks:
                self._fold_given(False)
            received = self.run.commit()
            self._next_epoch()
            if received:
                folding.run_post_accumulate_hooks(received)
        finally:
            self.run = EMPTY
        return True

    @contextlib.contextmanager
    def cross_replica(self) -> Iterator[None]:
        """Central variables as themselves, for ``merge_call``'s function."""
        with self.run.cross_replica():
            yield
        if self.in_run:
            self._next_epoch()

    def check_unseen(self) -> None:
        """Before a sync point inside a run: record the writes that kernels made behind the
        version counters of the replicas' views (raises for one the aggregation forbids)."""
        if any(map(_unseen_of, self.replicas)):
            record_unseen(self.replicas)

    def settled(self) -> bool:
        """Whether a sync point would find nothing to fold, so that an optimizer step may
        skip it: no run in progress, no gradients of a backward after ``run``, no replica
        work or metric copies left, and no GPU replicas, whose copies may still read the
        variables. (The usual step: ``run``'s own sync point folded everything.)"""
        return (
            self.run is EMPTY and not self._on_gpus and not self.fold_hooks
            and not self._left_over()
        )

    def _left_over(self) -> bool:
        """Whether a sync point has more to do than a run's own work and metrics' copies:
        gradients of a backward after ``run`` on views, views touched or written behind
        their counters."""
        replicas = self.replicas
        return bool(
            self.pending or any(map(_touched_of, replicas)) or any(map(_unseen_of, replicas))
        )

    def fold_later(self, hook: FoldHook) -> None:
        """Call ``hook.fold`` at the next sync point, once however often it is given (a
        metric whose replicas updated copies of its state; it gives itself again at its next
        update). Only that sync point: a hook held longer would be called at every later
        one, and would make every optimizer step sync."""
        self.fold_hooks[id(hook)] = hook

    def _fold_given(self, discard: bool) -> None:
        """Call the fold hooks given since the last sync point, and forget them."""
        given = self.fold_hooks
        while given:  # (one that raises leaves the others for the next sync point)
            given.popitem()[1].fold(discard)

    def sync(self) -> None:
        """The sync point of an optimizer step over these variables (``steps.py``); the
        strategy calls its workers' sync itself at the end of ``run`` and in ``merge_call``."""
        self.check_unseen()
        self.exchange.sync_step(self)

    def fold(self, discard: bool = False, hooks: bool = True) -> None:
        """This process's part of a sync point: fold everything the replicas left since the
        last one into the central variables, in replica order, or drop it (``discard``);
        then the post-accumulate-grad hooks of the variables whose ``.grad`` received some
        run, once each. With ``hooks`` False the caller calls them: a sync point across
        workers, whose ``.grad`` is complete only once the workers' gradients are exchanged,
        and whose hooks fire for the variables any worker had a gradient for."""
        if self._on_gpus:
            self._gpus_synced()
        self._fold_given(discard)
        received: list[torch.Tensor] = []
        if self.pending:
            with no_grad():
                received += folding.fold_gradients(self.pending)
            self.pending.clear()
        run = self.run  # what it did to the variables themselves: before the views' work
        if discard:
            run.rollback()
        else:
            received += run.commit()
        touched = list(map(_touched_of, self.replicas))
        if self._sums is not None:  # (what the fold would add to nothing, added up already)
            if discard or not any(touched):
                self._sums.drop()
            else:
                received += self._sums.settle()
        if any(touched):
            if discard:
                for replica in self.replicas:
                    replica.unseen.clear()
                folding.discard(touched)
            else:
                with no_grad():
                    if self._on_gpus and len(touched) > 1:
                        # the GPU replicas' gradients wait in host buckets: folded together,
                        # the first replica's stay there and take the others' in place
                        # (or a bucket's sum, added up while backward ran, ``sums.py``)
                        received += folding.fold_gradients(list(chain.from_iterable(touched)))
                    else:
                        for views in touched:
                            received += folding.fold_gradients(views, distinct=True)
                    folding.apply_writes(
                        touched, self.placement.num_replicas, self.placement.replica_offset
                    )
                folding.finish(touched)
                run.settle_idle(received, self.replicas)
            self._next_epoch()
        if received and hooks:
            folding.run_post_accumulate_hooks(received)

    def _gpus_synced(self) -> None:
        """A sync point of GPU replicas begins: the copies from host memory they started are
        waited for, and the gradient buckets learn that a step begins."""
        for replica in self.replicas:
            replica.wait_for_copies()
            # the next arrival starts a step, though this sync point may take no copy: every
            # gradient a loop held on its GPU (``GradientBuckets.holds``); and the next
            # backward orders what follows it after its copies, though one that failed never
            # did (``folding.start_copy``)
            buckets = replica.gradient_buckets
            buckets.synced, buckets.ordered = True, False

    def _next_epoch(self) -> None:
        for views in self.replicas:
            views.epoch += 1

    # A view's gradient has accumulated on a GPU: its copy to the parameter device starts,
    # into its replica's buckets, while backward goes on, or at the last pass of a loop of
    # micro-batches (the function itself: a method around it would cost a call per gradient).
    on_gradient = staticmethod(folding.start_copy)

    def watch(self, outputs: list[torch.Tensor]) -> None:
        """(Runs that use views.) A backward after ``run`` through one of its ``outputs`` (a
        loss reduced outside ``run``) leaves gradients on the views: when it ends, hand them
        on, so that ``.grad`` is complete for what follows (``clip_grad_norm_``, the
        optimizer step)."""
        for output in outputs:
            if output.requires_grad:
                output.register_hook(  # type: ignore[no-untyped-call]
                    functools.partial(_backward_through_run, weakref.ref(self))
                )

    def _collect(self) -> None:
        """The end of a backward through a run's outputs: hand on what reached the views."""
        self._collecting = False
        if self.in_run:
            return  # the sync point of the run in progress takes them
        for replica in self.replicas:
            for view in list(replica.views.values()):
                if view.pending or any(
                    t is not None and t.grad is not None for t in (view.tensor, view.alias)
                ):
                    self.exchange.gradient_after_run(self, view)


def _running(store_ref: weakref.ref[VariableStore]) -> Run | None:
    """The store's run in progress, or None outside runs (``sums.py``)."""
    store = store_ref()
    return store.run if store is not None and store.in_run else None


def _backward_through_run(store_ref: weakref.ref[VariableStore], grad: torch.Tensor) -> None:
    """A backward reached an output of ``run``: collect the views' gradients when it ends."""
    store = store_ref()
    if store is not None and not store._collecting:
        store._collecting = True
        torch.autograd.Variable._execution_engine.queue_callback(store._collect)


_touched_of = attrgetter("touched")
_views_of = attrgetter("views")
_unseen_of = attrgetter("unseen")
_get_ident = threading.get_ident  # (one lookup, where ``threading.get_ident`` takes two)


def _forget(store_ref: weakref.ref[VariableStore], key: int, _: object) -> None:
    store = store_ref()
    if store is not None:
        store.forget(key)


def current_store() -> VariableStore:
    """The store of the current strategy (the one whose scope or run this thread is in)."""
    return _context.current().store  # type: ignore[return-value]


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
            and out._base is None  # a view is no leaf (and no_grad views forbid asking)
            and out.is_leaf
            and id(out) not in self._store.records
            and self._mine()
        ):
            self._store.register(out, VariableAggregation.NONE)
        return out
