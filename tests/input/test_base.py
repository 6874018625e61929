"""What every cs.Dataset answers: len, reductions, element_spec, options, missing methods."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from centralstore.input.data_options import Options
from centralstore.input.dataset import Dataset
from centralstore.input.spec import TensorSpec


def test_len_of_infinite_and_unknown_datasets_raises_type_error() -> None:
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(3).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(3).filter(bool))
    assert list(Dataset.range(3).filter(bool)) == [1, 2]  # list() tolerates the TypeError


def test_as_numpy_iterator_gives_numpy_values() -> None:
    first, second = Dataset.range(2).batch(1).as_numpy_iterator()
    assert isinstance(first, np.ndarray)
    assert second.tolist() == [1]
    (scalar,) = Dataset.from_tensors(3).as_numpy_iterator()
    assert isinstance(scalar, np.generic)
    assert list(Dataset.from_tensor_slices((np.arange(2),)).map(lambda x: (x, "s"))
                .as_numpy_iterator())[1][1] == "s"



# reduce, get_single_element (TensorFlow's documented examples)


def test_tensorflow_examples_reduce() -> None:
    assert int(Dataset.range(5).reduce(np.int64(0), lambda x, _: x + 1)) == 5
    assert int(Dataset.range(5).reduce(np.int64(0), lambda x, y: x + y)) == 10
    pairs = Dataset.from_tensor_slices(["a", "b"]).reduce("", lambda state, s: state + s)
    assert pairs == "ab"


def test_tensorflow_example_get_single_element() -> None:
    element = Dataset.from_tensors(([1, 2, 3], [4])).get_single_element()
    assert [part.tolist() for part in element] == [[1, 2, 3], [4]]


@pytest.mark.parametrize(("count", "what"), [(0, "has no element"), (2, "more than one")])
def test_get_single_element_of_another_count_raises(count: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        Dataset.range(count).get_single_element()


# element_spec, options


def test_element_spec_describes_the_first_element() -> None:
    dataset = Dataset.from_tensor_slices((np.zeros((3, 2), np.float32), ["a", "b", "c"]))
    assert dataset.element_spec == (TensorSpec((2,), torch.float32), TensorSpec((), str))
    assert dataset.batch(2).element_spec[1] == TensorSpec((2,), str)


def test_element_spec_does_not_disturb_iteration_and_needs_an_element() -> None:
    made: list[int] = []

    def gen() -> Iterator[int]:
        for i in range(3):
            made.append(i)
            yield i

    dataset = Dataset.from_generator(gen)
    assert dataset.element_spec == TensorSpec((), torch.int64)
    assert [int(x) for x in dataset] == [0, 1, 2]
    with pytest.raises(ValueError, match="has none"):
        _ = Dataset.range(0).element_spec


def test_options_of_a_plain_dataset_are_the_defaults() -> None:
    assert Dataset.range(3).options() == Options()


# Methods that are not there, and names users see


def test_a_tensorflow_method_without_counterpart_says_why_and_where_to_look() -> None:
    with pytest.raises(
        AttributeError, match=r"tf\.data\.Dataset\.window is not supported.*docs/data.md"
    ):
        Dataset.range(3).window(2)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=r"snapshot.*use cache\(\)"):
        Dataset.range(3).map(lambda x: x).snapshot  # type: ignore[attr-defined]  # noqa: B018


def test_unknown_attributes_name_no_internal_class() -> None:
    with pytest.raises(AttributeError, match=re.escape("'Dataset' object has no attribute 'foo'")):
        Dataset.range(3).batch(2).foo  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(Dataset.range(1), "__getitems__")  # what DataLoader probes
    assert repr(Dataset.range(3).batch(2)) == "<Dataset cardinality=2>"
    assert repr(Dataset.from_tensors(1)) == "<Dataset cardinality=1>"
