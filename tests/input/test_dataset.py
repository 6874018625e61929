"""cs.Dataset: TensorFlow's documented examples, container types, cardinality, errors."""

from __future__ import annotations

import collections
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from centralstore.input.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
)

Point = collections.namedtuple("Point", ["x", "y"])


def values(dataset: Dataset) -> list[Any]:
    """The elements as Python values (tensors to lists, containers kept)."""
    return [_plain(element) for element in dataset]


def _plain(element: object) -> object:
    if isinstance(element, torch.Tensor):
        return element.tolist()
    if isinstance(element, dict):
        return {key: _plain(item) for key, item in element.items()}
    if isinstance(element, tuple):
        items = [_plain(item) for item in element]
        return type(element)(*items) if hasattr(element, "_fields") else tuple(items)  # type: ignore[arg-type]
    return element


# TensorFlow's documented examples, with tf.data.Dataset renamed to Dataset.


def test_tensorflow_examples_range_and_batch() -> None:
    assert values(Dataset.range(5).batch(2)) == [[0, 1], [2, 3], [4]]
    assert values(Dataset.range(2, 5)) == [2, 3, 4]
    assert values(Dataset.range(1, 5, 2)) == [1, 3]
    assert values(Dataset.range(5, 1, -2)) == [5, 3]
    assert values(Dataset.range(8).batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]


def test_range_yields_int64_scalars_or_the_asked_type() -> None:
    element = next(iter(Dataset.range(3)))
    assert element.dtype == torch.int64
    assert element.shape == ()
    assert next(iter(Dataset.range(3, output_type=torch.int32))).dtype == torch.int32


def test_tensorflow_example_repeat_batch_shard() -> None:
    dataset = Dataset.from_tensors([[1.0]]).repeat().batch(4).shard(2, 0)
    first = next(iter(dataset))
    assert first.shape == (4, 1, 1)
    assert dataset.cardinality() == INFINITE_CARDINALITY


def test_tensorflow_examples_from_tensor_slices() -> None:
    assert values(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]
    assert values(Dataset.from_tensor_slices([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert values(Dataset.from_tensor_slices(([1, 2], [3, 4], [5, 6]))) == [
        (1, 3, 5),
        (2, 4, 6),
    ]
    assert values(Dataset.from_tensor_slices({"a": [1, 2], "b": [3, 4]})) == [
        {"a": 1, "b": 3},
        {"a": 2, "b": 4},
    ]
    assert values(Dataset.from_tensor_slices(Point([1, 2], [3, 4]))) == [Point(1, 3), Point(2, 4)]


def test_tensorflow_examples_zip() -> None:
    a, b = Dataset.range(1, 4), Dataset.range(4, 7)
    assert values(Dataset.zip((a, b))) == [(1, 4), (2, 5), (3, 6)]
    assert values(Dataset.zip(a, b)) == [(1, 4), (2, 5), (3, 6)]
    c = Dataset.range(7, 13).batch(2)
    assert values(Dataset.zip((a, b, c))) == [(1, 4, [7, 8]), (2, 5, [9, 10]), (3, 6, [11, 12])]
    d = Dataset.range(13, 15)
    assert values(Dataset.zip((a, d))) == [(1, 13), (2, 14)]
    assert values(Dataset.zip(datasets={"a": a, "d": d})) == [{"a": 1, "d": 13}, {"a": 2, "d": 14}]
    assert values(Dataset.zip(a)) == [1, 2, 3]


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


def test_tensorflow_examples_cardinality() -> None:
    dataset = Dataset.range(42)
    assert dataset.cardinality() == 42
    assert dataset.repeat().cardinality() == INFINITE_CARDINALITY
    assert dataset.filter(lambda x: True).cardinality() == UNKNOWN_CARDINALITY


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: Dataset.range(10).batch(3), 4),
        (lambda: Dataset.range(10).batch(3, drop_remainder=True), 3),
        (lambda: Dataset.range(10).shard(3, 1), 3),
        (lambda: Dataset.range(10).shard(4, 3), 2),
        (lambda: Dataset.range(2).shard(4, 3), 0),
        (lambda: Dataset.range(5).take(7), 5),
        (lambda: Dataset.range(5).repeat().take(7), 7),
        (lambda: Dataset.range(5).skip(2), 3),
        (lambda: Dataset.range(5).skip(9), 0),
        (lambda: Dataset.range(5).repeat(3), 15),
        (lambda: Dataset.range(0).repeat(), 0),
        (lambda: Dataset.range(5).repeat(0), 0),
        (lambda: Dataset.range(5).map(lambda x: x).prefetch(2), 5),
        (lambda: Dataset.range(5).shuffle(2), 5),
        (lambda: Dataset.zip((Dataset.range(5), Dataset.range(3))), 3),
        (lambda: Dataset.zip((Dataset.range(5), Dataset.range(1).repeat())), 5),
        (lambda: Dataset.zip((Dataset.range(1).repeat(), Dataset.range(1).repeat())), -1),
        (lambda: Dataset.zip((Dataset.range(5), Dataset.range(5).unbatch())), -2),
        (lambda: Dataset.range(5).filter(bool).repeat(), -2),
        (lambda: Dataset.range(5).filter(bool).skip(2), -2),
        (lambda: Dataset.range(1).repeat().skip(2), -1),
        (lambda: Dataset.range(5).repeat().batch(2), -1),
        (lambda: Dataset.from_tensors(np.zeros(3)), 1),
    ],
)
def test_cardinality_table(make: object, expected: int) -> None:
    dataset = make()  # type: ignore[operator]
    assert dataset.cardinality() == expected
    if expected >= 0:
        assert len(dataset) == expected == len(list(dataset))


