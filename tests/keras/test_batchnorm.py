"""BatchNormalization under a strategy: each replica normalizes its own slice, and the moving
statistics are averaged over the replicas (MEAN), as torch's BatchNorm buffers are. The
oracle is one device that runs the same slices one after the other."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import torch
from keras_models import CLASSES, FEATURES, data, max_difference
from replicas import strategy_of

import centralstore as cs
from centralstore.input.split import split_sizes


def batchnorm_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Activation("relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


def compiled(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def per_slice_reference(
    model: keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int, replicas: int, epochs: int
) -> list[float]:
    """One device training on the replicas' slices of each batch: each slice normalized on
    its own from the same moving statistics, the losses weighted by the slices' shares, the
    moving statistics averaged over the slices, one optimizer step. The epochs' mean losses."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    moving = [v for v in model.non_trainable_variables if "moving" in v.path]
    trainable = model.trainable_variables
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            model.zero_grad()
            before = [v.numpy() for v in moving]
            after = []
            offset = 0
            for count in split_sizes(len(xb), replicas):
                if count:
                    for v, value in zip(moving, before, strict=True):
                        v.assign(value)
                    xs, ys = xb[offset : offset + count], yb[offset : offset + count]
                    loss = loss_fn(ys, model(xs, training=True))
                    (loss * (count / len(xb))).backward()
                    total += float(loss.detach()) * count
                    after.append([v.numpy() for v in moving])
                offset += count
            for i, v in enumerate(moving):
                v.assign(np.mean([values[i] for values in after], axis=0))
            with torch.no_grad():
                model.optimizer.apply([v.value.grad for v in trainable], trainable)
        losses.append(total / len(x))
    return losses


@pytest.mark.parametrize("replicas", [2, 3])
def test_fit_with_batchnorm_equals_the_per_slice_reference(replicas: int) -> None:
    x, y = data(40)
    reference = compiled(batchnorm_model())
    reference.optimizer.build(reference.trainable_variables)
    initial = reference.get_weights()
    with strategy_of(replicas).scope():
        model = batchnorm_model()
        model.set_weights(initial)
        compiled(model)
    history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history  # 12*3 + 4
    expected = per_slice_reference(reference, x, y, 12, replicas, epochs=2)
    assert max_difference(history["loss"], expected) < 1e-5
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5
    # which is not what one device computes on the whole batches
    one_device = batchnorm_model()
    one_device.set_weights(initial)
    compiled(one_device).fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_difference(one_device.get_weights(), model.get_weights()) > 1e-3


def test_moving_statistics_average_over_the_replicas_in_run() -> None:
    """The failure the issue measured: a Keras BatchNormalization inside strategy.run."""
    strategy = strategy_of(2)
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=0.0)  # the statistic of the last batch
        layer.build((None, 3))
    batch = torch.randn(8, 3)
    halves = cs.PerReplica([batch[:4], batch[4:]])
    strategy.run(lambda x: layer(x, training=True), args=(halves,))
    expected = (batch[:4].mean(0) + batch[4:].mean(0)) / 2
    torch.testing.assert_close(layer.moving_mean.value, expected)
    assert layer.moving_mean.aggregation == "none"  # Keras' declaration, a torch buffer's rule


def test_dropout_seed_state_advances_once_per_step() -> None:
    def build() -> keras.Model:
        model = keras.Sequential([
            keras.Input((FEATURES,)), keras.layers.Dropout(0.3, seed=1), keras.layers.Dense(CLASSES)
        ])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    x, y = data(32)
    with strategy_of(2).scope():
        model = build()
    reference = build()

    def seed_state(m: Any) -> np.ndarray:
        return next(v.numpy() for v in m.non_trainable_variables if "seed" in v.path)

    starts = seed_state(model), seed_state(reference)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=1, verbose=0)
    advanced = seed_state(model) - starts[0]
    assert np.array_equal(advanced, seed_state(reference) - starts[1])
    assert advanced.tolist() == [0, 4]  # four steps, not eight replica calls
