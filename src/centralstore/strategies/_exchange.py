"""The sync point across workers: what this sync point added, exchanged with the others.

At every sync point (the end of ``run``, ``merge_call``, ``optimizer.step()``) each worker

1. notes the writes its replicas made to central variables (how many replicas wrote each
   one, and whether any assigned) and the values before them;
2. sets the existing ``.grad`` aside and folds its replicas' gradients into fresh ones
   (the local sync point), so that accumulation over several ``run`` calls exchanges only
   what is new;
3. agrees with the other workers on the layout and on what there is to exchange (one small
   all-gather; a second, of per-variable flags, only when some worker lacks a gradient,
   wrote a variable or folded a sparse gradient, and the workers' flags differ: the
   agreement carries a digest of each worker's, so that workers whose replicas wrote the
   same variables, as batch norm's do every run, skip it); the row also carries this
   worker's values of the variables written at the last sync point that wrote any
   (``_writes.CarriedWrites``);
4. all-reduces (SUM) the fresh gradients in flat buckets (``_buckets.py``: reverse
   registration order, a small first bucket), with zeros where a worker has none: the
   traffic is one gradient per worker whatever its number of replicas (hierarchical
   reduction);
5. adds the set-aside ``.grad`` back, and combines the writes by each variable's aggregation
   over the writers of every worker, as one process with all the replicas would
   (``_writes.py``: from the values the agreement carried when they cover the writes,
   else summed in an all-reduce);
6. calls the post-accumulate-grad hooks of the variables whose ``.grad`` received a sum,
   on every worker the same ones: they see the sum over the workers, as one process would.

Inside ``run``, step 4 starts early: from the second sync point on, each run's buckets leave
while its backward still runs, as soon as every local replica's gradients in them are there
(``EarlyExchange``); the sync point starts the rest before the agreement and only waits.
The agreement row says whether each worker's early buckets are what its fold produced; if
any is not, every worker exchanges again from the fold, in step 4's order. The numbers are
those of the exchange after the fold: the same local sums, the same buckets. A gradient the
workers summed sparse stays out of the next runs' buckets: it travels as indices and values
at the sync point, and, should it be dense somewhere later, in buckets of its own there. A
trainable variable that no worker's run has given a gradient since the layout (an EMA copy
of the model, a teacher) stays out of them too, rather than travel as zeros at every step
and hold back the buckets after its own; the first gradient it gets travels at the sync
point, in buckets of its own, and from then on it is in the plan.

When the run failed on any worker, every worker puts back its set-aside ``.grad`` and the
values its replicas' writes replaced, and raises: the run is discarded everywhere.

Gradients that arrive outside ``run`` (a backward on a reduced loss) wait in
``store.pending`` until the next sync point, usually ``optimizer.step()``, and are exchanged
there. Every worker reaches the same collectives in the same order, even one whose replicas
produced nothing. The one exception is an optimizer step with nothing pending: since a
backward after ``run`` happens on every worker or on none, such a step makes no collective
at all (``ProcessGroup.sync_step``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from itertools import compress, repeat
from operator import attrgetter, call, is_, is_not
from typing import TYPE_CHECKING, Any, NamedTuple, final

import torch

from .._autograd import grad_of, no_grad, requires_grad_of, set_grads, some
from ..variables.folding import add_in_order, run_post_accumulate_hooks
from ._buckets import (
    FIRST_BUCKET_BYTES,
    BucketPlan,
    CopyGradient,
    EarlyExchange,
    bucket_indices,
    flat_gradient,
)
from ._cross_worker import AGREEMENT_FIELDS, CARRIED_AT, HOST, Collectives, Kind, signature
from ._flat import as_bytes, padded
from ._writes import CarriedWrites, ValuesBefore, exchange_writes, local_writes, wide

if TYPE_CHECKING:
    from ..variables.buckets import GradientBuckets
    from ..variables.records import Central
    from ..variables.store import VariableStore
    from ..variables.views import View

_ref = attrgetter("ref")
_is_sparse = attrgetter("is_sparse")

NONE, ALL = 0, 2  # how many trainable variables got a gradient on a worker: none, some, all
# The early exchange, in the agreement row: this sync point ends a run whose buckets could
# start early (every worker alike), this worker's early buckets passed their check, and this
# worker started buckets (then every worker starts them all); and, apart from the early
# exchange, some gradient this worker folded is sparse, and some integer variable this
# worker's replicas wrote may sum beyond float64's exact integers (then the writes' sums
# travel in their own dtypes, not all as float64 in one all-reduce).
# And this worker's row carries the values of the variables written at the last sync
# point that wrote any (``CarriedWrites``).
ARMED, VALID, STARTED, SPARSE, WIDE, CARRIED = 1, 2, 4, 8, 16, 32
PASSES = 8  # the flags' bits from here on: the backward passes the run made (``EarlyExchange``)


class Agreed(NamedTuple):
    """What a sync point settled, the same on every worker: every worker's agreement
    ``flags``, which trainable variables some worker's run gave a gradient
    (``received``), the trainable variables whose sums stayed ``sparse``, and the
    variables some worker's replicas ``written``."""

    flags: Sequence[int]
    received: Sequence[bool]
    sparse: Collection[int] = ()
    written: Sequence[int] = ()


