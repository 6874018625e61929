"""``Dataset``: the lazy, re-iterable subset of ``tf.data.Dataset`` that ported code needs.

Built on ``torch.utils.data.IterableDataset`` so that it also feeds a ``DataLoader``. Each
transformation is a small generator function, wrapped in a ``_Stage`` together with the
cardinality it implies; sources (``range``, ``from_tensor_slices``) can cut whole batches in
one call, which ``batch`` uses instead of stacking elements one by one.
"""

from __future__ import annotations

import abc
import itertools
import operator
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from .. import _tree
from .distributed import PrefetchIterator
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
            raise TypeError(
                f"Dataset.range takes 1 to 3 ints (stop | start, stop[, step]). Received: {args}"
            )
        values = range(*(_int("range argument", a) for a in args))
        return _Range(values, output_type)

    @staticmethod
    def from_tensors(element: Any) -> Dataset:
        """A dataset of one element, ``element`` (numpy arrays shared, lists made tensors).

        >>> [x.tolist() for x in Dataset.from_tensors([[1.0]]).repeat(2)]
        [[[1.0]], [[1.0]]]
        """
        leaves, spec = _tree.flatten(_to_tensors(element))
        return _Slices([leaf.unsqueeze(0) for leaf in leaves], spec, 1)

    @staticmethod
    def from_tensor_slices(element: Any) -> Dataset:
        """A dataset of the slices of ``element`` along its first dimension, leaf by leaf.

        numpy arrays are wrapped with ``torch.from_numpy`` (no copy) and stay on the host.

        >>> [(int(x), int(y["a"])) for x, y in Dataset.from_tensor_slices(([1, 2], {"a": [3, 4]}))]
        [(1, 3), (2, 4)]
        """
        leaves, spec = _tree.flatten(_to_tensors(element))
        if not leaves:
            raise ValueError(f"from_tensor_slices needs at least one tensor. Received: {element!r}")
        sizes = [leaf.shape[0] if leaf.dim() > 0 else None for leaf in leaves]
        if None in sizes:
            raise ValueError(
                "from_tensor_slices slices every component along its first dimension, but got "
                f"a scalar (component shapes: {[list(leaf.shape) for leaf in leaves]}). Use "
                "Dataset.from_tensors for a single element."
            )
        if len(set(sizes)) > 1:
            raise ValueError(
                "Every component given to from_tensor_slices must have the same first "
                f"dimension, but got the sizes {sizes}."
            )
        return _Slices(leaves, spec, int(leaves[0].shape[0]))

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> Dataset:
        """Elements of several datasets side by side, stopping with the shortest.

        Takes a tuple (or dict) of datasets as TensorFlow does, or the datasets as arguments.

        >>> [(int(x), int(y)) for x, y in Dataset.zip((Dataset.range(3), Dataset.range(7, 9)))]
        [(0, 7), (1, 8)]
        """
        if (datasets is None) == (not args):
            raise TypeError(
                "Dataset.zip takes the datasets either as one structure, as arguments, or as "
                f"datasets=, exactly one of them. Received: args={args}, datasets={datasets}"
            )
        if datasets is None:
            datasets = args[0] if len(args) == 1 else args
        members, spec = _tree.flatten(datasets)
        wrong = [m for m in members if not isinstance(m, Dataset)]
        if wrong or not members:
            raise TypeError(
                "Dataset.zip needs a non-empty structure of Datasets, but it holds "
                f"{[type(m).__name__ for m in wrong] or 'nothing'}. Received: {datasets!r}"
            )
        return _Stage(_zipped, (members, spec), _zip_cardinality(members))

    # Transformations.

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Consecutive elements stacked into batches; the container types are kept.

        >>> [b.tolist() for b in Dataset.range(7).batch(3, drop_remainder=True)]
        [[0, 1, 2], [3, 4, 5]]
        """
        batch_size = _positive("batch_size", batch_size)
        n = self._cardinality
        if n >= 0:
            n = n // batch_size if drop_remainder else -(-n // batch_size)
        return _Stage(_batched, (self, batch_size, drop_remainder), n)

    def unbatch(self) -> Dataset:
        """Each element split back into its rows along the first dimension.

        >>> [int(x) for x in Dataset.range(5).batch(2).unbatch()]
        [0, 1, 2, 3, 4]
        """
        return _Stage(_unbatched, (self,), UNKNOWN_CARDINALITY)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset:
        """``map_func`` applied to each element; tuple elements are passed as arguments.

        ``num_parallel_calls`` and ``deterministic`` are accepted for porting: ``map_func``
        runs on the iterating thread, in order (use DataLoader workers for parallelism).

        >>> [int(y) for y in Dataset.range(3).map(lambda x: x * 2)]
        [0, 2, 4]
        """
        return _Stage(_mapped, (self, map_func), self._cardinality)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which ``predicate`` (a bool or scalar tensor) is true.

        >>> [int(x) for x in Dataset.range(6).filter(lambda x: x % 2 == 0)]
        [0, 2, 4]
        """
        return _Stage(_filtered, (self, predicate), UNKNOWN_CARDINALITY)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Elements drawn at random from a buffer of ``buffer_size`` (TensorFlow's algorithm).

        With a ``seed`` the orders are reproducible; each iteration (epoch) draws a new order
        unless ``reshuffle_each_iteration=False``. Without one, the seed is drawn from torch's
        global generator, so ``torch.manual_seed`` makes runs reproducible.

        >>> ds = Dataset.range(5).shuffle(5, seed=1)
        >>> sorted(int(x) for x in ds)
        [0, 1, 2, 3, 4]
        """
        buffer_size = _positive("buffer_size", buffer_size)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        seeds = _Seeds(_int("seed", seed), reshuffle_each_iteration)
        return _Stage(_shuffled, (self, buffer_size, seeds), self._cardinality)

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset ``count`` times over; forever when ``count`` is None or -1.

        >>> [int(x) for x in Dataset.range(2).repeat(2)]
        [0, 1, 0, 1]
        """
        count = -1 if count is None else _int("count", count)
        if count < -1:
            raise ValueError(f"repeat needs count >= 0, or None or -1 for forever. "
                             f"Received: count={count}")
        n = self._cardinality
        if count == 0 or n == 0:
            n = 0
        elif count == -1:
            n = INFINITE_CARDINALITY if n != UNKNOWN_CARDINALITY else n
        elif n > 0:
            n *= count
        return _Stage(_repeated, (self, count), n)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``.

        >>> [int(x) for x in Dataset.range(7).shard(3, 1)]
        [1, 4]
        """
        num_shards = _positive("num_shards", num_shards)
        index = _int("index", index)
        if not 0 <= index < num_shards:
            raise ValueError(
                f"shard needs 0 <= index < num_shards, but got index == {index} and "
                f"num_shards == {num_shards}."
            )
        n = self._cardinality
        if n >= 0:
            n = max(0, -(-(n - index) // num_shards))
        return _Stage(_islice, (self, index, None, num_shards), n)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all of them for -1).

        >>> [int(x) for x in Dataset.range(5).take(2)]
        [0, 1]
        """
        count = _at_least_minus_one("count", count)
        if count == -1:
            return self
        n = self._cardinality
        n = count if n == INFINITE_CARDINALITY else (min(n, count) if n >= 0 else n)
        return _Stage(_islice, (self, 0, count, 1), n)

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none of them for -1).

        >>> [int(x) for x in Dataset.range(5).skip(3)]
        [3, 4]
        """
        count = _at_least_minus_one("count", count)
        if count == -1:
            return _Stage(_islice, (self, 0, 0, 1), 0)
        n = self._cardinality
        n = max(n - count, 0) if n >= 0 else n
        return _Stage(_islice, (self, count, None, 1), n)

    def prefetch(self, buffer_size: int) -> Dataset:
        """Elements produced ahead by a background thread, up to ``buffer_size`` of them.

        ``AUTOTUNE`` (-1) picks a small buffer; 0 returns the dataset unchanged.

        >>> [int(x) for x in Dataset.range(3).prefetch(AUTOTUNE)]
        [0, 1, 2]
        """
        buffer_size = _at_least_minus_one("buffer_size", buffer_size)
        if buffer_size == 0:
            return self
        size = _AUTOTUNE_BUFFER if buffer_size == AUTOTUNE else buffer_size
        return _Stage(_prefetched, (self, size), self._cardinality)

    # Inspection.

    def cardinality(self) -> int:
        """The number of elements: -1 (``INFINITE_CARDINALITY``) or -2 (unknown) otherwise.

        >>> Dataset.range(5).batch(2).cardinality(), Dataset.range(1).repeat().cardinality()
        (3, -1)
        """
        return self._cardinality

    def __len__(self) -> int:
        n = self._cardinality
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite, so it has no len().")
        if n < 0:
            raise TypeError(
                "The dataset's length is unknown (filter and unbatch hide it), so it has no "
                "len(); iterate it to count, or check cardinality()."
            )
        return n

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements with every tensor as a numpy array (0-d tensors as numpy scalars).

        >>> [int(x) for x in Dataset.range(2).as_numpy_iterator()]
        [0, 1]
        """
        return (_tree.map_leaves(_to_numpy, element) for element in self)


