"""torchmetrics metrics updated inside strategy.run accumulate as one device updated with
the whole batch: each state folds by its own dist_reduce_fx (centralstore/metrics.py). And a
metric written as a module with plain buffers, aggregated by SUM (docs/keras.md)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from paths import PATHS, run_on, strategy_on
from replicas import context, replica_id, strategy_of

import centralstore as cs
import centralstore.metrics

torchmetrics = pytest.importorskip("torchmetrics")
centralstore.metrics.install()


class RunningMean(torchmetrics.Metric):  # type: ignore[misc]
    """A state reduced by "mean": the running mean of the batches' means."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("value", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x: torch.Tensor) -> None:
        self.value = (self.value * self._update_count_before + x.mean()) / self._update_count

    @property
    def _update_count_before(self) -> int:
        return self._update_count - 1

    def compute(self) -> torch.Tensor:
        return self.value


METRICS: dict[str, Callable[[], Any]] = {
    "sum (accuracy)": lambda: torchmetrics.classification.MulticlassAccuracy(3, average="micro"),
    "sum (mean)": torchmetrics.MeanMetric,
    "max": torchmetrics.MaxMetric,
    "min": torchmetrics.MinMetric,
    "cat": torchmetrics.CatMetric,
    "cat (auroc)": lambda: torchmetrics.classification.MulticlassAUROC(3, thresholds=None),
}


def arguments(name: str, logits: torch.Tensor, y: torch.Tensor) -> tuple[Any, ...]:
    if name in ("sum (accuracy)", "cat (auroc)"):
        return (logits.softmax(-1), y)
    return (logits[:, 0],)


def batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(n, 3, generator=generator), torch.randint(0, 3, (n,), generator=generator))
        for n in sizes
    ]


def update(metric: Any, name: str, logits: torch.Tensor, y: torch.Tensor) -> None:
    if len(y):  # a slice may be empty, which torchmetrics' classification metrics refuse
        metric.update(*arguments(name, logits, y))


@pytest.mark.parametrize("replicas", [1, 2, 3])  # (one: the short path of run, from the second)
@pytest.mark.parametrize("name", sorted(METRICS))
def test_states_fold_by_their_reduction(name: str, replicas: int) -> None:
    strategy = strategy_of(replicas)
    with strategy.scope():
        metric = METRICS[name]()
    reference = METRICS[name]()
    for logits, y in batches([7, 5, 4, 1]):  # uneven, and slices of 0 rows
        dataset = cs.Dataset.from_tensor_slices((logits, y)).batch(len(y))
        for step in strategy.experimental_distribute_dataset(dataset):
            strategy.run(update, args=(metric, name, *step))
        reference.update(*arguments(name, logits, y))
        torch.testing.assert_close(metric.compute(), reference.compute())
    assert metric._update_count == reference._update_count == 4


def test_forward_returns_the_slice_value_and_accumulates() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        metric = torchmetrics.SumMetric()
    values = cs.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([4.0])])
    per_replica = strategy.run(metric, args=(values,))
    assert [float(v) for v in strategy.experimental_local_results(per_replica)] == [3.0, 4.0]
    strategy.run(metric, args=(values,))
    assert float(metric.compute()) == 14.0


def test_a_mean_state_averages_the_replicas() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        metric = RunningMean()
    for first, second in ((1.0, 3.0), (5.0, 7.0)):
        values = cs.PerReplica([torch.tensor([first]), torch.tensor([second])])
        strategy.run(metric.update, args=(values,))
    assert float(metric.compute()) == 4.0  # the mean of the steps' means, 2 and 6


def test_a_failed_run_leaves_no_trace() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        metric = torchmetrics.CatMetric()

    def step() -> None:
        metric.update(torch.tensor([float(replica_id())]))
        if replica_id() == 1:
            raise ValueError("replica 1 fails after its update")

    with pytest.raises(ValueError, match="replica 1 fails"):
        strategy.run(step)
    strategy.run(lambda: metric.update(torch.tensor([10.0 + replica_id()])))
    assert metric.compute().tolist() == [10.0, 11.0]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(METRICS))
def test_a_failed_run_puts_back_every_state_and_the_update_count(
    name: str, path: str, replicas: int
) -> None:
    """(One replica updates the metric's own states, and the first update after a sync point
    keeps what a failure puts back; several update copies, which a failure drops: either
    way the failed run leaves no trace, in place states, rebound ones and lists alike.)"""
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        metric = METRICS[name]()
    reference = METRICS[name]()
    (logits, y), (other, z), (more, w) = batches([6, 4, 8])

    def failing(*inputs: torch.Tensor) -> None:
        metric.update(*inputs)
        metric.update(*inputs)
        if replica_id() == replicas - 1:
            raise ValueError("the last replica fails after its updates")

    run_on(path, strategy, metric.update, args=split(replicas, *arguments(name, logits, y)))
    reference.update(*arguments(name, logits, y))
    with pytest.raises(ValueError, match="the last replica fails"):
        run_on(path, strategy, failing, args=split(replicas, *arguments(name, other, z)))
    assert metric._update_count == reference._update_count == 1
    torch.testing.assert_close(metric.compute(), reference.compute())
    run_on(path, strategy, metric.update, args=split(replicas, *arguments(name, more, w)))
    reference.update(*arguments(name, more, w))
    torch.testing.assert_close(metric.compute(), reference.compute())
    assert metric._update_count == 2


