"""GPU replicas' gradients added up on the host while backward goes on.

Several replicas on GPUs in one process whose variables live in host memory copy their
gradients into pinned buckets during backward (``buckets.py``); the sync point adds the
other replicas' buckets into the first replica's, in place and in replica order, and lends
that to ``.grad`` (or adds them all, in the same order, to a ``.grad`` already there).
``ReplicaSums`` makes those additions earlier: once the last replica's copy of a bucket has
started, a helper thread waits for it and for the other replicas' copies of the same
bucket, and adds them into the first replica's, while the GPUs still compute the buckets
after it. The sync point then only waits for the helper and takes the added buckets off the
views: the first replica's bucket holds the sum, the fold's own arithmetic in its own
order, so the same bits.

A bucket is handed to the helper only where the fold would add exactly those gradients:
every other replica has returned (one that waits in a rendezvous may still add a second
backward's gradients, which the fold would add before the last replica's), each of its
views of the bucket's variables holds its copy into that bucket and nothing else, its
``.grad`` still the gradient the copy took (``buckets.standing``), and the copy started
inside a run (a backward after ``run`` folds its gradients as it ends). Code in a replica
may still change its ``.grad`` after the hand-over (scale it, a later backward): the sync
point then drops the bucket's sum, and the fold adds the gradients themselves.

Where the variables have no ``.grad``, the sum becomes it (lent), as the fold's. Where each
has a dense one of the bucket's dtype and shape (a run that accumulates), the fold computes
``(old + r0) + r1``: so as soon as the first replica's copy of a bucket starts, the helper
adds the old gradients into it (``r0 + old``, which is ``old + r0`` bit for bit: IEEE
addition commutes) while the replicas compute on (whatever the first replica does after, a
second backward or a rendezvous, the fold adds after ``old + r0`` too); the hand-over then
adds the others' buckets, and the sync point copies the sums into ``.grad`` in place: one
pass over the gradients where the fold made R, and ``.grad`` untouched until then, so
that a failed run leaves it as it was. A first replica's bucket that took ``.grad`` but
whose hand-over did not come (the last replica's bucket there holds other variables) is
copied into ``.grad`` alone, and the fold adds the other replicas' gradients to it, as it
would have. A ``.grad`` replaced or written in place after its bucket took it (a tensor
kept from before ``run`` and written inside it) would have been read too early: the run
fails with an error that says so, and its work is discarded (``check``).

A second backward of the last replica after the hand-off adds to its gradients in place,
so the sum is dropped and the fold adds each replica's gradients, the twin's order (in a
loop of micro-batches the buckets hold the passes before the last on the GPU instead:
``GradientBuckets.holds``). The other buckets are folded as before. A run that fails waits
for the helper and discards the buckets as before.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import compress, repeat
from operator import attrgetter, call, delitem, is_, is_not, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, cast, final

import torch
from torch._C import DisableTorchFunctionSubclass

from .._autograd import grad_of, no_grad, set_grads, some, version_of
from .buckets import Bucket, BucketState, InBucket, forget_sources, standing

if TYPE_CHECKING:
    from .records import Central
    from .runs import Run
    from .views import ReplicaViews, View


class _Start(NamedTuple):
    """The ``.grad`` a handed bucket's sum starts from (a run that accumulates into it): the
    variables, their gradients and those gradients' version counters at the hand-over, and
    the first replica's views of its bucket's buffer, all by piece."""

    centrals: list[torch.Tensor]
    olds: list[torch.Tensor]
    versions: list[int]
    firsts: list[torch.Tensor]


class _Handed(NamedTuple):
    """A bucket handed to the helper: each replica's bucket and its views of the bucket's
    variables with their copies into it, in replica order; the ``.grad`` the first
    replica's bucket took, if any; the helper's work."""

    buckets: list[Bucket]
    views: list[tuple[list[View], list[InBucket]]]
    start: _Start | None
    done: Future[None]


class _Begun(NamedTuple):
    """A first replica's bucket that took its variables' ``.grad`` while backward ran (a run
    that accumulates): its views of the bucket's variables with their copies into it, the
    ``.grad`` it took, the helper's work."""

    bucket: Bucket
    views: tuple[list[View], list[InBucket]]
    start: _Start
    done: Future[None]


def _take_old(event: Any, start: _Start) -> None:
    """(On the helper thread.) Once the first replica's copy has finished, the old
    gradients added into its bucket: ``r0 + old``, the fold's ``old + r0`` bit for bit."""
    event.synchronize()
    torch._foreach_add_(start.firsts, start.olds)


