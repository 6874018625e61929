"""DistributedIterator: get_next, get_next_as_optional, exhaustion, element_spec; Optional."""

from __future__ import annotations

import gc
import re
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from centralstore._values import PerReplica
from centralstore.input.dataset import Dataset
from centralstore.input.distributed import distribute_dataset
from centralstore.input.errors import OutOfRangeError
from centralstore.input.iterator import DistributedIterator, Optional
from centralstore.input.options import InputOptions
from centralstore.input.prefetch import PrefetchIterator
from centralstore.input.spec import TensorSpec

TWO = ("cpu:0", "cpu:1")


def lists(step: Any) -> Any:
    return [c.tolist() for c in step] if isinstance(step, PerReplica) else step.tolist()


def input_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "centralstore-input"]


def wait_for_no_input_thread(before: set[threading.Thread], seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if not [t for t in input_threads() if t not in before and t.is_alive()]:
            return True
        time.sleep(0.01)
    return False


class Endless:
    """A re-iterable source without end, that counts the batches it produced."""

    def __init__(self) -> None:
        self.produced = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.produced += 1
            yield torch.zeros(4, 3)



def test_tensorflow_tutorial_loop_with_get_next_as_optional() -> None:
    dataset = Dataset.range(9).batch(4)
    distributed_iterator = iter(distribute_dataset(dataset, TWO))
    seen = []
    for _ in range(5):  # steps_per_loop
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        seen.append(lists(optional_data.get_value()))
    assert seen == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]


def test_get_next_past_the_end_raises_out_of_range_error() -> None:
    iterator = iter(distribute_dataset(Dataset.range(2).batch(2), TWO))
    assert lists(iterator.get_next()) == [[0], [1]]
    with pytest.raises(OutOfRangeError, match=r"exhausted.*get_next_as_optional"):
        iterator.get_next()
    assert not issubclass(OutOfRangeError, StopIteration)
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_value_of_an_empty_optional_raises() -> None:
    iterator = iter(distribute_dataset([torch.zeros(2)], TWO))
    assert iterator.get_next_as_optional().has_value()
    empty = iterator.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match=r"Test optional\.has_value\(\) first"):
        empty.get_value()


def test_optional_constructors_and_repr() -> None:
    assert Optional.from_value(None).has_value()
    assert Optional.from_value(None).get_value() is None
    assert repr(Optional.from_value(1)) == "Optional(1)"
    assert repr(Optional.empty()) == "Optional.empty()"


# element_spec


def test_iterator_element_spec_keeps_the_step_it_looked_at() -> None:
    dataset = Dataset.from_tensor_slices((torch.zeros(5, 2), ["a", "b", "c", "d", "e"])).batch(4)
    iterator = iter(distribute_dataset(dataset, TWO))
    assert iterator.element_spec == (TensorSpec((None, 2), torch.float32), TensorSpec((None,), str))
    first = iterator.get_next()
    assert list(first[1]) == [["a", "b"], ["c", "d"]]
    assert iterator.element_spec[1] == TensorSpec((None,), str)
    assert list(next(iterator)[1]) == [["e"], []]
    assert iterator.element_spec[0] == TensorSpec((None, 2), torch.float32)  # kept


def test_iterator_element_spec_of_an_exhausted_iterator_raises() -> None:
    iterator = iter(distribute_dataset(Dataset.range(2).batch(2), TWO))
    list(iterator)
    with pytest.raises(ValueError, match=re.escape("Read the dataset's element_spec instead")):
        _ = iterator.element_spec


def test_element_spec_through_a_prefetch_thread_skips_nothing() -> None:
    def steps() -> Iterator[tuple[Any, tuple[()], None]]:
        for i in range(3):
            yield torch.full((2, 3), i), (), None

    iterator = DistributedIterator(PrefetchIterator(steps(), 1))
    assert iterator.element_spec == TensorSpec((None, 3), torch.int64)
    assert [int(step[0, 0]) for step in iterator] == [0, 1, 2]
    iterator.close()


def test_close_drops_a_step_looked_at() -> None:
    iterator = iter(distribute_dataset(Dataset.range(4).batch(2), TWO))
    _ = iterator.element_spec
    iterator.close()
    with pytest.raises(StopIteration):
        next(iterator)


# The prefetch thread: abandoning and closing an iterator.


def test_break_out_of_the_loop_leaves_no_thread_running() -> None:
    before = set(input_threads())
    source = Endless()
    for i, _ in enumerate(distribute_dataset(source, TWO)):
        if i == 3:
            break
    assert wait_for_no_input_thread(before)
    produced = source.produced
    time.sleep(0.05)
    assert source.produced == produced


def test_dropped_iterator_is_not_kept_alive_by_its_thread() -> None:
    before = set(input_threads())
    iterator = iter(distribute_dataset(Endless(), TWO, InputOptions(
        experimental_per_replica_buffer_size=2)))
    next(iterator)
    time.sleep(0.02)  # let the producer fill the queue and block on it
    ref = weakref.ref(iterator)
    del iterator
    gc.collect()
    assert ref() is None
    assert wait_for_no_input_thread(before)


def test_close_stops_the_thread_and_ends_the_iteration() -> None:
    before = set(input_threads())
    iterator = iter(distribute_dataset(Endless(), TWO))
    assert next(iterator) is not None
    iterator.close()
    assert wait_for_no_input_thread(before)
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_next_and_the_context_manager() -> None:
    before = set(input_threads())
    with iter(distribute_dataset(Dataset.range(4).batch(2), TWO)) as iterator:
        assert lists(iterator.get_next()) == [[0], [1]]
    assert wait_for_no_input_thread(before)
