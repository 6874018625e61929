"""Replica views: what a replica sees when its code touches a central variable.

Module code on the calling thread finds its replica's views in the modules' attributes
(``modules.py``), or the parameters themselves where the replica uses them directly
(``direct.py``). For every other reference, and on replica threads, central variables have
a class of their own while replica code runs (``CentralParameter``, ``CentralTensor``),
whose ``__torch_function__`` swaps them for the running replica's views in the arguments of
the torch call (top level and one level of lists/tuples, which covers ``torch.cat``, RNN
weight lists and ``_foreach`` calls). Torch's dispatcher calls it only for calls that receive
a central variable: every other call costs what it costs in plain PyTorch, and outside runs
the variables are plain again. A parameter's view shares storage with it when the replica
computes where it lives (no copy) and is a cached copy otherwise, refreshed only when the
central value changed. Buffers get a private copy per replica, since kernels such as batch
norm write them in place. An in-place call on a shared view is routed to a private copy
first, so replicas never race on central storage; the sync point folds the writes by
aggregation (``folding.py``).

Where gradients are copied to the parameter device while backward runs (CUDA replicas, CPU
parameters), each view has a hook that starts its copy, into its replica's gradient buckets
(``buckets.py``). Every gradient hook holds its view, the buckets and its receiver weakly:
the garbage collector cannot see the references a tensor's hooks hold, so a strong one from
a view's hook back to the view would keep the view, its tensor and the model's weights alive
forever.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable
from itertools import compress, repeat
from operator import and_, attrgetter, eq, is_, le, not_
from typing import Any, Protocol

import torch
from torch._C import DisableTorchFunctionSubclass

from .._aggregation import VariableAggregation
from .._autograd import no_grad
from .._devices import CurrentStreams
from . import steps
from .buckets import GradientBuckets, GradientCopy
from .records import Central, on_read_reset


class GradientReceiver(Protocol):
    """Where a view's gradient goes once it has accumulated, with the buckets of the view's
    replica, held weakly: the store on GPUs (it starts the copy to the parameter device),
    the exchange across workers (it starts its buckets)."""

    def on_gradient(self, buckets: GradientBuckets, view: View, tensor: torch.Tensor) -> None:
        ...


READ, DELTA, ASSIGN = 0, 1, 2
_DELTA_NAMES = frozenset({"add_", "sub_", "__iadd__", "__isub__"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad"})
_AUGMENTED = frozenset(
    f"__i{op}__" for op in
    ("mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul")
)
_write_kinds: dict[Any, int] = {}
_SEQUENCES = frozenset({list, tuple})  # argument containers whose items are swapped too

# Kernels that write running statistics in place without bumping the version counter:
# function -> (index and name of the flag that enables the write, (index, name) written).
_KERNEL_WRITES: dict[Any, tuple[tuple[int, str], tuple[tuple[int, str], ...]]] = {
    torch.nn.functional.batch_norm: ((5, "training"), ((1, "running_mean"), (2, "running_var"))),
    torch.batch_norm: ((5, "training"), ((3, "running_mean"), (4, "running_var"))),
    torch.nn.functional.instance_norm: (
        (5, "use_input_stats"), ((1, "running_mean"), (2, "running_var"))
    ),
    torch.instance_norm: ((5, "use_input_stats"), ((3, "running_mean"), (4, "running_var"))),
}


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if index < len(args) else kwargs.get(name)


def kernel_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The ids of the arguments that ``func`` will write without a version bump."""
    spec = _KERNEL_WRITES.get(func)
    if spec is None:
        return set()
    (flag_index, flag_name), written = spec
    if not _argument(args, kwargs, flag_index, flag_name):
        return set()
    return {id(_argument(args, kwargs, i, name)) for i, name in written}


