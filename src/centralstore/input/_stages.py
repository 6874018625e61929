"""The generators behind ``Dataset``'s sources and element-wise transformations.

Each is a module-level function of the stage's arguments that returns a fresh iterator per
pass, so that a dataset pickles into ``DataLoader`` workers (a closure would not). Inputs
are plain iterables: a stage never needs to know what kind of dataset feeds it. The
argument checks and the cardinality arithmetic stay with the methods in ``dataset.py``;
batching lives in ``_batching.py``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .. import _tree
from ._base import DatasetBase
from .components import conform, to_components
from .prefetch import PrefetchIterator
from .strings import is_text


class Seeds:
    """The seed of each pass of a random stage: a new one per pass unless told otherwise.

    ``state()`` and ``set_state()`` are what a distributed iterator saves and restores (the
    seed, drawn from torch's generator when none was given, and the passes made), so that a
    resumed pipeline draws the orders of the run it resumes.
    """

    def __init__(self, seed: int, reshuffle: bool) -> None:
        self._seed = seed
        self._reshuffle = reshuffle
        self._passes = 0

    def state(self) -> list[int]:
        return [self._seed, self._passes]

    def set_state(self, state: list[int]) -> None:
        self._seed, self._passes = int(state[0]), int(state[1])

    def next(self) -> int:
        passes = self._passes
        self._passes += self._reshuffle
        # A DataLoader worker gets a fresh copy of this counter every epoch; the worker seed,
        # drawn from the parent's generator per epoch, still makes each epoch differ.
        worker = get_worker_info()
        salt = worker.seed if worker is not None and self._reshuffle else 0
        return hash((self._seed, passes, salt))


class Cache:
    """The elements of the first complete pass, replayed by every later pass."""

    def __init__(self) -> None:
        self.elements: list[Any] | None = None


def call(fn: Callable[..., Any], element: Any) -> Any:
    """``fn`` on an element: a plain tuple is passed as arguments, as TensorFlow does."""
    return fn(*element) if type(element) is tuple else fn(element)


# Sources.


def ranged(values: range, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    return (torch.tensor(i, dtype=dtype) for i in values)


def counted(start: int, step: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    return (torch.tensor(i, dtype=dtype) for i in itertools.count(start, step))


def random_integers(seeds: Seeds) -> Iterator[torch.Tensor]:
    rng = random.Random(seeds.next())
    while True:
        yield torch.tensor(rng.getrandbits(63), dtype=torch.int64)


def generated(
    generator: Callable[..., Iterable[Any]], args: tuple[Any, ...], signature: Any
) -> Iterator[Any]:
    call_name = "Dataset.from_generator"
    elements = generator(*args)
    if not isinstance(elements, Iterable):
        raise TypeError(
            f"{call_name}(generator) must return an iterator (or an iterable) each time it is "
            f"called. Received: it returned a {type(elements).__name__}"
        )
    for element in elements:
        if signature is None:
            yield to_components(element, call_name)
        else:
            yield conform(element, signature, call_name)


def zipped(datasets: Any) -> Iterator[Any]:
    members, spec = _tree.flatten(datasets)
    for row in zip(*members, strict=False):
        yield _tree.unflatten(list(row), spec)


def chosen(
    datasets: Sequence[Iterable[Any]], choices: Iterable[Any], stop_on_empty: bool
) -> Iterator[Any]:
    iterators = [iter(dataset) for dataset in datasets]
    for choice in choices:
        index = _index(choice, len(iterators))
        for element in iterators[index]:
            yield element
            break
        else:
            if stop_on_empty:
                return


def sampled(
    datasets: Sequence[Iterable[Any]], weights: list[float], seeds: Seeds, stop_on_empty: bool
) -> Iterator[Any]:
    rng = random.Random(seeds.next())
    active = [(iter(dataset), weight) for dataset, weight in zip(datasets, weights, strict=True)]
    active = [(iterator, weight) for iterator, weight in active if weight > 0]
    while active:
        (i,) = rng.choices(range(len(active)), weights=[w for _, w in active])
        for element in active[i][0]:
            yield element
            break
        else:
            if stop_on_empty:
                return
            del active[i]


# Transformations.


def enumerated(source: Iterable[Any], start: int) -> Iterator[Any]:
    for i, element in enumerate(source, start):
        yield torch.tensor(i, dtype=torch.int64), element


def concatenated(first: Iterable[Any], second: Iterable[Any]) -> Iterator[Any]:
    yield from first
    yield from second


def mapped(source: Iterable[Any], fn: Callable[..., Any]) -> Iterator[Any]:
    return (call(fn, element) for element in source)


def flat_mapped(source: Iterable[Any], fn: Callable[..., Any]) -> Iterator[Any]:
    for element in source:
        yield from _dataset_of(fn, element, "flat_map")


def interleaved(
    source: Iterable[Any], fn: Callable[..., Any], cycle_length: int, block_length: int
) -> Iterator[Any]:
    """TensorFlow's deterministic order: ``block_length`` elements from each of
    ``cycle_length`` open datasets in turn; an exhausted one is replaced by the dataset of
    the next input element, in its slot."""
    inputs = iter(source)
    slots: list[Iterator[Any] | None] = [None] * cycle_length
    slot = 0
    more_input = True
    while more_input or any(s is not None for s in slots):
        current = slots[slot]
        if current is None and more_input:
            element = next(inputs, _END)
            if element is _END:
                more_input = False
            else:
                slots[slot] = iter(_dataset_of(fn, element, "interleave"))
            continue
        for _ in range(block_length if current is not None else 0):
            item = next(current, _END)  # type: ignore[arg-type]
            if item is _END:
                slots[slot] = None
                break
            yield item
        slot = (slot + 1) % cycle_length


def filtered(source: Iterable[Any], predicate: Callable[..., Any]) -> Iterator[Any]:
    for element in source:
        if _truth(call(predicate, element), "filter"):
            yield element


def taken_while(source: Iterable[Any], predicate: Callable[..., Any]) -> Iterator[Any]:
    for element in source:
        if not _truth(call(predicate, element), "take_while"):
            return
        yield element


def scanned(source: Iterable[Any], state: Any, fn: Callable[[Any, Any], Any]) -> Iterator[Any]:
    for element in source:
        result = fn(state, element)
        if not isinstance(result, tuple) or len(result) != 2:
            raise ValueError(
                "Dataset.scan(scan_func) must return a pair (new_state, output_element). "
                f"Received: {type(result).__name__} {result!r}"
            )
        state, output = result
        yield output


def unique(source: Iterable[Any]) -> Iterator[Any]:
    seen: set[Any] = set()
    for element in source:
        key = _unique_key(element)
        if key not in seen:
            seen.add(key)
            yield element


def cached(source: Iterable[Any], cache: Cache) -> Iterator[Any]:
    if cache.elements is not None:
        yield from cache.elements
        return
    elements = []
    for element in source:
        elements.append(element)
        yield element
    cache.elements = elements  # reached only when this pass went through to the end


def shuffled(source: Iterable[Any], buffer_size: int, seeds: Seeds) -> Iterator[Any]:
    rng = random.Random(seeds.next())
    buffer: list[Any] = []
    for element in source:
        if len(buffer) < buffer_size:
            buffer.append(element)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = element
    rng.shuffle(buffer)
    yield from buffer


def repeated(source: Iterable[Any], count: int) -> Iterator[Any]:
    for _ in itertools.count() if count == -1 else range(count):
        empty = True
        for element in source:
            empty = False
            yield element
        if empty:  # forever over nothing is nothing, as in TensorFlow
            return


def sliced(source: Iterable[Any], start: int, stop: int | None, step: int) -> Iterator[Any]:
    return itertools.islice(source, start, stop, step)


def passed(source: Iterable[Any]) -> Iterator[Any]:
    return iter(source)


def prefetched(source: Iterable[Any], buffer_size: int) -> Iterator[Any]:
    return PrefetchIterator(iter(source), buffer_size)


_END = object()


def _dataset_of(fn: Callable[..., Any], element: Any, method: str) -> Iterable[Any]:
    dataset = call(fn, element)
    if not isinstance(dataset, DatasetBase):
        raise TypeError(
            f"Dataset.{method}(map_func) must return a Dataset for each element, e.g. "
            f"Dataset.from_tensor_slices(x). Received: a {type(dataset).__name__}"
        )
    return dataset


def _truth(keep: Any, method: str) -> bool:
    if isinstance(keep, torch.Tensor) and keep.numel() != 1:
        raise ValueError(
            f"Dataset.{method}'s predicate must return a bool or a scalar tensor, but returned "
            f"a tensor of shape {list(keep.shape)}."
        )
    return bool(keep)


def _unique_key(element: Any) -> Any:
    if is_text(element):
        return element
    if isinstance(element, torch.Tensor) and element.dim() == 0 and not element.is_floating_point():
        return element.item()
    raise ValueError(
        "Dataset.unique needs elements that are integer scalars or strings (as TensorFlow). "
        f"Received: {element!r}"
    )


def _index(choice: Any, count: int) -> int:
    integral = (isinstance(choice, int) and not isinstance(choice, bool)) or (
        isinstance(choice, torch.Tensor)
        and choice.dim() == 0
        and not choice.is_floating_point()
        and choice.dtype != torch.bool
    )
    index = int(choice) if integral else -1
    if not 0 <= index < count:
        raise ValueError(
            f"Dataset.choose_from_datasets(choice_dataset) must yield int scalars in [0, {count})"
            f", one index into datasets per element. Received: {choice!r}"
        )
    return index
