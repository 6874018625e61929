"""Gradient buckets across workers, started while backward runs (as DDP starts its own).

``BucketPlan`` cuts the trainable central variables into buckets as DDP does: in reverse
registration order (backward produces the last layers' gradients first), each bucket closed
once it holds its size, the first's small (DDP's 1 MB) so that the first all-reduce starts
early, the others' ``bucket_bytes``. It is built from a layout every worker agreed on at
a sync point, so every worker holds the same buckets. The variables whose gradients the
workers summed sparse stay out of them (DDP too gives each sparse gradient a bucket of its
own): their entries travel at the sync point. So do the variables no worker's run has
given a gradient since the layout (idle: an EMA copy of the model, a teacher, a model
dropped but not yet collected), which DDP never sees since it wraps one model: in a
bucket they would travel as zeros at every step, and hold back the buckets after theirs,
since a bucket leaves only once all its gradients have come.

``EarlyExchange`` is one run's use of the plan. Each local replica's view of a variable has
a post-accumulate-grad hook (the store's gradient receiver); once every local replica holds
a gradient for every variable of the next bucket, the bucket's local sum (replica order, the
fold's own arithmetic) starts its all-reduce while backward goes on. The sync point starts
the buckets left over from the local fold, and checks that what left early is what the fold
produced (the same gradient tensors, unmoved); when a worker's check fails (a second
backward, a gradient that arrived outside ``run``), every worker exchanges again from the
fold. A bucket in host memory is packed into the buffer it was packed into at the step
before, while nothing else uses it (``BucketPlan.buffer``), as DDP keeps its buckets.
Buckets travel in a process group of their own, so that the other collectives a run
makes (``all_reduce`` in a replica, ``merge_call``) never interleave with them differently
on different workers: on every worker an early exchange starts every bucket of the plan, in
plan order.

GPU replicas of variables in host memory copy each gradient there as it accumulates
(``folding.start_copy``, the store's receiver, which the exchange calls first), or, in a
run of several backward passes, hold it on the GPU for the next pass and copy the sum at
the last (``GradientBuckets.holds``). A bucket whose gradients have all come and whose
copies are all queued (one on each view, standing for its ``.grad``: ``buckets.standing``)
goes to a helper thread, which waits for the copies, sums them and starts the bucket, in
plan order: neither the backward nor the GPU waits for the host.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from itertools import repeat
from operator import attrgetter, is_, is_not, itemgetter, methodcaller, setitem
from typing import TYPE_CHECKING, Any, NamedTuple, cast, final

import torch

from .._autograd import no_grad
from ..variables.buckets import standing, use_count
from ._flat import pack, unflatten

if TYPE_CHECKING:
    from ..variables.buckets import GradientBuckets, GradientCopy
    from ..variables.records import Central
    from ..variables.views import ReplicaViews, View

FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def bucket_indices(
    tensors: Sequence[torch.Tensor], include: Sequence[bool], first_bytes: int,
    bucket_bytes: int,
) -> list[list[int]]:
    """The indices of the included ``tensors`` in buckets, by DDP's rule: in reverse order,
    a bucket takes tensors until it holds its size (``first_bytes`` for the first,
    ``bucket_bytes`` after), the tensor that reaches it included, and a new one starts where
    dtype or device changes. (Closing a bucket before the tensor that would pass its size
    instead put a large tensor in the next bucket, with everything after it: an MLP's 4 MB
    middle layer then waited for the end of backward with the first layer's 3 MB, where DDP
    sends it while that layer's backward runs.)

    >>> ts = [torch.zeros(n) for n in (64, 16, 48, 3)]  # 256, 64, 192 and 12 bytes
    >>> bucket_indices(ts, [True] * 4, 256, 256)
    [[3, 2, 1], [0]]
    >>> bucket_indices(ts, [True, True, False, True], 64, 1024)
    [[3, 1], [0]]
    """
    buckets: list[list[int]] = []
    key: tuple[torch.dtype, torch.device] | None = None
    size = 0
    full = True  # whether the last bucket holds its size (none yet: a new one starts)
    for i in reversed(range(len(tensors))):
        if not include[i]:
            continue
        tensor = tensors[i]
        if full or key != (tensor.dtype, tensor.device):
            buckets.append([])
            key, size = (tensor.dtype, tensor.device), 0
        buckets[-1].append(i)
        size += tensor.numel() * tensor.element_size()
        full = size >= (first_bytes if len(buckets) == 1 else bucket_bytes)
    return buckets


@final
class BucketPlan:
    """The buckets of the trainable central variables of one agreed layout (``records``,
    ``trainable_flags``: which of them required grad), indices into its trainable ones.
    ``sparse``: the trainable variables left out, whose gradients the workers summed sparse
    at some sync point (they travel as indices and values at the sync point, never
    densified into a bucket); ``idle``: those left out because no worker's run gave them a
    gradient at the sync point the plan learnt it from (a gradient they get later travels
    at the sync point, in buckets of its own, and the next plan takes them in); None
    before any sync point of the layout received gradients: every variable is in.
    ``passes``: the backward passes a run makes before its
    buckets leave (more than one where runs accumulate micro-batches, learnt from a run
    whose buckets left too early: ``strike``); ``usable`` turns False when early exchanges
    keep failing their check."""

    __slots__ = (
        "_buffers", "bucket_dtypes", "bucket_keys", "bucket_of", "bucket_records",
        "bucket_shapes", "buckets", "devices", "dtypes", "idle", "left_out", "members",
        "numels", "passes", "records", "shapes", "sparse", "strikes", "trainable_flags",
        "trainable_records", "usable",
    )

    STRIKES = 2  # early exchanges in a row that failed their check before the plan gives up

    def __init__(
        self, records: list[Central], trainable_flags: list[bool],
        trainable: list[torch.Tensor], first_bytes: int, bucket_bytes: int,
        sparse: frozenset[int] = frozenset(), idle: frozenset[int] | None = None,
    ) -> None:
        self.records = records
        self.trainable_flags = trainable_flags
        self.sparse = sparse
        self.idle = idle
        self.left_out = sparse if idle is None else sparse | idle
        self.buckets = bucket_indices(
            trainable, [j not in self.left_out for j in range(len(trainable))],
            min(first_bytes, bucket_bytes), bucket_bytes,
        )
        self.members = [j for bucket in self.buckets for j in bucket]
        self.trainable_records = [
            r for r, flag in zip(records, trainable_flags, strict=True) if flag
        ]
        # key of a trainable variable in a bucket -> its bucket (looked up at each
        # gradient's arrival)
        self.bucket_of = {
            self.trainable_records[j].key: b
            for b, bucket in enumerate(self.buckets) for j in bucket
        }
        self.numels = [t.numel() for t in trainable]
        self.dtypes = [t.dtype for t in trainable]
        self.devices = [t.device for t in trainable]
        # per bucket, its variables' records, keys, dtypes and shapes: what its gradients
        # must match to leave early, compared in C passes
        self.bucket_records = [[self.trainable_records[j] for j in b] for b in self.buckets]
        self.bucket_keys = [[r.key for r in records] for records in self.bucket_records]
        self.bucket_dtypes = [[self.dtypes[j] for j in b] for b in self.buckets]
        self.bucket_shapes = [[trainable[j].shape for j in b] for b in self.buckets]
        # per bucket, tensors without storage of its variables' shapes, to ``unflatten`` it
        self.shapes = [
            [torch.empty(trainable[j].shape, device="meta") for j in bucket]
            for bucket in self.buckets
        ]
        self.usable = True
        self.strikes = 0
        self.passes = 1
        # per bucket, the flat buffer in host memory it was last packed into, its views by
        # variable, and its storage's use count while only the plan uses it (``buffer``)
        self._buffers: list[tuple[torch.Tensor, list[torch.Tensor], int] | None] = (
            [None] * len(self.buckets)
        )

    def buffer(self, b: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Bucket ``b``'s flat buffer to pack its gradients into, and its views shaped as its
        variables': the one of the step before while nothing outside the plan uses its
        memory any more (``zero_grad()`` let go of the sums the sync point lent to
        ``.grad``), else a new one, kept for the next step. None for a bucket on a GPU,
        whose caching allocator keeps freed memory already. (A new buffer at every step
        cost a large model's step its gradients' pages faulted in again: glibc gives a large
        block back to the system when it is freed, and maps it afresh.)"""
        bucket = self.buckets[b]
        device = self.devices[bucket[0]]
        if device.type != "cpu":
            return None
        kept = self._buffers[b]
        if kept is not None and use_count(kept[0]) == kept[2]:
            return kept[0], kept[1]
        numel = sum(self.numels[j] for j in bucket)
        with torch.inference_mode(False):  # (packed again by later runs, in any mode)
            flat = torch.empty(numel, dtype=self.dtypes[bucket[0]], device=device)
        views = unflatten(flat, self.shapes[b])
        self._buffers[b] = (flat, views, use_count(flat))
        return flat, views

    def fits(self, records: list[Central], trainable_flags: list[bool]) -> bool:
        """Whether the plan is that of this layout (identity comparison, at C speed)."""
        return records == self.records and trainable_flags == self.trainable_flags

    def strike(self, failed: bool, passes: int = 0) -> None:
        """An early exchange passed (``failed`` False) or failed its check on some worker.
        ``passes``: the whole backward passes every worker's run made, when they made the
        same number (else 0). More than the plan waited for, the run's buckets left too
        early (and failed), or waited for the sync point (with several local replicas, a
        bucket that counts its gradients complete before the last replica has any): the
        next runs' buckets wait for that many. (A run that loops over micro-batches sends
        its buckets during its last backward, as DDP does under ``no_sync``.)"""
        self.strikes = self.strikes + 1 if failed else 0
        if passes > self.passes:
            self.passes = passes
        if self.strikes >= self.STRIKES:
            self.usable = False


class _Sources(NamedTuple):
    """One bucket's gradients that left early, per local replica in the bucket's order, and
    what must still hold at the sync point: each view still its replica's tensor, each
    gradient still that tensor's, unmoved."""

    views: list[list[View]]
    tensors: list[list[torch.Tensor]]
    grads: list[list[torch.Tensor]]
    versions: list[list[int]]


class _Copied(NamedTuple):
    """One bucket's gradients that left early from GPU replicas, as copies to host memory
    (``GradientCopy``): per local replica, one round of copies in the bucket's order; and
    what must still hold at the sync point: each view still its replica's tensor, its one
    copy standing for its gradient."""

    views: list[list[View]]
    tensors: list[list[torch.Tensor]]
    copies: list[list[list[GradientCopy]]]


_tensor_of = attrgetter("tensor")
_record_of = attrgetter("record")
_epoch_of = attrgetter("epoch")
_private_of = attrgetter("private")
_pending_of = attrgetter("pending")
_first = itemgetter(0)
_grad_of = attrgetter("grad")
_version_of = attrgetter("_version")
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_is_sparse = attrgetter("is_sparse")
_alias_of = attrgetter("alias")
_queued = methodcaller("queued")
_peek = methodcaller("peek")

StartAllReduce = Callable[[torch.Tensor], Callable[[], None]]
# starts copying a view's gradient, just accumulated on its tensor, to host memory
# (``folding.start_copy``)
CopyGradient = Callable[["GradientBuckets", "View", torch.Tensor], None]


@final
class EarlyExchange:
    """The buckets of one run, started across the workers as the local replicas' gradients
    come in (``gradient_accumulated``), the rest at the sync point (``start_rest``).

    ``replicas``: the local replicas' views; ``start``: starts a SUM all-reduce of a flat
    buffer in place and returns the function that waits for it; ``device``: where buffers
    travel. ``early``: how many buckets left from the replicas' gradients.

    ``copies``, for GPU replicas of variables in host memory: what starts each gradient's
    copy to the host (``copy_accumulated`` calls it before counting), and the
    helper thread on which a bucket whose copies are all queued waits for them, is summed
    and starts (``_sum_copies``), in plan order, off the backward thread.

    A gradient's arrival only counts (it comes from a hook, inside backward, once per
    variable and replica): a bucket is ready once every local replica's gradient of each of
    its variables came, as many times as the plan's ``passes``. Its gradients are checked
    when it is packed, all at once: each replica's view of each variable shares the
    variable's storage (a private copy, on another device or written, waits for the fold)
    and holds a dense gradient of its dtype and shape. A bucket that fails the check, or
    that counted more arrivals than it waited for (one more backward), waits for the sync
    point, and every later one too. ``arrivals`` counts them all, so that the sync point
    can tell how many whole backward passes the run made (``passes``).
    """

    __slots__ = (
        "_blocked", "_bucket_of", "_copied", "_copy", "_device", "_helper", "_last", "_lock",
        "_missing", "_plan", "_replicas", "_sources", "_start", "arrivals", "early", "error",
        "started",
    )

    def __init__(
        self, plan: BucketPlan, replicas: list[ReplicaViews], start: StartAllReduce,
        device: torch.device, copies: tuple[CopyGradient, Executor] | None = None,
    ) -> None:
        self._plan = plan
        self._bucket_of = plan.bucket_of
        self._replicas = replicas
        self._start = start
        self._device = device
        # per bucket, the gradients still to come: its variables', on every local replica,
        # in each of the plan's backward passes
        self._missing = [len(bucket) * len(replicas) * plan.passes for bucket in plan.buckets]
        self.arrivals = 0
        self._sources: list[_Sources] = []  # of the buckets that left early, in plan order
        self._copied: list[_Copied] = []  # (theirs, as copies to host memory)
        self.started: list[tuple[torch.Tensor, Callable[[], None]]] = []  # in plan order
        self.early = 0
        self.error: Exception | None = None  # a collective that failed in a hook
        self._copy: CopyGradient | None = None
        self._helper: Executor | None = None
        if copies is not None:
            self._copy, self._helper = copies
        self._lock = threading.Lock()  # (copies: GPU replicas' backward runs on their threads)
        self._blocked: GradientCopy | None = None  # the copy the next bucket waits for
        self._last: Future[None] | None = None  # the latest bucket handed to the helper

    @property
    def plan(self) -> BucketPlan:
        return self._plan

    def gradient_accumulated(self, buckets: object, view: View, tensor: torch.Tensor) -> None:
        """A local replica's gradient of ``view`` has accumulated (the views' hooks call this
        as their receiver's ``on_gradient``; ``buckets`` and ``tensor`` are not needed):
        when its bucket has all of them, start it, and the ready buckets after it, in order.
        (Never raises into the backward: a failed collective waits for the sync point.)"""
        b = self._bucket_of.get(view.record.key)
        if b is None:
            return
        self.arrivals += 1
        missing = self._missing[b] - 1
        self._missing[b] = missing
        if missing or b != self.early or self.error is not None:
            return
        plan = self._plan
        try:  # this bucket, and the ready ones after it
            while b < len(plan.buckets) and not self._missing[b]:
                sources = self._ready_sources(b)
                if sources is None:  # it waits for the sync point, and the later ones too
                    self._missing[b] = -1
                    return
                self._sources.append(sources)
                self._launch(local_sum(sources.grads, plan.buffer(b)))  # replica order, as the fold
                self.early = b = b + 1
        except Exception as error:
            self.error = error

    def copy_accumulated(
        self, buckets: GradientBuckets, view: View, tensor: torch.Tensor
    ) -> None:
        """``gradient_accumulated`` for GPU replicas of variables in host memory: the
        gradient's copy to the host starts first, then it counts. The next bucket leaves
        once it has all its gradients and their copies are queued (a pinned bucket of the
        store's still filling holds it back until a later arrival fills it): the helper
        thread waits for them, sums and starts it. (Only the copy may raise into the
        backward, as the store's receiver would.)"""
        assert self._copy is not None  # (bound only with copies)
        self._copy(buckets, view, tensor)
        b = self._bucket_of.get(view.record.key)
        if b is None:
            return
        with self._lock:
            self.arrivals += 1
            self._missing[b] -= 1
            if self.error is None and self.early < len(self._missing) and not self._missing[
                self.early
            ] and (self._blocked is None or self._blocked.queued() is not None):
                try:
                    self._send_copies()
                except Exception as error:
                    self.error = error

    def _send_copies(self) -> None:
        """Hand the complete buckets, from the next one on, to the helper thread while their
        copies are queued (``copy_accumulated``)."""
        missing, helper = self._missing, self._helper
        assert helper is not None
        while self.early < len(missing) and not missing[self.early]:
            b = self.early
            found = self._copied_sources(b)
            if found is None:  # it waits for the sync point, and the later ones too
                missing[b] = -1
                return
            copies = [copy for rounds in found.copies for round_ in rounds for copy in round_]
            events = list(map(_queued, copies))
            queued = list(map(is_not, events, repeat(None)))
            if not all(queued):  # a later arrival tries again
                self._blocked = copies[queued.index(False)]
                return
            self._blocked = None
            self._copied.append(found)
            self._last = helper.submit(
                self._sum_copies, b, found, [event for some in events for event in some]
            )
            self.early = b + 1

    def _copied_sources(self, b: int) -> _Copied | None:
        """Bucket ``b``'s gradients on every local replica as copies to host memory, if
        each may leave early: every view holds one copy, which stands for its ``.grad``
        (``buckets.standing``: in a run of several backward passes, the sum of the last,
        the passes before held on the GPU, ``GradientBuckets.holds``), and nothing else.
        (With two copies, the second is the running sum: the bucket waits for the fold.)"""
        replicas = self._bucket_views(b)
        if replicas is None:
            return None
        found = _Copied([], [], [])
        for mine, tensors in replicas:
            pendings = list(map(_pending_of, mine))
            if (
                not all(map(is_, map(_alias_of, mine), repeat(None)))
                or list(map(len, pendings)).count(1) != len(mine)
            ):
                return None
            copies = list(map(_first, pendings))
            if not standing(tensors, copies):
                return None
            found.views.append(mine)
            found.tensors.append(tensors)
            found.copies.append([copies])
        return found

    def _sum_copies(self, b: int, found: _Copied, events: list[Any]) -> None:
        """(On the helper thread.) Once the copies have finished, bucket ``b``'s local sum in
        host memory starts its all-reduce: added in the fold's order, replica by replica and
        each replica's passes in turn. Nothing starts after a bucket that failed, so that
        every worker's buckets stay in order."""
        if self.error is not None:
            return
        try:
            for event in events:
                event.synchronize()
            self._launch(local_sum(
                [list(map(_peek, round_)) for rounds in found.copies for round_ in rounds],
                self._plan.buffer(b),
            ))
        except Exception as error:
            self.error = error

    def settle(self) -> None:
        """At the sync point, before anything else: every bucket handed to the helper
        thread has started (or failed: ``error``)."""
        if self._last is not None:
            self._last.result()
            self._last = None

    def _ready_sources(self, b: int) -> _Sources | None:
        """Bucket ``b``'s gradients on every local replica, if each may leave early."""
        replicas = self._bucket_views(b)
        if replicas is None:
            return None
        found = _Sources([], [], [], [])
        for mine, tensors in replicas:
            if any(map(_private_of, mine)) or any(map(_pending_of, mine)):
                return None
            grads = list(map(_grad_of, tensors))
            if not all(map(is_not, grads, repeat(None))) or any(map(_is_sparse, grads)):
                return None
            found.views.append(mine)
            found.tensors.append(tensors)
            found.grads.append(grads)
            found.versions.append(list(map(_version_of, grads)))
        return found

    def _bucket_views(self, b: int) -> list[tuple[list[View], list[torch.Tensor]]] | None:
        """Per local replica, its views of bucket ``b``'s variables and their tensors, if
        every one is there, of this epoch, of the plan's record (a key may be reused), dtype
        and shape (a tensor may be set through ``.data`` since the plan); else None."""
        plan = self._plan
        keys, records = plan.bucket_keys[b], plan.bucket_records[b]
        dtypes, shapes = plan.bucket_dtypes[b], plan.bucket_shapes[b]
        found: list[tuple[list[View], list[torch.Tensor]]] = []
        for views in self._replicas:
            mine = cast("list[View]", list(map(views.views.get, keys)))  # (None is checked)
            if (
                not all(map(is_not, mine, repeat(None)))
                or not all(map(is_, map(_record_of, mine), records))
                or list(map(_epoch_of, mine)).count(views.epoch) != len(mine)
            ):
                return None
            tensors = list(map(_tensor_of, mine))
            if list(map(_dtype_of, tensors)) != dtypes or list(map(_shape_of, tensors)) != shapes:
                return None
            found.append((mine, tensors))
        return found

    def _launch(self, flat: torch.Tensor) -> None:
        flat = flat.to(self._device)
        self.started.append((flat, self._start(flat)))

    # -- at the sync point -------------------------------------------------------------------

    def check_sources(self) -> bool:
        """Before the fold: every gradient that left early is still its replica's gradient,
        unchanged (a second backward replaces or moves it); a copy to host memory, still
        the only gradient of its view."""
        if self._copy is not None:
            return self._check_copies()
        for sources in self._sources:
            for views, tensors, grads, versions in zip(*sources, strict=True):
                if (
                    not all(map(is_, map(_tensor_of, views), tensors))
                    or not all(map(is_, map(_grad_of, tensors), grads))
                    or list(map(_version_of, grads)) != versions
                    or any(map(_private_of, views)) or any(map(_pending_of, views))
                ):
                    return False
        return True

    def _check_copies(self) -> bool:
        for views, tensors, copies in self._copied:
            for mine, its_tensors, rounds in zip(views, tensors, copies, strict=True):
                pendings = list(map(_pending_of, mine))
                if (
                    not all(map(is_, map(_tensor_of, mine), its_tensors))
                    or list(map(len, pendings)).count(len(rounds)) != len(mine)
                    or not all(
                        all(map(is_, map(itemgetter(k), pendings), round_))
                        for k, round_ in enumerate(rounds)
                    )
                    or not standing(its_tensors, rounds[-1])
                    or not all(map(is_, map(_alias_of, mine), repeat(None)))
                ):
                    return False
        return True

    def check_fold(self, fresh: Sequence[Any]) -> bool:
        """After the fold, ``fresh`` its gradients per trainable variable: each early one
        began from replica 0's gradient, so nothing else (a gradient that arrived outside
        ``run``, a parameter used directly) was folded in. (Copies to host memory: the
        fold's sums are new tensors; ``check_sources`` found each view's gradients to be
        the copies that left, and the sync point found nothing pending outside ``run``, so
        the fold added those copies from nothing, in the order they were summed.)"""
        if self._copy is not None:
            return True
        for bucket, sources in zip(self._plan.buckets, self._sources):  # the early ones
            if not all(map(is_, map(fresh.__getitem__, bucket), sources.grads[0])):
                return False
        return True

    @property
    def passes(self) -> int:
        """How many backward passes the run made, each of which brought a gradient of every
        variable in the buckets on every local replica; 0 when the arrivals are no whole
        number of such passes."""
        per_pass = len(self._bucket_of) * len(self._replicas)
        return self.arrivals // per_pass if per_pass and self.arrivals % per_pass == 0 else 0

    @property
    def all_started(self) -> bool:
        return len(self.started) == len(self._plan.buckets)

    def start_rest(self, fresh: Sequence[Any] | None) -> None:
        """Start the buckets not yet started, from the fold's gradients ``fresh`` (zeros
        where there is none, and everywhere for None: a layout that left the plan)."""
        plan = self._plan
        for b in range(len(self.started), len(plan.buckets)):
            bucket = plan.buckets[b]
            grads = [None if fresh is None else fresh[j] for j in bucket]
            into = plan.buffer(b)
            if into is not None:
                self._launch(_packed(into, grads))
                continue
            parts = [
                flat_gradient(grad, plan.numels[j], plan.dtypes[j], plan.devices[j])
                for j, grad in zip(bucket, grads, strict=True)
            ]
            self._launch(torch.cat(parts))

    def wait(self) -> list[torch.Tensor]:
        """Wait for every started bucket; their flat sums, in plan order."""
        for _, wait in self.started:
            wait()
        return [flat for flat, _ in self.started]

    def exchanged(self, has_grad: Sequence[bool]) -> list[torch.Tensor | None]:
        """Per trainable variable, its sum over the workers (a view of its bucket), or None
        where no worker has a gradient and for the variables left out of the plan."""
        plan = self._plan
        out: list[torch.Tensor | None] = [None] * len(plan.numels)
        # the usual case: each piece goes to its place in one C pass
        every = all(map(has_grad.__getitem__, plan.members))
        for bucket, flat, shapes in zip(plan.buckets, self.wait(), plan.shapes, strict=True):
            pieces = unflatten(flat.to(plan.devices[bucket[0]]), shapes)
            if every:
                deque(map(setitem, repeat(out), bucket, pieces), maxlen=0)
                continue
            for j, piece in zip(bucket, pieces, strict=True):
                if has_grad[j]:
                    out[j] = piece
        return out


def local_sum(
    rounds: Sequence[list[torch.Tensor]],
    into: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """A bucket's gradients, one list per round (each local replica's, or each of its
    passes), added up round after round, the fold's order, so the same bits: into the flat
    buffer ``into`` (with its views, ``BucketPlan.buffer``) or else a new one."""
    with no_grad():
        if into is None:
            flat = pack(rounds[0])
            if len(rounds) == 1:
                return flat
            views = unflatten(flat, rounds[0])
        else:
            flat, views = into
            torch._foreach_copy_(views, rounds[0])
        for grads in rounds[1:]:
            torch._foreach_add_(views, grads)
    return flat


def _packed(
    into: tuple[torch.Tensor, list[torch.Tensor]], grads: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """The flat buffer of ``into`` holding ``grads`` (dense; zeros where there is none)."""
    flat, views = into
    with no_grad():
        if all(map(is_not, grads, repeat(None))) and not any(map(_is_sparse, grads)):
            torch._foreach_copy_(views, cast("list[torch.Tensor]", grads))
            return flat
        for view, grad in zip(views, grads, strict=True):
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.to_dense() if grad.is_sparse else grad)
    return flat


def flat_gradient(
    grad: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One variable's part of a bucket: its gradient flat (dense), or zeros."""
    if grad is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
