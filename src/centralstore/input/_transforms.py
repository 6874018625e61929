"""The transformations of ``Dataset``: each returns a new dataset reading this one.

Each method checks its arguments, works out the cardinality, and hands a module-level
generator function (``_stages.py``, ``_batching.py``) and its arguments to ``_stage``,
which ``Dataset`` implements. The class is generic in the dataset type it returns, so
that it needs no import of ``Dataset``: ``Dataset`` derives from ``Transformations[Dataset]``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

from . import _batching, _stages
from ._arguments import check_count, check_datasets, check_parallelism, seed_or_draw
from ._base import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, DatasetBase
from .components import to_components
from .data_options import AUTOTUNE, Options
from .options import as_int

D = TypeVar("D", bound="Transformations[Any]")
Generate = Callable[..., Iterator[Any]]

_AUTOTUNE_BUFFER = 2


class Transformations(DatasetBase, Generic[D]):
    """The layer of ``Dataset`` that builds a pipeline on a dataset; see ``Dataset``."""

    @abc.abstractmethod
    def _stage(
        self, generate: Generate, args: tuple[Any, ...], n: int, options: Options | None = None
    ) -> D:
        """A new dataset of ``n`` elements whose passes are ``generate(*args)``."""

    def _batcher(self, batch_size: int, drop_remainder: bool) -> tuple[Generate, tuple[Any, ...]]:
        """How ``batch`` batches this dataset: a generator function and its arguments."""
        return _batching.batched, (self, batch_size, drop_remainder)

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> D:
        """Consecutive elements stacked into batches; containers kept, strings made lists.

        ``num_parallel_calls`` (``AUTOTUNE`` too) and ``deterministic`` are accepted for porting.

        >>> import centralstore as cs
        >>> [b.tolist() for b in cs.Dataset.range(7).batch(3, drop_remainder=True)]
        [[0, 1, 2], [3, 4, 5]]
        """
        batch_size = check_count("Dataset.batch", "batch_size", batch_size, minimum=1)
        check_parallelism("Dataset.batch", num_parallel_calls)
        generate, arguments = self._batcher(batch_size, drop_remainder)
        n = _batches(self._cardinality, batch_size, drop_remainder)
        return self._stage(generate, arguments, n)

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
    ) -> D:
        """Batches whose components are first padded to one shape.

        Each dimension is padded to the largest size in the batch, or to the size that
        ``padded_shapes`` gives (None or -1: the largest), with ``padding_values`` (0, or ""
        for strings); both may be a single value or the element's structure.

        >>> import centralstore as cs, torch
        >>> ds = cs.Dataset.range(1, 4).map(lambda x: torch.full([int(x)], int(x)))
        >>> [b.tolist() for b in ds.padded_batch(2)]
        [[[1, 0], [2, 2]], [[3, 3, 3]]]
        """
        batch_size = check_count("Dataset.padded_batch", "batch_size", batch_size, minimum=1)
        arguments = (self, batch_size, drop_remainder, padded_shapes, padding_values)
        n = _batches(self._cardinality, batch_size, drop_remainder)
        return self._stage(_batching.padded, arguments, n)

    def unbatch(self) -> D:
        """Each element split back into its rows along the first dimension.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(5).batch(2).unbatch()]
        [0, 1, 2, 3, 4]
        """
        return self._stage(_batching.unbatched, (self,), UNKNOWN_CARDINALITY)

    def rebatch(self, batch_size: int, drop_remainder: bool = False) -> D:
        """The elements regrouped into batches of ``batch_size`` rows (``unbatch().batch()``).

        >>> import centralstore as cs
        >>> [b.tolist() for b in cs.Dataset.range(5).batch(2).rebatch(3)]
        [[0, 1, 2], [3, 4]]
        """
        rebatched: D = self.unbatch().batch(batch_size, drop_remainder)
        return rebatched

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> D:
        """``map_func`` applied to each element; tuple elements are passed as arguments.

        ``num_parallel_calls`` (``AUTOTUNE`` too) and ``deterministic`` are accepted for
        porting: ``map_func`` runs on the iterating thread, in order (DataLoader workers give
        parallelism).

        >>> import centralstore as cs
        >>> [int(y) for y in cs.Dataset.range(3).map(lambda x: x * 2)]
        [0, 2, 4]
        """
        check_parallelism("Dataset.map", num_parallel_calls)
        return self._stage(_stages.mapped, (self, map_func), self._cardinality)

    def flat_map(self, map_func: Callable[..., Any]) -> D:
        """The elements of the dataset that ``map_func`` returns for each element, in order.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(1, 4).flat_map(lambda x: cs.Dataset.range(x))]
        [0, 0, 1, 0, 1, 2]
        """
        return self._stage(_stages.flat_mapped, (self, map_func), UNKNOWN_CARDINALITY)

    def interleave(
        self,
        map_func: Callable[..., Any],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> D:
        """Like ``flat_map``, but ``cycle_length`` datasets at a time, ``block_length`` each.

        TensorFlow's order, made on the iterating thread (``num_parallel_calls`` is accepted
        for porting). ``cycle_length`` None or ``AUTOTUNE`` means one per CPU core, as in
        TensorFlow, so pass it for an order that does not depend on the machine.

        >>> import centralstore as cs
        >>> twice = lambda x: cs.Dataset.from_tensors(x).repeat(2)
        >>> [int(x) for x in cs.Dataset.range(1, 4).interleave(twice, cycle_length=2)]
        [1, 2, 1, 2, 3, 3]
        """
        check_parallelism("Dataset.interleave", num_parallel_calls)
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = os.cpu_count() or 1  # TensorFlow: the schedulable cores
        cycles = check_count("Dataset.interleave", "cycle_length", cycle_length, minimum=1)
        block = 1 if block_length is None else block_length
        blocks = check_count("Dataset.interleave", "block_length", block, minimum=1)
        arguments = (self, map_func, cycles, blocks)
        return self._stage(_stages.interleaved, arguments, UNKNOWN_CARDINALITY)

    def filter(self, predicate: Callable[..., Any]) -> D:
        """The elements for which ``predicate`` (a bool or scalar tensor) is true.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(6).filter(lambda x: x % 2 == 0)]
        [0, 2, 4]
        """
        return self._stage(_stages.filtered, (self, predicate), UNKNOWN_CARDINALITY)

    def take_while(self, predicate: Callable[..., Any]) -> D:
        """The elements up to the first for which ``predicate`` is false.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(10).take_while(lambda x: x < 3)]
        [0, 1, 2]
        """
        return self._stage(_stages.taken_while, (self, predicate), UNKNOWN_CARDINALITY)

    def scan(self, initial_state: Any, scan_func: Callable[[Any, Any], Any]) -> D:
        """A running state: ``scan_func(state, element)`` returns ``(new_state, output)``.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(5).scan(0, lambda s, x: (s + x, s + x))]
        [0, 1, 3, 6, 10]
        """
        state = to_components(initial_state, "Dataset.scan(initial_state)")
        return self._stage(_stages.scanned, (self, state, scan_func), self._cardinality)

    def unique(self) -> D:
        """Each distinct element once, in order of first appearance (integers or strings).

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.from_tensor_slices([1, 3, 1, 2, 3]).unique()]
        [1, 3, 2]
        """
        return self._stage(_stages.unique, (self,), UNKNOWN_CARDINALITY)

    def enumerate(self, start: int = 0) -> D:
        """Pairs ``(index, element)``, the index an int64 scalar counting from ``start``.

        >>> import centralstore as cs
        >>> [(int(i), s) for i, s in cs.Dataset.from_tensor_slices(["a", "c"]).enumerate(5)]
        [(5, 'a'), (6, 'c')]
        """
        start = as_int("start", start, "Dataset.enumerate")
        return self._stage(_stages.enumerated, (self, start), self._cardinality)

    def concatenate(self, dataset: DatasetBase) -> D:
        """This dataset's elements, then those of ``dataset``.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(1, 3).concatenate(cs.Dataset.range(4, 6))]
        [1, 2, 4, 5]
        """
        check_datasets("Dataset.concatenate", "dataset", [dataset], dataset)
        counts = (self._cardinality, dataset.cardinality())
        if INFINITE_CARDINALITY in counts:
            n = INFINITE_CARDINALITY
        else:
            n = UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in counts else sum(counts)
        return self._stage(_stages.concatenated, (self, dataset), n)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> D:
        """Elements drawn at random from a buffer of ``buffer_size`` (TensorFlow's algorithm).

        With a ``seed`` the orders are reproducible; each pass (epoch) draws a new order unless
        ``reshuffle_each_iteration=False``. Without one, the seed comes from torch's global
        generator, so ``torch.manual_seed`` makes runs reproducible.

        >>> import centralstore as cs
        >>> sorted(int(x) for x in cs.Dataset.range(5).shuffle(5, seed=1))
        [0, 1, 2, 3, 4]
        """
        buffer_size = check_count("Dataset.shuffle", "buffer_size", buffer_size, minimum=1)
        seeds = _stages.Seeds(seed_or_draw("Dataset.shuffle", seed), reshuffle_each_iteration)
        return self._stage(_stages.shuffled, (self, buffer_size, seeds), self._cardinality)

    def repeat(self, count: int | None = None) -> D:
        """The dataset ``count`` times over; forever when ``count`` is None or -1.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(2).repeat(2)]
        [0, 1, 0, 1]
        """
        count = -1 if count is None else check_count("Dataset.repeat", "count", count, minimum=-1)
        n = self._cardinality
        if count == 0 or n == 0:
            n = 0
        elif count == -1:
            n = INFINITE_CARDINALITY if n != UNKNOWN_CARDINALITY else n
        elif n > 0:
            n *= count
        return self._stage(_stages.repeated, (self, count), n)

    def shard(self, num_shards: int, index: int) -> D:
        """Every ``num_shards``-th element, starting at ``index``.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(7).shard(3, 1)]
        [1, 4]
        """
        num_shards = check_count("Dataset.shard", "num_shards", num_shards, minimum=1)
        index = as_int("index", index, "Dataset.shard")
        if not 0 <= index < num_shards:
            raise ValueError(
                f"Dataset.shard needs 0 <= index < num_shards, but got index == {index} and "
                f"num_shards == {num_shards}. Received: index={index}"
            )
        n = self._cardinality
        n = max(0, -(-(n - index) // num_shards)) if n >= 0 else n
        return self._stage(_stages.sliced, (self, index, None, num_shards), n)

    def take(self, count: int) -> D:
        """The first ``count`` elements (all of them for -1).

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(5).take(2)]
        [0, 1]
        """
        count = check_count("Dataset.take", "count", count, minimum=-1)
        if count == -1:
            return cast(D, self)
        n = self._cardinality
        n = count if n == INFINITE_CARDINALITY else (min(n, count) if n >= 0 else n)
        return self._stage(_stages.sliced, (self, 0, count, 1), n)

    def skip(self, count: int) -> D:
        """All but the first ``count`` elements (none of them for -1).

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(5).skip(3)]
        [3, 4]
        """
        count = check_count("Dataset.skip", "count", count, minimum=-1)
        if count == -1:
            return self._stage(_stages.sliced, (self, 0, 0, 1), 0)
        n = self._cardinality
        n = max(n - count, 0) if n >= 0 else n
        return self._stage(_stages.sliced, (self, count, None, 1), n)

    def cache(self, filename: str = "") -> D:
        """The elements kept in memory by the first complete pass and replayed after it.

        A pass abandoned early keeps nothing. Cached tensors are shared between passes, so
        do not modify them in place. Caching to a file (a ``filename``) is not supported.

        >>> import centralstore as cs
        >>> calls = []
        >>> ds = cs.Dataset.range(2).map(lambda x: calls.append(x) or x).cache()
        >>> [int(x) for x in ds] == [int(x) for x in ds], len(calls)
        (True, 2)
        """
        if filename != "":
            raise NotImplementedError(
                "Dataset.cache(filename) caches in memory only: TensorFlow's cache files have "
                "no counterpart here. Call cache() without a filename, or save the elements "
                f"with torch.save. Received: filename={filename!r}"
            )
        return self._stage(_stages.cached, (self, _stages.Cache()), self._cardinality)

    def prefetch(self, buffer_size: int) -> D:
        """Elements produced ahead by a background thread, up to ``buffer_size`` of them.

        ``AUTOTUNE`` (-1) picks a small buffer; 0 returns the dataset unchanged.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(3).prefetch(AUTOTUNE)]
        [0, 1, 2]
        """
        buffer_size = check_count("Dataset.prefetch", "buffer_size", buffer_size, minimum=-1)
        if buffer_size == 0:
            return cast(D, self)
        size = _AUTOTUNE_BUFFER if buffer_size == AUTOTUNE else buffer_size
        return self._stage(_stages.prefetched, (self, size), self._cardinality)

    def with_options(self, options: Options) -> D:
        """The same elements, carrying ``options`` (merged over those set upstream).

        >>> import centralstore as cs
        >>> from centralstore.input.data_options import AutoShardPolicy
        >>> options = Options()
        >>> options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
        >>> cs.Dataset.range(3).with_options(options).map(lambda x: x).options() == options
        True
        """
        if not isinstance(options, Options):
            raise TypeError(
                "Dataset.with_options(options) takes a cs.data.Options. "
                f"Received: options={options!r}"
            )
        return self._stage(_stages.passed, (self,), self._cardinality, options)

    def apply(self, transformation_func: Callable[[D], D]) -> D:
        """``transformation_func(self)``: a chain of transformations as one call.

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(5).apply(lambda ds: ds.filter(lambda x: x > 2))]
        [3, 4]
        """
        result = transformation_func(self)  # type: ignore[arg-type]
        if not isinstance(result, DatasetBase):
            raise TypeError(
                "Dataset.apply(transformation_func) must return a Dataset. "
                f"Received: a {type(result).__name__}"
            )
        return result



def _batches(n: int, batch_size: int, drop_remainder: bool) -> int:
    if n < 0:
        return n
    return n // batch_size if drop_remainder else -(-n // batch_size)