def _add_up(hosts: list[torch.Tensor], events: list[Any]) -> None:
    """(On the helper thread.) Once every copy has finished, the other replicas' buffers
    added into the first's, in replica order."""
    for event in events:
        event.synchronize()
    first = hosts[0]
    for host in hosts[1:]:
        first.add_(host)


@final
class ReplicaSums:
    """The early sums of a store's GPU replicas (see the module's docstring): ``replicas``,
    two or more, each on a GPU, their variables in host memory; ``running()``: the store's
    run in progress, or None outside runs (a backward after ``run``, whose gradients are
    folded as they come)."""

    __slots__ = ("__weakref__", "_begun", "_handed", "_helper", "_lock", "_replicas",
                 "_running", "added", "begun")

    def __init__(
        self, replicas: Sequence[ReplicaViews], running: Callable[[], Run | None]
    ) -> None:
        self._replicas = list(replicas)
        self._running = running
        self._handed: list[_Handed] = []
        self._begun: dict[int, _Begun] = {}  # by the id of the first replica's bucket
        self._helper: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # (the hooks run on the GPUs' backward threads)
        # at the latest sync point that had some: the buckets it took added up, and the first
        # replica's buckets that took .grad early without the others' (they were folded)
        self.added = 0
        self.begun = 0
        me = weakref.ref(self)
        replicas[0].gradient_buckets.launched = functools.partial(_first_launched, me)
        replicas[-1].gradient_buckets.launched = functools.partial(_launched, me)

    def first_launched(self, bucket: Bucket) -> None:
        """The first replica's copy of ``bucket`` has started: if its variables' ``.grad``
        are filled (a run that accumulates) and the fold would add the bucket to them first,
        the helper adds them into the bucket at once, while the replicas compute on."""
        if self._running() is None or _no_grad(self._replicas[0], bucket):
            return
        views = _views_of(self._replicas[0], bucket, arriving=True)
        if views is None:
            return
        found = _centrals_and_grads(views[0])
        if found is None:
            return
        centrals, olds = found
        if not _addable(olds, bucket):
            return
        filled = cast(list[torch.Tensor], olds)
        start = _Start(centrals, filled, list(map(version_of, filled)), bucket.views)
        done = self._submit(_take_old, bucket.event, start)
        with self._lock:
            self._begun[id(bucket)] = _Begun(bucket, views, start, done)

    def launched(self, bucket: Bucket) -> None:
        """The last replica's copy of ``bucket`` has started (its gradient is not yet on its
        view): if the fold would add it to the other replicas' buckets of the same
        variables, laid out alike and copying too, and to nothing else or to the ``.grad``
        that the first replica's bucket took, the helper adds them up."""
        last = len(self._replicas) - 1
        run = self._running()
        if run is None or any(map(run.waits, range(last))):
            return
        arriving = _views_of(self._replicas[last], bucket, arriving=True)
        if arriving is None:
            return
        buckets, views = [], []
        for replica in self._replicas[:last]:
            copy = replica.gradient_buckets.slot_copy(bucket.keys[0])
            theirs = copy.bucket if copy is not None and copy.borrowed else None
            if (
                theirs is None or theirs.state is not BucketState.COPYING
                or theirs.keys != bucket.keys or theirs.pieces != bucket.pieces
                or theirs.dtype != bucket.dtype
            ):
                return
            mine = _views_of(replica, theirs, arriving=False)
            if mine is None:
                return
            buckets.append(theirs)
            views.append(mine)
        buckets.append(bucket)
        views.append(arriving)
        found = _centrals_and_grads(arriving[0])
        if found is None:
            return
        _, olds = found
        begun = self._begun.get(id(buckets[0])) if some(olds) else None
        if some(olds) and (begun is None or not all(map(is_, begun.start.olds, olds))):
            return  # (the first replica's bucket did not take them: the fold adds it to them)
        start = None if begun is None else begun.start
        done = self._submit(_add_up, [b.host for b in buckets], [b.event for b in buckets])
        with self._lock:
            if begun is not None:
                del self._begun[id(buckets[0])]
            self._handed.append(_Handed(buckets, views, start, done))

    def _submit(self, work: Callable[..., None], *args: Any) -> Future[None]:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="centralstore-sums")
        return self._helper.submit(work, *args)

    def check(self) -> RuntimeError | None:
        """Before the sync point of a run: an error if a ``.grad`` that a bucket took early
        was replaced or written in place since (the helper may have read it before), so that
        the run's work is discarded; else None."""
        if not self._begun and not self._handed:  # (the replicas are done: no hook adds one)
            return None
        with self._lock:
            starts = [(b.views[0], b.start) for b in self._begun.values()]
            starts += [(h.views[0][0], h.start) for h in self._handed if h.start is not None]
        for views, (centrals, olds, versions, _) in starts:
            with DisableTorchFunctionSubclass():
                now = list(map(grad_of, centrals))
            if all(map(is_, now, olds)) and list(map(version_of, olds)) == versions:
                continue
            replaced = not all(map(is_, now, olds))
            moved = [  # (views of one memory share a version counter: each may be named)
                _named(view.record, old)
                for view, grad, old, version in zip(views, now, olds, versions, strict=True)
                if grad is not old or (not replaced and old._version != version)
            ]
            whose = moved[0] if len(moved) == 1 else (
                f"one of {len(moved)} variables whose .grad share memory, {moved[0]} among them"
            )
            return RuntimeError(
                f"A .grad was {'replaced' if replaced else 'written in place'} during run() "
                f"after the replicas' gradients had begun to be added to it: that of {whose} "
                "(a tensor kept from before run() and changed inside it?). The run's "
                "gradients are discarded. Change .grad outside run(), or inside merge_call."
            )
        return None

    def settle(self) -> list[torch.Tensor]:
        """At the sync point of a run whose work is kept, before the fold: once the helper
        is done, the first replica's buckets hold the sums, and the copies that went into
        them leave the other replicas' views (and their buckets are taken); a first
        replica's bucket that took ``.grad`` is copied into it, the sum or alone (the
        others' gradients are folded after it), and leaves the first replica's views too.
        Returns the variables whose ``.grad`` took sums; raises what the helper raised (a
        copy that failed), or ``check``'s error."""
        self.added = self.begun = 0
        if not self._handed and not self._begun:
            return []
        unchanged = self.check()
        handed, begun = self._take()
        works = [h.done for h in handed] + [b.done for b in begun]
        failed = [error for work in works if (error := work.exception()) is not None]
        if failed:  # (once the helper has left every bucket)
            raise failed[0]
        if unchanged is not None:
            raise unchanged
        received: list[torch.Tensor] = []
        for buckets, views, start, _ in handed:
            for bucket in buckets:
                bucket.waited()  # (the helper waited for its copy)
            if not all(_standing(mine, copies) for mine, copies in views):
                # a gradient changed after its copy (code in a replica, a later backward):
                # the first replica's buffer holds a sum that no longer stands, so its
                # views keep their gradients for the fold, as the others' do
                _taken(buckets[0], *views[0], keep=True)
                continue
            # the first replica's copies stay for the fold to lend, unless they hold .grad's
            first = 0 if start is not None else 1
            for bucket, (mine, copies) in zip(buckets[first:], views[first:], strict=True):
                _taken(bucket, mine, copies)
            if start is not None:
                received += _into_grad(start)
            self.added += 1
        for bucket, (mine, copies), start, _ in begun:
            bucket.waited()
            if not _standing(mine, copies):  # (as above: the fold adds the gradients)
                _taken(bucket, mine, copies, keep=True)
                continue
            _taken(bucket, mine, copies)
            received += _into_grad(start)
            self.begun += 1
        for replica in self._replicas:
            replica.gradient_buckets.synced = True  # (as taking a copy does)
        return received

    def drop(self) -> None:
        """The run's work is discarded: once the helper has left the buckets, they are
        discarded as before."""
        handed, begun = self._take()
        if handed or begun:
            self.added = self.begun = 0
        for work in [h.done for h in handed] + [b.done for b in begun]:
            try:
                work.result()
            except Exception:  # (a failed copy: the discard's own wait reports it)
                continue

    def _take(self) -> tuple[list[_Handed], list[_Begun]]:
        with self._lock:
            handed, self._handed = self._handed, []
            begun, self._begun = list(self._begun.values()), {}
        return handed, begun


