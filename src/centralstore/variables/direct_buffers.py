"""Buffers that replicas computing where they live use directly, one replica at a time.

Views give every replica a private copy of each buffer and fold the copies' writes at the
sync point (``folding.apply_writes``): Python per buffer and per replica, which made a
network of ten batch-norm layers cost 1.17 to 1.19x two half-batch passes at R = 2. Where
every replica of a process computes where the variables live (a ``DirectRun``; a
``ReplicasRun`` whose other variables keep views; a worker's replicas, which see views of
the parameters), the replicas compute one after another, so they can share the buffers
themselves instead, if each finds them as they were before the run and the sync point
leaves what views would. Two kinds qualify (``BufferGroups``):

* **integers** taking the first replica's write (their default aggregation: position ids,
  ``num_batches_tracked``): a write moves the version counter, so a run that writes none
  (the usual case for position ids) costs a comparison of counters, and the values from
  before the run are copied only when a buffer changed since the last copy (a sync point
  that gives every buffer replica 0's copy counts as one: ``num_batches_tracked``, which
  every run writes, is copied once a run, for the next replica, not twice). The sync point
  gives each written buffer its first writer's value, as views do. (A write through
  ``.data`` moves no counter: it applies at once, as on one device.)
* **floats** averaged over replicas (aggregation MEAN, their default), in groups of one
  dtype (``FloatGroup``, one tensor of rows each): the running statistics of normalization
  layers (``running_mean`` / ``running_var`` of batch and instance norm), which their
  kernel writes behind their version counters, and, apart, small floating buffers that runs
  usually only read (a positional table, a rotary embedding's frequencies, an input's mean
  and deviation; contiguous, at most ``SMALL_FLOATS`` elements in all), which a write
  through ``.data`` changes behind the counters too. So every run copies them, each copy
  into a row of one tensor (reused from run to run: ``FloatMemory``), and the sync point
  compares the replicas' rows with the one from before the run in one operation, and tests
  the result in another (element by element; then, unless every element changed or none
  did, buffer by buffer: a training step can leave a value as it was, the running mean of a
  channel of zeros, and evaluation leaves them all; a group only read is first tested in
  one operation, whose True ends the sync point's work). Stacking the copies and reducing
  the comparison took two more, each 10 to 15 us right after a step. If every replica
  changed every statistic (training; a group only read is not tested for this), they become
  the mean of the replicas' values in replica order, on their rows (``(w0 + w1 + ...) /
  R``, the arithmetic of views), and so they do, without the comparison, if every replica
  wrote every one through its version counter (compiled code's statistics: its graph
  writes them back with a ``copy_``); if none changed one (evaluation, a table only read),
  they stay; any other pattern (a replica that did not change one) goes buffer by buffer:
  those every replica wrote (changed, or moved the counter of) are averaged, the others'
  writes go to the writers' views, whose fold is the general one. Their writes average by
  value whatever their kind, so a write through a counter, which views note as a change,
  averages as one behind it does.

Each replica's values are kept when it finishes or waits in a rendezvous and the values from
before the run put back (two foreach calls), so the next replica does not see them; a
replica that runs on after a rendezvous finds its own again. The last replica's stay in the
buffers until the sync point. Across workers, the sync point commits the buffers first and
combines the written ones with the other workers' writes, from their values from before the
run (``Written``), as it combines the writes views fold. Other buffers keep their views:
those whose aggregation was set, complex ones, strided ones, and floating buffers past
``SMALL_FLOATS``, whose copies at every run cost more than views, which copy a buffer only
when it changes and compare it with the replicas' copies once a run.
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import NamedTuple, cast

import torch

from .._aggregation import VariableAggregation
from .._autograd import no_grad
from .._autograd import version_of as _version
from .records import Central
from .views import ReplicaViews

_STATISTICS = frozenset({"running_mean", "running_var"})
# the most elements of the floating buffers that runs usually only read which replicas
# share: a run copies them four times and compares them once, where views cost 50 to 150 us
# more in Python at R = 2 but compare each replica's copy once; at 16,384 floats the two
# cost about the same on a CPU
SMALL_FLOATS = 1 << 14


def _is_statistic(record: Central, tensor: torch.Tensor) -> bool:
    """A floating running statistic of normalization layers only (a vector of one value per
    feature), averaged by replicas."""
    if (
        record.aggregation is not VariableAggregation.MEAN or not tensor.is_floating_point()
        or tensor.dim() != 1
    ):
        return False
    for module_ref, name in record.owners:
        module = module_ref()
        if name not in _STATISTICS or not isinstance(
            module, torch.nn.modules.batchnorm._NormBase
        ):
            return False
    return True


# one call for a list (one kernel on a GPU), where this torch has it; else a clone each
_clone_all = getattr(torch, "_foreach_clone", None)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors``, in fresh memory: a run inside ``merge_call`` keeps copies of
    the same buffers."""
    if _clone_all is not None:
        return list(_clone_all(tensors))
    return list(map(torch.Tensor.clone, tensors))