class _Layout:
    """The live central variables in registration order (the same order on every worker),
    and a signature of their shapes, dtypes, trainability and aggregations that the
    workers compare. The signature is reused while the variables and their ``requires_grad``
    stay the same (computing it costs about 1.5 us per variable); the tensors are looked up
    afresh at every sync point, so that no dropped model is kept alive."""

    __slots__ = ("records", "signature", "tensors", "trainable", "trainable_flags")

    def __init__(
        self, store: VariableStore, previous: _Layout | None, bucket_bytes: int
    ) -> None:
        records = list(store.records.values())
        tensors = list(map(call, map(_ref, records)))  # passes in C: one per sync point
        if any(map(is_, tensors, repeat(None))):  # dying right now: leave them out
            records = [r for r, t in zip(records, tensors, strict=True) if t is not None]
            tensors = [t for t in tensors if t is not None]
        self.records: list[Central] = records
        self.tensors: list[torch.Tensor] = tensors
        self.trainable_flags = list(map(requires_grad_of, tensors))
        self.trainable = list(compress(tensors, self.trainable_flags))
        self.signature: int
        if (
            previous is not None
            and records == previous.records  # identity comparison, at C speed
            and self.trainable_flags == previous.trainable_flags
        ):
            self.signature = previous.signature
        else:
            self.signature = signature([bucket_bytes] + [  # the buckets must match too
                (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad,
                 r.aggregation.value)
                for r, t in zip(records, self.tensors, strict=True)
            ])

    def forget_tensors(self) -> None:
        """Keep only what the next sync point reuses (no strong reference to a variable)."""
        self.tensors, self.trainable = [], []


def _add_back(trainable: list[torch.Tensor], stash: list[Any], added: list[Any]) -> None:
    """``.grad``: the set-aside gradients plus ``added`` (this worker's fresh ones when the
    sync point is undone, the exchanged sums when it succeeds; None where there is none), in
    place where a set-aside one exists."""
    sums = list(stash)
    add_in_order(sums, added)
    set_grads(trainable, sums)


