"""Pinned host buckets for the gradients that a CUDA replica copies to the CPU during backward.

A replica's gradients land in flat pinned buffers, buckets of at most ``BUCKET_BYTES`` per
dtype, laid out in the order the gradients arrived at the step before: backward's order, so a
bucket fills early and all at once (DDP rebuilds its buckets from its first iteration's order
the same way). Each gradient lands whole: a bucket closes when the next gradient would cross
its end, and a gradient larger than ``BUCKET_BYTES`` has a bucket of its own, as DDP's. The
layout is built again from a step's arrivals when that step brought a gradient it had no slot
for, or left a slot empty (the variables, their shapes or the ones that are used changed).

The sync point copies nothing out of the buffers: ``.grad`` gets the gradients where they lie
(``lend``), and with several replicas the first replica's buffers take the others' sums in
place. A bucket fills the same buffer at every step while nothing outside it uses that
memory any more (``zero_grad()``, which sets ``.grad`` to None, lets it go before the next
backward), and another buffer while something does (``.grad`` kept to accumulate into, a
reference to it kept), as DDP's ``gradient_as_bucket_view`` lets ``.grad`` be views of its
buckets. With ``LENT_BUFFERS`` in use it fills a spare, whose gradients the sync point copies
out: a program that keeps every step's ``.grad`` pins no more than that. (A copy would cost
the host the gradients' bytes read, written and, in memory the allocator had just handed back
to the system, paged in again, at every step.) Whole gradients are what makes this possible:
one in two pieces would have to be joined into a new tensor.

The CUDA calls per bucket and step are a constant few, whatever the number of gradients in
it: when its last gradient has arrived, the side stream waits for the streams that produced
them, concatenates them (one kernel), copies the result into the pinned buffer (one copy) and
records the bucket's event; the sync point synchronizes that event once. The gradients are
held until then rather than named to ``record_stream`` one by one: once the host has waited
for the event, freeing them is safe. A bucket some of whose gradients never came is copied
when the backward ends (``GradientBuckets.after_backward``), each run of arrived gradients
as above, or at the sync point.

A gradient copied stays in its view's ``.grad``, as on one device: code in the replica
reads it after backward, writes it (clipping, scaling), sets it to None, and a later
backward adds to it. Each copy keeps the tensor it copied and its version counter
(``GradientCopy.source``, ``version``); the sync point takes a copy only while it still
stands for the view's gradient (``standing``), else the gradient itself. At the end of a
backward that copied, the replica's stream waits for the side stream, so that no such
write meets a copy's read; the sync point waits for the copies anyway, so this costs
nothing where nothing follows the backward.

Pinned memory per replica, for gradients of ``G`` bytes: each bucket asks for the bytes of
its gradients, which torch's caching host allocator rounds up to a power of two, at most
``B = BUCKET_BYTES`` (itself one) for a bucket of several; so under ``2 G`` in all, and
about ``G`` plus the rounding of the buckets that closed short (the gap a gradient too large
for a bucket's rest leaves) and of the gradients larger than ``B``. It is allocated at the
first sync point and stays while the layout does, with a second buffer for a bucket whose
gradients ``.grad`` keeps across steps (the bytes a copy of them would take anyway).

A gradient the layout has no slot for (at the first step, or for a variable new to it) waits
on its GPU until the sync point, which lays the buckets out again from the step's arrivals and
copies it there: the layout is built when the gradients are known, and the first step pins
nothing else. A gradient that cannot land in its slot is copied alone, as before buckets (a
pinned block of its own, an event, ``record_stream``): a second gradient for a slot before
the sync point took the first, or one for a bucket whose earlier contents are not yet taken.

A loop of micro-batches inside one run brings each variable's gradient several times
before the sync point. The buckets count them, and the next step leaves that many but the
last on their GPU (``GradientBuckets.holds``), where the next pass's gradient accumulates
into them as on one device: the last pass copies each replica's sum once, into its slot,
with the calls and the host memory of one backward, and the fold adds the replicas' sums
in the CPU twin's order. (Copied at every pass, the later ones go alone, K times the
bytes over the bus, of which the sync point uses the last, the sum, which still stands for
the gradient.) A replica that returns with gradients still held (fewer passes than the
step before) starts their copies then; a pass more than the step before goes alone;
either way the next step counts again. The first step of a loop, with nothing counted,
copies every pass.
"""