_dtype = attrgetter("dtype")
_layout = attrgetter("shape", "dtype")


class Written(NamedTuple):
    """A shared buffer that a sync point left holding its replicas' combined write: how many
    replicas wrote it, whether one assigned it (a float's averaged write counts as an
    assignment, as views note one behind its counter, a statistic's by its kernel; an
    integer's write, of unknown kind, as a change: both combine by value, MEAN and
    ONLY_FIRST_REPLICA, whatever the kind), and its value from before the run. A sync point
    across workers combines these with the other workers' (``_writes.py``), as it combines
    the writes that views fold."""

    writers: int
    assigned: bool
    before: torch.Tensor


def _note(
    written: dict[int, list[bool]], replica: int, versions: list[int], before: list[int]
) -> None:
    """Add to ``written[replica]`` the buffers whose version counter moved."""
    moved = list(map(int.__ne__, versions, before))
    known = written.get(replica)
    written[replica] = moved if known is None else list(map(bool.__or__, known, moved))


class FloatGroup:
    """Floating buffers of one dtype that replicas share and whose writes average
    (``SharedFloats``): their records, weak references and ``FloatMemory``, and whether runs
    usually change them (``changing``: running statistics, which every training run writes)
    or only read them (a positional table, rotary frequencies)."""

    __slots__ = ("changing", "memory", "records", "refs")

    def __init__(self, records: list[Central], changing: bool) -> None:
        self.records = records
        self.refs = [record.ref for record in records]
        self.memory = FloatMemory([cast(torch.Tensor, record.ref()) for record in records])
        self.changing = changing


def _by_dtype(records: list[Central]) -> list[list[Central]]:
    """``records`` in groups of one dtype, in order of first appearance: each group's
    copies fit one tensor."""
    groups: dict[torch.dtype, list[Central]] = {}
    for record in records:
        groups.setdefault(_dtype(record.ref()), []).append(record)
    return list(groups.values())


def _small(records: list[Central]) -> list[Central]:
    """Of floating buffers that runs usually only read, as many as fit ``SMALL_FLOATS``
    elements, in order: every run copies them, which costs less than views only while they
    are small."""
    kept: list[Central] = []
    total = 0
    for record in records:
        size = cast(torch.Tensor, record.ref()).numel()
        if total + size <= SMALL_FLOATS:
            kept.append(record)
            total += size
    return kept