def write_kind(func: Any) -> int:
    """Whether ``func`` writes its first argument in place, and how (by its name)."""
    kind = _write_kinds.get(func)
    if kind is None:
        name = getattr(func, "__name__", "")
        if name in _DELTA_NAMES:
            kind = DELTA
        elif name in _NOT_WRITES:
            kind = READ
        elif name == "__setitem__" or name in _AUGMENTED or (
            name.endswith("_") and not name.endswith("__")
        ):
            kind = ASSIGN
        else:
            kind = READ
        _write_kinds[func] = kind
    return kind


class View:
    """One replica's view of one central variable."""

    __slots__ = (
        "__weakref__", "alias", "assigned", "central_ptr", "central_version", "epoch",
        "generation", "pending", "private", "record", "stamp", "start", "start_at",
        "start_version", "tensor",
    )

    def __init__(self, record: Central, tensor: torch.Tensor, private: bool) -> None:
        self.record = record
        self.tensor = tensor
        self.private = private
        self.alias: torch.Tensor | None = None  # the shared view, while routed to a copy
        self.assigned = False
        self.central_version = -1
        self.central_ptr = -1
        self.stamp = -1
        self.start_version = tensor._version
        self.epoch = -1
        self.pending: list[GradientCopy] = []  # gradients on their way to host memory
        # ON_READ: the generation of the record this copy belongs to, and its value when the
        # epoch began (its write since then is the difference), kept from epoch to epoch
        # while it equals the copy: until the copy's version counter leaves ``start_at``
        self.generation = -1
        self.start: torch.Tensor | None = None
        self.start_at = -1

    def written(self) -> bool:
        return self.private and (self.assigned or self.tensor._version != self.start_version)


# A copy to a GPU of at most this many bytes goes with the others of its dtype
# (``ReplicaViews.refresh``): gathering it where it is costs less than starting its own copy.
_SMALL_COPY = 64 * 1024
_nbytes_of = attrgetter("nbytes")
_layout_of = attrgetter("layout")
_device_of = attrgetter("device")
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_numel = torch.Tensor.numel


def _copy_to(tensor: torch.Tensor, central: torch.Tensor) -> torch.Tensor:
    """A private copy refreshed from its central variable, without waiting."""
    return tensor.copy_(central, non_blocking=True)


def _copy_together(tensors: list[torch.Tensor], centrals: list[torch.Tensor]) -> None:
    """``_copy_to`` for each pair, from one device to one GPU, in one copy: the values (all
    of one dtype) are gathered where they are. (On the host, in pageable memory: CUDA
    stages such a copy before it returns, so the gathered values may be freed at once, and
    the pinned memory held stays the gradient buckets'.)"""
    numels = list(map(_numel, centrals))
    gathered = torch.cat(list(map(torch.reshape, centrals, repeat((-1,)))))
    arrived = gathered.to(tensors[0].device, non_blocking=True)
    pieces = arrived.split_with_sizes(numels)
    torch._foreach_copy_(tensors, list(map(torch.Tensor.view, pieces, map(_shape_of, centrals))))


def _on_gradient(
    view_ref: weakref.ref[View], buckets_ref: weakref.ref[GradientBuckets],
    receiver_ref: weakref.ref[GradientReceiver], tensor: torch.Tensor,
) -> None:
    view, buckets, receiver = view_ref(), buckets_ref(), receiver_ref()
    if view is not None and buckets is not None and receiver is not None:
        receiver.on_gradient(buckets, view, tensor)