from __future__ import annotations

import abc
import enum
import functools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from itertools import repeat, starmap
from operator import attrgetter, getitem, is_, methodcaller
from typing import Any, NamedTuple, cast, final

import torch

from .._autograd import grad_of, version_of
from .._devices import CurrentStreams, wait_through

BUCKET_BYTES = 1 << 24  # 16 MiB: DDP's 25 MB, to the power of two the host allocator serves
# The buffers a bucket lends to ``.grad`` at most: with as many still in use, it fills a spare,
# which the sync point copies out (so a program that keeps every step's ``.grad`` pins no more)
LENT_BUFFERS = 2


class Piece(NamedTuple):
    """Where one gradient's elements land in a bucket, all of them."""

    position: int  # among the bucket's pieces, which are in the order of their offsets
    offset: int  # its first element in the bucket
    numel: int


# a bucket's pinned buffer: its tensor, its views by piece, the use count of its storage while
# only the bucket uses it
_Buffer = tuple[torch.Tensor, list[torch.Tensor], int]


class BucketState(enum.Enum):
    EMPTY = "empty"  # nothing in it: the next gradient starts a fill
    FILLING = "filling"  # gradients arriving; none copied yet
    COPYING = "copying"  # the copy queued on the side stream, and the event after it
    READ = "read"  # the host waited for the copy; its gradients may not all be taken yet


