"""batch, padded_batch and unbatch: TensorFlow's padded_batch examples, strings, properties."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from centralstore.input.dataset import Dataset
from centralstore.input.strings import Strings


def filled(x: torch.Tensor) -> torch.Tensor:
    """TensorFlow's example element: ``tf.fill([x], x)``."""
    return torch.full([int(x)], int(x), dtype=torch.int32)


A = Dataset.range(1, 5, output_type=torch.int32).map(filled)


def arrays(dataset: Any) -> list[Any]:
    return [
        tuple(part.tolist() for part in batch) if isinstance(batch, tuple) else batch.tolist()
        for batch in dataset
    ]


# TensorFlow's documented examples of padded_batch.


def test_tensorflow_example_pad_to_the_longest_in_each_batch() -> None:
    assert arrays(A.padded_batch(2)) == [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]]]
    assert next(iter(A.padded_batch(2))).dtype == torch.int32


def test_tensorflow_example_pad_to_a_fixed_size() -> None:
    assert arrays(A.padded_batch(2, padded_shapes=5)) == [
        [[1, 0, 0, 0, 0], [2, 2, 0, 0, 0]],
        [[3, 3, 3, 0, 0], [4, 4, 4, 4, 0]],
    ]


def test_tensorflow_example_pad_with_a_custom_value() -> None:
    assert arrays(A.padded_batch(2, padded_shapes=5, padding_values=-1)) == [
        [[1, -1, -1, -1, -1], [2, 2, -1, -1, -1]],
        [[3, 3, 3, -1, -1], [4, 4, 4, 4, -1]],
    ]


def test_tensorflow_example_components_padded_independently() -> None:
    elements = [([1, 2, 3], [10]), ([4, 5], [11, 12])]
    dataset = Dataset.from_generator(lambda: iter(elements), (torch.int32, torch.int32))
    dataset = dataset.padded_batch(2, padded_shapes=([4], [None]), padding_values=(-1, 100))
    assert arrays(dataset) == [([[1, 2, 3, -1], [4, 5, -1, -1]], [[10, 100], [11, 12]])]


def test_tensorflow_example_one_value_for_several_components() -> None:
    dataset = Dataset.zip((A, A)).padded_batch(2, padding_values=-1)
    first = [[1, -1], [2, 2]]
    second = [[3, 3, 3, -1], [4, 4, 4, 4]]
    assert arrays(dataset) == [(first, first), (second, second)]


def test_padded_batch_pads_every_dimension_and_drops_the_remainder() -> None:
    shapes = [(1, 3), (2, 1), (1, 1)]
    dataset = Dataset.from_generator(lambda: (np.ones(s) for s in shapes))
    (batch,) = list(dataset.padded_batch(2, padded_shapes=[-1, 4], drop_remainder=True))
    assert batch.shape == (2, 2, 4)
    assert batch.sum().item() == 3 + 2
    assert A.padded_batch(3, drop_remainder=True).cardinality() == 1


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=9),
    batch_size=st.integers(1, 4),
    pad=st.integers(-3, 3),
)
def test_padded_batches_give_back_every_element(
    lengths: list[int], batch_size: int, pad: int
) -> None:
    elements = [torch.arange(n) + 10 for n in lengths]
    dataset = Dataset.from_generator(lambda: iter(elements))
    batches = list(dataset.padded_batch(batch_size, padding_values=pad))
    rows = [row for batch in batches for row in batch]
    assert [row[:n].tolist() for row, n in zip(rows, lengths, strict=True)] == [
        e.tolist() for e in elements
    ]
    assert all((row[n:] == pad).all() for row, n in zip(rows, lengths, strict=True))
    for i, batch in enumerate(batches):
        assert batch.shape[1] == max(lengths[i * batch_size : (i + 1) * batch_size])


# Strings


def test_batching_strings_gives_lists_of_str() -> None:
    batches = list(Dataset.from_tensor_slices(["a", "c", "e"]).batch(2))
    assert batches == [["a", "c"], ["e"]]
    assert all(isinstance(b, list) for b in batches)
    pairs = list(Dataset.from_tensor_slices(([1, 2, 3], ["x", "y", "z"])).batch(3))
    assert pairs[0][1] == ["x", "y", "z"]
    assert list(Dataset.from_tensor_slices(["a", "b"]).batch(1).unbatch()) == ["a", "b"]


def test_batching_strings_row_by_row_and_stacking_string_lists() -> None:
    words = Dataset.from_tensor_slices(["a", "b", "c"]).map(lambda s: s + "!")
    assert list(words.batch(2)) == [["a!", "b!"], ["c!"]]
    rows = Dataset.from_tensor_slices([["a", "b"], ["c", "d"]]).map(lambda r: r)
    assert list(rows.batch(2)) == [[["a", "b"], ["c", "d"]]]


def test_padded_batch_pads_strings_with_empty_strings() -> None:
    rows = Dataset.from_generator(lambda: iter([["a"], ["b", "c"]]))
    assert list(rows.padded_batch(2)) == [[["a", ""], ["b", "c"]]]
    assert list(rows.padded_batch(2, padding_values="?", padded_shapes=3)) == [
        [["a", "?", "?"], ["b", "c", "?"]]
    ]
    assert list(Dataset.from_tensor_slices(["p", "q"]).padded_batch(2)) == [["p", "q"]]


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.text(max_size=3), min_size=1, max_size=10), size=st.integers(1, 4))
def test_string_batches_unbatch_to_the_same_strings(words: list[str], size: int) -> None:
    batches = list(Dataset.from_tensor_slices(words).batch(size))
    assert all(isinstance(b, Strings) for b in batches)
    expected = [len(words[i : i + size]) for i in range(0, len(words), size)]
    assert [len(b) for b in batches] == expected
    assert list(Dataset.from_tensor_slices(words).batch(size).unbatch()) == words


# Errors


def test_batching_strings_of_different_lengths_raises() -> None:
    rows = Dataset.from_generator(lambda: iter([["a"], ["b", "c"]]))
    with pytest.raises(ValueError, match=r"Dataset.batch cannot stack string.*padded_batch"):
        list(rows.batch(2))


def test_padding_to_a_smaller_shape_raises() -> None:
    with pytest.raises(ValueError, match=r"cannot pad components of shape \[4\] .* to \[3\]"):
        list(A.padded_batch(4, padded_shapes=[3]))


def test_padding_to_another_rank_raises() -> None:
    with pytest.raises(ValueError, match=r"needs the component's rank"):
        list(A.padded_batch(2, padded_shapes=[None, 2]))


def test_padding_components_of_different_ranks_raises() -> None:
    mixed = Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros((2, 2))]))
    with pytest.raises(ValueError, match="one rank and dtype"):
        list(mixed.padded_batch(2))


@pytest.mark.parametrize("value", [[1, 2], "x"])
def test_padding_value_that_is_no_number_raises(value: object) -> None:
    with pytest.raises(ValueError, match="must give a number"):
        list(A.padded_batch(2, padding_values=value))


def test_padded_shapes_of_another_structure_raise() -> None:
    with pytest.raises(ValueError, match=r"padded_batch\(padded_shapes\) must have the structure"):
        list(Dataset.zip((A, A)).padded_batch(2, padded_shapes=[5]))


@pytest.mark.parametrize("shape", ["abc", [1.5], [-2]])
def test_padded_shapes_that_are_no_shapes_raise(shape: object) -> None:
    with pytest.raises(TypeError, match=r"padded_batch\(padded_shapes\) must be a shape"):
        list(A.padded_batch(2, padded_shapes=shape))


def test_unbatch_of_components_with_different_first_dimensions_raises() -> None:
    ragged = Dataset.from_tensors((np.zeros(2), ["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"Received: sizes=\[2, 3\]"):
        list(ragged.unbatch())
