"""cs.Dataset's sources: TensorFlow's documented examples, cardinality, pickling, errors."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from centralstore.input.data_options import AutoShardPolicy, Options
from centralstore.input.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
)
from centralstore.input.spec import TensorSpec

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


# Strings


def test_from_tensor_slices_of_strings_yields_str() -> None:
    assert list(Dataset.from_tensor_slices(["a", "c", "e"])) == ["a", "c", "e"]
    pairs = Dataset.from_tensor_slices((np.array(["x", "y"]), [b"p", b"q"]))
    assert list(pairs) == [("x", b"p"), ("y", b"q")]
    rows = list(Dataset.from_tensor_slices([["a", "b"], ["c", "d"]]))
    assert rows == [["a", "b"], ["c", "d"]]
    assert list(Dataset.from_tensors("word")) == ["word"]


def test_ragged_string_lists_raise() -> None:
    with pytest.raises(ValueError, match=r"different shapes.*lengths or types \[2, 1\]"):
        Dataset.from_tensor_slices([["a", "b"], ["c"]])


# from_generator (TensorFlow's documented examples)


def test_tensorflow_example_from_generator_with_a_signature() -> None:
    def gen() -> Iterator[tuple[int, list[int]]]:
        ragged = [[], [1], [1, 2], [1, 2, 3]]
        yield from ((i, ragged[i]) for i in range(4))

    signature = (TensorSpec(shape=(), dtype=torch.int32), TensorSpec([None], torch.int32))
    dataset = Dataset.from_generator(gen, output_signature=signature)
    elements = list(dataset.take(2))
    assert [(int(i), x.tolist()) for i, x in elements] == [(0, []), (1, [1])]
    assert elements[1][1].dtype == torch.int32
    assert dataset.cardinality() == UNKNOWN_CARDINALITY


def test_tensorflow_tutorial_generator_with_output_types_and_shapes() -> None:
    def gen() -> Iterator[np.ndarray]:
        while True:
            yield np.random.rand(4)

    dataset = Dataset.from_generator(gen, output_types=torch.float32, output_shapes=[4])
    batch = next(iter(dataset.batch(3)))
    assert batch.shape == (3, 4)
    assert batch.dtype == torch.float32
    pairs = Dataset.from_generator(lambda: iter([([1, 2, 3], [10])]), (torch.int32, torch.int64))
    (first,) = list(pairs)
    assert [first[0].dtype, first[1].dtype] == [torch.int32, torch.int64]


def test_from_generator_calls_the_generator_afresh_each_pass_with_args() -> None:
    calls: list[tuple[int, ...]] = []

    def gen(*args: int) -> Iterator[int]:
        calls.append(args)
        yield from range(args[0])

    dataset = Dataset.from_generator(gen, args=(3,))
    assert values(dataset) == values(dataset) == [0, 1, 2]
    assert calls == [(3,), (3,)]


def test_from_generator_without_a_signature_reads_elements_like_from_tensors() -> None:
    dataset = Dataset.from_generator(lambda: iter([(1, "a", [1.5])]))
    ((number, text, floats),) = list(dataset)
    assert (number.dtype, text, floats.tolist()) == (torch.int64, "a", [1.5])


def test_from_generator_whose_function_returns_no_iterable_raises() -> None:
    with pytest.raises(TypeError, match=r"must return an iterator.*returned a int"):
        list(Dataset.from_generator(lambda: 5))


def test_from_generator_of_a_generator_object_raises() -> None:
    generator = (i for i in range(3))
    with pytest.raises(TypeError, match="pass the generator function itself"):
        Dataset.from_generator(generator)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("element", "match"),
    [(np.zeros(3), r"shape=\(3,\)"), ([1.0, 2.0, 3.0], "does not fit"), ("a", "it is str")],
)
def test_from_generator_element_that_does_not_fit_the_signature_raises(
    element: object, match: str
) -> None:
    dataset = Dataset.from_generator(
        lambda: iter([element]), output_signature=TensorSpec((2,), torch.float32)
    )
    with pytest.raises(ValueError, match=match):
        list(dataset)


def test_from_generator_element_of_another_structure_raises() -> None:
    spec = TensorSpec((), torch.int64)
    dataset = Dataset.from_generator(lambda: iter([np.zeros(2)]), output_signature=(spec, spec))
    with pytest.raises(ValueError, match="structure does not match"):
        list(dataset)


def test_from_generator_signature_argument_errors() -> None:
    spec = TensorSpec((), torch.int64)
    with pytest.raises(TypeError, match="not both"):
        Dataset.from_generator(lambda: iter([]), torch.int64, output_signature=spec)
    with pytest.raises(TypeError, match="needs output_types too"):
        Dataset.from_generator(lambda: iter([]), output_shapes=[2])
    with pytest.raises(TypeError, match=r"structure of cs\.data\.TensorSpec"):
        Dataset.from_generator(lambda: iter([]), output_signature=(torch.int64,))
    with pytest.raises(ValueError, match="structure of output_types"):
        Dataset.from_generator(lambda: iter([]), (torch.int64, torch.int64), [[1], [2], [3]])


# counter, random, choose_from_datasets, sample_from_datasets


def test_tensorflow_examples_counter() -> None:
    assert values(Dataset.counter().take(5)) == [0, 1, 2, 3, 4]
    assert values(Dataset.counter(start=2).take(5)) == [2, 3, 4, 5, 6]
    assert values(Dataset.counter(start=2, step=5).take(5)) == [2, 7, 12, 17, 22]
    assert values(Dataset.counter(start=10, step=-1).take(5)) == [10, 9, 8, 7, 6]
    assert Dataset.counter(dtype=torch.int32).cardinality() == INFINITE_CARDINALITY
    assert next(iter(Dataset.counter(dtype=torch.int32))).dtype == torch.int32


def test_random_is_reproducible_with_a_seed_and_rerandomizes_when_asked() -> None:
    same = Dataset.random(seed=4).take(5)
    assert values(same) == values(same) == values(Dataset.random(seed=4).take(5))
    again = Dataset.random(seed=4, rerandomize_each_iteration=True).take(5)
    assert values(again) != values(again)
    assert all(x >= 0 for x in values(same))
    assert Dataset.random().cardinality() == INFINITE_CARDINALITY


def test_tensorflow_example_choose_from_datasets() -> None:
    datasets = [Dataset.from_tensors(word).repeat() for word in ("foo", "bar", "baz")]
    choice_dataset = Dataset.range(3).repeat(3)
    result = Dataset.choose_from_datasets(datasets, choice_dataset)
    assert list(result) == ["foo", "bar", "baz"] * 3


def test_choose_from_datasets_stops_or_skips_an_empty_dataset() -> None:
    datasets = [Dataset.range(1), Dataset.range(5, 9)]
    choices = Dataset.from_tensor_slices([0, 0, 1])
    assert values(Dataset.choose_from_datasets(datasets, choices)) == [0]
    skipping = Dataset.choose_from_datasets(datasets, choices, stop_on_empty_dataset=False)
    assert values(skipping) == [0, 5]


@pytest.mark.parametrize("choice", [2, -1, 0.0, True])
def test_choose_from_datasets_with_a_bad_index_raises(choice: object) -> None:
    choices = Dataset.from_tensors(choice)
    with pytest.raises(ValueError, match=r"int scalars in \[0, 2\)"):
        list(Dataset.choose_from_datasets([Dataset.range(1), Dataset.range(1)], choices))


def test_sample_from_datasets_follows_the_weights_and_the_seed() -> None:
    datasets = [Dataset.from_tensors(0).repeat(), Dataset.from_tensors(1).repeat()]
    sampled = Dataset.sample_from_datasets(datasets, weights=[0.9, 0.1], seed=7).take(400)
    drawn = values(sampled)
    assert drawn == values(sampled)  # same seed, same draws each pass
    assert 300 < drawn.count(0) < 390
    only_first = Dataset.sample_from_datasets(datasets, weights=[1.0, 0.0], seed=1).take(20)
    assert values(only_first) == [0] * 20


def test_sample_from_datasets_runs_until_every_dataset_is_empty_or_the_first() -> None:
    datasets = [Dataset.range(1), Dataset.range(10, 100)]
    assert sorted(values(Dataset.sample_from_datasets(datasets, seed=3))) == [0, *range(10, 100)]
    stopped = values(Dataset.sample_from_datasets(datasets, seed=3, stop_on_empty_dataset=True))
    assert 0 in stopped
    assert len(stopped) < 91


@pytest.mark.parametrize("weights", [[1.0], [1.0, -1.0], [0.0, 0.0]])
def test_sample_from_datasets_bad_weights_raise(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="one non-negative weight per dataset"):
        Dataset.sample_from_datasets([Dataset.range(1), Dataset.range(1)], weights)


# Sources: errors


def test_range_argument_errors() -> None:
    with pytest.raises(TypeError, match="1 to 3 ints"):
        Dataset.range()
    with pytest.raises(TypeError, match=r"Dataset.range\(args\) must be an int"):
        Dataset.range(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "element", [torch.tensor(1.0), ([1, 2], 3), (np.zeros(2), np.zeros(3)), ()]
)
def test_from_tensor_slices_needs_a_shared_first_dimension(element: object) -> None:
    with pytest.raises(ValueError, match="share their first dimension"):
        Dataset.from_tensor_slices(element)


@pytest.mark.parametrize("element", [None, object()])
def test_components_of_an_unsupported_type_raise(element: object) -> None:
    with pytest.raises(TypeError, match=r"Dataset.from_tensors: dataset components must be"):
        Dataset.from_tensors((np.zeros(1), element))


def test_ragged_number_lists_raise() -> None:
    with pytest.raises(ValueError, match="must be rectangular"):
        Dataset.from_tensor_slices([[1, 2], [3]])


def test_zip_argument_errors() -> None:
    with pytest.raises(TypeError, match="exactly one of them"):
        Dataset.zip()
    with pytest.raises(TypeError, match="exactly one of them"):
        Dataset.zip(Dataset.range(1), datasets=(Dataset.range(1),))
    with pytest.raises(TypeError, match="non-empty structure of Datasets"):
        Dataset.zip((Dataset.range(1), [1, 2]))
    with pytest.raises(TypeError, match="non-empty structure of Datasets"):
        Dataset.zip(())
    with pytest.raises(TypeError, match=r"choose_from_datasets\(choice_dataset\)"):
        Dataset.choose_from_datasets([Dataset.range(1)], [0])  # type: ignore[arg-type]


def test_dataset_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Dataset()  # type: ignore[abstract]


# Iteration: re-iterable, numpy, DataLoader, pickling


def test_a_dataset_is_re_iterable() -> None:
    dataset = Dataset.range(4).map(lambda x: x * 2).batch(3)
    assert values(dataset) == values(dataset) == [[0, 2, 4], [6]]


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


def test_datasets_with_options_strings_and_caches_pickle() -> None:
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    dataset = Dataset.from_tensor_slices(["a", "b", "c"]).cache().batch(2).with_options(options)
    clone = pickle.loads(pickle.dumps(dataset))
    assert list(clone) == [["a", "b"], ["c"]]
    assert clone.options() == options
