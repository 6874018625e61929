"""TensorFlow's "Distributed training with Keras" tutorial, on PyTorch with centralstore.

The tutorial's structure, step by step: a strategy; an input pipeline whose global batch is
the per-replica batch times the number of replicas; a model built and compiled inside
``strategy.scope()``; ``fit`` with callbacks (checkpoints, a learning-rate schedule, a
callback that prints the learning rate, a log); the latest checkpoint restored and
evaluated; the model saved, then loaded without a strategy and under one. The TensorFlow
code changes only by ``KERAS_BACKEND=torch``, ``import centralstore as cs`` and the
strategy's constructor; scikit-learn's 8x8 handwritten digits replace MNIST (no download),
and a CSV log replaces TensorBoard (which needs TensorFlow).

Run: ``python examples/keras_fit.py [--epochs N] [--out DIR]``
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is imported

import keras
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import centralstore as cs


def load_data() -> tuple[cs.Dataset, cs.Dataset]:
    """The digits as (image, label) pairs: 1,437 for training and 360 for evaluation."""
    digits = load_digits()
    images = digits.images.astype("float32")[..., None]  # 8x8x1, values 0 to 16
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0
    )
    train = cs.Dataset.from_tensor_slices((torch.from_numpy(x_train), torch.from_numpy(y_train)))
    test = cs.Dataset.from_tensor_slices((torch.from_numpy(x_test), torch.from_numpy(y_test)))
    return train, test


def scale(image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return image / 16.0, label


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def compile_model(model: keras.Model) -> None:
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(),
        metrics=["accuracy"],
    )


def decay(epoch: int) -> float:
    """The tutorial's schedule, ten times larger: the digits set is small."""
    if epoch < 3:
        return 1e-2
    if epoch < 7:
        return 1e-3
    return 1e-4


class PrintLR(keras.callbacks.Callback):  # type: ignore[misc]
    """Print the learning rate at the end of each epoch."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        print(f"Learning rate for epoch {epoch + 1} is {rate:.0e}")


def latest_checkpoint(directory: Path) -> Path:
    """``tf.train.latest_checkpoint``: the checkpoint of the highest epoch."""
    return max(directory.glob("ckpt_*.weights.h5"),
               key=lambda p: int(re.findall(r"\d+", p.name)[0]))


def main(epochs: int, out: Path) -> None:
    # Define the distribution strategy: every GPU, else two logical CPU devices.
    devices = None if torch.cuda.device_count() else ["cpu:0", "cpu:1"]
    strategy = cs.CentralStorageStrategy(devices)
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # Set up the input pipeline.
    train, test = load_data()
    buffer_size = 1437
    batch_size_per_replica = 64
    batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    train_dataset = train.map(scale).shuffle(buffer_size, seed=0).batch(batch_size)
    eval_dataset = test.map(scale).batch(batch_size)

    # Create the model and instantiate the optimizer within the strategy's scope.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        compile_model(model)

    # Define the callbacks.
    checkpoint_dir = out / "training_checkpoints"
    callbacks = [
        keras.callbacks.CSVLogger(str(out / "logs.csv")),
        keras.callbacks.ModelCheckpoint(
            filepath=str(checkpoint_dir / "ckpt_{epoch}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    # Train and evaluate.
    model.fit(train_dataset, epochs=epochs, callbacks=callbacks, verbose=2)
    model.load_weights(latest_checkpoint(checkpoint_dir))
    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
    print(f"Eval loss: {eval_loss:.4f}, Eval accuracy: {eval_acc:.4f}")

    # Save the model; load it without a strategy, then under one.
    path = out / "saved_model" / "digits.keras"
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    unreplicated_model = keras.models.load_model(path)
    compile_model(unreplicated_model)
    plain_loss, plain_acc = unreplicated_model.evaluate(eval_dataset, verbose=0)
    print(f"Eval loss, accuracy (loaded without a strategy): {plain_loss:.4f}, {plain_acc:.4f}")
    with strategy.scope():
        replicated_model = keras.models.load_model(path)
        compile_model(replicated_model)
    loss, acc = replicated_model.evaluate(eval_dataset, verbose=0)
    print(f"Eval loss, accuracy (loaded under the strategy): {loss:.4f}, {acc:.4f}")
    print(f"Largest difference between the three evaluations: "
          f"{np.max(np.abs([eval_loss - plain_loss, eval_loss - loss])):.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="where files go (a temporary dir)")
    arguments = parser.parse_args()
    if arguments.out is None:
        with tempfile.TemporaryDirectory() as directory:
            main(arguments.epochs, Path(directory))
    else:
        main(arguments.epochs, arguments.out)
