"""Keras variables created in a strategy's scope are its central variables and keep their
declared aggregation; metric variables sum (docs/keras.md)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch
from keras_models import compile_model, data, max_difference, sequential, twins
from replicas import replica_id, strategy_of

import centralstore as cs
from centralstore.keras._variables import aggregation_of
from centralstore.keras._variables import strategy_of as model_strategy
from centralstore.variables.store import current_store

A = cs.VariableAggregation


def aggregation(strategy: cs.Strategy, variable: keras.Variable) -> A:
    with strategy.scope():
        record = current_store().record(variable.value)
    assert record is not None, f"{variable.path} is not a central variable"
    return record.aggregation


@pytest.mark.parametrize(
    ("declared", "trainable", "dtype", "expected"),
    [
        ("none", True, "float32", A.NONE),
        ("none", False, "float32", A.MEAN),
        ("none", False, "int32", A.ONLY_FIRST_REPLICA),
        ("mean", False, "float32", A.MEAN),
        ("sum", False, "float32", A.SUM),
        ("sum", True, "float32", A.SUM),
        ("only_first_replica", False, "int32", A.ONLY_FIRST_REPLICA),
    ],
)
def test_declared_aggregations_map_onto_variable_aggregation(
    declared: str, trainable: bool, dtype: str, expected: A
) -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        variable = keras.Variable(
            np.zeros(3), trainable=trainable, dtype=dtype, aggregation=declared
        )
    assert aggregation_of(variable) is expected
    assert aggregation(strategy, variable) is expected


def test_a_model_built_in_scope_is_central_on_the_parameter_device() -> None:
    strategy = strategy_of(3)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(2), keras.layers.BatchNormalization()
        ])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    found = {v.name: aggregation(strategy, v) for v in model.variables}
    assert found == {
        "kernel": A.NONE, "bias": A.NONE, "gamma": A.NONE, "beta": A.NONE,
        "moving_mean": A.MEAN, "moving_variance": A.MEAN,
    }
    assert all(v.value.device.type == "cpu" and v.value.is_leaf for v in model.variables)
    assert {aggregation(strategy, v) for v in model.metrics_variables} == {A.SUM}  # the loss
    assert model_strategy(model) is strategy
    assert model_strategy(sequential()) is None


def test_metric_state_sums_in_a_custom_loop() -> None:
    """The issue's halved counts: a metric updated inside run counts every replica's examples
    (total 14 and count 4 here), whatever was there before."""
    strategy = strategy_of(2)
    with strategy.scope():
        mean = keras.metrics.Mean()
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    values = cs.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([4.0, 0.0])])
    for _ in range(2):
        strategy.run(mean.update_state, args=(values,))
    assert (float(mean.total), float(mean.count), float(mean.result())) == (14.0, 8.0, 1.75)
    y = torch.tensor([0, 1, 2, 2])
    probabilities = torch.eye(3)[[0, 1, 0, 2]]
    halves = cs.PerReplica([(y[:3], probabilities[:3]), (y[3:], probabilities[3:])])
    strategy.run(lambda batch: accuracy.update_state(*batch), args=(halves,))
    assert float(accuracy.result()) == 0.75
    assert aggregation(strategy, mean.total) is A.SUM


def test_assign_inside_run_follows_the_aggregation() -> None:
    """assign_add is an increment and assign a final value, as in TensorFlow."""
    strategy = strategy_of(2)
    with strategy.scope():
        total = keras.Variable(10.0, trainable=False, aggregation="sum")
        first = keras.Variable(10.0, trainable=False, aggregation="only_first_replica")

    def write() -> None:
        total.assign_add(replica_id() + 1.0)
        first.assign(replica_id() + 1.0)

    strategy.run(write)
    assert (float(total.value), float(first.value)) == (13.0, 1.0)
    total.assign_add(1.0)  # cross-replica: applied at once
    assert float(total.value) == 14.0


def test_a_model_built_on_its_first_batch_is_adopted() -> None:
    """Compiled in the scope but built by fit, outside it: its variables join the strategy."""
    x, y = data()
    strategy = strategy_of(2)

    def unbuilt() -> keras.Model:
        return keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])

    keras.utils.set_random_seed(3)
    reference = compile_model(unbuilt())
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = compile_model(unbuilt())
    assert not model.built
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert all(strategy.extended.variable_created_in_scope(v.value) for v in model.variables)
    assert type(model.train_function).__name__ == "TrainStep"
    assert max_difference(history, expected) < 1e-5
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


def test_a_model_of_two_strategies_is_refused() -> None:
    first, second = strategy_of(2), strategy_of(2)
    with first.scope():
        inner = keras.layers.Dense(3)
        inner.build((None, 6))
    with second.scope():
        model = compile_model(keras.Sequential([keras.Input((6,)), inner, keras.layers.Dense(3)]))
    x, y = data(8)
    with pytest.raises(ValueError, match="belong to 2 strategies"):
        model.fit(x, y, verbose=0)


def test_the_model_keeps_its_strategy_alive() -> None:
    with strategy_of(2).scope():  # no reference to the strategy is kept, as in TensorFlow
        model = compile_model(sequential())
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0, epochs=1)
    assert type(model.train_function).__name__ == "TrainStep"
    assert model_strategy(model) is not None
    assert model_strategy(model).num_replicas_in_sync == 2  # type: ignore[union-attr]


def test_trained_weights_differ_from_the_initial_ones() -> None:
    """The equivalence tests compare against a twin; this checks that training happened."""
    strategy = strategy_of(2)
    reference, model = twins(strategy)
    before = model.get_weights()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert max_difference(before, model.get_weights()) > 1e-3
    assert max_difference(before, reference.get_weights()) == 0.0
