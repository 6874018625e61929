"""The sync point across workers: what this sync point added, exchanged with the others.

At every sync point (the end of ``run``, ``merge_call``, ``optimizer.step()``) each worker

1. notes the writes its replicas made to central variables (how many replicas wrote each
   one, and whether any assigned) and the values before them;
2. sets the existing ``.grad`` aside and folds its replicas' gradients into fresh ones
   (the local sync point), so that accumulation over several ``run`` calls exchanges only
   what is new;
3. agrees with the other workers on the layout and on what there is to exchange (one small
   all-gather; a second, of per-variable flags, only when some worker lacks a gradient or
   wrote a variable);
4. all-reduces (SUM) the fresh gradients in flat buckets, in registration order, with zeros
   where a worker has none: the traffic is one gradient per worker whatever its number of
   replicas (hierarchical reduction);
5. adds the set-aside ``.grad`` back, and combines the writes by each variable's aggregation
   over the writers of every worker, as one process with all the replicas would.

When the run failed on any worker, every worker puts back its set-aside ``.grad`` and the
values its replicas' writes replaced, and raises: the run is discarded everywhere.

Gradients that arrive outside ``run`` (a backward on a reduced loss) wait in
``store.pending`` until the next sync point, usually ``optimizer.step()``, and are exchanged
there. Every worker reaches the same collectives in the same order, even one whose replicas
produced nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import torch

from .._aggregation import VariableAggregation
from ..variables.folding import add_in_order
from ._cross_worker import Collectives, Kind, signature

if TYPE_CHECKING:
    from ..variables.records import Central
    from ..variables.store import VariableStore
    from ..variables.views import View

NONE, ALL = 0, 2  # how many trainable variables got a gradient on a worker: none, some, all


class _Layout:
    """The live central variables in registration order (the same order on every worker),
    and a signature of their shapes, dtypes, trainability and aggregations that the
    workers compare. The signature is reused while the variables and their ``requires_grad``
    stay the same (computing it costs about 1.5 us per variable); the tensors are looked up
    afresh at every sync point, so that no dropped model is kept alive."""

    __slots__ = ("records", "signature", "tensors", "trainable", "trainable_flags")

    def __init__(self, store: VariableStore, previous: _Layout | None) -> None:
        records = list(store.records.values())
        tensors = [r.ref() for r in records]
        if any(t is None for t in tensors):  # dying right now: leave them out
            records = [r for r, t in zip(records, tensors, strict=True) if t is not None]
        self.records: list[Central] = records
        self.tensors: list[torch.Tensor] = [t for t in tensors if t is not None]
        self.trainable_flags = [t.requires_grad for t in self.tensors]
        self.trainable = [t for t, flag in zip(self.tensors, self.trainable_flags) if flag]
        self.signature: int
        if (
            previous is not None
            and records == previous.records  # identity comparison, at C speed
            and self.trainable_flags == previous.trainable_flags
        ):
            self.signature = previous.signature
        else:
            self.signature = signature([
                (tuple(t.shape), str(t.dtype), t.requires_grad, r.aggregation.value)
                for r, t in zip(records, self.tensors, strict=True)
            ])

    def forget_tensors(self) -> None:
        """Keep only what the next sync point reuses (no strong reference to a variable)."""
        self.tensors, self.trainable = [], []


def _local_writes(store: VariableStore, layout: _Layout) -> dict[int, tuple[int, bool]]:
    """Variable index -> (replicas of this worker that wrote it, whether any assigned)."""
    writes: dict[int, tuple[int, bool]] = {}
    index: dict[int, int] | None = None
    for views in store.replicas:
        for view in views.touched:
            if not view.written() or view.record.aggregation is VariableAggregation.NONE:
                continue  # a NONE write has already raised in its replica
            if index is None:
                index = {r.key: i for i, r in enumerate(layout.records)}
            i = index.get(view.record.key)
            if i is not None:
                count, assigned = writes.get(i, (0, False))
                writes[i] = (count + 1, assigned or view.assigned)
    return writes


def _restore(trainable: list[torch.Tensor], stash: list[Any], fresh: list[Any]) -> None:
    """Put back the set-aside gradients, plus this worker's fresh ones, unexchanged."""
    sums = list(stash)
    add_in_order(sums, fresh)
    for tensor, total in zip(trainable, sums, strict=True):
        tensor.grad = total


