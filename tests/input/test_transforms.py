"""cs.Dataset's transformations: TensorFlow's documented examples, properties, errors."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from centralstore.input.data_options import AUTOTUNE, AutoShardPolicy, Options
from centralstore.input.dataset import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset

Point = collections.namedtuple("Point", ["x", "y"])


def values(dataset: Any) -> list[Any]:
    """The elements as Python values (tensors to lists, tuples kept)."""
    return [_plain(element) for element in dataset]


def _plain(element: object) -> object:
    if isinstance(element, torch.Tensor):
        return element.tolist()
    if isinstance(element, tuple):
        return tuple(_plain(item) for item in element)
    return element


# TensorFlow's documented examples, with tf.data.Dataset renamed to Dataset.


def test_tensorflow_examples_map_filter_unbatch() -> None:
    assert values(Dataset.range(1, 6).map(lambda x: x + 1)) == [2, 3, 4, 5, 6]
    pairs = Dataset.from_tensor_slices(([1, 2], [3, 4])).map(lambda x, y: x + y)
    assert values(pairs) == [4, 6]
    assert values(Dataset.from_tensor_slices([1, 2, 3]).filter(lambda x: x < 3)) == [1, 2]
    batched = Dataset.from_tensor_slices(([[1, 2], [3, 4]], [[5, 6], [7, 8]]))
    assert values(batched.unbatch()) == [(1, 5), (2, 6), (3, 7), (4, 8)]


def test_tensorflow_examples_take_skip_repeat() -> None:
    assert values(Dataset.range(10).take(3)) == [0, 1, 2]
    assert values(Dataset.range(10).skip(7)) == [7, 8, 9]
    assert values(Dataset.from_tensor_slices([1, 2, 3]).repeat(3)) == [1, 2, 3] * 3
    assert values(Dataset.range(3).take(-1)) == [0, 1, 2]
    assert values(Dataset.range(3).skip(-1)) == []


# Batching keeps the container types.


def test_batch_keeps_tuples_dicts_and_namedtuples() -> None:
    elements = [(torch.tensor(i), {"p": Point(torch.tensor(i), i * 1.0)}) for i in range(3)]
    dataset = Dataset.range(3).map(lambda i: elements[int(i)]).batch(3)
    (batch,) = list(dataset)
    assert type(batch) is tuple
    assert type(batch[1]) is dict
    assert type(batch[1]["p"]) is Point
    assert batch[0].tolist() == [0, 1, 2]
    assert batch[1]["p"].y.dtype == torch.float64
    assert batch[1]["p"].y.tolist() == [0.0, 1.0, 2.0]



def test_batch_of_different_shapes_raises() -> None:
    dataset = Dataset.range(1, 3).map(lambda n: torch.zeros(int(n)))
    with pytest.raises(ValueError, match="different shapes"):
        list(dataset.batch(2))


def test_batch_of_different_structures_raises() -> None:
    dataset = Dataset.range(2).map(lambda n: n if n == 0 else (n,))
    with pytest.raises(ValueError, match="one structure"):
        list(dataset.batch(2))


@pytest.mark.parametrize("size", [0, -3])
def test_batch_size_below_one_raises(size: int) -> None:
    with pytest.raises(ValueError, match=f"positive int. Received: batch_size={size}"):
        Dataset.range(3).batch(size)


@pytest.mark.parametrize("size", [2.0, True, "2"])
def test_batch_size_of_the_wrong_type_raises(size: object) -> None:
    with pytest.raises(TypeError, match=r"Dataset.batch\(batch_size\) must be an int"):
        Dataset.range(3).batch(size)  # type: ignore[arg-type]


def test_unbatch_of_scalars_raises() -> None:
    with pytest.raises(ValueError, match="same first dimension"):
        list(Dataset.range(3).unbatch())


def test_unbatch_of_numpy_elements() -> None:
    dataset = Dataset.range(2).map(lambda i: np.full((2,), int(i))).unbatch()
    assert values(dataset) == [0, 0, 1, 1]


def test_filter_predicate_with_many_values_raises() -> None:
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        list(Dataset.range(3).filter(lambda x: torch.stack([x, x]) > 0))


# shuffle


def test_shuffle_with_a_seed_is_reproducible_and_new_each_pass() -> None:
    first = Dataset.range(20).shuffle(8, seed=3)
    second = Dataset.range(20).shuffle(8, seed=3)
    passes = [values(first) for _ in range(3)]
    assert passes == [values(second) for _ in range(3)]
    assert sorted(passes[0]) == list(range(20))
    assert passes[0] != passes[1]
    assert passes[0] != list(range(20))


def test_shuffle_without_reshuffle_repeats_its_order() -> None:
    dataset = Dataset.range(20).shuffle(20, seed=1, reshuffle_each_iteration=False)
    assert values(dataset) == values(dataset)


def test_shuffle_without_a_seed_follows_torch_manual_seed() -> None:
    torch.manual_seed(5)
    first = values(Dataset.range(30).shuffle(30))
    torch.manual_seed(5)
    assert values(Dataset.range(30).shuffle(30)) == first


def test_shuffle_buffer_of_one_keeps_the_order() -> None:
    assert values(Dataset.range(5).shuffle(1, seed=0)) == [0, 1, 2, 3, 4]


def test_shuffle_buffer_below_one_raises() -> None:
    with pytest.raises(ValueError, match="Received: buffer_size=0"):
        Dataset.range(3).shuffle(0)


def test_shuffle_seed_must_be_an_int() -> None:
    with pytest.raises(TypeError, match=r"Received: seed=1\.5"):
        Dataset.range(3).shuffle(2, seed=1.5)  # type: ignore[arg-type]


# repeat, shard, take, skip, prefetch


def test_repeat_forever_over_nothing_ends() -> None:
    assert values(Dataset.range(0).repeat()) == []


def test_repeat_count_below_minus_one_raises() -> None:
    with pytest.raises(ValueError, match="Received: count=-2"):
        Dataset.range(3).repeat(-2)


def test_shard_splits_elements_between_shards() -> None:
    shards = [values(Dataset.range(10).shard(3, i)) for i in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@pytest.mark.parametrize(("num_shards", "index"), [(2, 2), (2, -1)])
def test_shard_index_out_of_range_raises(num_shards: int, index: int) -> None:
    with pytest.raises(ValueError, match=f"index == {index} and num_shards == {num_shards}"):
        Dataset.range(4).shard(num_shards, index)


def test_shard_count_below_one_raises() -> None:
    with pytest.raises(ValueError, match="Received: num_shards=0"):
        Dataset.range(4).shard(0, 0)


@pytest.mark.parametrize("method", ["take", "skip", "prefetch"])
def test_counts_below_minus_one_raise(method: str) -> None:
    with pytest.raises(ValueError, match=r"or -1 for all\. Received"):
        getattr(Dataset.range(3), method)(-2)


def test_prefetch_yields_every_element_and_passes_errors() -> None:
    assert values(Dataset.range(5).prefetch(2)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(5).prefetch(AUTOTUNE)) == [0, 1, 2, 3, 4]
    dataset = Dataset.range(3)
    assert dataset.prefetch(0) is dataset

    def fail(x: torch.Tensor) -> torch.Tensor:
        if int(x) == 2:
            raise KeyError("bad element")
        return x

    with pytest.raises(KeyError, match="bad element"):
        list(Dataset.range(4).map(fail).prefetch(1))


# enumerate, concatenate


def test_tensorflow_examples_enumerate() -> None:
    dataset = Dataset.from_tensor_slices([1, 2, 3]).enumerate(start=5)
    assert values(dataset) == [(5, 1), (6, 2), (7, 3)]
    nested = Dataset.from_tensor_slices([(7, 8), (9, 10)]).enumerate()
    assert values(nested) == [(0, [7, 8]), (1, [9, 10])]
    index, _ = next(iter(nested))
    assert (index.dtype, index.shape) == (torch.int64, ())
    assert dataset.cardinality() == 3


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.integers(-100, 100), max_size=12), start=st.integers(-5, 5))
def test_enumerate_pairs_each_element_with_its_position(items: list[int], start: int) -> None:
    source = Dataset.from_tensor_slices(items) if items else Dataset.range(0)
    pairs = values(source.enumerate(start))
    assert [i for i, _ in pairs] == list(range(start, start + len(items)))
    assert [x for _, x in pairs] == items


def test_tensorflow_example_concatenate() -> None:
    a = Dataset.range(1, 4)
    b = Dataset.range(4, 8)
    ds = a.concatenate(b)
    assert values(ds) == [1, 2, 3, 4, 5, 6, 7]
    assert ds.cardinality() == 7
    assert a.concatenate(b.repeat()).cardinality() == INFINITE_CARDINALITY
    assert a.filter(bool).concatenate(b).cardinality() == UNKNOWN_CARDINALITY
    assert a.filter(bool).concatenate(b.repeat()).cardinality() == INFINITE_CARDINALITY


@settings(max_examples=40, deadline=None)
@given(
    first=st.lists(st.integers(0, 9), max_size=8),
    second=st.lists(st.integers(-9, 0), max_size=8),
)
def test_concatenate_is_the_first_then_the_second(first: list[int], second: list[int]) -> None:
    def dataset(items: list[int]) -> Dataset:
        return Dataset.from_tensor_slices(items) if items else Dataset.range(0)

    joined = dataset(first).concatenate(dataset(second))
    assert values(joined) == first + second == values(joined)
    assert joined.cardinality() == len(first) + len(second)


def test_concatenate_needs_a_dataset() -> None:
    with pytest.raises(TypeError, match=r"Dataset.concatenate\(dataset\).*Received: dataset=\[1\]"):
        Dataset.range(2).concatenate([1])  # type: ignore[arg-type]


# flat_map, interleave


def test_tensorflow_example_flat_map() -> None:
    dataset = Dataset.from_tensor_slices([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert values(dataset.flat_map(Dataset.from_tensor_slices)) == list(range(1, 10))
    assert dataset.flat_map(Dataset.from_tensor_slices).cardinality() == UNKNOWN_CARDINALITY


def test_flat_map_function_must_return_a_dataset() -> None:
    with pytest.raises(TypeError, match=r"flat_map\(map_func\) must return a Dataset"):
        list(Dataset.range(2).flat_map(lambda x: x))
    with pytest.raises(TypeError, match="Received: a list"):
        list(Dataset.range(2).interleave(lambda x: [x], cycle_length=1))


def test_tensorflow_example_interleave() -> None:
    dataset = Dataset.range(1, 6).interleave(
        lambda x: Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    )
    assert values(dataset) == [
        *[1] * 4, *[2] * 4, 1, 1, 2, 2,
        *[3] * 4, *[4] * 4, 3, 3, 4, 4,
        *[5] * 4, 5, 5,
    ]  # fmt: skip


def test_interleave_of_one_cycle_is_flat_map_and_accepts_autotune() -> None:
    def three(x: torch.Tensor) -> Dataset:
        return Dataset.range(3).map(lambda y: y + 10 * x)

    flat = values(Dataset.range(3).flat_map(three))
    assert values(Dataset.range(3).interleave(three, cycle_length=1)) == flat
    parallel = Dataset.range(3).interleave(three, AUTOTUNE, num_parallel_calls=AUTOTUNE)
    assert sorted(values(parallel)) == sorted(flat)


def test_interleave_cycle_length_below_one_raises() -> None:
    with pytest.raises(ValueError, match="Received: cycle_length=0"):
        Dataset.range(3).interleave(Dataset.from_tensors, cycle_length=0)
    with pytest.raises(ValueError, match="Received: block_length=0"):
        Dataset.range(3).interleave(Dataset.from_tensors, cycle_length=1, block_length=0)


# take_while, scan, unique, apply, rebatch


def test_tensorflow_example_take_while() -> None:
    assert values(Dataset.range(10).take_while(lambda x: x < 5)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"take_while's predicate.*shape \[2\]"):
        list(Dataset.range(3).take_while(lambda x: torch.stack([x, x]) > 0))


def test_tensorflow_example_scan() -> None:
    dataset = Dataset.range(10).scan(initial_state=0, scan_func=lambda s, i: (s + i, s + i))
    assert values(dataset) == [0, 1, 3, 6, 10, 15, 21, 28, 36, 45]
    with pytest.raises(ValueError, match=r"pair \(new_state, output_element\)"):
        list(Dataset.range(2).scan(0, lambda state, x: state + x))


def test_tensorflow_examples_unique() -> None:
    dataset = Dataset.from_tensor_slices([1, 37, 2, 37, 2, 1]).unique()
    assert sorted(values(dataset)) == [1, 2, 37]
    assert sorted(Dataset.from_tensor_slices(["b", "a", "b"]).unique()) == ["a", "b"]
    with pytest.raises(ValueError, match="integer scalars or strings"):
        list(Dataset.from_tensor_slices([1.5, 2.5]).unique())


def test_tensorflow_example_apply() -> None:
    def dataset_fn(ds: Dataset) -> Dataset:
        return ds.filter(lambda x: x < 5)

    assert values(Dataset.range(100).apply(dataset_fn)) == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match=r"apply\(transformation_func\) must return a Dataset"):
        Dataset.range(3).apply(lambda ds: list(ds))  # type: ignore[arg-type,return-value]


def test_tensorflow_example_rebatch() -> None:
    assert values(Dataset.range(6).batch(2).rebatch(3)) == [[0, 1, 2], [3, 4, 5]]
    assert values(Dataset.range(5).batch(2).rebatch(2, drop_remainder=True)) == [[0, 1], [2, 3]]


# cache


def test_tensorflow_example_cache_runs_the_pipeline_once() -> None:
    calls: list[int] = []

    def square(x: torch.Tensor) -> torch.Tensor:
        calls.append(int(x))
        return x**2

    dataset = Dataset.range(5).map(square).cache()
    assert values(dataset) == [0, 1, 4, 9, 16]
    assert values(dataset) == [0, 1, 4, 9, 16]
    assert calls == [0, 1, 2, 3, 4]
    assert dataset.cardinality() == 5


def test_cache_keeps_nothing_from_an_abandoned_pass() -> None:
    calls: list[int] = []
    dataset = Dataset.range(3).map(lambda x: calls.append(int(x)) or x).cache()
    next(iter(dataset))
    assert values(dataset) == [0, 1, 2]
    assert values(dataset) == [0, 1, 2]
    assert calls == [0, 0, 1, 2]


def test_cache_to_a_file_is_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="Received: filename='/tmp/cache'"):
        Dataset.range(3).cache("/tmp/cache")


# with_options, AUTOTUNE


def test_options_carry_through_transformations_and_merge() -> None:
    off, deterministic = Options(), Options()
    off.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    deterministic.deterministic = True
    dataset = Dataset.range(4).with_options(off).map(lambda x: x).batch(2)
    assert dataset.options().experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    both = dataset.with_options(deterministic).options()
    assert both.deterministic is True
    assert both.experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    joined = Dataset.zip((Dataset.range(2), Dataset.range(2).with_options(off)))
    assert joined.options() == off
    assert values(dataset) == [[0, 1], [2, 3]]


def test_options_are_copied_when_attached() -> None:
    options = Options()
    dataset = Dataset.range(2).with_options(options)
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    assert dataset.options() == Options()
    dataset.options().deterministic = False
    assert dataset.options() == Options()


def test_with_options_needs_options() -> None:
    with pytest.raises(TypeError, match=r"takes a cs\.data\.Options"):
        Dataset.range(2).with_options({"deterministic": True})  # type: ignore[arg-type]


def test_autotune_is_accepted_where_tensorflow_takes_it() -> None:
    dataset = (
        Dataset.range(6)
        .map(lambda x: x * 2, num_parallel_calls=AUTOTUNE, deterministic=True)
        .batch(4, num_parallel_calls=AUTOTUNE)
        .prefetch(AUTOTUNE)
    )
    assert values(dataset) == [[0, 2, 4, 6], [8, 10]]
    assert values(Dataset.range(2).map(lambda x: x, num_parallel_calls=4)) == [0, 1]


@pytest.mark.parametrize("calls", [0, -2, 1.5])
def test_bad_num_parallel_calls_raise(calls: object) -> None:
    with pytest.raises((ValueError, TypeError), match=r"num_parallel_calls"):
        Dataset.range(2).map(lambda x: x, num_parallel_calls=calls)  # type: ignore[arg-type]