class _Stage(Dataset):
    """A transformation: ``generate(*args)`` makes a fresh iterator for every pass."""

    def __init__(self, generate: Callable[..., Iterator[Any]], args: tuple[Any, ...], n: int):
        self._generate = generate
        self._args = args
        self._cardinality = n

    def __iter__(self) -> Iterator[Any]:
        return self._generate(*self._args)


class _Range(Dataset):
    """``Dataset.range``: the integers of a Python range, one scalar tensor each."""

    def __init__(self, values: range, dtype: torch.dtype) -> None:
        self._values = values
        self._dtype = dtype
        self._cardinality = len(values)

    def __iter__(self) -> Iterator[Any]:
        dtype = self._dtype
        return (torch.tensor(i, dtype=dtype) for i in self._values)

    def _batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any] | None:
        values, dtype = self._values, self._dtype
        cuts = range(0, len(values), batch_size)
        return (
            torch.arange(part.start, part.stop, part.step, dtype=dtype)
            for part in (values[i : i + batch_size] for i in cuts)
            if not drop_remainder or len(part) == batch_size
        )


class _Slices(Dataset):
    """``from_tensor_slices`` (and ``from_tensors``): rows of leaves, as views."""

    def __init__(self, leaves: list[torch.Tensor], spec: _tree.TreeSpec, n: int) -> None:
        self._leaves = leaves
        self._spec = spec
        self._cardinality = n

    def __iter__(self) -> Iterator[Any]:
        return self._cut(1, drop_remainder=False, rows=True)

    def _batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any] | None:
        return self._cut(batch_size, drop_remainder, rows=False)

    def _cut(self, size: int, drop_remainder: bool, rows: bool) -> Iterator[Any]:
        leaves, spec, n = self._leaves, self._spec, self._cardinality
        stop = n - n % size if drop_remainder else n
        for start in range(0, stop, size):
            if rows:
                parts = [leaf[start] for leaf in leaves]
            else:
                parts = [leaf.narrow(0, start, min(size, n - start)) for leaf in leaves]
            yield parts[0] if spec.is_leaf() else _tree.unflatten(parts, spec)


