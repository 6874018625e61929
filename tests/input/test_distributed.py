"""Distributed datasets on logical CPU devices: values, placement, prefetch thread, errors."""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import centralstore as cs
from centralstore._values import PerReplica
from centralstore.input.data_options import AutoShardPolicy, Options
from centralstore.input.dataset import Dataset
from centralstore.input.distributed import (
    DistributedDataset,
    distribute_dataset,
    distribute_datasets_from_function,
)
from centralstore.input.options import InputContext, InputOptions
from centralstore.input.spec import TensorSpec

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


class Flaky:
    """A re-iterable source that raises ``error`` after ``good`` batches."""

    def __init__(self, good: int, error: BaseException) -> None:
        self.good = good
        self.error = error

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.good):
            yield torch.full((2,), i)
        raise self.error


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
    with pytest.raises(TypeError, match=re.escape("no len(): its source, a Dataset, has none")):
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


# The prefetch thread: errors (abandoning and closing: test_iterator.py).


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
    call = re.escape("experimental_distribute_dataset(dataset) is a one-shot iterator")
    with pytest.raises(TypeError, match=f"{call}.*Pass a re-iterable"):
        distribute_dataset(iter([torch.zeros(2)]), TWO)


def test_non_iterable_source_raises() -> None:
    with pytest.raises(TypeError, match=r"must be iterable.*got a int\. Received: dataset=5"):
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
    call = re.escape("distribute_datasets_from_function(dataset_fn) must be a function")
    with pytest.raises(TypeError, match=f"{call}.*Received: dataset_fn=<Dataset cardinality=2>"):
        distribute_datasets_from_function(Dataset.range(2), TWO)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_context must be an InputContext"):
        distribute_datasets_from_function(
            lambda ctx: [], TWO, input_context=(1, 0, 2)  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match=r"\(dataset_fn's result\) must be iterable"):
        distribute_datasets_from_function(lambda ctx: None, TWO)  # type: ignore[arg-type,return-value]


def test_from_function_different_structures_in_one_step_raise() -> None:
    mixed = [torch.zeros(2), {"x": torch.zeros(2)}]
    dist = distribute_datasets_from_function(lambda ctx: mixed, TWO)
    with pytest.raises(ValueError, match="same structure"):
        list(dist)


def test_distributed_dataset_type() -> None:
    assert isinstance(distribute_dataset([torch.zeros(2)], TWO), DistributedDataset)


def test_host_replicas_make_steps_on_the_calling_thread() -> None:
    """On the host the first steps are made on the calling thread, only when the loop asks
    for them: a prefetch thread starts only once the loop's steps take time."""
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