def test_len_of_infinite_and_unknown_datasets_raises_type_error() -> None:
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(3).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(3).filter(bool))
    assert list(Dataset.range(3).filter(bool)) == [1, 2]  # list() tolerates the TypeError


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


def test_batch_of_slices_is_a_view_of_numpy_memory() -> None:
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    labels = np.arange(6)
    batches = list(Dataset.from_tensor_slices((features, labels)).batch(4))
    assert [tuple(b[0].shape) for b in batches] == [(4, 2), (2, 2)]
    assert batches[0][0].data_ptr() == features.ctypes.data
    assert batches[1][1].tolist() == [4, 5]
    assert batches[0][0].device.type == "cpu"


def test_from_tensors_and_slices_share_numpy_memory() -> None:
    array = np.ones((2, 3), dtype=np.float32)
    (whole,) = list(Dataset.from_tensors(array))
    first = next(iter(Dataset.from_tensor_slices(array)))
    array[0, 0] = 5.0
    assert whole[0, 0] == 5.0
    assert first[0] == 5.0


def test_from_tensor_slices_of_a_list_of_tensors_stacks_them() -> None:
    dataset = Dataset.from_tensor_slices([torch.zeros(2), np.ones(2)])
    assert values(dataset) == [[0.0, 0.0], [1.0, 1.0]]


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
    with pytest.raises(TypeError, match="batch_size must be an int"):
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


# Sources: errors


def test_range_argument_errors() -> None:
    with pytest.raises(TypeError, match="1 to 3 ints"):
        Dataset.range()
    with pytest.raises(TypeError, match="range argument must be an int"):
        Dataset.range(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "element", [torch.tensor(1.0), ([1, 2], 3), (np.zeros(2), np.zeros(3)), ()]
)
def test_from_tensor_slices_needs_a_shared_first_dimension(element: object) -> None:
    with pytest.raises(ValueError, match="share their first dimension"):
        Dataset.from_tensor_slices(element)


@pytest.mark.parametrize("element", ["text", None, object()])
def test_components_of_an_unsupported_type_raise(element: object) -> None:
    with pytest.raises(TypeError, match="Dataset components must be"):
        Dataset.from_tensors((np.zeros(1), element))


def test_zip_argument_errors() -> None:
    with pytest.raises(TypeError, match="exactly one of them"):
        Dataset.zip()
    with pytest.raises(TypeError, match="exactly one of them"):
        Dataset.zip(Dataset.range(1), datasets=(Dataset.range(1),))
    with pytest.raises(TypeError, match="non-empty structure of Datasets"):
        Dataset.zip((Dataset.range(1), [1, 2]))
    with pytest.raises(TypeError, match="non-empty structure of Datasets"):
        Dataset.zip(())


def test_dataset_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Dataset()  # type: ignore[abstract]


# Iteration: re-iterable, numpy, DataLoader, pickling


def test_a_dataset_is_re_iterable() -> None:
    dataset = Dataset.range(4).map(lambda x: x * 2).batch(3)
    assert values(dataset) == values(dataset) == [[0, 2, 4], [6]]


def test_as_numpy_iterator_gives_numpy_values() -> None:
    first, second = Dataset.range(2).batch(1).as_numpy_iterator()
    assert isinstance(first, np.ndarray)
    assert second.tolist() == [1]
    (scalar,) = Dataset.from_tensors(3).as_numpy_iterator()
    assert isinstance(scalar, np.generic)
    assert list(Dataset.from_tensor_slices((np.arange(2),)).map(lambda x: (x, "s"))
                .as_numpy_iterator())[1][1] == "s"


def test_dataset_feeds_a_dataloader() -> None:
    dataset = Dataset.from_tensor_slices((np.arange(6.0), np.arange(6))).batch(4)
    loaded = list(DataLoader(dataset, batch_size=None))
    assert [x.tolist() for x, _ in loaded] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    assert len(DataLoader(dataset, batch_size=None)) == 2


def test_dataset_in_dataloader_workers_each_yield_it_whole() -> None:
    loader = DataLoader(Dataset.range(4), batch_size=None, num_workers=2)
    assert sorted(int(x) for x in loader) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_datasets_without_lambdas_pickle() -> None:
    dataset = Dataset.from_tensor_slices(np.arange(10)).shuffle(4, seed=2).batch(3).repeat(2)
    clone = pickle.loads(pickle.dumps(dataset))
    assert values(clone) == values(pickle.loads(pickle.dumps(dataset)))


def test_from_tensors_of_an_empty_structure_pickles() -> None:
    dataset = pickle.loads(pickle.dumps(Dataset.from_tensors(())))
    assert list(dataset) == [()]
