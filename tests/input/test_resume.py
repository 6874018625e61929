"""A distributed iterator's position: ``state_dict`` / ``load_state_dict`` (``resume.py``).

The oracle is always the uninterrupted iterator: the steps a restored iterator makes must be
exactly those the saved one went on to make.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

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
from centralstore.input.iterator import DistributedIterator
from centralstore.input.options import InputContext

TWO = ("cpu:0", "cpu:1")
THREE = ("cpu:0", "cpu:1", "cpu:2")


def lists(step: Any) -> Any:
    """A step as nested lists: PerReplica leaves as lists of their components."""
    if isinstance(step, PerReplica):
        return [lists(c) for c in step.values]
    if isinstance(step, (tuple, list)):
        return [lists(s) for s in step]
    return step.tolist()


def rows(step: Any) -> list[Any]:
    """The examples of one step, replicas concatenated (for comparisons across R)."""
    components = step.values if isinstance(step, PerReplica) else (step,)
    return [row for c in components for row in c.tolist()]


def resumed_after(dataset: DistributedDataset, steps: int) -> tuple[list[Any], list[Any]]:
    """The steps after ``steps`` of an uninterrupted iterator, and of one restored there."""
    iterator = iter(dataset)
    for _ in range(steps):
        next(iterator)
    state = iterator.state_dict()
    expected = [lists(s) for s in iterator]
    restored = iter(dataset)
    restored.load_state_dict(state)
    return expected, [lists(s) for s in restored]


def pipeline(seed: int | None = 7) -> Dataset:
    mapped = Dataset.range(23).shuffle(9, seed=seed).repeat(3).map(lambda x: x * 10)
    return mapped.batch(4).prefetch(2)


@pytest.mark.parametrize("steps", [0, 1, 5, 16, 17, 18])
def test_a_dataset_pipeline_resumes_at_every_position(steps: int) -> None:
    expected, got = resumed_after(distribute_dataset(pipeline(), TWO), steps)
    assert got == expected
    assert len(expected) == 18 - steps  # 69 elements in batches of 4


def test_an_unseeded_shuffle_resumes_too_its_seed_is_saved() -> None:
    dataset = distribute_dataset(pipeline(seed=None), TWO)
    iterator = iter(dataset)
    next(iterator)
    state = iterator.state_dict()
    expected = [lists(s) for s in iterator]
    torch.manual_seed(1234)  # a resumed process draws other seeds when building pipelines
    rebuilt = distribute_dataset(pipeline(seed=None), TWO)
    restored = iter(rebuilt)
    restored.load_state_dict(state)
    assert [lists(s) for s in restored] == expected


def test_the_next_pass_after_a_restored_one_reshuffles_as_the_saved_run() -> None:
    source = Dataset.range(10).shuffle(10, seed=3).batch(5)
    dataset = distribute_dataset(source, TWO)
    first = iter(dataset)
    next(first)
    state = first.state_dict()
    list(first)
    ended = first.state_dict()
    second_epoch = [lists(s) for s in iter(dataset)]
    for saved in (state, ended):  # restored mid-pass, and after the pass had ended
        fresh = distribute_dataset(Dataset.range(10).shuffle(10, seed=3).batch(5), TWO)
        restored = iter(fresh)
        restored.load_state_dict(saved)
        list(restored)
        assert [lists(s) for s in iter(fresh)] == second_epoch
    assert ended["exhausted"] and not state["exhausted"]


def test_from_function_resumes_with_another_number_of_replicas() -> None:
    def dataset_fn(context: InputContext) -> Dataset:
        batch = context.get_per_replica_batch_size(12)
        return Dataset.range(60).shuffle(16, seed=2).map(lambda x: x + 1).batch(batch)

    two = distribute_datasets_from_function(dataset_fn, TWO)
    iterator = iter(two)
    for _ in range(2):
        next(iterator)
    state = iterator.state_dict()
    expected = [rows(s) for s in iterator]
    three = iter(distribute_datasets_from_function(dataset_fn, THREE, input_context=InputContext(
        1, 0, 3)))
    three.load_state_dict(state)
    assert [rows(s) for s in three] == expected  # the same examples, cut in three
    assert state["elements_per_step"] == 2


def test_experimental_distribute_dataset_resumes_with_another_number_of_replicas() -> None:
    iterator = iter(distribute_dataset(pipeline(), TWO))
    for _ in range(4):
        next(iterator)
    state = iterator.state_dict()
    expected = [rows(s) for s in iterator]
    restored = iter(distribute_dataset(pipeline(), THREE))
    restored.load_state_dict(state)
    assert [rows(s) for s in restored] == expected


def loader(generator: bool) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(30.0))
    if generator:
        seeded = torch.Generator().manual_seed(5)
        return DataLoader(data, batch_size=4, shuffle=True, generator=seeded)
    return DataLoader(data, batch_size=4, shuffle=True)


@pytest.mark.parametrize("generator", [True, False])
def test_a_dataloader_is_fast_forwarded_with_a_warning(generator: bool) -> None:
    torch.manual_seed(0)
    dataset = distribute_dataset(loader(generator), TWO)
    list(iter(dataset))  # one epoch first: the restored pass is the second one
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    state = iterator.state_dict()
    expected = [lists(s) for s in iterator]
    global_state = torch.get_rng_state()
    torch.manual_seed(99)  # what the restoring process's global generator happens to be
    fresh = distribute_dataset(loader(generator), TWO)
    restored = iter(fresh)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match=re.escape(
        "over a DataLoader by reading and discarding the 3 element(s) it had already produced"
    )):
        restored.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator handed back
    assert [lists(s) for s in restored] == expected
    if generator:  # the next epoch continues from the loader's own generator
        torch.set_rng_state(global_state)
        assert [lists(s) for s in iter(fresh)] == [lists(s) for s in iter(dataset)]


def test_a_stateful_dataloader_resumes_from_its_own_state_without_reading_again() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        return stateful.StatefulDataLoader(
            TensorDataset(torch.arange(30.0)), batch_size=4, shuffle=True,
            generator=torch.Generator().manual_seed(5),
        )

    dataset = distribute_dataset(make(), TWO)
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    state = iterator.state_dict()
    expected = [lists(s) for s in iterator]
    restored = iter(distribute_dataset(make(), TWO))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*reading and discarding.*")
        restored.load_state_dict(state)
    assert [lists(s) for s in restored] == expected
    assert state["source"] == "StatefulDataLoader" and state["mark"]["_num_yielded"] == 3


def test_a_list_of_batches_resumes_by_skipping() -> None:
    batches = [torch.arange(i, i + 4) for i in range(0, 20, 4)]
    expected, got = resumed_after(distribute_dataset(batches, TWO), 2)
    assert got == expected == [lists(PerReplica(tuple(b.split(2)))) for b in batches[2:]]


def test_the_state_is_small_and_plain() -> None:
    iterator = iter(distribute_dataset(pipeline(), TWO))
    next(iterator)
    state = iterator.state_dict()
    assert state["steps"] == 1 and state["source"] == "Dataset"
    assert state["origin"] == {"random_stages": [[7, 0]]}


# -- Mistakes ---------------------------------------------------------------------------------


def fresh_iterator() -> DistributedIterator:
    return iter(distribute_dataset(pipeline(), TWO))


def test_a_state_that_is_not_an_iterators_is_refused() -> None:
    state = fresh_iterator().state_dict()
    with pytest.raises(ValueError, match=r"takes what DistributedIterator.state_dict\(\) returned"):
        fresh_iterator().load_state_dict({"steps": 3})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['mark'\] and unexpected key\(s\) "
                                         r"\['extra'\]"):
        fresh_iterator().load_state_dict(
            {**{k: v for k, v in state.items() if k != "mark"}, "extra": 1}
        )
    with pytest.raises(ValueError, match="over a Dataset into one over a plain iterable"):
        iter(distribute_dataset([torch.zeros(2)], TWO)).load_state_dict(state)


def test_a_pipeline_that_differs_from_the_saved_one_is_refused() -> None:
    iterator = fresh_iterator()
    for _ in range(10):
        next(iterator)
    state = iterator.state_dict()
    shorter = iter(distribute_dataset(Dataset.range(23).shuffle(9, seed=7).batch(4), TWO))
    with pytest.raises(ValueError, match=r"had made steps from 10 elements of its source, but "
                                         r"a pass over the source now has only 6"):
        shorter.load_state_dict(state)
    unshuffled = iter(distribute_dataset(Dataset.range(99).batch(4), TWO))
    with pytest.raises(ValueError, match=r"saved pipeline had 1 random stage\(s\)"):
        unshuffled.load_state_dict(state)


def test_an_iterator_built_on_bare_steps_has_no_state() -> None:
    def steps() -> Iterator[tuple[Any, tuple[()], None]]:
        yield torch.zeros(1), (), None

    with pytest.raises(TypeError, match=r"state_dict\(\) needs an iterator made by iter\(\)"):
        DistributedIterator(steps()).state_dict()  # type: ignore[arg-type]