@pytest.mark.parametrize("path", PATHS)
def test_one_replica_reads_its_own_updates_as_one_device(path: str) -> None:
    """(A process's only replica, computing where the states live, updates them directly: a
    read after its update in the same step sees it, as on one device.)"""
    strategy = strategy_on(path, 1)
    with strategy.scope():
        metric = torchmetrics.MeanMetric()
    reference = torchmetrics.MeanMetric()

    def step(values: torch.Tensor) -> torch.Tensor:
        metric.update(values)
        return metric.compute()

    for values in (torch.tensor([1.0, 2.0]), torch.tensor([6.0])):
        reference.update(values)
        torch.testing.assert_close(run_on(path, strategy, step, args=(values,)),
                                   reference.compute())


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_a_merge_commits_the_updates_before_it_and_a_failure_after_drops_the_rest(
    path: str, replicas: int
) -> None:
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        metric = torchmetrics.CatMetric()

    def step() -> None:
        metric.update(torch.tensor([float(replica_id())]))
        context().merge_call(lambda strategy: None)
        metric.update(torch.tensor([10.0 + replica_id()]))
        raise ValueError("the step fails after its merge")

    with pytest.raises(ValueError, match="fails after its merge"):
        run_on(path, strategy, step)
    assert metric.compute().reshape(-1).tolist() == [float(r) for r in range(replicas)]
    assert metric._update_count == 1


def test_replicas_on_threads_fold_in_replica_order() -> None:
    strategy = strategy_of(3)
    with strategy.scope():
        metric = torchmetrics.CatMetric()

    def step() -> None:
        rc = cs.get_replica_context()
        assert rc is not None
        rc.all_reduce("sum", 1.0)  # replicas 1 and 2 now run on replica threads
        metric.update(torch.tensor([float(replica_id())]))

    for _ in range(2):
        strategy.run(step)
    assert metric.compute().tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("replicas", [1, 2])
def test_training_after_an_evaluation_finds_the_store_settled(replicas: int) -> None:
    """(The sync point that folds a metric's copies forgets the metric: training runs after
    an evaluation that updated one take the short path at R = 1 and leave nothing for the
    optimizer's step to sync; the metric's next update folds as before.)"""
    strategy = strategy_of(replicas)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
        metric = torchmetrics.SumMetric()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    store = strategy._store

    def train() -> None:
        layer(torch.ones(2)).sum().backward()

    for evaluation in range(2):
        strategy.run(metric.update, args=(torch.tensor([1.0, 2.0]),))
        assert store.fold_hooks == {}
        for _ in range(2):
            strategy.run(train)
            assert store.settled()
            optimizer.step()
        assert float(metric.compute()) == 3.0 * replicas * (evaluation + 1)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(METRICS))
