"""The hook into Keras' PyTorch trainer: it acts only for models whose variables belong to a
strategy, it can be undone, it installs itself when a scope is entered, and it explains what
it cannot do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import Any, ClassVar

import keras
import numpy as np
import pytest
from keras.src.backend.common import global_state
from keras.src.backend.torch import core, trainer
from keras.src.trainers import data_adapters
from keras_models import compile_model, data, max_difference, sequential, twins
from replicas import strategy_of

import centralstore as cs
import centralstore.keras
from centralstore.keras import _backend


def run_python(source: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environment.pop("KERAS_BACKEND", None)
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
        timeout=240, check=False, env=environment,
    )


def keras_own() -> dict[str, Any]:
    return {
        "make_train_function": vars(trainer.TorchTrainer)["make_train_function"],
        "make_test_function": vars(trainer.TorchTrainer)["make_test_function"],
        "make_predict_function": vars(trainer.TorchTrainer)["make_predict_function"],
        "_initialize": vars(core.Variable)["_initialize"],
        "assign_add": vars(core.Variable).get("assign_add"),
        "get_data_adapter": data_adapters.get_data_adapter,
    }


def test_uninstall_restores_keras_and_install_hooks_it_again() -> None:
    _, model = twins(strategy_of(2))
    x, y = data()
    hooked = keras_own()
    centralstore.keras.uninstall()
    try:
        assert not centralstore.keras.installed()
        restored = keras_own()
        assert restored["assign_add"] is None  # inherited from KerasVariable again
        for name, value in restored.items():
            assert value is not hooked[name]
            assert value is None or value.__module__.startswith("keras.src"), name
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert type(model.train_function).__name__ == "function"  # Keras' own
    finally:
        centralstore.keras.install()
    assert {value.__module__ for value in keras_own().values()} == {"centralstore.keras._hook"}
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert type(model.train_function).__name__ == "TrainStep"


def test_a_model_without_a_strategy_trains_with_keras_own_step() -> None:
    model = compile_model(sequential())
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    for function in (model.train_function, model.test_function, model.predict_function):
        assert function.__name__ == "one_step_on_data"


def test_a_loss_summed_over_the_batch_is_refused() -> None:
    with strategy_of(2).scope():
        model = sequential()
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    x, y = data(8)
    with pytest.raises(ValueError, match="reduces by 'sum'"):
        model.fit(x, np.eye(3)[y], verbose=0)


class ReadsKerasState(keras.layers.Layer):  # type: ignore[misc]
    """Meets the other replicas (all_reduce), so that they run on replica threads, and
    records which thread ran it and the Keras device scope that thread sees."""

    seen: ClassVar[list[tuple[str, Any]]] = []

    def call(self, x: Any) -> Any:
        context = cs.get_replica_context()
        if not cs.has_strategy() or context is None:  # no replicas: built, or the reference
            return x
        ReadsKerasState.seen.append(
            (threading.current_thread().name, global_state.get_global_attribute("torch_device"))
        )
        return x + 0.0 * context.all_reduce("sum", x.sum())


def test_replica_threads_receive_the_callers_keras_state() -> None:
    def build() -> keras.Model:
        return keras.Sequential([keras.Input((6,)), ReadsKerasState(), keras.layers.Dense(3)])

    reference, model = twins(strategy_of(2), build)
    x, y = data(32)
    ReadsKerasState.seen.clear()
    with keras.device("cpu"):
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    threads = {name for name, _ in ReadsKerasState.seen}
    assert len(threads) == 2 and threading.current_thread().name in threads
    assert {device for _, device in ReadsKerasState.seen} == {"cpu"}
    expected = reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert max_difference(history, expected) < 1e-5


def test_the_keras_versions_outside_the_tested_range_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backend._check_version("3.15.1")
        _backend._check_version("3.8.0")
    with pytest.warns(RuntimeWarning, match="tested with Keras 3.8 to 3.15"):
        _backend._check_version("3.16.0")


def test_user_code_needs_no_import_beyond_centralstore() -> None:
    """TensorFlow's tutorial code with KERAS_BACKEND=torch, `import centralstore as cs` and
    the strategy's constructor: the hook installs itself when the scope is entered."""
    result = run_python(
        """
        import numpy as np, keras, centralstore as cs
        strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
        print(type(model.train_function).__name__)
        """,
        KERAS_BACKEND="torch",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["TrainStep"]


def test_missing_keras_names_the_extra() -> None:
    result = run_python(
        """
        import sys
        sys.modules["keras"] = None  # as if Keras were not installed
        import centralstore.keras
        centralstore.keras.activate()  # nothing to do, no error
        centralstore.keras.install()
        """
    )
    assert "ModuleNotFoundError: centralstore.keras needs Keras 3" in result.stderr
    assert "pip install 'centralstore[keras]'" in result.stderr


def test_another_backend_requested_is_refused() -> None:
    result = run_python("import centralstore.keras; centralstore.keras.install()",
                        KERAS_BACKEND="jax")
    assert "RuntimeError: centralstore.keras distributes Keras on its PyTorch backend" in (
        result.stderr
    )
    assert "Received: KERAS_BACKEND='jax'" in result.stderr


def test_keras_on_another_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.config, "backend", lambda: "jax")
    assert not _backend.loaded_on_torch()  # so activate() leaves that Keras alone
    with pytest.raises(RuntimeError, match="Set KERAS_BACKEND=torch before the first") as error:
        centralstore.keras.install()
    assert "Received: keras.config.backend()='jax'" in str(error.value)


def test_install_sets_the_torch_backend_when_none_was_asked_for() -> None:
    result = run_python(
        "import centralstore.keras; centralstore.keras.install(); "
        "import keras; print(keras.config.backend())"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch"]
