"""The split and deal rules against literal tables measured on TensorFlow, and properties."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from centralstore import _tree
from centralstore.input.dataset import Dataset
from centralstore.input.split import deal_steps, split_leaves, split_sizes
from centralstore.input.strings import Strings


def replicas_of(batch: Any, num_replicas: int, **local: int) -> list[Any]:
    """One copy of ``batch``'s structure per local replica, rebuilt from ``split_leaves``."""
    columns, spec = split_leaves(batch, num_replicas, **local)
    count = local.get("local_replicas", num_replicas - local.get("replica_offset", 0))
    return [_tree.unflatten([column[i] for column in columns], spec) for i in range(count)]


def steps(n: int, batch: int, replicas: int, drop_remainder: bool = False) -> list[list[Any]]:
    """``range(n).batch(batch)`` split over ``replicas``: one list of slices per step."""
    dataset = Dataset.range(n).batch(batch, drop_remainder=drop_remainder)
    return [[s.tolist() for s in replicas_of(b, replicas)] for b in dataset]


@pytest.mark.parametrize(
    ("n", "batch", "replicas", "expected"),
    [
        (10, 4, 2, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]),
        (5, 4, 2, [[[0, 1], [2, 3]], [[4], []]]),
        (11, 5, 2, [[[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]], [[10], []]]),
        (4, 1, 2, [[[0], []], [[1], []], [[2], []], [[3], []]]),
        (8, 4, 3, [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]),
        (7, 4, 3, [[[0, 1], [2, 3], []], [[4], [5], [6]]]),
        (7, 7, 3, [[[0, 1, 2], [3, 4, 5], [6]]]),
        (5, 2, 1, [[[0, 1]], [[2, 3]], [[4]]]),
    ],
)
def test_split_rule_table(n: int, batch: int, replicas: int, expected: list[Any]) -> None:
    assert steps(n, batch, replicas) == expected


@pytest.mark.parametrize(
    ("size", "replicas", "sizes"),
    [(6, 2, [3, 3]), (5, 3, [2, 2, 1]), (4, 3, [2, 2, 0]), (1, 2, [1, 0]), (0, 2, [0, 0])],
)
def test_split_sizes_table(size: int, replicas: int, sizes: list[int]) -> None:
    assert split_sizes(size, replicas) == sizes
    assert [len(s) for s in replicas_of(torch.arange(size), replicas)] == sizes


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 50), replicas=st.integers(1, 6))
def test_split_sizes_are_ceil_slices_that_cover_the_batch(size: int, replicas: int) -> None:
    sizes = split_sizes(size, replicas)
    per_replica = -(-size // replicas)
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    assert sum(sizes) == size
    assert starts == [min(i * per_replica, size) for i in range(replicas)]


def test_split_sizes_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="Received: num_replicas=0"):
        split_sizes(4, 0)


def test_drop_remainder_drops_only_the_short_final_global_batch() -> None:
    assert steps(10, 4, 2, drop_remainder=True) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert steps(8, 4, 2, drop_remainder=True) == steps(8, 4, 2)


def test_empty_slices_are_real_tensors_keeping_trailing_dims_and_dtype() -> None:
    batch = torch.ones(1, 2, dtype=torch.float16)
    first, second = replicas_of(batch, 2)
    assert first.shape == (1, 2)
    assert second.shape == (0, 2)
    assert second.dtype == torch.float16


def test_every_leaf_is_cut_at_the_same_rows_keeping_the_structure() -> None:
    Pair = collections.namedtuple("Pair", ["x", "y"])
    batch = {"pair": Pair(torch.zeros(5, 3), torch.arange(5)), "other": torch.ones(5, 4)}
    first, second = replicas_of(batch, 2)
    assert type(first["pair"]) is Pair
    assert [first["pair"].x.shape, first["pair"].y.shape, first["other"].shape] == [
        (3, 3),
        (3,),
        (3, 4),
    ]
    assert [second["pair"].x.shape, second["other"].shape] == [(2, 3), (2, 4)]


@pytest.mark.parametrize(
    ("sizes", "replicas", "expected"),
    [
        # TensorFlow 2.21: zip(range(8).batch(4), range(8).batch(2)) over 2 replicas
        ((4, 2), 2, [([0, 1], [0]), ([2, 3], [1])]),
        ((5, 2), 3, [([0, 1], [0]), ([2, 3], [1]), ([4], [])]),  # 2/2/1 and 1/1/0
        ((2, 5), 3, [([0], [0, 1]), ([1], [2, 3]), ([], [4])]),
        ((3, 7), 2, [([0, 1], [0, 1, 2, 3]), ([2], [4, 5, 6])]),
        ((1, 4), 3, [([0], [0, 1]), ([], [2, 3]), ([], [])]),
        ((0, 3), 2, [([], [0, 1]), ([], [2])]),
        ((6, 4, 1), 4, [([0, 1], [0], [0]), ([2, 3], [1], []), ([4, 5], [2], []),
                        ([], [3], [])]),
    ],
)
def test_leaves_of_different_batch_sizes_are_each_split_on_their_own(
    sizes: tuple[int, ...], replicas: int, expected: list[tuple[list[int], ...]]
) -> None:
    """TensorFlow's rule, measured: every leaf is cut by the split rule applied to its own
    first dimension g (slices of ceil(g / R), the last short or empty)."""
    batch = tuple(torch.arange(size) for size in sizes)
    assert [tuple(t.tolist() for t in r) for r in replicas_of(batch, replicas)] == expected


