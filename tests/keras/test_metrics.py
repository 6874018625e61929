"""Every Keras metric (``keras.metrics.*``) equals one device under a strategy: in ``fit``,
``evaluate`` and a custom loop of ``strategy.run``, at R = 2 and 3, with uneven last
batches. Metric variables are synchronized on read (ON_READ), so metrics that update with
``var.assign(var + x)`` (the confusion-matrix metrics, F1Score, IoU, R2Score) count every
replica's ``x`` once (docs/design.md §3.6)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import torch
from keras_models import FEATURES, max_difference
from replicas import strategy_of

import centralstore as cs
from centralstore.keras._batches import split

M = keras.metrics
TOLERANCE = 1e-5

# name -> (kind of data it takes, how to build it); kinds are below (DATA, HEADS)
METRICS: dict[str, tuple[str, Callable[[], Any]]] = {
    "AUC": ("binary", M.AUC),
    "Accuracy": ("binary", M.Accuracy),
    "BinaryAccuracy": ("binary", M.BinaryAccuracy),
    "BinaryCrossentropy": ("binary", M.BinaryCrossentropy),
    "BinaryIoU": ("binary", M.BinaryIoU),
    "FalseNegatives": ("binary", M.FalseNegatives),
    "FalsePositives": ("binary", M.FalsePositives),
    "TrueNegatives": ("binary", M.TrueNegatives),
    "TruePositives": ("binary", M.TruePositives),
    "Precision": ("binary", M.Precision),
    "Recall": ("binary", M.Recall),
    "PrecisionAtRecall": ("binary", lambda: M.PrecisionAtRecall(0.5)),
    "RecallAtPrecision": ("binary", lambda: M.RecallAtPrecision(0.5)),
    "SensitivityAtSpecificity": ("binary", lambda: M.SensitivityAtSpecificity(0.5)),
    "SpecificityAtSensitivity": ("binary", lambda: M.SpecificityAtSensitivity(0.5)),
    "Hinge": ("binary", M.Hinge),
    "SquaredHinge": ("binary", M.SquaredHinge),
    # Mean and Sum take values, not (y_true, y_pred): not compiled metrics (fit's loss is a
    # Mean, the loss tracker), updated with the model's outputs in the custom loop
    "Mean": ("values", M.Mean),
    "Sum": ("values", M.Sum),
    "CategoricalAccuracy": ("categorical", M.CategoricalAccuracy),
    "CategoricalCrossentropy": ("categorical", M.CategoricalCrossentropy),
    "CategoricalHinge": ("categorical", M.CategoricalHinge),
    "KLDivergence": ("categorical", M.KLDivergence),
    "TopKCategoricalAccuracy": ("categorical", lambda: M.TopKCategoricalAccuracy(2)),
    "F1Score": ("categorical", M.F1Score),
    "FBetaScore": ("categorical", lambda: M.FBetaScore(beta=2.0)),
    "OneHotIoU": ("categorical", lambda: M.OneHotIoU(3, target_class_ids=[0, 2])),
    "OneHotMeanIoU": ("categorical", lambda: M.OneHotMeanIoU(3)),
    "CosineSimilarity": ("categorical", M.CosineSimilarity),
    "Poisson": ("categorical", M.Poisson),
    "SparseCategoricalAccuracy": ("sparse", M.SparseCategoricalAccuracy),
    "SparseCategoricalCrossentropy": ("sparse", M.SparseCategoricalCrossentropy),
    "SparseTopKCategoricalAccuracy": ("sparse", lambda: M.SparseTopKCategoricalAccuracy(2)),
    "IoU": ("sparse", lambda: M.IoU(3, target_class_ids=[0, 1], sparse_y_pred=False)),
    "MeanIoU": ("sparse", lambda: M.MeanIoU(3, sparse_y_pred=False)),
    "MeanAbsoluteError": ("regression", M.MeanAbsoluteError),
    "MeanAbsolutePercentageError": ("regression", M.MeanAbsolutePercentageError),
    "MeanSquaredError": ("regression", M.MeanSquaredError),
    "MeanSquaredLogarithmicError": ("regression", M.MeanSquaredLogarithmicError),
    "RootMeanSquaredError": ("regression", M.RootMeanSquaredError),
    "LogCoshError": ("regression", M.LogCoshError),
    "R2Score": ("regression", M.R2Score),
    "ConcordanceCorrelation": ("regression", M.ConcordanceCorrelation),
    "PearsonCorrelation": ("regression", M.PearsonCorrelation),
    "MeanMetricWrapper": (
        "regression", lambda: M.MeanMetricWrapper(keras.losses.mean_squared_error, name="mmw")
    ),
}
# What cannot be constructed and updated on its own, and why.
SKIPPED = {"Metric": "the abstract base class: its update_state and result are not implemented"}

KINDS = ("binary", "categorical", "sparse", "regression")
HEADS = {"binary": (1, "sigmoid"), "categorical": (3, "softmax"), "sparse": (3, "softmax"),
         "regression": (3, None)}
LOSSES = {"binary": "binary_crossentropy", "categorical": "categorical_crossentropy",
          "sparse": "sparse_categorical_crossentropy", "regression": "mse"}


def close(got: Any, want: Any) -> bool:
    """Equal up to float32 rounding, relative to the values' size (R2Score's sums of
    squares reach hundreds)."""
    scale = max(1.0, max_difference(want, keras.tree.map_structure(lambda _: 0.0, want)))
    return max_difference(got, want) < TOLERANCE * scale


def data(kind: str, n: int = 34, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    labels = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 0.5).astype("int64")
    if kind in ("binary", "values"):
        return x, (x[:, 0] > 0).astype("float32")[:, None]
    if kind == "categorical":
        return x, np.eye(3, dtype="float32")[labels]
    if kind == "sparse":
        return x, labels
    return x, (np.abs(x[:, :3]) + 1.0).astype("float32")


def model_of(kind: str) -> keras.Model:
    units, activation = HEADS[kind]
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(units, activation=activation),
    ])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=LOSSES[kind],
        metrics=[build() for k, build in METRICS.values() if k == kind],
    )
    return model


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_every_metric_in_fit_and_evaluate_equals_one_device(kind: str, replicas: int) -> None:
    x, y = data(kind)
    reference = model_of(kind)
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = model_of(kind)
    kwargs: dict[str, Any] = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    expected = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    # the same metrics in the same order (Keras numbers the names of a second instance)
    assert len(history) == len(expected) == 1 + sum(k == kind for k, _ in METRICS.values())
    for name, got, want in zip(expected, history.values(), expected.values(), strict=True):
        assert close(got, want), name
    evaluated = model.evaluate(x, y, batch_size=7, verbose=0)
    expected_evaluation = reference.evaluate(x, y, batch_size=7, verbose=0)
    assert close(evaluated, expected_evaluation)


def update(metric: Any, batch: Any) -> None:
    if len(batch[0]):  # some metrics cannot take an empty slice (AUC's max of nothing)
        metric.update_state(*batch)


@pytest.mark.parametrize("replicas", [2, 3])
def test_every_metric_in_a_custom_loop_equals_one_device(replicas: int) -> None:
    """Updated inside strategy.run on each replica's slice (batches of 16, 16 and 2: the
    last splits 1 / 1 / 0 over three replicas), read and reset outside it. The list covers
    every metric class of ``keras.metrics``."""
    found = {
        name for name, value in vars(keras.metrics).items()
        if inspect.isclass(value) and issubclass(value, keras.metrics.Metric)
    }
    assert found == set(METRICS) | set(SKIPPED)
    strategy = strategy_of(replicas)
    predictions: dict[str, np.ndarray] = {}
    for name, (kind, build) in METRICS.items():
        x, y = data(kind)
        if kind not in predictions:
            head = "binary" if kind == "values" else kind
            predictions[kind] = keras.ops.convert_to_numpy(model_of(head)(x))
        y_pred = predictions[kind]
        reference = build()
        with strategy.scope():
            metric = build()
        for _ in range(2):
            for start in (0, 16, 32):
                batch: tuple[torch.Tensor, ...] = (torch.from_numpy(y_pred[start:start + 16]),)
                if kind != "values":
                    batch = (torch.from_numpy(y[start:start + 16]), *batch)
                reference.update_state(*batch)
                slices = cs.PerReplica(split(batch, replicas))
                strategy.run(update, args=(metric, slices))
            assert close(metric.result(), reference.result()), name
            metric.reset_state()
            reference.reset_state()
