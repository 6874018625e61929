"""``Dataset``: the lazy, re-iterable subset of ``tf.data.Dataset`` that ported code needs.

Built on ``torch.utils.data.IterableDataset`` so that it also feeds a ``DataLoader``. Each
method checks its arguments, works out the cardinality, and wraps a module-level generator
function from ``_stages.py`` (so that datasets pickle into DataLoader workers) in a
``_Stage``. ``from_tensor_slices`` cuts whole batches as views, which ``batch`` uses instead
of stacking rows one by one.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .. import _tree
from . import _stages
from .options import as_int
from .split import from_numpy

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
AUTOTUNE = -1
_AUTOTUNE_BUFFER = 2


class Dataset(IterableDataset[Any]):
    """A lazy, re-iterable pipeline of elements: tensors or tuples/dicts/namedtuples of them.

    TensorFlow's names and conventions (``cardinality()`` is -1 for infinite, -2 for unknown);
    ``tf.data`` examples run after renaming ``tf.data.Dataset`` to ``cs.Dataset``. As with every
    ``IterableDataset``, each ``DataLoader`` worker iterates the whole dataset: ``shard`` it
    by ``torch.utils.data.get_worker_info()`` when using ``num_workers > 0``.

    >>> [b.tolist() for b in Dataset.range(5).batch(2)]
    [[0, 1], [2, 3], [4]]
    """

    _cardinality: int = UNKNOWN_CARDINALITY

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """A fresh iterator over the elements: every pass starts from the beginning."""

    def _batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any] | None:
        """Whole batches cut straight from the source when it can (a fast path), else None."""
        return None

    # Sources.

    @staticmethod
    def range(*args: int, output_type: torch.dtype = torch.int64) -> Dataset:
        """The integers of ``range(start, stop, step)`` as scalar tensors (int64 by default).

        >>> [int(x) for x in Dataset.range(1, 8, 3)]
        [1, 4, 7]
        """
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 ints (start, stop, step); got {args}")
        values = range(*(as_int("range argument", a) for a in args))
        return _Stage(_stages.ranged, (values, output_type), len(values))

    @staticmethod
    def from_tensors(element: Any) -> Dataset:
        """A dataset of one element, ``element`` (numpy arrays shared, lists made tensors).

        >>> [x.tolist() for x in Dataset.from_tensors([[1.0]]).repeat(2)]
        [[[1.0]], [[1.0]]]
        """
        rows = _tree.map_leaves(lambda leaf: leaf.unsqueeze(0), _to_tensors(element))
        return _Slices(rows, 1)

    @staticmethod
    def from_tensor_slices(element: Any) -> Dataset:
        """A dataset of the slices of ``element`` along its first dimension, leaf by leaf.

        numpy arrays are wrapped with ``torch.from_numpy`` (no copy) and stay on the host.

        >>> [(int(x), int(y["a"])) for x, y in Dataset.from_tensor_slices(([1, 2], {"a": [3, 4]}))]
        [(1, 3), (2, 4)]
        """
        leaves, spec = _tree.flatten(_to_tensors(element))
        sizes = [leaf.shape[0] if leaf.dim() > 0 else None for leaf in leaves]
        if not leaves or None in sizes or len(set(sizes)) > 1:
            raise ValueError(
                "from_tensor_slices needs tensors that share their first dimension (the one "
                f"sliced), but got the shapes {[list(leaf.shape) for leaf in leaves]}. Use "
                "Dataset.from_tensors for a single element."
            )
        return _Slices(_tree.unflatten(leaves, spec), len(leaves[0]))

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> Dataset:
        """Elements of several datasets side by side, stopping with the shortest.

        Takes a tuple (or dict) of datasets as TensorFlow does, or the datasets as arguments.

        >>> [(int(x), int(y)) for x, y in Dataset.zip((Dataset.range(3), Dataset.range(7, 9)))]
        [(0, 7), (1, 8)]
        """
        if (datasets is None) == (not args):
            raise TypeError(
                "Dataset.zip takes the datasets as one structure, as arguments, or as "
                f"datasets=: exactly one of them. Received: args={args}, datasets={datasets}"
            )
        if datasets is None:
            datasets = args[0] if len(args) == 1 else args
        members = _tree.flatten(datasets)[0]
        if not members or not all(isinstance(m, Dataset) for m in members):
            raise TypeError(
                f"Dataset.zip needs a non-empty structure of Datasets. Received: {datasets!r}"
            )
        counts = [m.cardinality() for m in members]
        finite = [n for n in counts if n >= 0]
        n = UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in counts else INFINITE_CARDINALITY
        return _Stage(_stages.zipped, (datasets,), min(finite) if finite and n == -1 else n)

    # Transformations.

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Consecutive elements stacked into batches; the container types are kept.

        >>> [b.tolist() for b in Dataset.range(7).batch(3, drop_remainder=True)]
        [[0, 1, 2], [3, 4, 5]]
        """
        batch_size = _count("batch_size", batch_size, minimum=1)
        n = self._cardinality
        if n >= 0:
            n = n // batch_size if drop_remainder else -(-n // batch_size)
        return _Stage(_stages.batched, (self, batch_size, drop_remainder), n)

    def unbatch(self) -> Dataset:
        """Each element split back into its rows along the first dimension.

        >>> [int(x) for x in Dataset.range(5).batch(2).unbatch()]
        [0, 1, 2, 3, 4]
        """
        return _Stage(_stages.unbatched, (self,), UNKNOWN_CARDINALITY)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset:
        """``map_func`` applied to each element; tuple elements are passed as arguments.

        ``num_parallel_calls`` and ``deterministic`` are accepted for porting: ``map_func``
        runs on the iterating thread, in order (DataLoader workers give parallelism).

        >>> [int(y) for y in Dataset.range(3).map(lambda x: x * 2)]
        [0, 2, 4]
        """
        return _Stage(_stages.mapped, (self, map_func), self._cardinality)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which ``predicate`` (a bool or scalar tensor) is true.

        >>> [int(x) for x in Dataset.range(6).filter(lambda x: x % 2 == 0)]
        [0, 2, 4]
        """
        return _Stage(_stages.filtered, (self, predicate), UNKNOWN_CARDINALITY)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Elements drawn at random from a buffer of ``buffer_size`` (TensorFlow's algorithm).

        With a ``seed`` the orders are reproducible; each pass (epoch) draws a new order unless
        ``reshuffle_each_iteration=False``. Without one, the seed comes from torch's global
        generator, so ``torch.manual_seed`` makes runs reproducible.

        >>> sorted(int(x) for x in Dataset.range(5).shuffle(5, seed=1))
        [0, 1, 2, 3, 4]
        """
        buffer_size = _count("buffer_size", buffer_size, minimum=1)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        seeds = _stages.Seeds(as_int("seed", seed), reshuffle_each_iteration)
        return _Stage(_stages.shuffled, (self, buffer_size, seeds), self._cardinality)

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset ``count`` times over; forever when ``count`` is None or -1.

        >>> [int(x) for x in Dataset.range(2).repeat(2)]
        [0, 1, 0, 1]
        """
        count = -1 if count is None else _count("count", count, minimum=-1)
        n = self._cardinality
        if count == 0 or n == 0:
            n = 0
        elif count == -1:
            n = INFINITE_CARDINALITY if n != UNKNOWN_CARDINALITY else n
        elif n > 0:
            n *= count
        return _Stage(_stages.repeated, (self, count), n)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``.

        >>> [int(x) for x in Dataset.range(7).shard(3, 1)]
        [1, 4]
        """
        num_shards = _count("num_shards", num_shards, minimum=1)
        index = as_int("index", index)
        if not 0 <= index < num_shards:
            raise ValueError(
                f"shard needs 0 <= index < num_shards, but got index == {index} and "
                f"num_shards == {num_shards}."
            )
        n = self._cardinality
        n = max(0, -(-(n - index) // num_shards)) if n >= 0 else n
        return _Stage(_stages.sliced, (self, index, None, num_shards), n)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all of them for -1).

        >>> [int(x) for x in Dataset.range(5).take(2)]
        [0, 1]
        """
        count = _count("count", count, minimum=-1)
        if count == -1:
            return self
        n = self._cardinality
        n = count if n == INFINITE_CARDINALITY else (min(n, count) if n >= 0 else n)
        return _Stage(_stages.sliced, (self, 0, count, 1), n)

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none of them for -1).

        >>> [int(x) for x in Dataset.range(5).skip(3)]
        [3, 4]
        """
        count = _count("count", count, minimum=-1)
        if count == -1:
            return _Stage(_stages.sliced, (self, 0, 0, 1), 0)
        n = self._cardinality
        return _Stage(_stages.sliced, (self, count, None, 1), max(n - count, 0) if n >= 0 else n)

    def prefetch(self, buffer_size: int) -> Dataset:
        """Elements produced ahead by a background thread, up to ``buffer_size`` of them.

        ``AUTOTUNE`` (-1) picks a small buffer; 0 returns the dataset unchanged.

        >>> [int(x) for x in Dataset.range(3).prefetch(AUTOTUNE)]
        [0, 1, 2]
        """
        buffer_size = _count("buffer_size", buffer_size, minimum=-1)
        if buffer_size == 0:
            return self
        size = _AUTOTUNE_BUFFER if buffer_size == AUTOTUNE else buffer_size
        return _Stage(_stages.prefetched, (self, size), self._cardinality)

    # Inspection.

    def cardinality(self) -> int:
        """The number of elements; -1 (``INFINITE_CARDINALITY``), or -2 when unknown.

        >>> Dataset.range(5).batch(2).cardinality(), Dataset.range(1).repeat().cardinality()
        (3, -1)
        """
        return self._cardinality

    def __len__(self) -> int:
        n = self._cardinality
        if n < 0:
            why = "is infinite" if n == INFINITE_CARDINALITY else "is unknown (filter, unbatch)"
            raise TypeError(f"The dataset's length {why}, so it has no len(); see cardinality().")
        return n

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements with every tensor as a numpy array (0-d tensors as numpy scalars).

        >>> [int(x) for x in Dataset.range(2).as_numpy_iterator()]
        [0, 1]
        """
        return (_tree.map_leaves(_to_numpy, element) for element in self)


class _Stage(Dataset):
    """A source or transformation: ``generate(*args)`` makes a fresh iterator per pass."""

    def __init__(self, generate: Callable[..., Iterator[Any]], args: tuple[Any, ...], n: int):
        self._generate = generate
        self._args = args
        self._cardinality = n

    def __iter__(self) -> Iterator[Any]:
        return self._generate(*self._args)


class _Slices(Dataset):
    """``from_tensor_slices`` (and ``from_tensors``): the rows of the leaves, as views."""

    def __init__(self, rows: Any, n: int) -> None:
        self._leaves, self._spec = _tree.flatten(rows)
        self._cardinality = n

    def __reduce__(self) -> tuple[Any, ...]:  # pickle the structure, not torch's TreeSpec
        return _Slices, (_tree.unflatten(self._leaves, self._spec), self._cardinality)

    def __iter__(self) -> Iterator[Any]:
        leaves, spec = self._leaves, self._spec
        for row in range(self._cardinality):
            yield _tree.unflatten([leaf[row] for leaf in leaves], spec)

    def _batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any] | None:
        leaves, spec, n = self._leaves, self._spec, self._cardinality
        stop = n - n % batch_size if drop_remainder else n
        return (
            _tree.unflatten([leaf[start : start + batch_size] for leaf in leaves], spec)
            for start in range(0, stop, batch_size)
        )


# Conversions and checks.


def _to_tensors(value: Any) -> Any:
    """TensorFlow's reading of a structure: tuples and dicts nest, lists become tensors."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return from_numpy(value)
    if isinstance(value, dict):
        return type(value)((key, _to_tensors(item)) for key, item in value.items())
    if isinstance(value, tuple):
        items = [_to_tensors(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list) and any(isinstance(v, (torch.Tensor, np.ndarray)) for v in value):
        return torch.stack([_to_tensors(item) for item in value])
    if isinstance(value, (list, bool, int, float, complex, np.generic)):
        return torch.tensor(value)
    raise TypeError(
        "Dataset components must be tensors, numpy arrays, Python numbers or lists of them, "
        f"nested in tuples, dicts or namedtuples. Received: a {type(value).__name__}, {value!r}"
    )


def _to_numpy(leaf: Any) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    array = leaf.numpy(force=True)
    return array[()] if array.ndim == 0 else array


def _count(name: str, value: Any, minimum: int) -> int:
    number = as_int(name, value)
    if number < minimum:
        meaning = "a positive int" if minimum == 1 else ">= 0, or -1 for all"
        raise ValueError(f"{name} must be {meaning}. Received: {name}={number}")
    return number
