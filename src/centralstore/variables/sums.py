"""GPU replicas' gradients added up on the host while backward goes on.

Several replicas on GPUs in one process whose variables live in host memory copy their
gradients into pinned buckets during backward (``buckets.py``); the sync point adds the
other replicas' buckets into the first replica's, in place and in replica order, and lends
that to ``.grad``. ``ReplicaSums`` makes those additions earlier: once the last replica's
copy of a bucket has started, a helper thread waits for it and for the other replicas'
copies of the same bucket, and adds them into the first replica's, while the GPUs still
compute the buckets after it. The sync point then only waits for the helper and takes the
added buckets off the other replicas' views: the first replica's bucket holds the sum, the
fold's own arithmetic in its own order, so the same bits.

A bucket is handed to the helper only where the fold would add exactly those gradients to
nothing: every other replica has returned (one that waits in a rendezvous may still add a
second backward's gradients, which the fold would add before the last replica's), each of
its views of the bucket's variables holds its copy into that bucket and nothing else, and
the variables have no ``.grad`` (one accumulated across runs comes first in the fold:
``(old + r0) + r1`` is not ``old + (r0 + r1)``), and the copy started inside a run (a
backward after ``run`` folds its gradients as it ends). A second backward of the last
replica after the hand-off leaves its gradients beside the copy, and the fold adds them after
the sum, as it would have. The other buckets are folded as before. A run that fails waits for
the helper and discards the buckets as before.
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
from typing import TYPE_CHECKING, Any, NamedTuple, final

from torch._C import DisableTorchFunctionSubclass

from .._autograd import grad_of, some
from .buckets import Bucket, BucketState, InBucket

if TYPE_CHECKING:
    import torch

    from .runs import Run
    from .views import ReplicaViews, View


class _Handed(NamedTuple):
    """A bucket handed to the helper: each replica's bucket, and after the first its views
    of the bucket's variables with their copies into it, in replica order; the helper's
    work."""

    buckets: list[Bucket]
    views: list[tuple[list[View], list[InBucket]]]
    done: Future[None]


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
        variables, laid out alike and copying too, and to nothing else, the helper adds
        them up."""
        last = len(self._replicas) - 1
        run = self._running()
        if run is None or any(map(run.waits, range(last))):
            return
        buckets, views = [], []
        for r, replica in enumerate(self._replicas):
            if r == last:
                theirs: Bucket | None = bucket
            else:
                copy = replica.gradient_buckets.slot_copy(bucket.keys[0])
                theirs = copy.bucket if copy is not None and copy.borrowed else None
            if (
                theirs is None or theirs.state is not BucketState.COPYING
                or theirs.keys != bucket.keys or theirs.pieces != bucket.pieces
                or theirs.dtype != bucket.dtype
            ):
                return
            mine = _views_of(replica, theirs, arriving=r == last)
            if mine is None:
                return
            buckets.append(theirs)
            views.append(mine)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="centralstore-sums")
        done = self._helper.submit(_add_up, [b.host for b in buckets], [b.event for b in buckets])
        with self._lock:
            self._handed.append(_Handed(buckets, views[1:], done))

    def settle(self) -> None:
        """At the sync point of a run whose work is kept, before the fold: once the helper
        is done, the first replica's buckets hold the sums, and the copies that went into
        them leave the other replicas' views (and their buckets are taken). Raises what
        the helper raised (a copy that failed)."""
        handed = self._take()
        self.added = 0
        failed = [error for h in handed if (error := h.done.exception()) is not None]
        if failed:  # (once the helper has left every bucket)
            raise failed[0]
        for buckets, views, _ in handed:
            for bucket in buckets:
                bucket.waited()  # (the helper waited for its copy)
            for bucket, (mine, copies) in zip(buckets[1:], views, strict=True):
                pendings = list(map(_pending_of, mine))
                if not all(map(is_, map(_first, pendings), copies)):
                    raise RuntimeError(
                        "centralstore: a gradient bucket added up early lost its place in a "
                        "replica's gradients (a bug: please report it)"
                    )
                # each copy is first: what the last replica's later passes left stays after
                deque(map(delitem, pendings, repeat(0)), maxlen=0)
                bucket.unread -= len(bucket.pieces)
            self.added += 1
        for replica in self._replicas[1:] if handed else ():
            replica.gradient_buckets.synced = True  # (as taking a copy does)

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
    after) and its variable has no ``.grad``. (Passes in C: this runs inside backward.)"""
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
    centrals = list(map(call, map(_ref_of, views)))
    if not all(map(is_not, centrals, repeat(None))):
        return None
    with DisableTorchFunctionSubclass():  # (in replica code it would read the views')
        if some(map(grad_of, centrals)):
            return None
    return views, copies  # type: ignore[return-value]


_first = itemgetter(0)
_pending_of = attrgetter("pending")
_tensor_of = attrgetter("tensor")
_alias_of = attrgetter("alias")
_ref_of = attrgetter("record.ref")


def _launched(sums_ref: weakref.ref[ReplicaSums], bucket: Bucket) -> None:
    sums = sums_ref()
    if sums is not None:
        sums.launched(bucket)