def _taken(
    bucket: Bucket, views: list[View], copies: list[InBucket], keep: bool = False
) -> None:
    """``copies``, each the first gradient of its view, taken off them, and the views'
    ``.grad``, for which they stood, unless ``keep`` (the copies no longer stand: the fold
    takes the gradients): their bucket's sum is read. (What a replica's later passes left
    stays after them, for the fold.)"""
    pendings = list(map(_pending_of, views))
    if not all(map(is_, map(_first, pendings), copies)):
        raise RuntimeError(
            "centralstore: a gradient bucket added up early lost its place in a replica's "
            "gradients (a bug: please report it)"
        )
    deque(map(delitem, pendings, repeat(0)), maxlen=0)
    bucket.unread -= len(bucket.pieces)
    forget_sources(copies)
    if not keep:
        set_grads(list(map(_tensor_of, views)), repeat(None))


def _standing(views: list[View], copies: list[InBucket]) -> bool:
    """Whether the views' copies still stand for their ``.grad`` (``buckets.standing``)."""
    return standing(list(map(_tensor_of, views)), copies)


def _into_grad(start: _Start) -> list[torch.Tensor]:
    """The first replica's bucket, which took ``.grad`` (and maybe the others' buckets),
    copied into ``.grad`` in place; returns the variables."""
    with no_grad():
        torch._foreach_copy_(start.olds, start.firsts)
    return start.centrals