def test_a_loop_whose_steps_take_time_gets_its_next_steps_made_on_a_thread() -> None:
    """On the host the first steps are made on the calling thread; once the loop's steps
    take time (here sleeps longer than making a batch; the first time, after 8 steps timed
    past the dataset's first 8, here those of the empty loop), the source moves to the
    prefetch thread for the rest of the pass, and the steps are those made without it."""
    made_on: list[threading.Thread] = []

    class Source:
        def __iter__(self) -> Iterator[torch.Tensor]:
            for i in range(12):
                made_on.append(threading.current_thread())
                time.sleep(0.002)
                yield torch.arange(4) + i

    dataset = distribute_dataset(Source(), TWO)
    expected = [per_replica(step) for step in dataset]  # an empty loop: all made here
    assert set(made_on) == {threading.current_thread()}
    made_on.clear()
    before = set(input_threads())
    got = []
    for step in dataset:
        got.append(per_replica(step))
        time.sleep(0.02)
    assert got == expected
    assert made_on[0] is threading.current_thread()
    assert made_on[-1] is not threading.current_thread()
    deadline = time.monotonic() + 2.0
    while set(input_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(input_threads()) - before


def _made_slowly(batch: torch.Tensor) -> torch.Tensor:
    """A batch that takes 1 ms to make: long enough, on any machine, for the iterator to move
    the source to a thread once the loop's steps take longer (a batch of this pipeline
    alone can take under the 0.1 ms below which that never pays)."""
    time.sleep(0.001)
    return batch


def test_a_position_saved_while_steps_are_made_ahead_resumes_exactly() -> None:
    dataset = distribute_dataset(
        Dataset.range(120).shuffle(120, seed=1).batch(4).map(_made_slowly), TWO
    )
    before = set(input_threads())
    iterator = iter(dataset)
    for _ in range(20):  # moved ahead at the 17th: 8 steps of warm-up, 8 of the baseline
        next(iterator)
        time.sleep(0.01)
    assert set(input_threads()) - before  # the rest of the pass is made ahead
    state = iterator.state_dict()
    assert state["steps"] == 20  # counted where the loop takes them
    expected = [per_replica(step) for step in iterator]
    restored = iter(dataset)
    restored.load_state_dict(state)
    assert [per_replica(step) for step in restored] == expected
    assert len(expected) == 10


# auto_shard_policy: worker 1 of a job of 2 workers with 2 replicas each, without processes.


def with_policy(dataset: Dataset, policy: AutoShardPolicy) -> Dataset:
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


@pytest.mark.parametrize("policy", [None, AutoShardPolicy.AUTO, AutoShardPolicy.DATA])
def test_data_sharding_gives_each_worker_its_replicas_slices(
    policy: AutoShardPolicy | None,
) -> None:
    dataset = Dataset.range(16).batch(8)
    if policy is not None:
        dataset = with_policy(dataset, policy)
    workers = [
        distribute_dataset(dataset, TWO, replica_offset=offset, global_replicas=4)
        for offset in (0, 2)
    ]
    seen = [[x for step in w for part in per_replica(step) for x in part] for w in workers]
    assert seen == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_sharding_off_gives_every_worker_all_the_data_over_its_replicas() -> None:
    dataset = with_policy(Dataset.range(16).batch(8), AutoShardPolicy.OFF)
    worker = distribute_dataset(dataset, TWO, replica_offset=2, global_replicas=4)
    assert [per_replica(step) for step in worker] == [
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[8, 9, 10, 11], [12, 13, 14, 15]],
    ]
    alone = distribute_dataset(dataset, TWO)
    assert [per_replica(step) for step in alone] == [per_replica(step) for step in worker]


@pytest.mark.parametrize("policy", [AutoShardPolicy.FILE, AutoShardPolicy.HINT])
def test_file_and_hint_sharding_are_not_supported(policy: AutoShardPolicy) -> None:
    dataset = with_policy(Dataset.range(4).batch(2), policy)
    received = re.escape(f"Received: auto_shard_policy=AutoShardPolicy.{policy.name}")
    with pytest.raises(ValueError, match=f"does not support.*Use AutoShardPolicy.DATA.*{received}"):
        distribute_dataset(dataset, TWO)


# Strings, mismatched leaves, element_spec


def test_string_batches_are_split_and_never_placed() -> None:
    dataset = Dataset.from_tensor_slices((np.arange(5), ["a", "b", "c", "d", "e"])).batch(5)
    for options in (None, INLINE):
        ((numbers, words),) = list(distribute_dataset(dataset, TWO, options))
        assert isinstance(words, PerReplica)
        assert list(words) == [["a", "b", "c"], ["d", "e"]]
        assert per_replica(numbers) == [[0, 1, 2], [3, 4]]
    ((_, whole),) = list(distribute_dataset(dataset, ("cpu:0",)))
    assert whole == ["a", "b", "c", "d", "e"]


OPTIONS = [None, INLINE, InputOptions(experimental_per_replica_buffer_size=3)]


@pytest.mark.parametrize("options", OPTIONS)
def test_zip_of_differently_batched_datasets_splits_each_component_on_its_own(
    options: InputOptions | None,
) -> None:
    """Measured on TensorFlow 2.21: zip(range(8).batch(4), range(8).batch(2)) over 2
    replicas gives ([0, 1], [0]) and ([2, 3], [1]): each component is cut by the split rule
    applied to its own first dimension."""
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    zipped = Dataset.zip(Dataset.range(8).batch(4), Dataset.range(8).batch(2))
    dist = strategy.experimental_distribute_dataset(zipped, options)
    steps = [[per_replica(component) for component in step] for step in dist]
    assert steps == [
        [[[0, 1], [2, 3]], [[0], [1]]],
        [[[4, 5], [6, 7]], [[2], [3]]],
    ]
    assert dist.element_spec == (TensorSpec((None,), torch.int64),) * 2