@final
class ProcessGroup(Collectives):
    """The workers of one ``torch.distributed`` process group, whose sync points exchange
    what each worker's replicas added.

    ``_plan``: the buckets of the layout the workers last agreed on (None before the first
    sync point, or without a process group for gradients); ``_early``: the run in progress
    whose buckets may start while its backward runs, until its next sync point.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout: _Layout | None = None  # the previous sync point's, for its signature
        self._plan: BucketPlan | None = None
        self._early: EarlyExchange | None = None
        # GPU replicas of variables in host memory: what copies each gradient there, and the
        # thread that sums and starts their buckets (``copy_gradients``)
        self._copies: tuple[CopyGradient, Executor] | None = None
        self.carried: CarriedWrites | None = None
        # the trainable variables whose numbers of sparse entries every agreement carries:
        # those the plan leaves out, summed sparse before
        self.sparse_order: tuple[int, ...] = ()
        self.watches_gradients = self.gradient_group is not None

    def begin_run(self, store: VariableStore) -> None:
        super().begin_run(store)
        self._arm(store)

    def _arm(self, store: VariableStore) -> None:
        """The run in progress may start the agreed plan's buckets during its backward
        (decided alike on every worker: from the last agreement, at the same call)."""
        plan = self._plan
        if self._early is None and plan is not None and plan.usable and plan.buckets:
            early = self._early = EarlyExchange(
                plan, store.replicas,
                lambda flat: self.start_gradient_all_reduce("gradient all-reduce", flat),
                self.device, self._copies,
            )
            # the views' hooks call the run's exchange itself: a method in between would
            # cost a Python call per gradient, inside backward
            self.on_gradient = (  # type: ignore[method-assign]
                early.gradient_accumulated if self._copies is None else early.copy_accumulated
            )

    def on_gradient(self, buckets: GradientBuckets, view: View, tensor: torch.Tensor) -> None:
        """No run may start buckets early now (``_arm`` binds the run's exchange instead;
        ``copy_gradients`` the store's copy)."""

    def copy_gradients(self, copy: CopyGradient) -> None:
        """The views' gradients are on GPUs and the variables in host memory: ``copy`` (the
        store's) starts each one's copy there as it accumulates, before the run's exchange
        counts it; a helper thread sums and starts the buckets whose copies have finished."""
        helper = ThreadPoolExecutor(1, thread_name_prefix="centralstore-buckets")
        self._copies = (copy, helper)
        self.on_gradient = copy  # type: ignore[method-assign, assignment]

    def _disarm(self) -> EarlyExchange | None:
        """The run's early exchange, taken off, every bucket it handed to the helper thread
        started: a gradient arriving now waits for a sync point."""
        early, self._early = self._early, None
        if self._copies is None:
            self.__dict__.pop("on_gradient", None)
        else:
            self.on_gradient = self._copies[0]  # type: ignore[method-assign, assignment]
        if early is not None:
            early.settle()
        return early

    def sync(self, store: VariableStore, error: BaseException | None) -> None:
        self._sync(store, error, Kind.SYNC)

    def sync_step(self, store: VariableStore) -> None:
        """An optimizer step's sync point. The only gradients it can find are those of a
        backward after ``run`` (``store.pending``), and such a backward happens on every
        worker or on none (it goes through a loss reduced over every worker, whose value is
        the same everywhere). So a worker with none pending folds locally and exchanges
        nothing, not even an agreement: a training step makes one cross-worker rendezvous,
        at the end of ``run``, as DDP's makes one at the end of backward. A worker with
        gradients pending agrees with the others on an optimizer step of their own; when
        they had none and went on, the kinds of the agreement differ and every worker
        raises (``Collectives.agree``)."""
        if not store.pending:
            store.fold()
            return
        self._sync(store, None, Kind.STEP)

    def _sync(self, store: VariableStore, error: BaseException | None, kind: Kind) -> None:
        layout = _Layout(store, self._layout, self.bucket_bytes)
        self._layout = layout
        early = self._disarm()
        try:
            agreed = sync_across(self, store, layout, early, error, kind)
            self._follow(layout, agreed, early)
            self._carry(layout, agreed.written)
            writes_words = 0 if self.carried is None else self.carried.words
            self.carry_words = writes_words + len(self.sparse_order)
        finally:
            layout.forget_tensors()
        if store.in_run:  # a merge_call's sync point: the rest of the run may start early too
            self._arm(store)

    def _follow(self, layout: _Layout, agreed: Agreed, early: EarlyExchange | None) -> None:
        """After a sync point every worker passed (``agreed`` the same everywhere): the plan
        of the agreed layout, without the variables whose sums stay sparse or that no run
        has given a gradient since the layout, and how its early exchange fared."""
        if self.gradient_group is None or not layout.trainable:
            return
        flags = agreed.flags
        if early is not None and any(f & STARTED for f in flags):
            passes = {f >> PASSES for f in flags}
            early.plan.strike(
                not all(f & VALID for f in flags), passes.pop() if len(passes) == 1 else 0
            )
        plan, received = self._plan, agreed.received
        if plan is not None and not plan.fits(layout.records, layout.trainable_flags):
            plan = None  # another layout's
        # once sparse, out of the buckets for good: a dense read of a table is rare
        sparse = frozenset(agreed.sparse) if plan is None else plan.sparse.union(agreed.sparse)
        # Idle: what the first sync point that received gradients did not (one that received
        # none, an evaluation's, says nothing: every variable stays in). Once given a
        # gradient, a variable is in the buckets for good: a program that alternates, as a
        # GAN's steps do, would otherwise make a new plan at every run.
        idle = None if plan is None else plan.idle
        if idle is None:
            if any(received):
                idle = frozenset(j for j, got in enumerate(received) if not got)
        elif any(map(received.__getitem__, idle)):
            idle = frozenset(j for j in idle if not received[j])
        if plan is not None and sparse == plan.sparse:
            if idle == plan.idle:
                return
            if idle == plan.left_out - sparse:  # learnt, and the same buckets: none idle
                plan.idle = idle
                return
        self._plan = BucketPlan(
            layout.records, layout.trainable_flags, layout.trainable,
            FIRST_BUCKET_BYTES, self.bucket_bytes, sparse, idle,
        )
        if plan is not None:  # the runs' backward passes, as learnt
            self._plan.passes = plan.passes
        self.sparse_order = tuple(sorted(sparse))

    def _carry(self, layout: _Layout, written: Sequence[int]) -> None:
        """After a sync point every worker passed: the variables its agreements carry from
        now on, when it wrote some that the carried ones do not cover (decided alike on
        every worker, so that their rows stay the same size)."""
        carried = self.carried
        if not written or (
            carried is not None and carried.records == layout.records
            and carried.indices.issuperset(written)
        ):
            return
        self.carried = CarriedWrites.of(
            layout.records, layout.tensors, written, self.num_workers
        )

    def gradient_after_run(self, store: VariableStore, view: View) -> None:
        store.pending.append(view)  # exchanged at the next sync point, by every worker


def sync_across(
    workers: ProcessGroup,
    store: VariableStore,
    layout: _Layout,
    early: EarlyExchange | None,
    run_error: BaseException | None,
    kind: Kind = Kind.SYNC,
) -> Agreed:
    """The sync point of ``store`` (its variables: ``layout``) across ``workers``
    (``early``: the run's buckets that may have left already; ``run_error``: this worker's
    ``run`` failed; the workers still agree, then every worker discards the run and raises;
    ``kind``: the agreement's, ``Kind.STEP`` for an optimizer step's). Returns every
    worker's agreement flags, which gradients were summed sparse, and which variables some
    worker's replicas wrote."""
    writes, starts = ({}, {}) if run_error is not None else local_writes(store, layout.records)
    before = ValuesBefore(layout.tensors, writes, starts) if writes else {}
    trainable = layout.trainable
    stash = list(map(grad_of, trainable))
    if some(stash):
        set_grads(trainable, repeat(None))
    valid = early is None or (not (early.early and store.pending) and early.check_sources())
    try:
        store.fold(discard=run_error is not None, hooks=False)  # hooks: once exchanged
    except BaseException:
        _add_back(trainable, stash, list(map(grad_of, trainable)))
        raise
    fresh = list(map(grad_of, trainable))
    have = sum(map(is_not, fresh, repeat(None)))
    state = NONE if not have else ALL if have == len(fresh) else 1
    present = compress(fresh, map(is_not, fresh, repeat(None)))
    flags = SPARSE if have and any(map(_is_sparse, present)) else 0
    carried = workers.carried
    payload = None
    if carried is not None and run_error is None:
        payload = carried.payload(layout.records, layout.tensors)
    if payload is not None:
        flags |= CARRIED
        if carried is not None and carried.indices.issuperset(writes):
            flags |= WIDE  # carried, no bound needed; summed after all, in their own dtypes
    if writes and not flags & WIDE and wide(layout.tensors, writes, before, workers.num_workers):
        flags |= WIDE
    order = workers.sparse_order
    entries = None
    if flags & SPARSE and order:
        entries = torch.tensor(
            [_entries(fresh, j) for j in order], dtype=torch.int64, device=HOST
        )
    words = _carried_words(workers, payload, entries)
    fits = early is not None and early.plan.fits(layout.records, layout.trainable_flags)
    # this worker's per-variable flags, where they are not implied by ``state`` alone
    mine = (
        _flag_row(fresh, writes, len(layout.records))
        if writes or state == 1 or flags & SPARSE else None
    )
    try:
        if early is not None:
            valid = valid and fits and early.check_fold(fresh)
            if early.error is not None:
                raise early.error
            if early.started or (have and run_error is None):
                early.start_rest(fresh if fits else None)  # travels during the agreement
            flags |= ARMED | (VALID if valid else 0) | (STARTED if early.started else 0)
            flags |= min(early.passes, 2**20) << PASSES
        table = workers.agree(
            kind, layout.signature, state, len(writes), flags,
            0 if mine is None else signature(mine) | 1,  # odd: never the 0 of no flags
            failed=run_error is not None, carried=words,
        )
        _, failures, signatures, states, counts, all_flags, digests = zip(
            *table[:, :AGREEMENT_FIELDS].tolist()
        )
        if len(set(signatures)) > 1:
            workers.mark_broken("the workers' central variables differ")
            raise RuntimeError(
                "The workers' central variables differ (number, shapes, dtypes, "
                "requires_grad or aggregation), so their gradients cannot be exchanged. "
                "Build the same model on every worker, inside strategy.scope(), in the same "
                "order."
            )
        if len({f & ARMED for f in all_flags}) > 1:  # cannot happen while workers are in step
            workers.mark_broken("the workers disagree on the early gradient exchange")
            raise RuntimeError(
                "The workers disagree on whether this sync point's gradients left early "
                f"(agreement flags {all_flags}): they are out of step. Every worker must "
                "make the same strategy calls in the same order."
            )
        started = early is not None and any(f & STARTED for f in all_flags)
        if early is not None and started and not early.all_started:
            early.start_rest(fresh if fits else None)  # this worker had nothing: zeros
    except BaseException:
        _add_back(trainable, stash, fresh)
        raise
    if any(failures):  # the run failed somewhere: discarded on every worker
        _add_back(trainable, stash, [None] * len(trainable))
        with no_grad():
            for i, value in before.items():
                layout.tensors[i].copy_(value)
        if early is not None and started:
            early.wait()  # every bucket is done before the next collective
        workers.raise_failures(table, "strategy.run", run_error)
    if not any(counts) and all(s == NONE for s in states):
        if early is not None and started:
            early.wait()
        _add_back(trainable, stash, fresh)
        return Agreed(all_flags, [False] * len(trainable))
    sparse = any(f & SPARSE for f in all_flags)
    if not any(counts) and all(s == ALL for s in states) and not sparse:
        has_grad, writers, assigned, kept = [True] * len(trainable), None, None, None
    else:
        # every worker's flags are the same, and so are the gradients they fold sparse,
        # whose numbers of entries the agreement carried (when it carries them all)
        alike = mine is not None and len(set(digests)) == 1 and (
            not sparse or all(
                j in order for j, g in enumerate(fresh) if g is not None and g.is_sparse
            )
        )
        every_entries = None
        if alike and sparse:  # the last words of the rows
            carried_entries = table[:, table.shape[1] - len(order) :].int()
            every_entries = torch.zeros(
                workers.num_workers, len(fresh), dtype=torch.int32, device=HOST
            )
            for k, j in enumerate(order):
                if j < len(fresh):
                    every_entries[:, j] = carried_entries[:, k]
        has_grad, writers, assigned, kept = _flags(
            workers, layout, fresh, writes, sparse, mine if alike else None, every_entries
        )
    dense = has_grad if kept is None else [h and j not in kept for j, h in enumerate(has_grad)]
    if early is not None and started and all(f & VALID for f in all_flags):
        exchanged = early.exchanged(dense)
        left_out = early.plan.left_out
        if left_out and any(dense[j] for j in left_out):  # in buckets of their own
            outside = [j in left_out and d for j, d in enumerate(dense)]
            for j, total in enumerate(_exchange_gradients(workers, trainable, fresh, outside)):
                if outside[j]:
                    exchanged[j] = total
    else:
        if early is not None and started:
            early.wait()  # left early but not what the fold produced somewhere: again
        exchanged = _exchange_gradients(workers, trainable, fresh, dense)
    if kept:
        for j, total in _exchange_sparse(workers, trainable, fresh, kept).items():
            exchanged[j] = total
    _add_back(trainable, stash, exchanged)
    written: list[int] = []
    if writers is not None and assigned is not None:
        written = writers.any(dim=0).nonzero().flatten().tolist()
    if written and writers is not None and assigned is not None:
        if (
            carried is not None and all(f & CARRIED for f in all_flags)
            and carried.indices.issuperset(written)
        ):
            carried.combine(
                table[:, CARRIED_AT:], layout.tensors, layout.records, before,
                writers, assigned,
            )
        else:
            widen = not any(f & WIDE for f in all_flags)
            exchange_writes(
                workers, layout.tensors, layout.records, before, writers, assigned, widen
            )
    # The post-accumulate-grad hooks see the sum over the workers, and fire on every worker
    # for the same variables: an optimizer step in one keeps the workers' copies equal.
    run_post_accumulate_hooks(list(compress(trainable, has_grad)))
    return Agreed(all_flags, has_grad, kept or (), written)


def _kind(grad: torch.Tensor | None) -> int:
    """A gradient's kind in the flags: 0 none, 1 dense, 1 + its sparse dimensions if sparse."""
    if grad is None:
        return 0
    return 1 + grad.sparse_dim() if grad.is_sparse else 1


def _flag_row(fresh: list[Any], writes: dict[int, tuple[int, bool]], n: int) -> list[int]:
    """This worker's per-variable flags: each trainable variable's gradient kind, then for
    each of the ``n`` variables how many replicas wrote it, then whether any assigned."""
    m = len(fresh)
    row = [*map(_kind, fresh), *repeat(0, 2 * n)]
    for i, (count, assigned) in writes.items():
        row[m + i] = count
        row[m + n + i] = int(assigned)
    return row


def _entries(fresh: Sequence[Any], j: int) -> int:
    """How many entries the sparse gradient ``fresh[j]`` holds (0: none, or dense)."""
    grad = fresh[j] if j < len(fresh) else None
    return grad._nnz() if grad is not None and grad.is_sparse else 0


def _carried_words(
    workers: ProcessGroup, payload: torch.Tensor | None, entries: torch.Tensor | None
) -> torch.Tensor | None:
    """What this worker's agreement row carries after its fields: the carried writes'
    values, then the numbers of entries of the sparse gradients (``sparse_order``), each
    part zeros when this worker has none to send; None when it sends neither."""
    if payload is None and entries is None:
        return None
    writes_words = 0 if workers.carried is None else workers.carried.words
    return torch.cat([
        torch.zeros(writes_words, dtype=torch.int64, device=HOST) if payload is None else payload,
        torch.zeros(len(workers.sparse_order), dtype=torch.int64, device=HOST)
        if entries is None else entries,
    ])


def _flags(
    workers: Collectives, layout: _Layout, fresh: list[Any], writes: dict[int, tuple[int, bool]],
    sparse: bool = False, alike: list[int] | None = None, entries: torch.Tensor | None = None,
) -> tuple[list[bool], torch.Tensor, torch.Tensor, dict[int, tuple[int, list[int]]] | None]:
    """Every worker's per-variable flags: which trainable variables got a gradient, and how
    many replicas wrote each variable (and whether any assigned). With ``sparse`` (some
    worker folded a sparse gradient) also the trainable variables whose gradient stays
    sparse, each with its sparse dimensions and every worker's number of entries: those
    whose gradient is sparse, of the same sparse dimensions, on every worker that has one.
    (A gradient dense on some worker makes the sum dense, as a dense gradient added to a
    sparse one does.) ``alike``: this worker's flags (``_flag_row``), when the agreement
    showed every worker's to be the same: then nothing travels; with ``sparse``, every
    worker's numbers of entries came with the agreement (``entries``: [workers, trainable])."""
    n, m = len(layout.records), len(fresh)
    if alike is not None:
        table = torch.tensor(alike, dtype=torch.int32, device=HOST)
        table = table.expand(workers.num_workers, -1)
        if entries is not None:
            table = torch.cat([table, entries], dim=1)
    else:
        row = _flag_row(fresh, writes, n)
        if sparse:
            row += [_entries(fresh, j) for j in range(m)]
        flat = torch.tensor(row, dtype=torch.int32, device=workers.device)
        table = workers.all_gather("sync point's flags", flat).cpu()
    kinds = table[:, :m]
    has_grad = kinds.any(dim=0).tolist()
    kept = None
    if sparse:
        entries = table[:, m + 2 * n :]
        kept = {}
        for j in kinds.max(dim=0).values.ge(2).nonzero().flatten().tolist():
            present = kinds[:, j][kinds[:, j] != 0]
            if bool((present == present[0]).all()):
                kept[j] = (int(present[0]) - 1, entries[:, j].tolist())
    return has_grad, table[:, m : m + n], table[:, m + n : m + 2 * n], kept


def _exchange_gradients(
    workers: Collectives,
    trainable: list[torch.Tensor],
    fresh: list[Any],
    has_grad: list[bool],
) -> list[torch.Tensor | None]:
    """SUM all-reduce of the fresh gradients in flat buckets (the plan's order and sizes,
    over the variables ``has_grad`` names); per trainable variable, its sum (None where
    there is none)."""
    buckets = bucket_indices(
        trainable, has_grad, min(FIRST_BUCKET_BYTES, workers.bucket_bytes), workers.bucket_bytes
    )
    started = []
    for bucket in buckets:  # pack the next bucket while the previous one travels
        flat = torch.cat([
            flat_gradient(fresh[i], trainable[i].numel(), trainable[i].dtype, trainable[i].device)
            for i in bucket
        ]).to(workers.device)
        started.append(
            (bucket, flat, workers.start_gradient_all_reduce("gradient all-reduce", flat))
        )
    exchanged: list[torch.Tensor | None] = [None] * len(trainable)
    for bucket, flat, wait in started:
        wait()
        home = trainable[bucket[0]].device
        pieces = torch.split(flat.to(home), [trainable[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces, strict=True):
            exchanged[i] = piece.view(trainable[i].shape)  # a view of the bucket: no copy
    return exchanged


def _exchange_sparse(
    workers: Collectives,
    trainable: list[torch.Tensor],
    fresh: list[Any],
    kept: dict[int, tuple[int, list[int]]],
) -> dict[int, torch.Tensor]:
    """The sums of the gradients that stay sparse (``kept``: variable -> its sparse
    dimensions and every worker's number of entries), as one process would make them: every
    worker's entries, in worker order, in one uncoalesced sparse tensor, as the gradients of
    the slices of one batch add up on one device. Each worker's indices and values, padded
    to the most entries any worker has, travel as bytes in one all-gather: one collective
    for every table, where the indices and each dtype's values took one each."""
    pieces: list[torch.Tensor] = []
    for j, (dims, counts) in kept.items():
        variable, grad, longest = trainable[j], fresh[j], max(counts)
        mine_indices = torch.zeros(dims, longest, dtype=torch.int64, device=HOST)
        mine_values = torch.zeros(
            longest, *variable.shape[dims:], dtype=variable.dtype, device=HOST
        )
        if grad is not None:
            mine_indices[:, : grad._nnz()] = grad._indices()
            mine_values[: grad._nnz()] = grad._values()
        pieces += [as_bytes(mine_indices), as_bytes(mine_values)]
    every = workers.all_gather("sparse gradients", torch.cat(pieces).to(workers.device))
    sums: dict[int, torch.Tensor] = {}
    offset = 0
    for j, (dims, counts) in kept.items():
        variable, longest = trainable[j], max(counts)
        index_bytes = 8 * dims * longest
        value_bytes = longest * math.prod(variable.shape[dims:]) * variable.element_size()
        rows = every[:, offset : offset + index_bytes].view(torch.int64)
        offset += padded(index_bytes)
        entries = every[:, offset : offset + value_bytes].view(variable.dtype)
        offset += padded(value_bytes)
        rows = rows.reshape(len(counts), dims, longest)
        entries = entries.reshape(len(counts), longest, *variable.shape[dims:])
        sums[j] = torch.sparse_coo_tensor(
            torch.cat([rows[w, :, :n] for w, n in enumerate(counts)], dim=1).to(variable.device),
            torch.cat([entries[w, :n] for w, n in enumerate(counts)]).to(variable.device),
            variable.shape,
            check_invariants=False,  # every worker's entries were a valid sparse tensor's
        )
    return sums