class _Seeds:
    """The seed of each pass of a shuffled dataset: a new one per pass unless told otherwise."""

    def __init__(self, seed: int, reshuffle: bool) -> None:
        self._seed = seed
        self._reshuffle = reshuffle
        self._passes = 0

    def next(self) -> int:
        passes = self._passes
        if self._reshuffle:
            self._passes += 1
        worker = get_worker_info()
        # A DataLoader worker gets a fresh copy of this counter every epoch; the worker seed,
        # drawn from the parent's generator per epoch, still makes each epoch differ.
        salt = 0 if worker is None or not self._reshuffle else worker.seed
        return hash((self._seed, passes, salt))


# The generators behind the stages: module-level, so that a Dataset pickles into workers.


def _zipped(members: list[Dataset], spec: _tree.TreeSpec) -> Iterator[Any]:
    for row in zip(*members):
        yield _tree.unflatten(list(row), spec)


def _batched(dataset: Dataset, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    fast = dataset._batches(batch_size, drop_remainder)
    if fast is not None:
        yield from fast
        return
    iterator = iter(dataset)
    while elements := list(itertools.islice(iterator, batch_size)):
        if drop_remainder and len(elements) < batch_size:
            return
        yield _collate(elements)


def _collate(elements: list[Any]) -> Any:
    """Stack elements leaf by leaf with torch's collate, keeping the container types."""
    leaves, spec = _tree.flatten(elements[0])
    columns: list[list[Any]] = [[leaf] for leaf in leaves]
    for element in elements[1:]:
        leaves, other = _tree.flatten(element)
        if other != spec:
            raise ValueError(
                "batch needs every element to have the same structure, but got "
                f"{spec} and {other}."
            )
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    try:
        stacked = [default_collate(column) for column in columns]
    except RuntimeError as error:
        raise ValueError(
            f"Cannot batch elements of different shapes ({error}). Make every element the "
            "same shape (e.g. with map) before batch, or batch with batch_size=1."
        ) from error
    return _tree.unflatten(stacked, spec)


def _unbatched(dataset: Dataset) -> Iterator[Any]:
    for element in dataset:
        leaves, spec = _tree.flatten(element)
        leaves = [from_numpy(leaf) for leaf in leaves]
        sizes = {
            leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None
            for leaf in leaves
        }
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                "unbatch needs every component of an element to have the same first "
                f"dimension, but got {[getattr(x, 'shape', type(x)) for x in leaves]}."
            )
        for row in zip(*(leaf.unbind(0) for leaf in leaves)):
            yield _tree.unflatten(list(row), spec)