class ReplicaViews:
    """The views of one replica, created on first use and validated once per epoch (each
    run and each sync point starts one)."""

    def __init__(
        self,
        records: dict[int, Central],
        replica: int,
        device: torch.device,
        num_replicas: int,
        receiver: weakref.ref[GradientReceiver] | None,
        offset: int = 0,
    ) -> None:
        self.records = records
        self.replica = replica
        self.global_replica = offset + replica
        self.device = device
        self.num_replicas = num_replicas
        self.views: dict[int, View] = {}
        self.touched: list[View] = []
        self.unseen: list[View] = []  # buffers a kernel may have written (modules.py)
        self._copies: Any = None  # a CUDA event, recorded after each copy from host memory
        self._unwaited = False  # whether copies were recorded since the host last waited
        self.epoch = 0
        self._receiver = receiver  # None: no gradient hooks (the sync point takes them)
        self.streams = CurrentStreams()  # each device's current stream, found by its handle
        self.gradient_buckets = GradientBuckets(self.streams)  # where hooks copy gradients to

    def forget(self, key: int) -> None:
        self.views.pop(key, None)

    def central_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        for view in self.views.values():
            if tensor is view.tensor or tensor is view.alias:
                return view.record.ref()
        return None

    def resolve(self, record: Central, write: bool) -> View:
        view = self.views.get(record.key)
        if view is None or view.epoch != self.epoch:
            central = record.ref()
            assert central is not None  # records of dead tensors are removed by their weakref
            view = self.validate(record, central, view)
        if write and not view.private:
            self._route(view)
        return view

    def validate(self, record: Central, central: torch.Tensor, view: View | None) -> View:
        """``view`` (or a new one) made current for this epoch: recreated when ``central``
        changed shape, dtype, ``requires_grad`` or storage; a private copy is refreshed
        unless its central value provably did not change: a frozen variable whose version
        counter, data pointer and optimizer stamp stayed (a trained parameter changes at every
        step, and writes through ``.data`` move none of the three). An ON_READ variable's
        view is the replica's own copy (``_validate_on_read``)."""
        if record.on_read:
            return self._validate_on_read(record, central, view)
        if view is None:
            view = self._create(record, central)
        else:
            tensor = view.tensor
            if (
                tensor.shape != central.shape or tensor.dtype != central.dtype
                or tensor.requires_grad != central.requires_grad  # read when a run begins
            ):
                view = self._create(record, central)
            elif not view.private:
                if tensor.data_ptr() != central.data_ptr():  # storage replaced (.data = ...)
                    view = self._create(record, central)
            elif (
                central.requires_grad  # trained: changed every step, also through .data
                or central._version != view.central_version
                or central.data_ptr() != view.central_ptr
                or record.stamp != view.stamp  # stepped by a fused optimizer
                or view.written()
            ):
                if central.data_ptr() != view.central_ptr:
                    self._pin(central)
                with no_grad():
                    tensor.copy_(central, non_blocking=True)
                self.copied(central)
        view.central_ptr = central.data_ptr()
        view.stamp = record.stamp
        return self._current(view, central)

    def _current(self, view: View, central: torch.Tensor) -> View:
        """``view`` made current for this epoch: the variable's tensor hooks run on it, and
        its writes from now on are the epoch's."""
        hooks = central._backward_hooks
        if view.tensor._backward_hooks is not hooks and view.tensor.requires_grad:
            view.tensor._backward_hooks = hooks
        view.central_version = central._version
        view.start_version = view.tensor._version
        view.assigned = False
        view.epoch = self.epoch
        self.touched.append(view)
        return view

    def _validate_on_read(
        self, record: Central, central: torch.Tensor, view: View | None
    ) -> View:
        """The replica's copy of an ON_READ variable, kept across runs and sync points. A
        central value written since the copies last agreed with it (in cross-replica
        context) starts a new generation: every replica's copy begins again from it, by
        TensorFlow's rule (``records.on_read_reset``). The copy's start, its value when the
        epoch begins, is the one the last sync point left (``folding._restart``) while the
        copy's version counter has not moved since; a clone of it otherwise."""
        stamp = (central._version, central.data_ptr())
        if record.synced != stamp or record.reset is None:
            with no_grad(), torch.inference_mode(False):
                record.reset = on_read_reset(central, record.aggregation, self.num_replicas)
            record.generation += 1
            record.synced = stamp
        if view is None or view.generation != record.generation or (
            view.tensor.shape != central.shape or view.tensor.dtype != central.dtype
            or view.tensor.requires_grad != central.requires_grad
        ):
            first, rest = record.reset
            value = first if self.global_replica == 0 else rest
            with torch.inference_mode(False):
                copy = value.detach().to(self.device, copy=True, non_blocking=True)
            self.copied(central)
            view = View(record, copy, private=True)
            view.generation = record.generation
            self._make_leaf(view, copy, central.requires_grad)
            self._keep(record, view)
        tensor = view.tensor
        if view.start is None or tensor._version != view.start_at:  # the copy moved since
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    view.start = tensor.detach().clone()
            elif tensor.requires_grad:
                view.start = tensor.detach().clone()
            else:  # (a metric's copy: its clone records nothing, and a detach is an operation)
                view.start = tensor.clone()
            view.start_at = tensor._version
        return self._current(view, central)

    def _create(self, record: Central, central: torch.Tensor) -> View:
        if torch.is_inference_mode_enabled():  # views are normal tensors: they track versions
            with torch.inference_mode(False):
                return self._create(record, central)
        if central.device == self.device and not record.is_buffer:
            view = View(record, central.detach(), private=False)
        else:
            copy = central.detach().to(self.device, copy=True, non_blocking=True)
            self.copied(central)
            view = View(record, copy, private=True)
        self._make_leaf(view, view.tensor, central.requires_grad)
        self._keep(record, view)
        return view

    def _pin(self, central: torch.Tensor) -> None:
        """A central variable on the host whose storage was replaced (``p.data = t``,
        ``vector_to_parameters``) is pinned again, so that its copies to the GPU stay
        asynchronous."""
        if (
            self.device.type == "cuda" and central.device.type == "cpu"
            and not central.is_pinned()
        ):
            with no_grad():
                central.data = central.data.pin_memory()

    def refresh(self, tensors: list[torch.Tensor], centrals: list[torch.Tensor]) -> None:
        """Copy each of ``centrals`` into its private copy in ``tensors`` without waiting, as
        ``validate`` does for one (under ``no_grad``). Copies on their variables' device (the
        buffers of CPU replicas) take one ``_foreach_copy_``. From host memory or another GPU
        to a GPU, the small values travel together: a copy costs microseconds to start whatever
        its size, so those of each dtype are gathered in one buffer, copied at once and put
        in place by one kernel."""
        if not centrals:
            return
        first = centrals[0]
        if all(map(eq, map(_device_of, centrals), repeat(self.device))) and all(
            map(is_, map(_layout_of, centrals), repeat(torch.strided))
        ):  # copies where their variables live (buffers' on the CPU): one call, one kernel
            torch._foreach_copy_(tensors, centrals)
            return
        if (
            self.device.type == "cuda" and first.device != self.device
            and all(map(eq, map(_device_of, centrals), repeat(first.device)))
            and all(map(is_, map(_layout_of, centrals), repeat(torch.strided)))  # not sparse
        ):
            small = list(map(le, map(_nbytes_of, centrals), repeat(_SMALL_COPY)))
            if small.count(True) > 1:
                dtypes = list(map(_dtype_of, centrals))
                for dtype in dict.fromkeys(compress(dtypes, small)):
                    chosen = list(map(and_, small, map(eq, dtypes, repeat(dtype))))
                    mine = list(compress(tensors, chosen))
                    _copy_together(mine, list(compress(centrals, chosen)))
                large = list(map(not_, small))
                tensors, centrals = list(compress(tensors, large)), list(compress(centrals, large))
        deque(map(_copy_to, tensors, centrals), maxlen=0)
        self.copied(first)

    def copied(self, central: torch.Tensor) -> None:
        """A copy from ``central`` to this replica's GPU was queued without waiting."""
        if self.device.type == "cuda" and central.device.type == "cpu":
            if self._copies is None:  # (made once: recording it again moves it on)
                self._copies = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copies.record(self.streams(self.device))
            self._unwaited = True

    def wait_for_copies(self) -> None:
        """Wait until the copies from host memory queued for this replica have read it: once
        the sync point returns, the host may change the variables (``optimizer.step()``,
        ``load_state_dict``). The copies were queued before the replica's work, so this
        seldom waits."""
        if self._unwaited:
            self._copies.synchronize()
            self._unwaited = False

    def _keep(self, record: Central, view: View) -> None:
        """``view`` is the replica's view of ``record`` from now on; optimizer steps stamp
        the frozen variables they update once some view exists (``steps.py``)."""
        self.views[record.key] = view
        if not steps.stamping:
            steps.stamp_after_steps()

    def _make_leaf(self, view: View, tensor: torch.Tensor, requires_grad: bool) -> None:
        """Let ``tensor`` collect gradients for ``view``'s variable, handed to the receiver
        by a hook as each one accumulates, if there is a receiver."""
        if requires_grad:
            tensor.requires_grad_(True)
            if self._receiver is not None:
                tensor.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(
                        _on_gradient, weakref.ref(view), weakref.ref(self.gradient_buckets),
                        self._receiver,
                    )
                )

    def _route(self, view: View) -> None:
        """Give this replica a private copy of a shared parameter before it writes it."""
        self._check_aggregation(view)
        central = view.record.ref()
        assert central is not None
        with torch.inference_mode(False):
            private = central.detach().clone()
        self._make_leaf(view, private, central.requires_grad)
        view.alias, view.tensor, view.private = view.tensor, private, True
        view.start_version = private._version

    def _check_aggregation(self, view: View) -> None:
        if self.num_replicas > 1 and view.record.aggregation is VariableAggregation.NONE:
            central = view.record.ref()
            shape = None if central is None else tuple(central.shape)
            raise ValueError(
                f"Replica {self.replica} wrote in place to a central variable of shape {shape} "
                "whose aggregation is NONE, so it is unclear how the replicas' writes combine. "
                "Give it one: cs.set_aggregation(var, cs.VariableAggregation.SUM) (or MEAN, "
                "ONLY_FIRST_REPLICA) inside strategy.scope(), or create it with "
                "cs.Variable(..., aggregation=...)."
            )

    def note_write(self, view: View, kind: int, moved: bool) -> None:
        """``view``'s tensor was written, its version counter ``moved`` or not (a kernel's
        write behind it)."""
        self._check_aggregation(view)
        if view.record.on_read:  # its write is the copy's difference, whatever the kind,
            if not moved:  # seen by its version
                torch.autograd.graph.increment_version(view.tensor)
        elif kind != DELTA:
            view.assigned = True

    def write_in_place(
        self, record: Central, update: Callable[[torch.Tensor], object], kind: int
    ) -> None:
        """``update`` writes this replica's view of ``record``'s variable in place, a write of
        ``kind``: what ``call`` does for a torch call that writes the variable, without
        looking for central variables among its arguments."""
        with DisableTorchFunctionSubclass():  # the central variable itself, as in ``call``
            view = self.resolve(record, write=True)  # a private view: its writes are noted
        tensor = view.tensor
        version = tensor._version
        update(tensor)  # (a central variable among what it reads resolves as in any call)
        if tensor._version != version:
            self.note_write(view, kind, moved=True)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``func`` with central variables swapped for this replica's views."""
        kind = _write_kinds.get(func)
        if kind is None:
            kind = write_kind(func)
        writes: set[int] = set()
        if kind != READ:
            first = args[0] if args else next(
                (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None
            )
            writes.add(id(first))
        if kwargs:
            out = kwargs.get("out")
            if out is not None:
                writes.update(id(t) for t in (out if isinstance(out, (tuple, list)) else (out,)))
                kind = kind or ASSIGN
        private: list[tuple[View, int]] = []  # private views used, and their versions
        args = self._swap(args, writes, private)
        if kwargs and self._holds_central(kwargs.values()):
            kwargs = dict(zip(kwargs, self._swap(tuple(kwargs.values()), writes, private)))
        if not private:
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        for view, version in private:
            if view.tensor._version != version:
                self.note_write(view, kind, moved=True)
        if func in _KERNEL_WRITES:
            written = kernel_writes(func, args, kwargs)
            for view, _ in private:
                if id(view.tensor) in written:
                    self.note_write(view, ASSIGN, moved=False)
        if kind != READ:
            for view, _ in private:  # ``m.total += x`` rebinds m.total to what __iadd__
                if result is view.tensor:  # returns: the variable, not this replica's view
                    return view.record.ref()
        return result

    def _holds_central(self, values: Any) -> bool:
        """Whether ``values`` hold a central variable, or a list or tuple that may (checked
        in C)."""
        return not (
            self.records.keys().isdisjoint(map(id, values))
            and _SEQUENCES.isdisjoint(map(type, values))
        )

    def _swap(
        self, values: tuple[Any, ...], writes: set[int], private: list[tuple[View, int]]
    ) -> tuple[Any, ...]:
        """``values`` with views for central variables, at the top level and in the items of
        list and tuple values; private views used go to ``private``."""
        records = self.records
        swapped = list(values)
        for i, record in enumerate(map(records.get, map(id, values))):
            if record is not None:
                swapped[i] = self._view_tensor(record, id(values[i]) in writes, private)
        if not _SEQUENCES.isdisjoint(map(type, values)):  # the items of lists and tuples too
            for i, value in enumerate(values):
                if type(value) in _SEQUENCES and any(id(item) in records for item in value):
                    swapped[i] = type(value)(
                        self._view_tensor(records[id(item)], id(item) in writes, private)
                        if id(item) in records else item
                        for item in value
                    )
        return tuple(swapped)

    def _view_tensor(
        self, record: Central, write: bool, private: list[tuple[View, int]]
    ) -> torch.Tensor:
        view = self.resolve(record, write)
        tensor = view.tensor
        if view.private:
            private.append((view, tensor._version))
        return tensor


class _Resolution(threading.local):
    """The views the code on this thread sees: its replica's while it runs in ``run``."""

    views: ReplicaViews | None = None


_resolution = _Resolution()


def _resolve(func: Any, args: Any, kwargs: Any) -> Any:
    """``__torch_function__`` of central variables: a torch call that receives one runs on
    the views of the replica running on this thread, or on the variables themselves."""
    if kwargs is None:
        kwargs = {}
    views = _resolution.views
    if views is None:
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if torch.compiler.is_dynamo_compiling():
        return _on_views(views, func, args, kwargs)
    with DisableTorchFunctionSubclass():  # ``_call_on_views`` inlined: a call fewer each time
        return views.call(func, args, kwargs)


def write_in_place(
    central: torch.Tensor, update: Callable[[torch.Tensor], object], kind: int = DELTA
) -> bool:
    """``update(tensor)`` writes in place the view of ``central`` that the replica running on
    this thread sees, as a torch call given ``central`` would (``ReplicaViews.call``), for a
    caller that knows the variable and its write: Keras' ``assign_add``, a metric's update,
    takes about 40 lines of Python here against 80 through ``__torch_function__``. False,
    with nothing done, when no replica's views are resolved on this thread (the replica uses
    the variables themselves) or ``central`` is not one of their variables."""
    views = _resolution.views
    if views is None:
        return False
    record = views.records.get(id(central))
    if record is None:
        return False
    views.write_in_place(record, update, kind)
    return True


def _call_on_views(views: ReplicaViews, func: Any, args: Any, kwargs: Any) -> Any:
    """A call on a replica's views."""
    with DisableTorchFunctionSubclass():
        return views.call(func, args, kwargs)


# torch.compile does not trace the call on views (its bookkeeping would turn into guards on
# tensor ids): a compiled function runs the calls that receive a central variable eagerly,
# and compiles the rest. (torch's lazy ``torch.compiler.disable``, which its optimizers'
# methods use: it imports torch._dynamo at the first call, which only a compilation makes,
# where ``torch.compiler.disable`` took a second of every ``import centralstore``.)
_on_views: Callable[[ReplicaViews, Any, Any, Any], Any] = torch._disable_dynamo(  # type: ignore[attr-defined]
    _call_on_views
)

FULLGRAPH_NOTE = (
    "A function compiled with fullgraph=True reached a central variable other than through "
    "a module attribute (a cs.Variable, or a parameter or buffer taken before run by a "
    "replica that sees views): that call runs eagerly between compiled pieces, so the "
    "function cannot compile whole. Compile it without fullgraph=True (the rest still "
    "compiles), or reach the module's variables through the module inside it."
)


def fullgraph_refused(error: BaseException) -> bool:
    """Whether ``error`` is torch.compile refusing, under ``fullgraph=True``, to leave the
    call on views untraced (``FULLGRAPH_NOTE`` explains it to the user)."""
    return _call_on_views.__name__ in str(error)


class CentralParameter(torch.nn.Parameter):
    """The class a central parameter has while replica code runs: an ``nn.Parameter`` whose
    torch calls look for the running replica's view. Outside runs it is a plain
    ``nn.Parameter`` again, so nothing else (optimizers, ``state_dict``, ``torch.compile``
    outside ``run``) ever meets it."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _resolve(func, args, kwargs)


class CentralTensor(torch.Tensor):
    """``CentralParameter`` for central variables that are plain tensors (buffers,
    ``cs.Variable``); pickled as a plain tensor."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _resolve(func, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        with DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)  # type: ignore[no-untyped-call]


_CENTRAL_CLASS: dict[type, type] = {
    torch.nn.Parameter: CentralParameter, torch.Tensor: CentralTensor,
}
_PLAIN_CLASS: dict[type, type] = {central: plain for plain, central in _CENTRAL_CLASS.items()}
# The classes that count as ``nn.Parameter`` and as ``torch.Tensor`` exactly where a
# variable's class chooses a path: replicas share such variables without views
# (``runs.py``), and their writes combine in passes in C (``folding.py``); a subclass,
# whose calls may dispatch anything, keeps its views and its writes go one by one. The test
# suite's fake GPUs add their tensor class to both, as they add it to ``_CENTRAL_CLASS``,
# so that they take the paths real GPUs take.
EXACT_CLASSES: dict[type, frozenset[type]] = {
    torch.nn.Parameter: frozenset({torch.nn.Parameter}),
    torch.Tensor: frozenset({torch.Tensor}),
}


def lend_class(tensors: list[torch.Tensor]) -> None:
    """Give central variables their resolving class for the replica code about to run. A
    tensor of another class (a lazy module's ``UninitializedParameter``, a tensor subclass)
    cannot take it: ``TypeError``. (Every run lends and takes back the class of each of its
    variables: the usual case is one pass in C.)"""
    classes = list(map(_CENTRAL_CLASS.get, map(type, tensors)))
    if None not in classes:
        deque(map(setattr, tensors, repeat("__class__"), classes), maxlen=0)
        return
    for tensor, cls in zip(tensors, classes, strict=True):
        if cls is not None:
            tensor.__class__ = cls
        elif type(tensor) not in _PLAIN_CLASS:  # (one that has the class already passes)
            restore_class(tensors)
            raise TypeError(
                f"A central variable of class {type(tensor).__name__} cannot be resolved to "
                "replica views: only plain tensors and nn.Parameter can become central "
                "variables. Materialize lazy modules before the first run (one forward inside "
                "strategy.scope()), or keep tensor subclasses out of the scope."
            )


def restore_class(tensors: list[torch.Tensor]) -> None:
    """Central variables back to their plain class, outside replica code."""
    classes = list(map(_PLAIN_CLASS.get, map(type, tensors)))
    if None not in classes:
        deque(map(setattr, tensors, repeat("__class__"), classes), maxlen=0)
        return
    for tensor, cls in zip(tensors, classes, strict=True):
        if cls is not None:
            tensor.__class__ = cls


class resolving:
    """While active on a thread, central variables resolve to ``views`` (None: to
    themselves, for cross-replica code such as ``merge_call``)."""

    __slots__ = ("_previous", "_views")

    def __init__(self, views: ReplicaViews | None) -> None:
        self._views = views
        self._previous: ReplicaViews | None = None

    def __enter__(self) -> None:
        self._previous, _resolution.views = _resolution.views, self._views

    def __exit__(self, *exc: object) -> None:
        _resolution.views = self._previous
