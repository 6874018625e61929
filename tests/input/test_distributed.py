"""Distributed datasets on logical CPU devices: values, placement, prefetch thread, errors."""

from __future__ import annotations

import collections
import gc
import re
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from centralstore._values import PerReplica
from centralstore.input.dataset import Dataset
from centralstore.input.distributed import (
    DistributedDataset,
    distribute_dataset,
    distribute_datasets_from_function,
)
from centralstore.input.options import InputContext, InputOptions

TWO = ("cpu:0", "cpu:1")
INLINE = InputOptions(experimental_fetch_to_device=False, experimental_place_dataset_on_device=True)


def per_replica(step: object) -> Any:
    """A step as plain lists: one per replica (or the value itself with one replica)."""
    if isinstance(step, PerReplica):
        return [component.tolist() for component in step]
    assert isinstance(step, torch.Tensor)
    return step.tolist()


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


class Flaky:
    """A re-iterable source that raises ``error`` after ``good`` batches."""

    def __init__(self, good: int, error: BaseException) -> None:
        self.good = good
        self.error = error

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.good):
            yield torch.full((2,), i)
        raise self.error


class Endless:
    """A re-iterable source without end, that counts the batches it produced."""

    def __init__(self) -> None:
        self.produced = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.produced += 1
            yield torch.zeros(4, 3)


# TensorFlow's documented example: range(5).batch(2), `val + 1` in every replica.


def test_tensorflow_example_on_one_replica_gives_plain_values() -> None:
    dist = distribute_dataset(Dataset.range(5).batch(2), ("cpu:0",))
    steps = [step + 1 for step in dist]
    assert [s.tolist() for s in steps] == [[1, 2], [3, 4], [5]]


def test_tensorflow_example_on_two_replicas_gives_per_replica_values() -> None:
    dist = distribute_dataset(Dataset.range(5).batch(2), TWO)
    steps = [PerReplica([x + 1 for x in step]) for step in dist]
    assert [per_replica(s) for s in steps] == [[[1], [2]], [[3], [4]], [[5], []]]


@pytest.mark.parametrize(
    "options", [None, INLINE, InputOptions(experimental_per_replica_buffer_size=3)]
)
def test_split_table_through_every_iterator_kind(options: InputOptions | None) -> None:
    dist = distribute_dataset(Dataset.range(7).batch(4), ("cpu:0", "cpu:1", "cpu:2"), options)
    expected = [[[0, 1], [2, 3], []], [[4], [5], [6]]]
    assert [per_replica(step) for step in dist] == expected


def test_nested_tuple_dict_and_namedtuple_batches_keep_their_structure() -> None:
    Pair = collections.namedtuple("Pair", ["x", "y"])
    batches = [(torch.zeros(4, 2), {"label": torch.arange(4), "pair": Pair(torch.ones(4), 1)})]
    batches[0][1]["pair"] = Pair(torch.ones(4), torch.arange(4.0))
    (step,) = list(distribute_dataset(batches, TWO))
    x, extras = step
    assert isinstance(x, PerReplica)
    assert [tuple(c.shape) for c in x] == [(2, 2), (2, 2)]
    assert per_replica(extras["label"]) == [[0, 1], [2, 3]]
    assert type(extras["pair"]) is Pair
    assert per_replica(extras["pair"].y) == [[0.0, 1.0], [2.0, 3.0]]


def test_numpy_batches_become_tensors_sharing_memory() -> None:
    array = np.arange(8, dtype=np.float32).reshape(4, 2)
    (step,) = list(distribute_dataset([array], TWO))
    assert step[0].data_ptr() == array.ctypes.data
    assert per_replica(step) == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]


@pytest.mark.parametrize("fetch", [True, False])
def test_cpu_slices_are_views_not_copies(fetch: bool) -> None:
    batch = torch.arange(10.0).reshape(5, 2).clone()
    options = InputOptions(experimental_fetch_to_device=fetch)
    (step,) = list(distribute_dataset([batch], TWO, options))
    first, second = step
    assert first._base is batch
    assert second._base is batch
    assert second.data_ptr() == batch.data_ptr() + 3 * 2 * batch.element_size()
    assert first.device == torch.device("cpu")


def test_one_replica_passes_the_batch_object_through() -> None:
    batch = torch.ones(3)
    (step,) = list(distribute_dataset([batch], ("cpu:0",)))
    assert step is batch


