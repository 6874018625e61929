"""The generators behind ``Dataset``'s sources and transformations, one per method.

Each is a module-level function of the stage's arguments that returns a fresh iterator per
pass, so that a dataset pickles into ``DataLoader`` workers (a closure would not). ``Dataset``
wraps each in a ``_Stage`` with the cardinality it implies; the argument checks and that
arithmetic stay with the methods in ``dataset.py``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import default_collate, get_worker_info

from .. import _tree
from .prefetch import PrefetchIterator
from .split import from_numpy

if TYPE_CHECKING:
    from .dataset import Dataset


class Seeds:
    """The seed of each pass of a shuffled dataset: a new one per pass unless told otherwise."""

    def __init__(self, seed: int, reshuffle: bool) -> None:
        self._seed = seed
        self._reshuffle = reshuffle
        self._passes = 0

    def next(self) -> int:
        passes = self._passes
        self._passes += self._reshuffle
        # A DataLoader worker gets a fresh copy of this counter every epoch; the worker seed,
        # drawn from the parent's generator per epoch, still makes each epoch differ.
        worker = get_worker_info()
        salt = worker.seed if worker is not None and self._reshuffle else 0
        return hash((self._seed, passes, salt))


def ranged(values: range, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    return (torch.tensor(i, dtype=dtype) for i in values)


def zipped(datasets: Any) -> Iterator[Any]:
    members, spec = _tree.flatten(datasets)
    for row in zip(*members, strict=False):
        yield _tree.unflatten(list(row), spec)


def batched(dataset: Dataset, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    fast = dataset._batches(batch_size, drop_remainder)
    if fast is not None:
        yield from fast
        return
    iterator = iter(dataset)
    while elements := list(itertools.islice(iterator, batch_size)):
        if drop_remainder and len(elements) < batch_size:
            return
        yield collate(elements)


def collate(elements: list[Any]) -> Any:
    """Stack elements leaf by leaf with torch's collate, keeping the container types."""
    leaves, spec = _tree.flatten(elements[0])
    columns: list[list[Any]] = [[leaf] for leaf in leaves]
    for element in elements[1:]:
        leaves, other = _tree.flatten(element)
        if other != spec:
            raise ValueError(f"batch needs elements of one structure, but got {spec} and {other}.")
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    try:
        stacked = [default_collate(column) for column in columns]
    except RuntimeError as error:
        raise ValueError(
            f"Cannot batch elements of different shapes ({error}). Make every element the "
            "same shape (e.g. with map) before batch."
        ) from error
    return _tree.unflatten(stacked, spec)


def unbatched(dataset: Dataset) -> Iterator[Any]:
    for element in dataset:
        leaves, spec = _tree.flatten(element)
        leaves = [from_numpy(leaf) for leaf in leaves]
        sizes = {leaf.shape[0] if _has_rows(leaf) else None for leaf in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                "unbatch needs every component of an element to have the same first "
                f"dimension, but got {[getattr(x, 'shape', type(x)) for x in leaves]}."
            )
        for row in zip(*(leaf.unbind(0) for leaf in leaves), strict=True):
            yield _tree.unflatten(list(row), spec)


def mapped(dataset: Dataset, fn: Callable[..., Any]) -> Iterator[Any]:
    for element in dataset:
        yield fn(*element) if type(element) is tuple else fn(element)


def filtered(dataset: Dataset, predicate: Callable[..., Any]) -> Iterator[Any]:
    for element in dataset:
        keep = predicate(*element) if type(element) is tuple else predicate(element)
        if isinstance(keep, torch.Tensor) and keep.numel() != 1:
            raise ValueError(
                "filter's predicate must return a bool or a scalar tensor, but returned a "
                f"tensor of shape {list(keep.shape)}."
            )
        if keep:
            yield element


def shuffled(dataset: Dataset, buffer_size: int, seeds: Seeds) -> Iterator[Any]:
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


def repeated(dataset: Dataset, count: int) -> Iterator[Any]:
    for _ in itertools.count() if count == -1 else range(count):
        empty = True
        for element in dataset:
            empty = False
            yield element
        if empty:  # forever over nothing is nothing, as in TensorFlow
            return


def sliced(dataset: Dataset, start: int, stop: int | None, step: int) -> Iterator[Any]:
    return itertools.islice(dataset, start, stop, step)


def prefetched(dataset: Dataset, buffer_size: int) -> Iterator[Any]:
    return PrefetchIterator(iter(dataset), buffer_size)


def _has_rows(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0