def _mapped(dataset: Dataset, fn: Callable[..., Any]) -> Iterator[Any]:
    for element in dataset:
        yield fn(*element) if type(element) is tuple else fn(element)


def _filtered(dataset: Dataset, predicate: Callable[..., Any]) -> Iterator[Any]:
    for element in dataset:
        keep = predicate(*element) if type(element) is tuple else predicate(element)
        if isinstance(keep, torch.Tensor) and keep.numel() != 1:
            raise ValueError(
                "filter's predicate must return a bool or a scalar tensor, but returned a "
                f"tensor of shape {list(keep.shape)}."
            )
        if keep:
            yield element


def _shuffled(dataset: Dataset, buffer_size: int, seeds: _Seeds) -> Iterator[Any]:
    rng = random.Random(seeds.next())
    buffer: list[Any] = []
    for element in dataset:
        if len(buffer) < buffer_size:
            buffer.append(element)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = element
    rng.shuffle(buffer)
    yield from buffer


def _repeated(dataset: Dataset, count: int) -> Iterator[Any]:
    passes = itertools.count() if count == -1 else range(count)
    for _ in passes:
        empty = True
        for element in dataset:
            empty = False
            yield element
        if empty:  # forever over nothing is nothing, as in TensorFlow
            return


def _islice(dataset: Dataset, start: int, stop: int | None, step: int) -> Iterator[Any]:
    return itertools.islice(dataset, start, stop, step)


def _prefetched(dataset: Dataset, buffer_size: int) -> Iterator[Any]:
    return PrefetchIterator(iter(dataset), buffer_size)


# Conversions and checks.


def _to_tensors(value: Any) -> Any:
    """TensorFlow's reading of a structure: tuples and dicts nest, lists become tensors."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return from_numpy(value)
    if isinstance(value, dict):
        return type(value)((key, _to_tensors(item)) for key, item in value.items())
    if isinstance(value, tuple):
        items = [_to_tensors(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        if any(isinstance(item, (torch.Tensor, np.ndarray)) for item in value):
            return torch.stack([_to_tensors(item) for item in value])
        return torch.tensor(value)
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return torch.as_tensor(value)
    raise TypeError(
        "Dataset components must be tensors, numpy arrays, Python numbers or lists of them, "
        f"nested in tuples, dicts or namedtuples, but got a {type(value).__name__}. "
        f"Received: {value!r}"
    )


def _to_numpy(leaf: Any) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    array = leaf.numpy(force=True)
    return array[()] if array.ndim == 0 else array


def _zip_cardinality(members: list[Dataset]) -> int:
    counts = [m.cardinality() for m in members]
    if all(n == INFINITE_CARDINALITY for n in counts):
        return INFINITE_CARDINALITY
    if UNKNOWN_CARDINALITY in counts:
        return UNKNOWN_CARDINALITY
    return min(n for n in counts if n >= 0)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not a bool. Received: {name}={value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}") from None


def _positive(name: str, value: Any) -> int:
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value}")
    return value


def _at_least_minus_one(name: str, value: Any) -> int:
    value = _int(name, value)
    if value < -1:
        raise ValueError(f"{name} must be >= 0, or -1 for all. Received: {name}={value}")
    return value
