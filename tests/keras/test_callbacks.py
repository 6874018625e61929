"""Callbacks, saving and loading under a strategy: a model saved under a strategy loads
without one, and the reverse; ModelCheckpoint, EarlyStopping, BackupAndRestore and custom
callbacks behave as without a strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import pytest
from keras_models import compile_model, data, max_difference, sequential, twins
from replicas import strategy_of

TOLERANCE = 1e-5


class Interrupt(keras.callbacks.Callback):  # type: ignore[misc]
    """Stops the job at the end of an epoch, as a preemption would."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch:
            raise RuntimeError("preempted")


class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[float] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches.append(float(logs["loss"]))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(dict(logs))


def test_custom_callbacks_see_the_same_logs() -> None:
    reference, model = twins(strategy_of(3))
    x, y = data()
    seen = Recorder(), Recorder()
    for m, recorder in zip((reference, model), seen, strict=True):
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              validation_data=data(10, 1), callbacks=[recorder])
    assert len(seen[1].batches) == 8
    assert max_difference(seen[0].batches, seen[1].batches) < TOLERANCE
    assert max_difference(seen[0].epochs, seen[1].epochs) < TOLERANCE


def test_model_checkpoint_and_early_stopping(tmp_path: Path) -> None:
    reference, model = twins(strategy_of(2))
    x, y = data()
    for m, name in ((reference, "reference"), (model, "model")):
        m.fit(
            x, y, batch_size=16, epochs=6, shuffle=False, verbose=0, validation_data=data(20, 1),
            callbacks=[
                keras.callbacks.ModelCheckpoint(
                    tmp_path / f"{name}.keras", monitor="val_loss", save_best_only=True
                ),
                keras.callbacks.ModelCheckpoint(
                    tmp_path / f"{name}.weights.h5", save_weights_only=True
                ),
                keras.callbacks.EarlyStopping(
                    monitor="val_loss", min_delta=1.0, patience=1, restore_best_weights=True
                ),
            ],
        )
    assert model.history.epoch == reference.history.epoch == [0, 1]  # stopped early
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE
    best = keras.models.load_model(tmp_path / "model.keras")  # saved under the strategy
    expected = keras.models.load_model(tmp_path / "reference.keras")
    assert max_difference(best.get_weights(), expected.get_weights()) < TOLERANCE
    assert max_difference(best.get_weights(), model.get_weights()) > 1e-3  # another epoch's
    last = sequential()
    last.load_weights(tmp_path / "model.weights.h5")
    expected = sequential()
    expected.load_weights(tmp_path / "reference.weights.h5")
    assert max_difference(last.get_weights(), expected.get_weights()) < TOLERANCE


def test_backup_and_restore_resumes_where_the_job_stopped(tmp_path: Path) -> None:
    x, y = data()
    kwargs: dict[str, Any] = {"batch_size": 16, "epochs": 4, "shuffle": False, "verbose": 0}
    uninterrupted, model = twins(strategy_of(2))
    uninterrupted.fit(x, y, **kwargs)
    backup = keras.callbacks.BackupAndRestore(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(x, y, callbacks=[backup, Interrupt(1)], **kwargs)
    strategy = strategy_of(3)  # the job restarts, with another number of replicas
    with strategy.scope():
        restarted = compile_model(sequential())
    history = restarted.fit(x, y, callbacks=[backup], **kwargs)
    assert history.epoch == [2, 3]
    assert max_difference(restarted.get_weights(), uninterrupted.get_weights()) < TOLERANCE
    assert all(
        strategy.extended.variable_created_in_scope(v.value) for v in restarted.trainable_variables
    )


def test_saved_under_a_strategy_loads_without_one_and_the_reverse(tmp_path: Path) -> None:
    x, y = data()
    reference, model = twins(strategy_of(2))
    for m in (reference, model):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "distributed.keras")
    reference.save(tmp_path / "plain.keras")
    plain = keras.models.load_model(tmp_path / "distributed.keras")
    assert max_difference(plain.predict(x, verbose=0), model.predict(x, verbose=0)) < TOLERANCE
    strategy = strategy_of(3)
    with strategy.scope():
        distributed = keras.models.load_model(tmp_path / "plain.keras")
    assert all(
        strategy.extended.variable_created_in_scope(v.value) for v in distributed.variables
    )
    # both continue training alike, optimizer state included
    for m in (plain, distributed):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_difference(distributed.get_weights(), reference.get_weights()) < TOLERANCE
    assert max_difference(plain.get_weights(), reference.get_weights()) < TOLERANCE
    assert type(distributed.train_function).__name__ == "TrainStep"
    # weights files, both ways
    model.save_weights(tmp_path / "distributed.weights.h5")
    fresh = compile_model(sequential())
    fresh.load_weights(tmp_path / "distributed.weights.h5")
    with strategy.scope():
        again = compile_model(sequential())
    again.load_weights(tmp_path / "distributed.weights.h5")
    assert max_difference(fresh.get_weights(), model.get_weights()) == 0.0
    assert max_difference(again.get_weights(), model.get_weights()) == 0.0
