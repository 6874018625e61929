"""Seeded random layers and ``keras.random`` with a ``SeedGenerator`` draw different numbers
on each replica, reproducibly: replica r > 0 moves the seed the generator hands out by r
strides, replica 0 draws what one device draws (as replica 0 keeps torch's global stream,
docs/design.md §5.9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import torch
from keras_models import data, max_difference
from replicas import strategy_of

import centralstore as cs

LAYERS: dict[str, tuple[Callable[[], Any], tuple[int, ...]]] = {
    "Dropout": (lambda: keras.layers.Dropout(0.5, seed=3), (8, 6)),
    "GaussianNoise": (lambda: keras.layers.GaussianNoise(1.0, seed=3), (8, 6)),
    "GaussianDropout": (lambda: keras.layers.GaussianDropout(0.5, seed=3), (8, 6)),
    "AlphaDropout": (lambda: keras.layers.AlphaDropout(0.5, seed=3), (8, 6)),
    "SpatialDropout1D": (lambda: keras.layers.SpatialDropout1D(0.5, seed=3), (8, 5, 6)),
    "RandomFlip": (lambda: keras.layers.RandomFlip(seed=3), (8, 4, 4, 1)),
}


def inputs(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(np.prod(shape))).reshape(shape) + 1.0


def replica_outputs(name: str, replicas: int = 3) -> tuple[Any, ...]:
    build, shape = LAYERS[name]
    strategy = strategy_of(replicas)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        layer = build()
        layer.build((None, *shape[1:]))
    outputs = []
    for _ in range(2):  # the second draw moves on, in every replica
        outputs.append(strategy.experimental_local_results(strategy.run(
            lambda x: layer(x, training=True), args=(cs.PerReplica([inputs(shape)] * replicas),)
        )))
    return tuple(outputs)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_replica_draws_its_own_numbers_reproducibly(name: str) -> None:
    first, second = replica_outputs(name)
    for drawn in (first, second):
        for a in range(3):
            for b in range(a + 1, 3):
                assert not torch.equal(drawn[a], drawn[b]), (a, b)
    assert not torch.equal(first[0], second[0])
    again = replica_outputs(name)
    assert all(torch.equal(a, b) for a, b in zip(first + second, again[0] + again[1]))
    # replica 0 draws what the layer draws on one device
    build, shape = LAYERS[name]
    keras.utils.set_random_seed(0)
    alone = build()
    alone.build((None, *shape[1:]))
    assert torch.equal(keras.ops.convert_to_tensor(alone(inputs(shape), training=True)), first[0])


def test_keras_random_with_a_seed_generator_differs_per_replica() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        generator = keras.random.SeedGenerator(7)
    a, b = strategy.experimental_local_results(
        strategy.run(lambda: keras.random.normal((5,), seed=generator))
    )
    assert not torch.equal(a, b)


class Record(keras.layers.Layer):  # type: ignore[misc]
    """Keeps what it is called with (during fit: each replica's dropped activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def call(self, x: Any) -> Any:
        if x.device.type != "meta":  # not Keras' shape inference
            self.seen.append(x.detach().clone())
        return x


def test_fit_drops_differently_per_replica_and_two_identical_fits_agree() -> None:
    x, y = data(8)
    x, y = np.concatenate([x, x]), np.concatenate([y, y])  # both replicas get the same slice

    def fit() -> tuple[list[np.ndarray], list[torch.Tensor]]:
        keras.utils.set_random_seed(5)
        record = Record()
        with strategy_of(2).scope():
            model = keras.Sequential([
                keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                keras.layers.Dropout(0.5, seed=11), record,
                keras.layers.Dense(3, activation="softmax"),
            ])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), record.seen

    weights, seen = fit()
    assert len(seen) == 4  # two replicas, two steps
    assert not torch.equal(seen[0], seen[1])  # the replicas' masks differ
    again, seen_again = fit()
    assert max_difference(weights, again) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(seen, seen_again, strict=True))