def test_a_forward_caches_the_whole_batch_value(name: str, path: str, replicas: int) -> None:
    """(Each replica's forward returns its slice's value; the metric's ``_forward_cache``,
    which Lightning logs as the step's value, is the whole batch's, as one device's.)"""
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        metric = METRICS[name]()
    reference = METRICS[name]()
    for logits, y in batches([9, 6, 12]):  # (no empty slice: a forward of nothing raises)
        inputs = arguments(name, logits, y)
        run_on(path, strategy, metric, args=split(replicas, *inputs))
        expected = reference(*inputs)
        torch.testing.assert_close(metric._forward_cache, expected)
    torch.testing.assert_close(metric.compute(), reference.compute())


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_compiled_step_updates_a_metric_as_one_device(replicas: int) -> None:
    """(torch.compile traces a replica's update through the integration: it must not warn
    about centralstore's code, and the metric folds as when eager.)"""
    strategy = strategy_of(replicas)
    with strategy.scope():
        metric = METRICS["sum (accuracy)"]()
    reference = METRICS["sum (accuracy)"]()

    @torch.compile
    def step(logits: torch.Tensor, y: torch.Tensor) -> None:
        metric.update(logits.softmax(-1), y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for logits, y in batches([8, 6]):
            strategy.run(step, args=split(replicas, logits, y))
            reference.update(logits.softmax(-1), y)
    assert not [str(w.message) for w in caught if "centralstore" in str(w.message)]
    torch.testing.assert_close(metric.compute(), reference.compute())


def collection() -> Any:
    """Two compute groups: macro accuracy, precision and recall share their states (equal
    after any update); top-3 accuracy has states of the same names that differ."""
    from torchmetrics.classification import (
        MulticlassAccuracy,
        MulticlassPrecision,
        MulticlassRecall,
    )

    return torchmetrics.MetricCollection({
        "accuracy": MulticlassAccuracy(3, average="macro"),
        "precision": MulticlassPrecision(3, average="macro"),
        "recall": MulticlassRecall(3, average="macro"),
        "top 2": MulticlassAccuracy(3, top_k=2, average="micro"),
    })


def split(replicas: int, *tensors: torch.Tensor) -> Any:
    """Each tensor in ``replicas`` slices as ``PerReplica`` values (the tensors as they are
    at R = 1)."""
    if replicas == 1:
        return tensors
    return tuple(cs.PerReplica(list(t.tensor_split(replicas))) for t in tensors)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("path", PATHS)
def test_a_collection_forms_its_compute_groups_from_the_whole_batch(
    path: str, replicas: int
) -> None:
    """(torchmetrics groups a collection's metrics whose states are equal after their first
    update; inside a replica the metrics' own states are untouched then, so the groups form
    at the sync point, from the folded states.)"""
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        metrics = collection()
    reference = collection()
    for logits, y in batches([12, 9, 6]):
        probabilities = logits.softmax(-1)
        run_on(path, strategy, metrics.update, args=split(replicas, probabilities, y))
        reference.update(probabilities, y)
        torch.testing.assert_close(metrics.compute(), reference.compute())
        assert metrics.compute_groups == reference.compute_groups
    assert reference.compute_groups == {0: ["accuracy", "precision", "recall"], 1: ["top 2"]}


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_collection_whose_first_run_fails_forms_its_groups_at_the_next(replicas: int) -> None:
    strategy = strategy_of(replicas)
    with strategy.scope():
        metrics = collection()
    reference = collection()
    (logits, y), (other, z) = batches([6, 4])

    def failing(probabilities: torch.Tensor, target: torch.Tensor) -> None:
        metrics.update(probabilities, target)
        raise ValueError("the step failed after its update")

    with pytest.raises(ValueError, match="the step failed"):
        strategy.run(failing, args=split(replicas, logits.softmax(-1), y))
    assert not metrics._groups_checked
    strategy.run(metrics.update, args=split(replicas, other.softmax(-1), z))
    reference.update(other.softmax(-1), z)
    torch.testing.assert_close(metrics.compute(), reference.compute())
    assert metrics.compute_groups == reference.compute_groups
    with pytest.raises(ValueError, match="the step failed"):  # (the groups share states now)
        strategy.run(failing, args=split(replicas, logits.softmax(-1), y))
    torch.testing.assert_close(metrics.compute(), reference.compute())
    assert metrics.compute_groups == reference.compute_groups


def test_a_custom_reduction_is_refused() -> None:
    class Custom(torchmetrics.Metric):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.add_state("value", torch.tensor(0.0), dist_reduce_fx=torch.sum)

        def update(self, x: torch.Tensor) -> None:
            self.value += x.sum()

        def compute(self) -> torch.Tensor:
            return self.value

    strategy = strategy_of(2)
    with strategy.scope():
        metric = Custom()
    with pytest.raises(ValueError, match="reduces by a custom dist_reduce_fx") as error:
        strategy.run(metric.update, args=(torch.ones(2),))
    assert "Received: dist_reduce_fx=" in str(error.value)
    metric.update(torch.ones(2))  # outside run it is torchmetrics' own
    assert float(metric.compute()) == 2.0


def test_outside_run_the_metric_is_untouched_torchmetrics() -> None:
    with strategy_of(2).scope():
        metric = torchmetrics.SumMetric()
    metric.update(torch.tensor(2.0))
    assert float(metric(torch.tensor(3.0))) == 3.0
    assert float(metric.compute()) == 5.0
    assert float(metric.clone().compute()) == 5.0


class Counts(torch.nn.Module):
    """docs/keras.md's metric with plain buffers: totals aggregated by SUM."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))
        self.register_buffer("count", torch.zeros(()))
        for buffer in (self.total, self.count):
            cs.set_aggregation(buffer, "SUM")  # floating buffers default to MEAN

    def update(self, values: torch.Tensor) -> None:
        self.total.add_(values.sum())  # add_ writes an increment: SUM adds the replicas'
        self.count.add_(values.numel())


def test_a_metric_of_plain_buffers_aggregated_by_sum() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        metric = Counts()
    values = cs.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([4.0, 0.0])])
    for _ in range(2):
        strategy.run(metric.update, args=(values,))
    assert (float(metric.total), float(metric.count)) == (14.0, 8.0)
    assert strategy.extended.variable_created_in_scope(metric.total)
