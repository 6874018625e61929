"""The writes a sync point combines across workers: what the replicas assigned or added to
central variables (batch norm's running statistics, counters, EMA buffers).

Each worker first combines its own replicas' writes into its value (the local fold). The
workers' values then combine by each variable's aggregation as one process of all the
replicas would (``_aggregation.write_term`` and ``written_value``, docs/design.md §3.6),
in one of two ways:

- **Carried in the agreement** (``CarriedWrites``): the variables written at the last sync
  point that wrote any, when they are few (``CARRY_BYTES``), travel as every worker's value
  in the agreement row itself, so that a run of batch norm makes no collective for its
  writes. Every worker combines every worker's values in worker order, the same arithmetic
  on the same bytes: the same result everywhere.
- **Summed** (``exchange_writes``): each worker's term of each written variable, summed by
  one all-reduce (one per dtype when integers may pass float64's exact range, ``wide``).
  Used when the written variables are not the carried ones (the first writing sync point,
  a new variable written) or too large to carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import torch

from .._aggregation import (
    VariableAggregation,
    by_value,
    sum_in_order,
    write_term,
    written_value,
)
from .._autograd import no_grad
from ._flat import as_bytes, is_integer, is_real, pack, padded, unflatten, unpack

if TYPE_CHECKING:
    from ..variables.records import Central
    from ..variables.store import VariableStore
    from ._cross_worker import Collectives

# The most bytes of values one worker carries in every agreement, and all of them together:
# past these a sum of the terms (one all-reduce) moves less than a gather of the values.
CARRY_BYTES = 64 * 2**10
CARRY_TOTAL_BYTES = 2**20

_private_of = attrgetter("private")


def local_writes(
    store: VariableStore, records: Sequence[Central]
) -> tuple[dict[int, tuple[int, bool]], dict[int, torch.Tensor]]:
    """Index in ``records`` of each variable this worker's replicas wrote -> (how many
    wrote it, whether any assigned); and, for the buffers they wrote in place (shared by
    replicas computing where the variables live, ``direct_buffers.py``), whose local fold
    this makes first, their values from before the run."""
    writes: dict[int, tuple[int, bool]] = {}
    starts: dict[int, torch.Tensor] = {}
    index: dict[int, int] | None = None
    in_place = store.run.commit_buffers()
    if in_place:
        index = {r.key: i for i, r in enumerate(records)}
        for key, (count, assigned, before) in in_place.items():
            i = index.get(key)
            if i is not None:
                writes[i] = (count, assigned)
                starts[i] = before
    for views in store.replicas:
        if not any(map(_private_of, views.touched)):  # only a private copy can be written
            continue
        for view in views.touched:
            if not view.written() or view.record.aggregation is VariableAggregation.NONE:
                continue  # a NONE write has already raised in its replica
            if index is None:
                index = {r.key: i for i, r in enumerate(records)}
            i = index.get(view.record.key)
            if i is not None:
                count, assigned = writes.get(i, (0, False))
                writes[i] = (count + 1, assigned or view.assigned)
    return writes, starts


class ValuesBefore(Mapping[int, torch.Tensor]):
    """The values of the variables ``indices`` of ``tensors`` before a sync point's fold
    writes them (``starts``: those of the variables written already, in place): what a
    failed run puts back and what a SUM's terms start from. Copied in one kernel per dtype
    and device (``pack``), where a clone each took 106 us for a batch-norm network's sixty
    buffers in a warm loop; a group's values are cut into tensors of each variable's shape
    (one C call) only when one of them is read. A step whose writes are final values
    carried in the agreement (batch norm's statistics and counts: MEAN,
    ONLY_FIRST_REPLICA) reads none unless the run failed."""

    __slots__ = ("_flats", "_group_of", "_members", "_pieces", "_tensors")

    def __init__(
        self, tensors: Sequence[torch.Tensor], indices: Iterable[int],
        starts: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in indices:
            tensor = tensors[i]
            groups.setdefault((tensor.dtype, tensor.device), []).append(i)
        self._tensors = tensors
        self._members = list(groups.values())
        values = tensors if not starts else [starts.get(i, t) for i, t in enumerate(tensors)]
        with no_grad():
            self._flats = [pack([values[i] for i in members]) for members in self._members]
        self._group_of = {i: g for g, members in enumerate(self._members) for i in members}
        self._pieces: dict[int, torch.Tensor] = {}

    def __getitem__(self, index: int) -> torch.Tensor:
        piece = self._pieces.get(index)
        if piece is None:
            g = self._group_of[index]  # KeyError for a variable not copied
            members = self._members[g]
            like = [self._tensors[i] for i in members]
            self._pieces.update(zip(members, unflatten(self._flats[g], like), strict=True))
            piece = self._pieces[index]
        return piece

    def __iter__(self) -> Iterator[int]:
        return iter(self._group_of)

    def __len__(self) -> int:
        return len(self._group_of)


def wide(
    tensors: Sequence[torch.Tensor], writes: dict[int, tuple[int, bool]],
    before: Mapping[int, torch.Tensor], workers: int,
) -> bool:
    """Whether a write term of this worker's integer variables, summed over ``workers``
    such, may pass 2**53, where float64 stops holding every integer. A term
    (``write_term``) is the value, its change from ``before``, the value plus ``before``
    times the other writers, or the value times the writers: at most (|value| + |before|)
    times the writers."""
    ints = [i for i in writes if is_integer(tensors[i].dtype)]
    if not ints:
        return False
    values = torch.cat([tensors[i].detach().reshape(-1) for i in ints]).double()
    starts = torch.cat([before[i].reshape(-1) for i in ints]).double()
    most = max(writes[i][0] for i in ints)
    bound = (float(values.abs().max()) + float(starts.abs().max())) * most
    return bound * workers >= 2.0**53


def _term_of(
    aggregation: VariableAggregation, counts: Sequence[int], assignments: Sequence[int],
    worker: int,
) -> tuple[int, bool, bool] | None:
    """Worker ``worker``'s group among every worker's writers of a variable (``counts``,
    ``assignments``): its writers, whether one assigned, whether any writer did; None when
    it adds no term (no writer, or not the first writing worker under ONLY_FIRST_REPLICA)."""
    mine = counts[worker]
    if not mine or (
        aggregation is VariableAggregation.ONLY_FIRST_REPLICA
        and worker != next(w for w, n in enumerate(counts) if n)
    ):
        return None
    return mine, bool(assignments[worker]), any(assignments)


def _writers_everywhere(aggregation: VariableAggregation, counts: Sequence[int]) -> int:
    return 1 if aggregation is VariableAggregation.ONLY_FIRST_REPLICA else sum(counts)


def exchange_writes(
    workers: Collectives,
    tensors: Sequence[torch.Tensor],
    records: Sequence[Central],
    before: Mapping[int, torch.Tensor],
    writers: torch.Tensor,
    assigned: torch.Tensor,
    widen: bool = False,
) -> None:
    """Combine the writes of every worker's replicas by aggregation, each worker one group
    of ``write_term``: its writers already combined into its value, from the common value
    before the run; the terms are summed across workers, with ``widen`` (no worker's integer
    terms can pass float64's exact range, ``wide``) in one float64 all-reduce, else one per
    dtype."""
    rank = workers.worker_index
    plan, terms = [], []
    written = writers.sum(dim=0).nonzero().flatten().tolist()
    # per written variable, every worker's writers and assignment flags, as Python lists
    every_count = writers[:, written].t().tolist()
    every_assigned = assigned[:, written].t().tolist()
    for i, counts, assignments in zip(written, every_count, every_assigned, strict=True):
        tensor, aggregation = tensors[i].detach(), records[i].aggregation
        start = None if by_value(aggregation) else before.get(i, tensor)  # as in ``combine``
        group = _term_of(aggregation, counts, assignments, rank)
        if group is None:
            terms.append(torch.zeros_like(tensor))
        else:
            terms.append(write_term(aggregation, start, tensor, *group))
        plan.append((
            tensor, aggregation, _writers_everywhere(aggregation, counts), any(assignments),
            start,
        ))
    totals = workers.sum_across("exchange of variable writes", terms, widen)
    values = [
        written_value(aggregation, start, total, count, any_assigned)
        for (_, aggregation, count, any_assigned, start), total in zip(plan, totals, strict=True)
    ]
    with no_grad():
        torch._foreach_copy_([tensor for tensor, *_ in plan], values)


class CarriedWrites:
    """Variables whose values every worker carries in each agreement row, after its fields:
    those written at the last sync point that wrote any (``indices`` into the layout of
    ``records``), grouped by dtype and device, each group's values packed and padded to
    8 bytes. ``words``: the int64 words they take, the same on every worker (it follows
    from a sync point all of them passed), so the agreement rows stay the same size. After
    a batch-norm run, say, the running statistics (float32) and the batch counts (int64)
    of every worker arrive with the next sync point's agreement.
    """

    __slots__ = ("_groups", "_layout", "indices", "records", "words")

    def __init__(
        self, records: list[Central], tensors: Sequence[torch.Tensor], indices: Sequence[int]
    ) -> None:
        self.records = records
        self.indices = frozenset(indices)
        self._layout = [(i, tensors[i].dtype, tensors[i].shape, tensors[i].device)
                        for i in sorted(indices)]
        # per group (dtype, device): its variables' indices and where its bytes start
        self._groups: list[tuple[torch.dtype, torch.device, list[int], int, int]] = []
        offset = 0
        for (dtype, device), members in groupby(
            sorted(self._layout, key=lambda m: (str(m[1]), str(m[3]), m[0])),
            key=lambda m: (m[1], m[3]),
        ):
            chosen = [i for i, *_ in members]
            numel = sum(tensors[i].numel() for i in chosen)
            self._groups.append((dtype, device, chosen, offset, numel))
            offset += padded(numel * dtype.itemsize)
        self.words = offset // 8

    @classmethod
    def of(
        cls, records: list[Central], tensors: Sequence[torch.Tensor], written: Sequence[int],
        workers: int,
    ) -> CarriedWrites | None:
        """The variables ``written`` to carry from now on, or None when they are too many
        bytes to carry (``CARRY_BYTES``) or of a dtype that is neither real nor integer."""
        if not all(is_real(tensors[i].dtype) for i in written):
            return None
        carried = cls(records, tensors, written)
        if not carried.words or carried.words * 8 > min(CARRY_BYTES, CARRY_TOTAL_BYTES // workers):
            return None
        return carried

    def payload(
        self, records: list[Central], tensors: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """This worker's values of the carried variables as ``words`` int64 words on the CPU
        (where the agreement row is put together), or None when the layout is no longer the
        one they were chosen in (then the agreement carries zeros and the writes are
        summed)."""
        if records != self.records or any(
            tensors[i].dtype != dtype or tensors[i].shape != shape or tensors[i].device != device
            for i, dtype, shape, device in self._layout
        ):
            return None
        with no_grad():
            pieces = [
                as_bytes(pack([tensors[i] for i in chosen]).cpu())
                for _, _, chosen, _, _ in self._groups
            ]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(torch.int64)

    def combine(
        self,
        rows: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        records: Sequence[Central],
        before: Mapping[int, torch.Tensor],
        writers: torch.Tensor,
        assigned: torch.Tensor,
    ) -> None:
        """Write the combined values of the written variables (all of them carried): from
        every worker's carried values (``rows``, [workers, words] int64), each worker one
        group of ``write_term``, the terms added in worker order (floating ones in float64,
        as the sum across workers adds them), then ``written_value``. A stretch of variables
        whose writers and aggregation are alike is computed as one flat tensor. Only a SUM's
        terms read its values from before (``write_term``): final values (batch norm's)
        read none."""
        combined: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # written at the end
        raw = rows.contiguous().view(torch.uint8)
        with no_grad():
            for dtype, device, chosen, offset, numel in self._groups:
                every = raw[:, offset : offset + numel * dtype.itemsize].view(dtype).to(device)
                kinds = zip(
                    [records[i].aggregation for i in chosen],
                    map(tuple, writers[:, chosen].t().tolist()),
                    map(tuple, assigned[:, chosen].t().tolist()),
                )
                hi = 0
                for (aggregation, counts, assignments), members in groupby(
                    zip(chosen, kinds), key=itemgetter(1)
                ):
                    indices = [i for i, _ in members]
                    stretch = [tensors[i] for i in indices]
                    lo, hi = hi, hi + sum(map(torch.Tensor.numel, stretch))
                    if not any(counts):
                        continue  # carried, not written this time
                    start = None  # (final values: by_value)
                    if not by_value(aggregation):
                        start = pack([before.get(i, tensors[i]) for i in indices])
                    terms = [
                        write_term(aggregation, start, every[worker, lo:hi], *group)
                        for worker, group in enumerate(
                            _term_of(aggregation, counts, assignments, w)
                            for w in range(len(counts))
                        )
                        if group is not None
                    ]
                    if dtype.is_floating_point:
                        terms = [term.double() for term in terms]
                    value = written_value(
                        aggregation, start, sum_in_order(terms).to(dtype),
                        _writers_everywhere(aggregation, counts), any(assignments),
                    )
                    combined.append((value, stretch))
            for value, stretch in combined:
                unpack(value, stretch)