@final
class Bucket:
    """A bucket of gradients of one dtype: its pinned buffers, and the fill in progress.

    The sync point hands the gradients in the buffer to ``.grad`` as they lie (``lend``):
    while some tensor still uses the buffer's memory (a ``.grad`` not yet set to None, a
    view of one kept), the next fill goes to another buffer, taken from the ones no longer
    used or pinned anew, up to ``LENT_BUFFERS``; with that many in use, it fills a spare,
    which the sync point copies out instead of lending (``lends``). A loop that calls
    ``zero_grad()`` before its next backward fills one buffer at every step."""

    __slots__ = ("_buffers", "_current", "_event", "_held", "_produced", "_shapes", "_side",
                 "_spare", "_streams", "_uses", "arrived", "dtype", "host", "keys", "lends",
                 "pieces", "state", "unread", "views")

    def __init__(
        self, dtype: torch.dtype, numel: int, pieces: list[Piece],
        shapes: list[torch.Size], keys: list[int], current: CurrentStreams | None = None,
    ) -> None:
        """``current``: its replica's ``CurrentStreams`` (one of its own if None)."""
        self.dtype = dtype
        self._current = CurrentStreams() if current is None else current
        self.pieces = pieces
        self.keys = keys  # by piece: the variable whose gradient lands there
        self._shapes = shapes  # by piece: its gradient's shape
        self.state = BucketState.EMPTY
        self.arrived = 0
        self.unread = 0  # pieces copied in and not yet taken by a sync point
        self._held: list[torch.Tensor | None] = [None] * len(pieces)  # the arrived runs
        # the streams that produced them, by handle (a stream's ``==`` is Python in torch)
        self._streams: dict[int, Any] = {}
        self._side: Any = None
        self._event: Any = None  # a CUDA event, recorded on the side stream after the copy
        self._produced: Any = None  # one recorded on the streams whose gradients it copies
        # the buffers it may lend: (buffer, its views by piece, its storage's use count when
        # nothing else uses it); the one being filled is ``host``, ``views``
        self._buffers = [self._pinned(torch.empty(numel, dtype=dtype, pin_memory=True))]
        self._spare: _Buffer | None = None  # never lent (``LENT_BUFFERS``)
        self.host, self.views, self._uses = self._buffers[0]
        self.lends = True  # whether the sync point may lend the fill's gradients to ``.grad``

    def _pinned(self, host: torch.Tensor) -> _Buffer:
        views = [
            host[p.offset:p.offset + p.numel].view(shape)
            for p, shape in zip(self.pieces, self._shapes, strict=True)
        ]
        return host, views, use_count(host)

    def _unlent(self) -> None:
        """At the start of a fill: the buffer of the fill before, if nothing outside the
        bucket uses it any more; else one that nothing uses, or a new one; else (with
        ``LENT_BUFFERS`` in use) the spare."""
        if self.lends and use_count(self.host) == self._uses:
            return
        self.lends = True
        for buffer in self._buffers:
            if use_count(buffer[0]) == buffer[2]:
                self.host, self.views, self._uses = buffer
                return
        if len(self._buffers) < LENT_BUFFERS:
            self._buffers.append(self._pinned(torch.empty_like(self.host, pin_memory=True)))
            self.host, self.views, self._uses = self._buffers[-1]
            return
        if self._spare is None:
            self._spare = self._pinned(torch.empty_like(self.host, pin_memory=True))
        self.host, self.views, self._uses = self._spare
        self.lends = False

    @property
    def pinned_bytes(self) -> int:
        """The bytes of every buffer pinned for the bucket."""
        buffers = self._buffers if self._spare is None else [*self._buffers, self._spare]
        return sum(host.untyped_storage().nbytes() for host, _, _ in buffers)

    def accepts(self, piece: Piece) -> bool:
        """Whether ``piece`` may land now: the bucket's fill is open and has not had the
        piece yet, or the bucket is empty (a fill read and all taken empties it)."""
        if self.state is BucketState.FILLING:  # (most arrivals)
            return self._held[piece.position] is None
        if self.state is BucketState.READ and self.unread == 0:
            self.state = BucketState.EMPTY
        return self.state is BucketState.EMPTY

    def add(self, piece: Piece, run: torch.Tensor, stream: Any, side: Any) -> bool:
        """``piece``, whose elements are ``run`` (flat), produced on ``stream``, has arrived;
        the last piece of the bucket starts its copy on ``side``. False, with nothing held,
        if the bucket does not accept the piece now (``accepts``)."""
        if self.state is not BucketState.FILLING or self._held[piece.position] is not None:
            if not self.accepts(piece):
                return False
            self.state, self.arrived, self._side = BucketState.FILLING, 0, side
            self._unlent()
        self._held[piece.position] = run
        if stream.cuda_stream not in self._streams:
            self._streams[stream.cuda_stream] = stream
        self.arrived += 1
        self.unread += 1
        if self.arrived == len(self.pieces):
            self._launch()
        return True

    def _launch(self) -> None:
        """Copy the arrived runs into the pinned buffer on the side stream, then record the
        event the sync point waits for."""
        side = self._side
        if self._produced is None:
            self._produced = torch.cuda.Event()  # type: ignore[no-untyped-call]
        for stream in self._streams.values():
            wait_through(side, stream, self._produced)
        with self._current.switch(side):
            for first, last in self._runs():
                runs = cast(list[torch.Tensor], self._held[first:last + 1])  # all arrived
                flat = runs[0] if len(runs) == 1 else torch.cat(runs)
                begin, end = self.pieces[first], self.pieces[last]
                self.host[begin.offset:end.offset + end.numel].copy_(flat, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(side)
        self.state = BucketState.COPYING

    @property
    def event(self) -> Any:
        """The CUDA event recorded after the fill's copy (``COPYING`` and ``READ``)."""
        return self._event

    def _runs(self) -> list[tuple[int, int]]:
        """The arrived pieces as runs of consecutive indices, first and last of each."""
        if self.arrived == len(self.pieces):  # all of them (a fill that completed)
            return [(0, self.arrived - 1)]
        runs: list[tuple[int, int]] = []
        for i, held in enumerate(self._held):
            if held is None:
                continue
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        return runs

    def wait(self) -> None:
        """Make the buffer readable on the host: a fill still open is copied now (its
        missing gradients never came), and the host waits for the event, once per fill. The
        gradients copied are let go only then."""
        if self.state is BucketState.FILLING:
            self._launch()
        if self.state is BucketState.COPYING:
            self._event.synchronize()
            self.waited()

    def waited(self) -> None:
        """The host has waited for the fill's copy (``wait``, or the helper that added the
        replicas' buckets up, ``sums.py``): the gradients copied are let go."""
        self._held = [None] * len(self.pieces)
        self._streams = {}
        self.state = BucketState.READ


class Slot(NamedTuple):
    """Where one variable's gradient lands: its piece of a bucket (``pieces``: one, or none
    for a gradient without elements)."""

    shape: torch.Size
    dtype: torch.dtype
    pieces: tuple[tuple[Bucket, Piece], ...]


class GradientCopy(abc.ABC):
    """A gradient on its way to host memory, as a view holds it until the sync point."""

    # Whether the tensor ``take`` returns is a view of a bucket's buffer: what the sync
    # point keeps must then be a tensor of its own on that memory (``lend``), which the
    # bucket sees using it, so that no later fill overwrites it.
    borrowed: bool
    # The gradient copied, which stays in its view's ``.grad``, and its version counter
    # then: the copy stands for the view's gradient while both are unchanged (a later
    # backward adds to it in place, or replaces it; code in the replica may write it).
    source: torch.Tensor | None
    version: int

    @abc.abstractmethod
    def take(self) -> torch.Tensor:
        """The gradient in host memory, once its copy has finished."""

    def queued(self) -> list[Any] | None:
        """The events after which the gradient may be read in host memory (``peek``), once
        its copy is queued; None while it is not: a bucket it lands in is still filling,
        or it has no slot yet (``Deferred``: the sync point copies it)."""
        return None

    def peek(self) -> torch.Tensor:
        """The gradient in host memory, left for ``take``: the host must have waited for
        the events ``queued`` returned (the multi-worker exchange sums it early)."""
        raise NotImplementedError(f"{type(self).__name__} has no copy queued to read")


@final
class InBucket(GradientCopy):
    """A gradient copied into its slot of the buckets. (One per slot, made with the layout:
    a slot holds one gradient at a time.)"""

    __slots__ = ("_owner", "borrowed", "bucket", "dtype", "piece", "shape", "slot", "source",
                 "version")
    bucket: Bucket  # with ``piece``, the slot's piece: set when ``borrowed``
    piece: Piece

    def __init__(self, owner: GradientBuckets, slot: Slot) -> None:
        self._owner = owner
        self.slot = slot
        self.borrowed = bool(slot.pieces)  # (not an empty gradient)
        self.shape, self.dtype = slot.shape, slot.dtype  # read at each arrival
        self.source, self.version = None, -1  # set at each arrival that lands in the slot
        if self.borrowed:
            self.bucket, self.piece = slot.pieces[0]

    def take(self) -> torch.Tensor:
        slot = self.slot
        for bucket, _ in slot.pieces:
            bucket.wait()
        grad = self.peek()
        for bucket, _ in slot.pieces:
            bucket.unread -= 1
            if not bucket.lends:  # the spare's: copied out
                grad = grad.clone()
        self._owner.synced = True
        self.source = None  # (the slot outlives the step: its GPU memory is let go)
        return grad

    def queued(self) -> list[Any] | None:
        events = []
        for bucket, _ in self.slot.pieces:
            if bucket.state is BucketState.FILLING or bucket.state is BucketState.EMPTY:
                return None
            events.append(bucket.event)
        return events

    def peek(self) -> torch.Tensor:
        if self.borrowed:
            return self.bucket.views[self.piece.position]
        return torch.empty(self.shape, dtype=self.dtype)  # a gradient without elements


@final
class Alone(GradientCopy):
    """A gradient copied into a pinned block of its own."""

    __slots__ = ("_event", "_host", "_owner", "source", "version")
    borrowed = False

    def __init__(self, owner: GradientBuckets, grad: torch.Tensor, stream: Any, side: Any) -> None:
        side.wait_stream(stream)
        with owner._current.switch(side):
            self._host = torch.empty(grad.shape, dtype=grad.dtype, device="cpu", pin_memory=True)
            self._host.copy_(grad, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(side)
        grad.record_stream(side)
        self._owner = owner
        self.source, self.version = grad, grad._version

    def take(self) -> torch.Tensor:
        self._event.synchronize()
        self._owner.synced = True
        return self._host

    def queued(self) -> list[Any] | None:
        return [self._event]

    def peek(self) -> torch.Tensor:
        return self._host


@final
class Deferred(GradientCopy):
    """A gradient the layout had no slot for: held on its GPU until the sync point, which
    lays the buckets out again, this step's arrivals included, and copies it there."""

    __slots__ = ("_copy", "_owner", "grad", "key", "side", "source", "stream", "version")

    def __init__(
        self, owner: GradientBuckets, key: int, grad: torch.Tensor, stream: Any, side: Any
    ) -> None:
        self._owner = owner
        self.key, self.stream, self.side = key, stream, side
        self.grad: torch.Tensor | None = grad
        self.source, self.version = grad, grad._version
        self._copy: GradientCopy | None = None

    def place(self, start: Callable[[torch.Tensor, Any, Any], GradientCopy]) -> None:
        """Start its copy (``start(grad, stream, side)``), which holds the gradient from now
        on."""
        grad, self.grad = self.grad, None
        assert grad is not None  # placed once
        self._copy = start(grad, self.stream, self.side)

    @property
    def borrowed(self) -> bool:  # type: ignore[override]
        return self._copy is not None and self._copy.borrowed

    def take(self) -> torch.Tensor:
        if self._copy is None:
            self._owner.settle()
        assert self._copy is not None  # settle placed every deferred gradient
        return self._copy.take()


def take_all(copies: list[GradientCopy]) -> list[torch.Tensor]:
    """Each copy's ``take()``, in order. When all are copies into their slots (a steady
    step's), each bucket is waited for once and the gradients read in passes in C."""
    if set(map(type, copies)) != {InBucket} or not all(map(_borrowed_of, copies)):
        return list(map(_take, copies))  # (not borrowed: a gradient without elements)
    buckets = list(map(_bucket_of, copies))
    for bucket, taken in Counter(buckets).items():
        bucket.wait()
        bucket.unread -= taken
    for owner in set(map(_owner_of, copies)):
        owner.synced = True
    forget_sources(copies)
    views = cast(list[torch.Tensor], list(
        map(getitem, map(_views_of, buckets), map(_position_of, map(_piece_of, copies)))
    ))
    if all(map(_lends_of, buckets)):
        return views
    return [v if b.lends else v.clone() for v, b in zip(views, buckets, strict=True)]


def standing(tensors: list[torch.Tensor], copies: Sequence[GradientCopy]) -> bool:
    """Whether each of ``tensors`` (views' tensors) still holds in ``.grad`` the gradient its
    copy of ``copies`` took, unchanged since: the copy then stands for it. (Passes in C.)"""
    grads = list(map(grad_of, tensors))
    return all(map(is_, grads, map(_source_of, copies))) and list(
        map(version_of, grads)
    ) == list(map(_copy_version_of, copies))


def forget_sources(copies: Sequence[GradientCopy]) -> None:
    """The copies no longer keep the gradients they copied (a slot's copy outlives the step:
    its source would hold GPU memory into the next). (A pass in C.)"""
    deque(map(setattr, copies, repeat("source"), repeat(None)), maxlen=0)


def lend(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors of their own on the memory of ``grads``, views of gradient buckets' buffers,
    for ``.grad`` to keep: while one lives, its bucket fills another buffer (``Bucket``), so
    the sync point copies nothing. (One pass in C.)"""
    return list(map(torch.Tensor.detach, grads))


def use_count(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) use the memory of ``tensor``: torch's count of
    references to its storage, which its views share."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


_take = methodcaller("take")
_source_of = attrgetter("source")
_copy_version_of = attrgetter("version")
_borrowed_of = attrgetter("borrowed")
_bucket_of = attrgetter("bucket")
_views_of = attrgetter("views")
_lends_of = attrgetter("lends")
_piece_of = attrgetter("piece")
_position_of = attrgetter("position")
_owner_of = attrgetter("_owner")


class _Arrival(NamedTuple):
    key: int
    shape: torch.Size
    dtype: torch.dtype


@final
class GradientBuckets:
    """One replica's gradient buckets: their layout, built from a step's arrivals, and the
    step in progress (see the module docstring)."""

    __slots__ = ("__weakref__", "_arrivals", "_buckets", "_copied", "_copies", "_counts",
                 "_current", "_deferred", "_filled", "_stale", "holding", "launched", "learns",
                 "ordered", "passes", "synced")

    def __init__(self, current: CurrentStreams | None = None) -> None:
        """``current``: the replica's ``CurrentStreams``, which its buckets share (one of
        their own if None)."""
        # by the key of the central variable: its slot, as the copy into it
        self._copies: dict[int, InBucket] = {}
        self._buckets: list[Bucket] = []  # the layout's, in the order of its slots
        # this step's gradients, in order (``_Arrival``'s fields: a tuple costs no call)
        self._arrivals: list[tuple[int, torch.Size, torch.dtype]] = []
        self._deferred: list[Deferred] = []  # this step's gradients without a slot
        self._filled = 0  # slots that received their gradient this step
        # each gradient's producer, the current stream the switches to a side stream restore
        self._current = CurrentStreams() if current is None else current
        self._copied: Any = None  # a CUDA event, recorded on the side stream after a backward
        self._stale = False  # this step does not fit the layout
        self.synced = True  # a sync point took gradients since the latest arrival
        # called with each bucket whose copy a gradient's arrival (``copy``: inside backward,
        # not at a sync point) has just started (``sums.py``)
        self.launched: Callable[[Bucket], None] | None = None
        # a loop of micro-batches (``holds``): by variable key, the gradients it received at
        # the step before, where more than one; this step's so far; and the keys of those
        # held on their GPU now, in the order they came
        self.passes: dict[int, int] = {}
        self._counts: dict[int, int] = {}
        self.holding: dict[int, None] = {}
        self.learns = True  # whether it counts passes and holds them (off: copied each)
        self.ordered = False  # whether the backward in progress orders later work (``folding``)

    def copy(self, key: int, grad: torch.Tensor, side: Any) -> GradientCopy:
        """Start copying ``grad``, the gradient of variable ``key``, to host memory on the
        side stream ``side``."""
        if self.synced:
            self._next_step()
        self._arrivals.append((key, grad.shape, grad.dtype))
        stream = self._current(grad.device)
        copy = self._copies.get(key)
        if copy is None or copy.shape != grad.shape or copy.dtype != grad.dtype:
            self._stale = True
            deferred = Deferred(self, key, grad, stream, side)
            self._deferred.append(deferred)
            return deferred
        if copy.borrowed and grad.is_contiguous():  # in one piece, as it is (most gradients)
            if not copy.bucket.add(copy.piece, grad.view(-1), stream, side):
                return Alone(self, grad, stream, side)
            copy.source, copy.version = grad, grad._version
            self._filled += 1
            if self.launched is not None and copy.bucket.state is BucketState.COPYING:
                self.launched(copy.bucket)  # (a full bucket takes no more: this one filled it)
            return copy
        landed = self._land(copy, grad, stream, side)
        if (
            self.launched is not None and landed is copy and copy.borrowed
            and copy.bucket.state is BucketState.COPYING  # (it accepted the gradient: open)
        ):
            self.launched(copy.bucket)
        return landed

    def holds(self, key: int) -> bool:
        """Whether the gradient of variable ``key`` that has just accumulated should stay on
        its GPU (the store's hook then copies nothing). A variable that received ``n`` at
        the step before (a loop of ``n`` micro-batches inside one run) keeps the first
        ``n - 1`` there, where the next pass's gradient adds to it in backward's own
        accumulation, and the ``n``-th arrival copies the sum into its slot. (Copied at each
        arrival, the later ones would go alone, ``n`` times the bytes over the bus.)
        Gradients still held when their replica returns (fewer
        passes this step) are copied then (``release``); more passes go alone, as before;
        either way the next step counts again. Called while ``passes`` is empty only at a
        step's first arrival."""
        if self.synced:
            self._next_step()
        expected = self.passes.get(key)
        if expected is None:
            return False
        arrived = self._counts.get(key, 0) + 1
        self._counts[key] = arrived
        if arrived < expected:
            self.holding[key] = None
            return True
        self.holding.pop(key, None)
        return False

    def release(self) -> list[int]:
        """The keys of the gradients held now, which wait for no more passes (their replica
        returned): the caller starts their copies, which ``holds`` lets go, as any later
        arrival of theirs this step."""
        keys = list(self.holding)
        self.holding.clear()
        for key in keys:
            del self.passes[key]  # (``_counts`` keeps what the step brought, for the next)
        return keys

    def after_backward(self, device: torch.device, side: Any) -> None:
        """A backward that copied gradients has ended: the buckets still filling start
        their copies (a bucket whose pieces spanned two backwards would read, during the
        next, gradients that backward adds to in place), and the current stream of
        ``device``, where the replica's work goes on, waits for the copies on ``side``, so
        that no later write to a gradient (the next backward's accumulation, code in the
        replica) meets its copy's read."""
        self.ordered = False
        for bucket in self.buckets:
            if bucket.state is BucketState.FILLING:
                bucket._launch()
        self.after_copies(device, side)

    def after_copies(self, device: torch.device, side: Any) -> None:
        """The current stream of ``device`` waits for the copies queued on ``side`` so far."""
        if self._copied is None:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        wait_through(self._current(device), side, self._copied)

    def _passes(self) -> dict[int, int]:
        """The gradients the step that ended received of each variable, where more than one:
        its copies' arrivals, and the counts of those ``holds`` was asked about."""
        counts = Counter(key for key, _, _ in self._arrivals if key not in self._counts)
        counts.update(self._counts)
        return {key: n for key, n in counts.items() if n > 1}

    def _land(self, copy: InBucket, grad: torch.Tensor, stream: Any, side: Any) -> GradientCopy:
        """``copy``'s piece takes ``grad``, if its bucket accepts it now; else it is copied
        alone. (A gradient without elements has no piece: nothing to copy.)"""
        pieces = copy.slot.pieces
        if not all(starmap(Bucket.accepts, pieces)):
            return Alone(self, grad, stream, side)
        if grad.is_contiguous():
            flat = grad.view(-1)
        else:  # a copy, made where the gradient was (the sync point's stream may differ)
            with self._current.switch(stream):
                flat = grad.reshape(-1)
        copy.source, copy.version = grad, grad._version
        for bucket, piece in pieces:
            bucket.add(piece, flat, stream, side)
        self._filled += 1
        return copy

    def _lay_out(self) -> None:
        """Slots for this step's arrivals."""
        slots = lay_out(list(starmap(_Arrival, self._arrivals)), BUCKET_BYTES, self._current)
        self._copies = {key: InBucket(self, slot) for key, slot in slots.items()}
        self._buckets = list(
            {id(b): b for copy in self._copies.values() for b, _ in copy.slot.pieces}.values()
        )

    def settle(self) -> None:
        """At the sync point, with deferred gradients: the layout from this step's arrivals,
        and those gradients copied into it."""
        self._lay_out()
        deferred, self._deferred = self._deferred, []
        for entry in deferred:
            entry.place(functools.partial(self._land, self._copies[entry.key]))
        self._stale, self._filled = False, len(self._copies)  # it fits this step

    def slot_copy(self, key: int) -> InBucket | None:
        """The copy into variable ``key``'s slot of the present layout, if it has one."""
        return self._copies.get(key)

    def slot_copies(self, keys: list[int]) -> list[InBucket | None]:
        """``slot_copy`` of each of ``keys``, in a pass in C."""
        return list(map(self._copies.get, keys))

    @property
    def slots(self) -> dict[int, Slot]:
        """The present layout: each variable's slot, by its key."""
        return {key: copy.slot for key, copy in self._copies.items()}

    @property
    def buckets(self) -> list[Bucket]:
        """The present layout's buckets, in the order of its slots."""
        return self._buckets

    @property
    def pinned_bytes(self) -> int:
        """The bytes of the pinned buffers of the present layout (a bucket's buffers still
        lent to ``.grad`` included)."""
        return sum(b.pinned_bytes for b in self.buckets)

    def _next_step(self) -> None:
        """The first gradient after a sync point: lay out again if the step before did not
        fit the layout (a slot left empty; one missing was laid out at the sync point)."""
        self.synced = False
        # (gradients held to the sync point, their replica never returned: their slots stay)
        if self._stale or self._filled + len(self.holding) != len(self._copies):
            self._lay_out()
        if self.learns and (  # (some variable's gradient came again)
            self.passes or self._counts or len(self._arrivals) > self._filled
        ):
            self.passes = self._passes()
        self._arrivals, self._filled, self._stale, self._counts = [], 0, False, {}
        self.holding.clear()
        for entry in self._deferred:  # not taken at the sync point (a discarded view's)
            entry.place(functools.partial(Alone, self))
        self._deferred = []


def lay_out(
    arrivals: list[_Arrival], bucket_bytes: int, current: CurrentStreams | None = None
) -> dict[int, Slot]:
    """Slots for the gradients of ``arrivals`` (the first of each key), in their order: per
    dtype, buckets of at most ``bucket_bytes`` that each gradient lands in whole. A bucket
    closes when the next gradient would cross its end; a gradient larger than a bucket has
    one of its own; one without elements has no piece. ``current``: the replica's
    ``CurrentStreams``, which the buckets share."""
    by_dtype: dict[torch.dtype, list[_Arrival]] = {}
    seen: set[int] = set()
    for arrival in arrivals:
        if arrival.key not in seen:
            seen.add(arrival.key)
            by_dtype.setdefault(arrival.dtype, []).append(arrival)
    slots: dict[int, Slot] = {}
    for dtype, group in by_dtype.items():
        capacity = max(bucket_bytes // dtype.itemsize, 1)
        sizes: list[int] = []  # by bucket: its elements,
        pieces: list[list[Piece]] = []  # its pieces,
        shapes: list[list[torch.Size]] = []  # their gradients' shapes
        keys: list[list[int]] = []  # and their variables
        placed: dict[int, tuple[int, Piece]] = {}
        filling = -1  # the bucket that takes the next gradient that fits
        for arrival in group:
            numel = arrival.shape.numel()
            if numel == 0:
                continue
            if numel > capacity or filling < 0 or sizes[filling] + numel > capacity:
                b = len(sizes)
                sizes.append(0)
                pieces.append([])
                shapes.append([])
                keys.append([])
                if numel <= capacity:
                    filling = b
            else:
                b = filling
            piece = Piece(len(pieces[b]), sizes[b], numel)
            pieces[b].append(piece)
            shapes[b].append(arrival.shape)
            keys[b].append(arrival.key)
            sizes[b] += numel
            placed[arrival.key] = (b, piece)
        buckets = list(map(
            functools.partial(Bucket, dtype, current=current), sizes, pieces, shapes, keys
        ))
        for arrival in group:
            where = placed.get(arrival.key)
            slots[arrival.key] = Slot(
                arrival.shape, dtype, () if where is None else ((buckets[where[0]], where[1]),)
            )
    return slots