def test_leaves_of_different_sizes_in_a_nested_batch_with_strings_and_local_replicas() -> None:
    batch = {"x": torch.zeros(5, 3), "tokens": np.arange(2), "words": Strings(["a", "b", "c"])}
    shapes = [
        (tuple(r["x"].shape), r["tokens"].tolist(), r["words"]) for r in replicas_of(batch, 3)
    ]
    assert shapes == [((2, 3), [0], ["a"]), ((2, 3), [1], ["b"]), ((1, 3), [], ["c"])]
    # a worker holding replicas 1 and 2 of 3 keeps their slices of every leaf
    local = replicas_of(batch, 3, replica_offset=1, local_replicas=2)
    assert [(len(r["x"]), r["tokens"].tolist(), r["words"]) for r in local] == [
        (2, [1], ["b"]), (1, [], ["c"])
    ]
    # a scalar leaf still cannot be split, whatever the other leaves' sizes (3.7.4)
    with pytest.raises(ValueError, match=r"Cannot split a scalar tensor \(shape \[\]\)"):
        split_leaves((torch.zeros(4), torch.zeros(2), torch.tensor(1.0)), 2)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=4), replicas=st.integers(1, 5))
def test_each_leaf_is_cut_by_the_split_sizes_of_its_own_first_dimension(
    sizes: list[int], replicas: int
) -> None:
    batch = [torch.arange(size) for size in sizes]
    columns, _ = split_leaves(batch, replicas)
    for size, column in zip(sizes, columns, strict=True):
        assert [len(piece) for piece in column] == split_sizes(size, replicas)
        assert torch.cat(column).tolist() == list(range(size))


def test_string_batches_split_into_lists_by_the_split_rule() -> None:
    words = Strings(["a", "b", "c", "d", "e"])
    first, second = replicas_of((torch.arange(5), words), 2)
    assert first[1] == ["a", "b", "c"]
    assert second[1] == ["d", "e"]
    assert isinstance(second[1], Strings)
    assert replicas_of(Strings(["a"]), 3) == [["a"], [], []]
    assert replicas_of(words, 3, replica_offset=1, local_replicas=2) == [["c", "d"], ["e"]]


def test_cpu_slices_are_views_of_the_batch() -> None:
    batch = torch.arange(12.0).reshape(6, 2).clone()
    slices = replicas_of(batch, 3)
    for i, piece in enumerate(slices):
        assert piece._base is batch
        assert piece.data_ptr() == batch.data_ptr() + i * 2 * 2 * batch.element_size()


def test_numpy_leaves_become_tensors_sharing_memory() -> None:
    array = np.arange(6, dtype=np.float32).reshape(3, 2)
    first, second = replicas_of((array,), 2)
    assert isinstance(first[0], torch.Tensor)
    assert first[0].data_ptr() == array.ctypes.data
    assert second[0].tolist() == [[4.0, 5.0]]


def test_numpy_with_negative_strides_is_copied_once() -> None:
    array = np.arange(4)[::-1]
    assert [s.tolist() for s in replicas_of(array, 2)] == [[3, 2], [1, 0]]


def test_local_replica_range_keeps_only_its_slices() -> None:
    batch = torch.arange(7)
    kept = replicas_of(batch, 3, replica_offset=1, local_replicas=2)
    assert [s.tolist() for s in kept] == [[3, 4, 5], [6]]
    assert [s.tolist() for s in replicas_of(batch, 3, replica_offset=2)] == [[6]]


def test_one_replica_keeps_the_batch_whole_even_a_scalar() -> None:
    batch = torch.tensor(3)
    assert replicas_of(batch, 1) == [batch]
    assert replicas_of(7, 1) == [7]
    assert replicas_of("one", 1) == ["one"]


@pytest.mark.parametrize("leaf", [torch.tensor(1.0), 5, np.float32(2.0), np.array(3)])
def test_scalar_element_with_several_replicas_says_to_batch(leaf: object) -> None:
    with pytest.raises(ValueError, match=r"over 2 replicas.*Batch the dataset first"):
        replicas_of((torch.zeros(2), leaf), 2)


@pytest.mark.parametrize("leaf", ["abc", b"abc"])
def test_a_single_string_is_a_scalar_that_says_to_batch(leaf: object) -> None:
    message = r"Cannot split a scalar \((str|bytes)\) over 2 replicas in experimental_distribute"
    with pytest.raises(ValueError, match=message):
        split_leaves(leaf, 2)