class BufferGroups:
    """The buffers of a plan that replicas use directly: ``integers`` (records), the
    ``floats`` (running statistics, and small floating buffers that runs usually only read,
    each a ``FloatGroup``), and the integers' values from before the runs while they
    stay."""

    __slots__ = ("_before", "_stamps", "floats", "integer_refs", "integers")

    def __init__(self, records: list[Central], storage: torch.device) -> None:
        self.integers: list[Central] = []
        statistics: list[Central] = []
        others: list[Central] = []
        for record in records:
            tensor = record.ref()
            if (
                tensor is None or not record.owners or not record.is_buffer or record.on_read
                or tensor.device != storage or tensor.is_complex()
            ):
                continue
            if not tensor.is_floating_point():
                if record.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
                    self.integers.append(record)
            elif _is_statistic(record, tensor):
                statistics.append(record)
            elif (  # (contiguous: no two elements share memory, so any can be put back)
                record.aggregation is VariableAggregation.MEAN and tensor.numel()
                and tensor.is_contiguous() and not tensor.requires_grad
            ):
                others.append(record)
        # apart, so that a table only read keeps training's statistics on their first test
        self.floats = [FloatGroup(group, True) for group in _by_dtype(statistics)] + [
            FloatGroup(group, False) for group in _by_dtype(_small(others))
        ]
        self.integer_refs = [record.ref for record in self.integers]
        # the integers' values before the run, and when they were copied
        self._before: list[torch.Tensor] = []
        self._stamps: tuple[list[int], list[int]] | None = None

    @property
    def records(self) -> list[Central]:
        return self.integers + [record for group in self.floats for record in group.records]

    def integers_before(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The integers' values before the run: copied again only if one moved."""
        stamps = _stamps(tensors)
        if stamps != self._stamps:
            self._before = _copies(tensors)
            self._stamps = stamps
        return self._before

    def remember(self, tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """A sync point left ``tensors`` holding ``values``, copies no one writes: the next
        run's values from before it, unless one moves first. (A counter that every run
        writes, ``num_batches_tracked``, is then copied once a run, not twice.)"""
        self._before = values
        self._stamps = _stamps(tensors)


def _stamps(tensors: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    return list(map(_version, tensors)), list(map(torch.Tensor.data_ptr, tensors))


class SharedIntegers:
    """The integer buffers of one run (see the module's docstring)."""

    __slots__ = ("_before", "_groups", "_kept", "_versions", "_written", "tensors")

    def __init__(self, groups: BufferGroups, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self._groups = groups
        self._before = groups.integers_before(tensors)
        self._versions = list(map(_version, tensors))
        self._written: dict[int, list[bool]] = {}  # replica -> which buffers it wrote
        self._kept: dict[int, list[torch.Tensor]] = {}  # replica -> its values

    def take(self, replica: int, last: bool) -> None:
        """Replica ``replica`` finished (``last``: the last one) or waits: its writes are
        noted, and the values of a replica that wrote are kept while the buffers get back
        their values from before the run (the last replica's stay in them)."""
        versions = list(map(_version, self.tensors))
        if versions != self._versions:
            _note(self._written, replica, versions, self._versions)
        if last or replica not in self._written:  # (nothing of its own in the buffers)
            return
        self._kept[replica] = _copies(self.tensors)
        torch._foreach_copy_(self.tensors, self._before)
        self._versions = list(map(_version, self.tensors))

    def put_back(self, replica: int) -> None:
        """Replica ``replica`` runs on after a rendezvous: its writes are back."""
        kept = self._kept.pop(replica, None)
        if kept is not None:
            torch._foreach_copy_(self.tensors, kept)
            self._versions = list(map(_version, self.tensors))

    def commit(self, report: bool) -> dict[int, Written]:
        """Each written buffer takes its first writer's value (the last replica's is in
        the buffer already). Returns the written ones, by record key, if ``report`` (a sync
        point across workers combines them; else nothing reads them)."""
        if not self._written:
            return {}
        written: dict[int, Written] = {}
        if report:
            records, before = self._groups.integers, self._before
            counts = list(map(sum, zip(*self._written.values(), strict=True)))
            written = {
                records[i].key: Written(count, False, before[i])
                for i, count in enumerate(counts) if count
            }
        kept = self._kept.get(0)
        if kept is not None and all(self._written[0]):  # replica 0 wrote every one
            torch._foreach_copy_(self.tensors, kept)  # (so they hold its copies exactly)
            self._groups.remember(self.tensors, kept)
            self._written, self._kept = {}, {}
            return written
        first: dict[int, int] = {}  # buffer -> its first writer
        for replica in sorted(self._written, reverse=True):
            for index in compress(range(len(self.tensors)), self._written[replica]):
                first[index] = replica
        targets, sources = [], []
        for index, replica in first.items():
            kept = self._kept.get(replica)
            if kept is not None:  # (None: the last replica, whose values are in place)
                targets.append(self.tensors[index])
                sources.append(kept[index])
        if targets:
            torch._foreach_copy_(targets, sources)
        self._written, self._kept = {}, {}
        return written

    def again(self) -> SharedIntegers:
        """The same buffers, used afresh from a sync point on (a merge's)."""
        return SharedIntegers(self._groups, self.tensors)

    def restore(self) -> None:
        """The run failed: the buffers as before it."""
        if self._written or list(map(_version, self.tensors)) != self._versions:
            torch._foreach_copy_(self.tensors, self._before)
        self._written, self._kept = {}, {}


class Rows:
    """Memory for the copies of a ``FloatGroup``'s buffers in one run of ``replicas``: one
    tensor whose ``rows`` are the values from before the run, then each replica's, then
    their mean, and views of each row shaped like each buffer (``pieces``), so that copying
    the buffers in is one operation (``fill``), putting them back one ``_foreach_copy_``,
    and comparing every replica's with those from before the run one operation: a test
    against ``before`` (the row from before the run, as many times as there are replicas)
    for a group only read, or a comparison into ``differs``, whose elements are all True,
    like ``every``'s, when every replica changed every element, and all False, like
    ``none``'s, when none changed one."""

    __slots__ = (
        "before", "differs", "every", "none", "pieces", "replicas", "rows", "vectors",
    )

    def __init__(
        self, like: torch.Tensor, shapes: list[torch.Size], sizes: list[int], replicas: int
    ) -> None:
        size, device = sum(sizes), like.device
        with torch.inference_mode(False):  # written again by later runs, in any mode
            data = torch.empty((replicas + 2, size), dtype=like.dtype, device=device)
            self.rows = list(data)
            self.replicas = data[1:-1]
            self.before = self.rows[0].expand_as(self.replicas)
            self.differs = torch.empty((replicas, size), dtype=torch.bool, device=device)
            self.every = torch.ones((replicas, size), dtype=torch.bool, device=device)
            self.none = torch.zeros((replicas, size), dtype=torch.bool, device=device)
            self.pieces = [
                [piece.view(shape) for piece, shape in zip(row.split(sizes), shapes, strict=True)]
                for row in self.rows
            ]
        self.vectors = all(len(shape) == 1 for shape in shapes)

    def fill(self, row: int, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into row ``row``: vectors (running statistics) in one ``cat``, one
        kernel where a copy each costs more; tensors of other shapes a copy each."""
        if self.vectors:
            torch.cat(tensors, out=self.rows[row])
        else:
            torch._foreach_copy_(self.pieces[row], tensors)


class FloatMemory:
    """The ``Rows`` of a ``FloatGroup`` (all of one dtype), reused from run to run (each is
    lent to one run at a time: a run inside ``merge_call`` takes others), and the index of
    each element's buffer, for comparisons buffer by buffer."""

    __slots__ = ("_like", "_shapes", "_sizes", "_spare", "layouts", "segments")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._like = torch.empty((), dtype=tensors[0].dtype, device=tensors[0].device)
        self._shapes = [tensor.shape for tensor in tensors]
        self._sizes = [tensor.numel() for tensor in tensors]
        self.layouts = list(map(_layout, tensors))
        self._spare: dict[int, list[Rows]] = {}  # number of replicas -> rows
        self.segments = torch.repeat_interleave(
            torch.arange(len(tensors), device=self._like.device),
            torch.tensor(self._sizes, device=self._like.device),
        )

    def lend(self, replicas: int, values: list[torch.Tensor]) -> Rows:
        """Rows for a run of ``replicas``, ``values`` in its row of values from before."""
        spare = self._spare.get(replicas)
        rows = spare.pop() if spare else Rows(self._like, self._shapes, self._sizes, replicas)
        rows.fill(0, values)
        return rows

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` still have the shapes and dtype of the memory's pieces (a
        ``.data =`` can give a buffer others)."""
        return list(map(_layout, tensors)) == self.layouts

    def take_back(self, rows: Rows) -> None:
        self._spare.setdefault(len(rows.replicas), []).append(rows)


class SharedFloats:
    """The floating buffers of one ``FloatGroup`` in one run (see the module's docstring)."""

    __slots__ = ("_group", "_kept", "_moved", "_replicas", "_rows", "_versions", "tensors")

    def __init__(
        self, group: FloatGroup, tensors: list[torch.Tensor], replicas: list[ReplicaViews]
    ) -> None:
        self.tensors = tensors
        self._group = group
        self._replicas = replicas
        self._rows = group.memory.lend(len(replicas), tensors)
        self._versions = list(map(_version, tensors))
        self._kept: set[int] = set()  # the replicas whose values are in their rows
        self._moved: dict[int, list[bool]] = {}  # replica -> its writes that moved a counter

    def take(self, replica: int, last: bool) -> None:
        """Replica ``replica`` finished (``last``: the last one) or waits: its values are
        kept and the buffers get back their values from before the run (the last
        replica's stay in them)."""
        versions = list(map(_version, self.tensors))
        if versions != self._versions:
            _note(self._moved, replica, versions, self._versions)
        if last:
            return
        self._rows.fill(replica + 1, self.tensors)
        self._kept.add(replica)
        torch._foreach_copy_(self.tensors, self._rows.pieces[0])
        self._versions = list(map(_version, self.tensors))

    def put_back(self, replica: int) -> None:
        """Replica ``replica`` runs on after a rendezvous: its values are back."""
        if replica in self._kept:
            self._kept.discard(replica)
            torch._foreach_copy_(self.tensors, self._rows.pieces[replica + 1])
            self._versions = list(map(_version, self.tensors))

    def commit(self, report: bool) -> dict[int, Written]:
        """Fold the replicas' values: a buffer every replica wrote (a statistic by its
        kernel, behind its counter, or by compiled code, through it) is their mean, in
        replica order; any other write goes to the writers' views (``folding.apply_writes``
        folds them next). Returns the buffers left holding a mean, by record key, if
        ``report``."""
        rows, count = self._rows, len(self._replicas)
        if count - 1 not in self._kept:  # (every replica's are kept at a merge's sync point)
            rows.fill(count, self.tensors)
        averaged: list[int] | range = []
        if (  # a group only read: one test, of every replica's values against those before
            self._group.changing or self._moved or not torch.equal(rows.replicas, rows.before)
        ):
            averaged = self._compare(rows, count)
        before = rows.pieces[0]  # (rows lent again only after this sync point)
        self._group.memory.take_back(rows)
        self._kept, self._moved = set(), {}
        if not report or not averaged:
            return {}
        records = self._group.records
        return {records[index].key: Written(count, True, before[index]) for index in averaged}

    def _compare(self, rows: Rows, count: int) -> list[int] | range:
        """``commit``'s comparison of the replicas' values with those from before the run,
        and their mean where every replica wrote them; returns the buffers averaged."""
        moved = self._moved
        if len(moved) == count and all(map(all, moved.values())):  # every replica wrote every
            return self._mean_of_all()  # buffer, by its counter: compiled code's statistics
        differs = torch.ne(rows.replicas, rows.rows[0], out=rows.differs)  # NaN differs
        averaged: list[int] | range = []
        if (  # training's statistics: all changed (a group only read skips this test)
            self._group.changing and not moved and torch.equal(differs, rows.every)
        ):
            averaged = self._mean_of_all()
        elif moved or not torch.equal(differs, rows.none):  # (none changed: evaluation)
            # buffer by buffer (a value that a training step left as it was counts)
            size = len(self.tensors)
            changed = torch.zeros((count, size), dtype=torch.int64, device=differs.device)
            found = changed.index_add_(1, self._group.memory.segments, differs.long()).tolist()
            if not moved and all(map(all, found)):
                averaged = self._mean_of_all()
            else:
                averaged = self._fold(rows.pieces[1:-1], found)
        return averaged

    def _mean_of_all(self) -> range:
        """Each buffer becomes the mean of the replicas' values, in replica order, on their
        rows: what ``folding.apply_writes`` computes for averaged assignments. (One
        replica's, a worker's only, are its values: in the buffers already, unless it waits
        in a ``merge_call``.)"""
        if len(self._replicas) == 1:
            if self._kept:
                torch._foreach_copy_(self.tensors, self._rows.pieces[1])
            return range(len(self.tensors))
        first, second, *more, total = self._rows.rows[1:]
        torch.add(first, second, out=total)
        for row in more:
            total.add_(row)
        total.div_(len(more) + 2)
        torch._foreach_copy_(self.tensors, self._rows.pieces[-1])
        return range(len(self.tensors))

    def _mean(self, targets: list[torch.Tensor], values: list[list[torch.Tensor]]) -> None:
        """``_mean_of_all`` for some buffers only (``targets``), tensor by tensor."""
        sums = torch._foreach_add(values[0], values[1])
        for more in values[2:]:
            torch._foreach_add_(sums, more)
        torch._foreach_div_(sums, len(values))
        torch._foreach_copy_(targets, sums)

    def _fold(self, values: list[list[torch.Tensor]], found: list[list[int]]) -> list[int]:
        """Some replica left a buffer unchanged or moved its counter: the buffers every
        replica wrote (changed, or moved the counter of) are averaged (returned), those
        some replicas wrote go to the writers' views, where ``folding.apply_writes`` folds
        them next."""
        size, count = len(self.tensors), len(values)
        moved = [self._moved.get(r, [False] * size) for r in range(count)]
        fast: list[int] = []
        for index in range(size):
            writers = [r for r in range(count) if found[r][index] or moved[r][index]]
            if len(writers) == count:
                fast.append(index)
            elif writers:
                self._to_views(index, writers, values, moved)
        if fast and count > 1:
            self._mean(
                [self.tensors[index] for index in fast],
                [[v[index] for index in fast] for v in values],
            )
        elif fast and self._kept:  # one replica, waiting in a merge_call: its values
            torch._foreach_copy_(
                [self.tensors[index] for index in fast], [values[0][index] for index in fast]
            )
        return fast

    def _to_views(
        self, index: int, writers: list[int], values: list[list[torch.Tensor]],
        moved: list[list[bool]],
    ) -> None:
        """Buffer ``index``'s writes, each in its writer's view, which the sync point folds
        as views' writes: one that moved the counter as a change, one behind it (a
        kernel's, a write through ``.data``) as an assignment (``modules.record_unseen``'s
        rule)."""
        record, tensor = self._group.records[index], self.tensors[index]
        with no_grad(), torch.inference_mode(False):
            tensor.copy_(self._rows.pieces[0][index])
            for replica in writers:
                views = self._replicas[replica]
                view = views.validate(record, tensor, views.views.get(record.key))
                view.tensor.copy_(values[replica][index])
                view.assigned = not moved[replica][index]

    def again(self) -> SharedFloats:
        """The same buffers, used afresh from a sync point on (a merge's)."""
        return SharedFloats(self._group, self.tensors, self._replicas)

    def restore(self) -> None:
        """The run failed: the buffers as before it."""
        torch._foreach_copy_(self.tensors, self._rows.pieces[0])
        self._group.memory.take_back(self._rows)
        self._kept, self._moved = set(), {}