def test_dataloader_with_workers_as_the_source() -> None:
    data = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5))
    loader = DataLoader(data, batch_size=3, num_workers=2)
    dist = distribute_dataset(loader, TWO)
    assert len(dist) == 2
    steps = list(dist)
    assert [per_replica(y) for _, y in steps] == [[[0, 1], [2]], [[3], [4]]]
    assert per_replica(steps[1][0]) == [[[6.0, 7.0]], [[8.0, 9.0]]]


def test_a_distributed_dataset_is_re_iterable_with_len() -> None:
    dist = distribute_dataset(Dataset.range(6).batch(3), TWO)
    expected = [[[0, 1], [2]], [[3, 4], [5]]]
    assert [per_replica(step) for step in dist] == expected
    assert [per_replica(step) for step in dist] == expected
    assert len(dist) == 2


def test_a_shuffled_source_is_reshuffled_every_pass() -> None:
    dist = distribute_dataset(Dataset.range(8).shuffle(8, seed=0).batch(4), TWO)
    passes = [[x for step in dist for part in per_replica(step) for x in part] for _ in "ab"]
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(8))
    assert passes[0] != passes[1]


def test_len_needs_a_source_with_len() -> None:
    dist = distribute_dataset(Dataset.range(4).filter(bool).batch(2), TWO)
    with pytest.raises(TypeError, match=re.escape("no len(): its source, a _Stage, has none")):
        len(dist)


def test_global_replicas_and_offset_keep_this_process_slices() -> None:
    dist = distribute_dataset(
        Dataset.range(8).batch(8), TWO, replica_offset=2, global_replicas=4
    )
    assert [per_replica(step) for step in dist] == [[[4, 5], [6, 7]]]
    single = distribute_dataset(Dataset.range(3).batch(3), ("cpu:0",), global_replicas=2)
    assert [per_replica(step) for step in single] == [[0, 1]]


def test_scalar_elements_over_two_replicas_raise_in_the_loop() -> None:
    with pytest.raises(ValueError, match="Batch the dataset first"):
        list(distribute_dataset(Dataset.range(3), TWO))


# The prefetch thread: errors, abandoning, closing.


def test_source_error_reaches_the_consumer_as_the_same_object() -> None:
    error = OSError("disk went away")
    seen = []
    with pytest.raises(OSError) as caught:
        for step in distribute_dataset(Flaky(2, error), TWO):
            seen.append(step)
    assert caught.value is error
    assert len(seen) == 2


def test_error_in_iter_of_the_source_raises_at_iter() -> None:
    class Broken:
        def __iter__(self) -> Iterator[torch.Tensor]:
            raise RuntimeError("cannot open")

    with pytest.raises(RuntimeError, match="cannot open"):
        iter(distribute_dataset(Broken(), TWO))


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
    assert wait_for_no_input_thread(before, seconds=0.5)
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_next_and_the_context_manager() -> None:
    before = set(input_threads())
    with iter(distribute_dataset(Dataset.range(4).batch(2), TWO)) as iterator:
        assert per_replica(iterator.get_next()) == [[0], [1]]
    assert wait_for_no_input_thread(before)


def test_place_dataset_on_device_runs_without_a_thread() -> None:
    before = set(input_threads())
    iterator = iter(distribute_dataset(Dataset.range(4).batch(2), TWO, INLINE))
    assert per_replica(next(iterator)) == [[0], [1]]
    assert set(input_threads()) <= before
    iterator.close()
    with pytest.raises(StopIteration):
        next(iterator)


# distribute_datasets_from_function


def test_from_function_deals_elements_and_pads_the_last_step() -> None:
    dist = distribute_datasets_from_function(lambda ctx: Dataset.range(7).batch(3), TWO)
    assert [per_replica(step) for step in dist] == [[[0, 1, 2], [3, 4, 5]], [[6], []]]
    assert len(dist) == 2


def test_from_function_padding_keeps_trailing_dims_and_dtype() -> None:
    def dataset_fn(ctx: InputContext) -> Dataset:
        return Dataset.from_tensor_slices(np.zeros((3, 4), dtype=np.float16)).batch(2)

    devices = ("cpu:0", "cpu:1", "cpu:2")
    (last,) = list(distribute_datasets_from_function(dataset_fn, devices))
    assert [tuple(c.shape) for c in last] == [(2, 4), (1, 4), (0, 4)]
    assert all(c.dtype == torch.float16 for c in last)