def test_leaf_that_is_no_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"type object.*Received: <object"):
        split_leaves(object(), 2)


@pytest.mark.parametrize(
    ("replicas", "offset", "local"), [(0, 0, None), (2, 2, None), (3, 1, 3), (2, -1, 1), (2, 0, 0)]
)
def test_bad_replica_counts_raise(replicas: int, offset: int, local: int | None) -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        split_leaves(torch.zeros(4), replicas, replica_offset=offset, local_replicas=local)


def test_split_of_a_structure_without_leaves_gives_one_per_replica() -> None:
    assert replicas_of((), 2) == [(), ()]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    batch=st.integers(1, 12),
    replicas=st.integers(1, 4),
    drop=st.booleans(),
)
def test_concatenated_slices_give_back_the_source_in_order(
    n: int, batch: int, replicas: int, drop: bool
) -> None:
    source = [b for b in Dataset.range(n).batch(batch, drop_remainder=drop)]
    for global_batch in source:
        x, y = split_leaves((global_batch, global_batch * 2), replicas)[0]
        assert len(x) == replicas
        assert torch.equal(torch.cat(x), global_batch)
        assert torch.equal(torch.cat(y), global_batch * 2)
    kept = n - n % batch if drop else n
    flat = [s for b in source for s in replicas_of(b, replicas)]
    assert (torch.cat(flat).tolist() if flat else []) == list(range(kept))


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 30), replicas=st.integers(1, 4), data=st.data())
def test_local_ranges_over_all_offsets_give_the_full_split(
    size: int, replicas: int, data: st.DataObject
) -> None:
    batch = torch.arange(size)
    full = [s.tolist() for s in replicas_of(batch, replicas)]
    cuts = sorted(data.draw(st.sets(st.integers(1, replicas - 1))) if replicas > 1 else set())
    bounds = [0, *cuts, replicas]
    union = []
    for start, stop in itertools.pairwise(bounds):
        local = replicas_of(batch, replicas, replica_offset=start, local_replicas=stop - start)
        union += [s.tolist() for s in local]
    assert union == full


# The deal rule of distribute_datasets_from_function.


def dealt(elements: list[Any], replicas: int) -> list[list[Any]]:
    return [[s.tolist() for s in columns[0]] for columns, _ in deal_steps(elements, replicas)]


def test_deal_hands_elements_out_round_robin_and_pads_the_last_step() -> None:
    elements = list(Dataset.range(7).batch(3))
    assert dealt(elements, 2) == [[[0, 1, 2], [3, 4, 5]], [[6], []]]
    assert dealt(elements, 3) == [[[0, 1, 2], [3, 4, 5], [6]]]
    assert dealt(elements, 1) == [[[0, 1, 2]], [[3, 4, 5]], [[6]]]


def test_deal_padding_keeps_dtype_and_trailing_dims_of_the_last_element() -> None:
    elements = [torch.ones(2, 5, dtype=torch.int8)] * 3
    _, (last, _) = deal_steps(elements, 2)
    padding = last[0][1]
    assert padding.shape == (0, 5)
    assert padding.dtype == torch.int8


def test_deal_of_scalars_drops_the_incomplete_step_with_a_count() -> None:
    with pytest.warns(UserWarning, match="Dropped the last 1 element"):
        assert dealt(list(Dataset.range(5)), 2) == [[0, 1], [2, 3]]


def test_deal_pads_string_batches_with_empty_lists() -> None:
    elements = [Strings(["a", "b"]), Strings(["c"]), Strings(["d"])]
    (_, (last, _)) = list(deal_steps(elements, 2))
    assert last[0] == [["d"], []]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text(max_size=2), max_size=20), replicas=st.integers(1, 4))
def test_strings_through_the_split_rule_give_back_the_batch(
    words: list[str], replicas: int
) -> None:
    columns, _ = split_leaves((Strings(words), torch.arange(len(words))), replicas)
    strings, numbers = columns
    assert [len(s) for s in strings] == [len(n) for n in numbers]
    assert [w for piece in strings for w in piece] == words
    if replicas > 1:
        assert [len(s) for s in strings] == split_sizes(len(words), replicas)


def test_deal_of_different_structures_in_one_step_raises() -> None:
    with pytest.raises(ValueError, match="same structure"):
        list(deal_steps([torch.zeros(2), (torch.zeros(2),)], 2))


def test_a_dataloader_batch_of_strings_splits_like_a_tensor() -> None:
    loader = torch.utils.data.DataLoader(
        list(zip(torch.arange(5), ["a", "b", "c", "d", "e"], strict=True)), batch_size=5
    )
    columns, _ = split_leaves(next(iter(loader)), 2)
    assert [list(part) for part in columns[1]] == [["a", "b", "c"], ["d", "e"]]