@final
class ProcessGroup(Collectives):
    """The workers of one ``torch.distributed`` process group, whose sync points exchange
    what each worker's replicas added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout: _Layout | None = None  # the previous sync point's, for its signature

    def sync(self, store: VariableStore, error: BaseException | None) -> None:
        layout = _Layout(store, self._layout)
        self._layout = layout
        try:
            sync_across(self, store, layout, error)
        finally:
            layout.forget_tensors()

    def gradient_after_run(self, store: VariableStore, view: View) -> None:
        store.pending.append(view)  # exchanged at the next sync point, by every worker


def sync_across(
    workers: Collectives,
    store: VariableStore,
    layout: _Layout,
    run_error: BaseException | None,
) -> None:
    """The sync point of ``store`` (its variables: ``layout``) across ``workers``
    (``run_error``: this worker's ``run`` failed; the workers still agree, then every
    worker discards the run and raises)."""
    writes = {} if run_error is not None else _local_writes(store, layout)
    before = {i: layout.tensors[i].detach().clone() for i in writes}
    trainable = layout.trainable
    stash = [t.grad for t in trainable]
    for t in trainable:
        t.grad = None
    try:
        store.fold(discard=run_error is not None)
    except BaseException:
        _restore(trainable, stash, [t.grad for t in trainable])
        raise
    fresh = [t.grad for t in trainable]
    have = sum(g is not None for g in fresh)
    state = NONE if not have else ALL if have == len(fresh) else 1
    try:
        table = workers.agree(
            Kind.SYNC, layout.signature, state, len(writes), failed=run_error is not None
        )
        if len(set(table[:, 2].tolist())) > 1:
            workers.mark_broken("the workers' central variables differ")
            raise RuntimeError(
                "The workers' central variables differ (number, shapes, dtypes, "
                "requires_grad or aggregation), so their gradients cannot be exchanged. "
                "Build the same model on every worker, inside strategy.scope(), in the same "
                "order."
            )
    except BaseException:
        _restore(trainable, stash, fresh)
        raise
    if table[:, 1].any():  # the run failed somewhere: discarded on every worker
        _restore(trainable, stash, [None] * len(trainable))
        with torch.no_grad():
            for i, value in before.items():
                layout.tensors[i].copy_(value)
        workers.raise_failures(table, "strategy.run", run_error)
    states, counts = table[:, 3].tolist(), table[:, 4].tolist()
    if not any(counts) and all(s == NONE for s in states):
        _restore(trainable, stash, fresh)
    else:
        if not any(counts) and all(s == ALL for s in states):
            has_grad, writers, assigned = [True] * len(trainable), None, None
        else:
            has_grad, writers, assigned = _flags(workers, layout, fresh, writes)
        _exchange_gradients(workers, trainable, stash, fresh, has_grad)
        if writers is not None and assigned is not None and writers.any():
            _exchange_writes(workers, layout, before, writers, assigned)


def _flags(
    workers: Collectives, layout: _Layout, fresh: list[Any], writes: dict[int, tuple[int, bool]]
) -> tuple[list[bool], torch.Tensor, torch.Tensor]:
    """Every worker's per-variable flags: which trainable variables got a gradient, and how
    many replicas wrote each variable (and whether any assigned)."""
    n = len(layout.records)
    row = torch.zeros(len(fresh) + 2 * n, dtype=torch.int32)
    row[: len(fresh)] = torch.tensor([g is not None for g in fresh], dtype=torch.int32)
    for i, (count, assigned) in writes.items():
        row[len(fresh) + i] = count
        row[len(fresh) + n + i] = int(assigned)
    table = workers.all_gather("sync point's flags", row.to(workers.device)).cpu()
    has_grad = table[:, : len(fresh)].any(dim=0).tolist()
    return has_grad, table[:, len(fresh) : len(fresh) + n], table[:, len(fresh) + n :]


def _flat(grad: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    if grad is None:
        return torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)


def _exchange_gradients(
    workers: Collectives,
    trainable: list[torch.Tensor],
    stash: list[Any],
    fresh: list[Any],
    has_grad: list[bool],
) -> None:
    """SUM all-reduce of the fresh gradients in flat buckets, then the stash added back."""
    buckets: list[list[int]] = []
    key: tuple[torch.dtype, torch.device] | None = None
    size = 0
    for i, tensor in enumerate(trainable):
        if not has_grad[i]:
            tensor.grad = stash[i]
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or key != (tensor.dtype, tensor.device) or (
            size + nbytes > workers.bucket_bytes and size
        ):
            buckets.append([])
            key, size = (tensor.dtype, tensor.device), 0
        buckets[-1].append(i)
        size += nbytes
    started = []
    for bucket in buckets:  # pack the next bucket while the previous one travels
        flat = torch.cat([_flat(fresh[i], trainable[i]) for i in bucket]).to(workers.device)
        started.append((bucket, flat, workers.start_all_reduce("gradient all-reduce", flat)))
    exchanged: list[torch.Tensor | None] = [None] * len(trainable)
    for bucket, flat, wait in started:
        wait()
        home = trainable[bucket[0]].device
        pieces = torch.split(flat.to(home), [trainable[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces, strict=True):
            exchanged[i] = piece.view(trainable[i].shape)  # a view of the bucket: no copy
    sums = list(stash)
    add_in_order(sums, exchanged)
    for i in {i for bucket in buckets for i in bucket}:
        trainable[i].grad = sums[i]


def _exchange_writes(
    workers: Collectives,
    layout: _Layout,
    before: dict[int, torch.Tensor],
    writers: torch.Tensor,
    assigned: torch.Tensor,
) -> None:
    """Combine the writes of every worker's replicas by aggregation (docs/design.md §3.6).

    Each worker has already combined its own writers into ``c_w`` from the common value
    ``c0``; with ``n_w`` writers there, MEAN is ``sum(n_w c_w) / sum(n_w)``, SUM is
    ``c0 + sum(c_w - c0)`` (or, when some replica assigned, the sum of every writer's final
    value), and ONLY_FIRST_REPLICA takes ``c_w`` of the first worker that wrote.
    """
    rank = workers.worker_index
    plan, contributions = [], []
    for i in writers.sum(dim=0).nonzero().flatten().tolist():
        record, tensor = layout.records[i], layout.tensors[i].detach()
        counts = writers[:, i].tolist()
        mine, start = counts[rank], before.get(i, tensor)
        aggregation = record.aggregation
        any_assigned = bool(assigned[:, i].any())
        if aggregation is VariableAggregation.MEAN:
            contribution = tensor * mine
        elif aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            first = next(r for r, n in enumerate(counts) if n)
            contribution = tensor.clone() if rank == first else torch.zeros_like(tensor)
        elif any_assigned:  # SUM of final values: a worker that only added holds c0 + deltas
            own = tensor if assigned[rank, i] else start * mine + (tensor - start)
            contribution = own if mine else torch.zeros_like(tensor)
        else:  # SUM of deltas
            contribution = tensor - start
        plan.append((tensor, aggregation, sum(counts), any_assigned, start))
        contributions.append(contribution)
    totals = workers.sum_across("exchange of variable writes", contributions)
    with torch.no_grad():
        for (tensor, aggregation, total_writers, any_assigned, start), total in zip(
            plan, totals, strict=True
        ):
            if aggregation is VariableAggregation.MEAN:
                value = total / total_writers
            elif aggregation is VariableAggregation.SUM and not any_assigned:
                value = start + total
            else:
                value = total
            tensor.copy_(value)
