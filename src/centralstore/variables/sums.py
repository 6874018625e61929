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
views of the bucket's variables holds its copy into that bucket and nothing else, and the
copy started inside a run (a backward after ``run`` folds its gradients as it ends).

Where the variables have no ``.grad``, the sum is lent to it, as the fold's. Where each has
a dense one of the bucket's dtype and shape (a run that accumulates), the fold computes
``(old + r0) + r1``, so the helper first adds the old gradients into the first replica's
bucket (``r0 + old``, which is ``old + r0`` bit for bit), then the others' buckets, and the
sync point copies the sums into ``.grad`` in place: one pass over the gradients where the
fold made R, and ``.grad`` untouched until then, so that a failed run leaves it as it was.
The copy is a pass the fold does not make, so the bucket that completes the step (no
backward left to hide the helper's work) is left to the fold. A ``.grad`` replaced or
written in place between the hand-over and the sync point (a tensor kept from before
``run`` and written inside it) would have been read too early: the run fails with an
error that says so, and its work is discarded (``check``).

A second backward of the last replica after the hand-off leaves its gradients beside the
copy, and the fold adds them after the sum, as it would have. The other buckets are folded
as before. A run that fails waits for the helper and discards the buckets as before.
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

from .._autograd import grad_of, no_grad, some, version_of
from .buckets import Bucket, BucketState, InBucket

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
    variables with their copies into it, in replica order; the ``.grad`` the sum starts
    from, if any; the helper's work."""

    buckets: list[Bucket]
    views: list[tuple[list[View], list[InBucket]]]
    start: _Start | None
    done: Future[None]


def _add_up(hosts: list[torch.Tensor], events: list[Any], start: _Start | None) -> None:
    """(On the helper thread.) Once every copy has finished, the old gradients (``start``)
    and then the other replicas' buffers added into the first's, in replica order."""
    for event in events:
        event.synchronize()
    if start is not None:  # ``r0 + old`` is the fold's ``old + r0``, bit for bit
        torch._foreach_add_(start.firsts, start.olds)
    first = hosts[0]
    for host in hosts[1:]:
        first.add_(host)


@final
class ReplicaSums:
    """The early sums of a store's GPU replicas (see the module's docstring): ``replicas``,
    two or more, each on a GPU, their variables in host memory; ``running()``: the store's
    run in progress, or None outside runs (a backward after ``run``, whose gradients are
    folded as they come)."""

    __slots__ = ("__weakref__", "_handed", "_helper", "_lock", "_replicas", "_running", "added")

    def __init__(
        self, replicas: Sequence[ReplicaViews], running: Callable[[], Run | None]
    ) -> None:
        self._replicas = list(replicas)
        self._running = running
        self._handed: list[_Handed] = []
        self._helper: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # (the hooks run on the GPUs' backward threads)
        # buckets the latest sync point that had some handed took added up
        self.added = 0
        replicas[-1].gradient_buckets.launched = functools.partial(_launched, weakref.ref(self))

    def launched(self, bucket: Bucket) -> None:
        """The last replica's copy of ``bucket`` has started (its gradient is not yet on its
        view): if the fold would add it to the other replicas' buckets of the same
        variables, laid out alike and copying too, and to nothing else or to their
        ``.grad``, the helper adds them up."""
        last = len(self._replicas) - 1
        run = self._running()
        if run is None or any(map(run.waits, range(last))):
            return
        arriving = _views_of(self._replicas[last], bucket, arriving=True)
        if arriving is None:
            return
        centrals = list(map(call, map(_ref_of, arriving[0])))
        if not all(map(is_not, centrals, repeat(None))):
            return
        with DisableTorchFunctionSubclass():  # (in replica code it would read the views')
            olds = list(map(grad_of, centrals))
        # (the step's last bucket has no backward left to hide behind: for it the helper's
        # additions and the copy into .grad would cost more than the fold)
        if some(olds) and (
            self._replicas[last].gradient_buckets.complete or not _addable(olds, bucket)
        ):
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
        start = None
        if some(olds):  # (all of them: ``_addable``)
            filled = cast(list[torch.Tensor], olds)
            start = _Start(centrals, filled, list(map(version_of, filled)), buckets[0].views)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="centralstore-sums")
        done = self._helper.submit(
            _add_up, [b.host for b in buckets], [b.event for b in buckets], start
        )
        with self._lock:
            self._handed.append(_Handed(buckets, views, start, done))

    def check(self) -> RuntimeError | None:
        """Before the sync point of a run: an error if a ``.grad`` that a handed bucket's
        sum started from was replaced or written in place since the hand-over (the helper
        may have read it before), so that the run's work is discarded; else None."""
        if not self._handed:  # (the replicas are done: no hook adds one now)
            return None
        with self._lock:
            handed = list(self._handed)
        for _, views, start, _ in handed:
            if start is None:
                continue
            centrals, olds, versions, _ = start
            with DisableTorchFunctionSubclass():
                now = list(map(grad_of, centrals))
            if all(map(is_, now, olds)) and list(map(version_of, olds)) == versions:
                continue
            replaced = not all(map(is_, now, olds))
            moved = [  # (views of one memory share a version counter: each may be named)
                _named(view.record, old)
                for view, grad, old, version in zip(views[0][0], now, olds, versions, strict=True)
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
        them leave the other replicas' views (and their buckets are taken); sums that
        started from ``.grad`` are copied into it and leave the first replica's views too.
        Returns the variables whose ``.grad`` took sums; raises what the helper raised (a
        copy that failed), or ``check``'s error."""
        self.added = 0
        if not self._handed:
            return []
        unchanged = self.check()
        handed = self._take()
        failed = [error for h in handed if (error := h.done.exception()) is not None]
        if failed:  # (once the helper has left every bucket)
            raise failed[0]
        if unchanged is not None:
            raise unchanged
        received: list[torch.Tensor] = []
        for buckets, views, start, _ in handed:
            for bucket in buckets:
                bucket.waited()  # (the helper waited for its copy)
            # the first replica's copies stay for the fold to lend, unless they hold .grad's
            first = 0 if start is not None else 1
            for bucket, (mine, copies) in zip(buckets[first:], views[first:], strict=True):
                pendings = list(map(_pending_of, mine))
                if not all(map(is_, map(_first, pendings), copies)):
                    raise RuntimeError(
                        "centralstore: a gradient bucket added up early lost its place in a "
                        "replica's gradients (a bug: please report it)"
                    )
                # each copy is first: what the last replica's later passes left stays after
                deque(map(delitem, pendings, repeat(0)), maxlen=0)
                bucket.unread -= len(bucket.pieces)
            if start is not None:
                with no_grad():
                    torch._foreach_copy_(start.olds, start.firsts)
                received += start.centrals
            self.added += 1
        for replica in self._replicas if handed else ():
            replica.gradient_buckets.synced = True  # (as taking a copy does)
        return received

    def drop(self) -> None:
        """The run's work is discarded: once the helper has left the buckets, they are
        discarded as before."""
        handed = self._take()
        if handed:
            self.added = 0
        for handed_bucket in handed:
            try:
                handed_bucket.done.result()
            except Exception:  # (a failed copy: the discard's own wait reports it)
                continue

    def _take(self) -> list[_Handed]:
        with self._lock:
            handed, self._handed = self._handed, []
        return handed


def _views_of(
    replica: ReplicaViews, bucket: Bucket, arriving: bool
) -> tuple[list[View], list[InBucket]] | None:
    """The replica's views of ``bucket``'s variables with their copies into it (a bucket
    holds its keys' slots), if each one's only gradient is that copy (``arriving``: the last
    replica's, where the gradient that started the bucket's copy reaches its view just
    after), and the view has no gradient of its own. (Passes in C: this runs inside
    backward.)"""
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
    tensors = list(map(_tensor_of, views))
    if not all(map(is_, map(_alias_of, views), repeat(None))) or some(map(grad_of, tensors)):
        return None
    return views, copies  # type: ignore[return-value]


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