def test_from_function_gets_the_input_context_once() -> None:
    calls = []

    def dataset_fn(ctx: InputContext) -> Dataset:
        calls.append(ctx)
        batch = ctx.get_per_replica_batch_size(4)
        return Dataset.range(8).batch(batch)

    dist = distribute_datasets_from_function(dataset_fn, TWO)
    assert [per_replica(step) for step in dist] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    list(dist)
    assert [repr(c) for c in calls] == [repr(InputContext(1, 0, 2))]
    custom = InputContext(2, 1, 4)
    distribute_datasets_from_function(dataset_fn, TWO, input_context=custom)
    assert calls[-1] is custom


def test_from_function_with_scalar_elements_warns_with_the_dropped_count() -> None:
    dist = distribute_datasets_from_function(lambda ctx: Dataset.range(5), TWO)
    with pytest.warns(UserWarning, match="Dropped the last 1 element"):
        steps = [per_replica(step) for step in dist]
    assert steps == [[0, 1], [2, 3]]


def test_from_function_on_one_replica_gives_plain_elements() -> None:
    dist = distribute_datasets_from_function(lambda ctx: Dataset.range(3).batch(2), ("cpu:0",))
    assert [per_replica(step) for step in dist] == [[0, 1], [2]]


# Argument errors.


def test_one_shot_iterator_source_raises() -> None:
    with pytest.raises(TypeError, match=r"one-shot iterator.*Pass a re-iterable"):
        distribute_dataset(iter([torch.zeros(2)]), TWO)


def test_non_iterable_source_raises() -> None:
    with pytest.raises(TypeError, match=r"must be iterable.*got a int"):
        distribute_dataset(5, TWO)  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", [(), "cpu:0", ("cpu:0", 1)])
def test_bad_devices_raise(devices: object) -> None:
    with pytest.raises(TypeError, match="devices must be a non-empty tuple"):
        distribute_dataset([torch.zeros(2)], devices)  # type: ignore[arg-type]


def test_options_of_the_wrong_type_raise() -> None:
    with pytest.raises(TypeError, match=re.escape("Received: options={'fetch': True}")):
        distribute_dataset([torch.zeros(2)], TWO, {"fetch": True})  # type: ignore[arg-type]


@pytest.mark.parametrize(("offset", "global_replicas"), [(-1, 2), (1, 2), (3, 4)])
def test_local_replicas_outside_the_replicas_in_sync_raise(
    offset: int, global_replicas: int
) -> None:
    with pytest.raises(ValueError, match=f"replica_offset == {offset}"):
        distribute_dataset(
            [torch.zeros(2)], TWO, replica_offset=offset, global_replicas=global_replicas
        )


def test_from_function_argument_errors() -> None:
    with pytest.raises(TypeError, match="dataset_fn must be a function"):
        distribute_datasets_from_function(Dataset.range(2), TWO)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_context must be an InputContext"):
        distribute_datasets_from_function(
            lambda ctx: [], TWO, input_context=(1, 0, 2)  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match="returned by dataset_fn must be iterable"):
        distribute_datasets_from_function(lambda ctx: None, TWO)  # type: ignore[arg-type,return-value]


def test_from_function_different_structures_in_one_step_raise() -> None:
    mixed = [torch.zeros(2), {"x": torch.zeros(2)}]
    dist = distribute_datasets_from_function(lambda ctx: mixed, TWO)
    with pytest.raises(ValueError, match="same structure"):
        list(dist)


def test_distributed_dataset_type() -> None:
    assert isinstance(distribute_dataset([torch.zeros(2)], TWO), DistributedDataset)


def test_host_replicas_make_steps_on_the_calling_thread() -> None:
    """On the host there is no copy to overlap: no prefetch thread, and steps are made only
    when the loop asks for them."""
    made: list[int] = []

    class Source:
        def __iter__(self) -> Iterator[torch.Tensor]:
            for i in range(3):
                made.append(i)
                yield torch.arange(2) + i

    before = set(threading.enumerate())
    iterator = iter(distribute_dataset(Source(), ("cpu:0", "cpu:1")))
    assert made == []
    next(iterator)
    assert made == [0]
    assert set(threading.enumerate()) == before