def _views_of(
    replica: ReplicaViews, bucket: Bucket, arriving: bool
) -> tuple[list[View], list[InBucket]] | None:
    """The replica's views of ``bucket``'s variables with their copies into it (a bucket
    holds its keys' slots), if each one's only copy is that one (``arriving``: the last
    replica's, where the copy that started the bucket's reaches its view just after), and
    it stands for the view's ``.grad`` (``buckets.standing``). (Passes in C: this runs
    inside backward.)"""
    keys = bucket.keys
    views = list(map(replica.views.get, keys))
    if not all(map(is_not, views, repeat(None))):
        return None
    copies = replica.gradient_buckets.slot_copies(keys)
    pendings = list(map(_pending_of, views))
    lengths = list(map(len, pendings))
    if lengths.count(1) != len(keys) - arriving or lengths.count(0) != arriving:
        return None  # (arriving: the one whose gradient is arriving has none yet)
    if not all(map(is_, map(_first, compress(pendings, lengths)), compress(copies, lengths))):
        return None
    if not all(map(is_, map(_alias_of, views), repeat(None))) or not _standing(
        views, copies  # type: ignore[arg-type]
    ):
        return None
    return views, copies  # type: ignore[return-value]


def _centrals_and_grads(
    views: list[View],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """The views' variables and their ``.grad``, or None when one has gone. (Passes in C:
    this runs inside backward.)"""
    centrals = list(map(call, map(_ref_of, views)))
    if not all(map(is_not, centrals, repeat(None))):
        return None
    with DisableTorchFunctionSubclass():  # (in replica code it would read the views')
        return centrals, list(map(grad_of, centrals))


def _no_grad(replica: ReplicaViews, bucket: Bucket) -> bool:
    """Whether the variable of ``bucket``'s first piece has no ``.grad`` (the usual run, not
    accumulating: then no bucket takes one), or has gone."""
    view = replica.views.get(bucket.keys[0])
    central = None if view is None else view.record.ref()
    if central is None:
        return True
    with DisableTorchFunctionSubclass():  # (in replica code it would read its view's)
        return central.grad is None


def _named(record: Central, tensor: torch.Tensor) -> str:
    """A variable as an error names it: its name in its module, and its shape."""
    name = f"{record.owners[0][1]!r} " if record.owners else "the variable "
    return f"{name}of shape {tuple(tensor.shape)}"


def _addable(olds: list[torch.Tensor | None], bucket: Bucket) -> bool:
    """Whether the fold would add ``bucket``'s gradients to ``olds``, the ``.grad`` of its
    variables by piece, as one ``_foreach_add_`` adds: each a distinct dense tensor in host
    memory of the bucket's dtype and its piece's shape. (Passes in C.)"""
    return (
        all(map(is_not, olds, repeat(None)))
        and set(map(type, olds)) == {torch.Tensor}
        and set(map(_layout_of, olds)) == {torch.strided}
        and set(map(_dtype_of, olds)) == {bucket.dtype}
        and set(map(_device_type_of, olds)) == {"cpu"}
        and list(map(_shape_of, olds)) == list(map(_shape_of, bucket.views))
        and len(set(map(id, olds))) == len(olds)
    )


_first = itemgetter(0)
_pending_of = attrgetter("pending")
_tensor_of = attrgetter("tensor")
_alias_of = attrgetter("alias")
_ref_of = attrgetter("record.ref")
_layout_of = attrgetter("layout")
_dtype_of = attrgetter("dtype")
_device_type_of = attrgetter("device.type")
_shape_of = attrgetter("shape")


def _launched(sums_ref: weakref.ref[ReplicaSums], bucket: Bucket) -> None:
    sums = sums_ref()
    if sums is not None:
        sums.launched(bucket)


def _first_launched(sums_ref: weakref.ref[ReplicaSums], bucket: Bucket) -> None:
    sums = sums_ref()
    if sums is not None:
        sums.first_launched(bucket)
