"""Models, data and comparisons shared by the Keras tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

FEATURES, CLASSES = 6, 3


def data(n: int = 50, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` examples of a 3-class problem; with batch 16 the last batch holds 2."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def sequential() -> keras.Model:
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


def functional() -> keras.Model:
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2")(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(CLASSES, activation="softmax")

    def build(self, input_shape: Any) -> None:
        self.hidden.build(input_shape)
        self.out.build((*input_shape[:-1], 8))

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def subclassed() -> keras.Model:
    model = Subclassed()
    model.build((None, FEATURES))
    return model


BUILDERS: dict[str, Callable[[], keras.Model]] = {
    "sequential": sequential, "functional": functional, "subclassed": subclassed,
}


def compile_model(model: keras.Model, **kwargs: Any) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2)],
        **kwargs,
    )
    return model


def twins(
    strategy: Any, build: Callable[[], keras.Model] = sequential, **compile_kwargs: Any
) -> tuple[keras.Model, keras.Model]:
    """The same model, compiled alike, without a strategy and under ``strategy``."""
    reference = compile_model(build(), **compile_kwargs)
    with strategy.scope():
        model = build()
        model.set_weights(reference.get_weights())
        compile_model(model, **compile_kwargs)
    return reference, model


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two structures of arrays or numbers."""
    flat_a, flat_b = keras.tree.flatten(a), keras.tree.flatten(b)
    assert len(flat_a) == len(flat_b)
    return max(
        (float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
         for x, y in zip(flat_a, flat_b, strict=True)),
        default=0.0,
    )