def test_components_of_5_and_2_rows_over_3_replicas_get_2_2_1_and_1_1_0() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    zipped = Dataset.zip((Dataset.range(5).batch(5), Dataset.range(10, 12).batch(2)))
    ((x, y),) = list(strategy.experimental_distribute_dataset(zipped))
    assert per_replica(x) == [[0, 1], [2, 3], [4]]
    assert per_replica(y) == [[10], [11], []]


def test_a_dataloader_of_tuples_of_different_first_dimensions() -> None:
    """A loader whose batches hold B images and a variable number of targets (as detection
    loaders do): each leaf is cut on its own."""

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        return torch.stack([x for x, _ in items]), torch.cat([t for _, t in items])

    items = [(torch.full((2,), float(i)), torch.arange(i + 1)) for i in range(5)]
    loader = DataLoader(items, batch_size=3, collate_fn=collate)  # type: ignore[arg-type]
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    steps = list(strategy.experimental_distribute_dataset(loader))
    assert [[c.shape[0] for c in strategy.experimental_local_results(x)] for x, _ in steps] == [
        [2, 1], [1, 1]
    ]
    assert [per_replica(t) for _, t in steps] == [
        [[0, 0, 1], [0, 1, 2]],  # 6 targets: 3 / 3
        [[0, 1, 2, 3, 0], [1, 2, 3, 4]],  # 9 targets: 5 / 4
    ]
    assert per_replica(steps[1][0]) == [[[3.0, 3.0]], [[4.0, 4.0]]]


@pytest.mark.parametrize("options", OPTIONS)
def test_distributed_datasets_on_a_device_named_twice(options: InputOptions | None) -> None:
    """Two replicas on cpu:0 (TensorFlow 2.21 accepts ["/cpu:0", "/cpu:0"]): each gets its
    own slice or element, as on two devices; nothing is merged by device."""
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:0", "cpu:1"])
    dist = strategy.experimental_distribute_dataset(Dataset.range(7).batch(4), options)
    assert [per_replica(step) for step in dist] == [[[0, 1], [2, 3], []], [[4], [5], [6]]]
    assert dist.element_spec == TensorSpec((None,), torch.int64)
    iterator = iter(dist)
    assert per_replica(next(iterator)) == [[0, 1], [2, 3], []]
    state = iterator.state_dict()
    again = iter(dist)
    again.load_state_dict(state)
    assert per_replica(next(again)) == [[4], [5], [6]]
    dealt = strategy.distribute_datasets_from_function(
        lambda ctx: Dataset.range(4 * ctx.num_replicas_in_sync).batch(4), options
    )
    assert [per_replica(step) for step in dealt] == [
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ]


def test_element_spec_of_a_distributed_dataset() -> None:
    dataset = Dataset.from_tensor_slices(
        {"x": np.zeros((6, 3), np.float32), "label": np.arange(6), "name": ["n"] * 6}
    ).batch(4)
    expected = {
        "x": TensorSpec((None, 3), torch.float32),
        "label": TensorSpec((None,), torch.int64),
        "name": TensorSpec((None,), str),
    }
    for devices in (("cpu:0",), TWO):
        dist = distribute_dataset(dataset, devices)
        assert dist.element_spec == expected
        assert len(list(dist)) == 2
    from_function = distribute_datasets_from_function(lambda ctx: Dataset.range(4).batch(2), TWO)
    assert from_function.element_spec == TensorSpec((None,), torch.int64)


def test_element_spec_is_made_by_a_separate_pass_once() -> None:
    passes: list[int] = []

    class Source:
        def __iter__(self) -> Iterator[torch.Tensor]:
            passes.append(1)
            yield from (torch.zeros(2, 5), torch.zeros(2, 5))

    dist = distribute_dataset(Source(), TWO)
    assert dist.element_spec == dist.element_spec == TensorSpec((None, 5), torch.float32)
    assert len(passes) == 1
    assert len(list(dist)) == 2


def test_element_spec_of_an_empty_source_raises() -> None:
    with pytest.raises(ValueError, match="has no element"):
        _ = distribute_dataset(Dataset.range(0).batch(2), TWO).element_spec
