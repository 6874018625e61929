"""A subclassed model's own ``train_step``, ``test_step`` and ``predict_step`` run per
replica under ``fit``, ``evaluate`` and ``predict``, as TensorFlow runs them; the
``optimizer.apply`` inside ``train_step`` applies once, to the replicas' gradients summed
with each weighted by its slice's share of the batch; metrics updated inside are ON_READ.
The examples are those of the Keras guide "Customizing what happens in fit() with
PyTorch"."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import torch
from keras_models import FEATURES, compile_model, data, max_difference
from replicas import strategy_of

TOLERANCE = 1e-5


class GuideModel(keras.Model):  # type: ignore[misc]
    """The guide's first example: compiled loss and metrics, and its test_step."""

    def train_step(self, data: Any) -> Any:
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable_weights = list(self.trainable_weights)
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data: Any) -> Any:
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, y_pred)
            else:
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}

    def predict_step(self, data: Any) -> Any:
        (x,) = data if isinstance(data, tuple) else (data,)
        return self(x, training=False) * 2.0


class LowLevelModel(keras.Model):  # type: ignore[misc]
    """The guide's lower-level example: its own loss, trackers and metrics property, with
    sample weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        loss.backward()
        trainable_weights = list(self.trainable_weights)
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker, self.mae_metric]


def regression(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, :1] * 2.0 - x[:, 1:2]).astype("float32")
    return x, y, np.linspace(0.5, 1.5, n).astype("float32")


def build(cls: type, compiled: bool = True) -> keras.Model:
    keras.utils.set_random_seed(4)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
    model = cls(inputs, outputs)
    if compiled:
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    else:
        model.compile(optimizer="adam")
    return model


def twins(cls: type, replicas: int, compiled: bool = True) -> tuple[Any, Any, Any]:
    strategy = strategy_of(replicas)
    reference = build(cls, compiled)
    with strategy.scope():
        model = build(cls, compiled)
    return reference, model, strategy


# Global batches that split evenly (16 over 2, 12 over 3): the guide's loss tracker
# averages the replicas' slice means with equal weights, the batch's mean only then.
EVEN = [(2, 16), (3, 12)]


@pytest.mark.parametrize(("replicas", "batch_size"), EVEN)
def test_the_guide_train_and_test_steps_equal_one_device(replicas: int, batch_size: int) -> None:
    x, y, _ = regression(48)
    reference, model, _ = twins(GuideModel, replicas)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "epochs": 2, "shuffle": False,
                              "verbose": 0, "validation_data": (x[:24], y[:24])}
    expected = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    assert type(model.train_function).__name__ == "CustomTrainStep"
    assert history.keys() == expected.keys() == {"loss", "mae", "val_loss", "val_mae"}
    assert max_difference(history, expected) < TOLERANCE
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE
    steps = 2 * 48 // batch_size
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == steps
    assert max_difference(
        model.evaluate(x, y, batch_size=batch_size, verbose=0),
        reference.evaluate(x, y, batch_size=batch_size, verbose=0),
    ) < TOLERANCE
    assert max_difference(model.predict(x, batch_size=7, verbose=0),
                          reference.predict(x, batch_size=7, verbose=0)) < TOLERANCE


@pytest.mark.parametrize(("replicas", "batch_size"), EVEN)
def test_the_guide_lower_level_step_with_sample_weights(replicas: int, batch_size: int) -> None:
    x, y, weights = regression(48)
    reference, model, _ = twins(LowLevelModel, replicas, compiled=False)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "epochs": 2, "shuffle": False,
                              "verbose": 0, "sample_weight": weights}
    expected = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    assert max_difference(history, expected) < TOLERANCE
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE


def test_uneven_slices_give_one_device_weights() -> None:
    """50 examples in batches of 16 over three replicas (6 / 5 / 5, and 1 / 1 / 0 last): the
    gradients, weighted by each slice's share, reach one device's weights; only the guide's
    unweighted loss tracker (a mean of the replicas' slice means) differs, as in
    TensorFlow."""
    x, y, _ = regression(50)
    reference, model, _ = twins(GuideModel, 3)
    kwargs: dict[str, Any] = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    expected = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE
    assert max_difference(history["mae"], expected["mae"]) < TOLERANCE


def test_a_train_step_calling_keras_own_equals_one_device() -> None:
    class Custom(keras.Sequential):  # type: ignore[misc]
        def train_step(self, batch: Any) -> Any:
            return super().train_step(batch)

    def custom() -> keras.Model:
        keras.utils.set_random_seed(4)
        return compile_model(Custom([
            keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]))

    x, y = data()
    reference = custom()
    with strategy_of(3).scope():
        model = custom()
    kwargs: dict[str, Any] = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    expected = reference.fit(x, y, **kwargs).history
    history = model.fit(x, y, **kwargs).history
    assert max_difference(history, expected) < TOLERANCE
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE
