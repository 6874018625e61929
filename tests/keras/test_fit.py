"""fit, evaluate and predict under a strategy equal the same calls without one (docs:
docs/keras.md): weights, every epoch's logs, evaluate's results and predict's
outputs, for R = 2 and 3, with an uneven last batch (50 examples in batches of 16: the last
batch of 2 splits 1 / 1 / 0 over three replicas)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import torch
from keras_models import BUILDERS, compile_model, data, max_difference, sequential, twins
from replicas import strategy_of

TOLERANCE = 1e-5


def fit_both(reference: Any, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    kwargs = {"epochs": 3, "verbose": 0, **kwargs}
    return reference.fit(*args, **kwargs).history, model.fit(*args, **kwargs).history


def assert_equivalent(reference: Any, model: Any, expected: Any, history: Any) -> None:
    assert history.keys() == expected.keys()
    assert max_difference(history, expected) < TOLERANCE
    assert max_difference(model.get_weights(), reference.get_weights()) < TOLERANCE


@pytest.mark.parametrize(("replicas", "views"), [(2, False), (3, False), (2, True)])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_fit_evaluate_predict_equal_one_device(kind: str, replicas: int, views: bool) -> None:
    # views: the replicas see views of the parameters, as GPU replicas do
    strategy = strategy_of(replicas, direct=not views)
    reference, model = twins(strategy, BUILDERS[kind])
    x, y = data()
    validation = data(20, seed=1)
    expected, history = fit_both(
        reference, model, x, y, batch_size=16, shuffle=False, validation_data=validation
    )
    assert type(model.train_function).__name__ == "TrainStep"
    assert set(history) >= {"loss", "sparse_categorical_accuracy", "val_loss"}
    assert_equivalent(reference, model, expected, history)
    for batch_size in (16, 7):
        assert max_difference(
            model.evaluate(x, y, batch_size=batch_size, verbose=0),
            reference.evaluate(x, y, batch_size=batch_size, verbose=0),
        ) < TOLERANCE
        predicted = model.predict(x, batch_size=batch_size, verbose=0)
        assert predicted.shape == (50, 3)
        assert max_difference(predicted, reference.predict(x, batch_size=batch_size, verbose=0)) < (
            TOLERANCE
        )
    # the central variables were trained in place: the model's weights are the strategy's
    assert all(
        strategy.extended.variable_created_in_scope(v.value) for v in model.trainable_variables
    )


def test_one_batch_smaller_than_the_replicas() -> None:
    """A global batch of 1 over two replicas: the second slice is empty and computes nothing."""
    reference, model = twins(strategy_of(2))
    x, y = data(3)
    expected, history = fit_both(reference, model, x, y, batch_size=1, shuffle=False)
    assert_equivalent(reference, model, expected, history)
    assert max_difference(model.predict(x, batch_size=1, verbose=0),
                          reference.predict(x, batch_size=1, verbose=0)) < TOLERANCE


def test_sample_weight_and_class_weight() -> None:
    x, y = data()
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    reference, model = twins(strategy_of(3), weighted_metrics=["sparse_categorical_accuracy"])
    expected, history = fit_both(
        reference, model, x, y, batch_size=16, shuffle=False, sample_weight=weights
    )
    assert_equivalent(reference, model, expected, history)
    reference, model = twins(strategy_of(2))
    expected, history = fit_both(
        reference, model, x, y, batch_size=16, shuffle=False, class_weight={0: 1.0, 1: 3.0, 2: 0.5}
    )
    assert_equivalent(reference, model, expected, history)


def test_steps_per_epoch() -> None:
    reference, model = twins(strategy_of(2))
    x, y = data()
    expected, history = fit_both(
        reference, model, x, y, batch_size=8, shuffle=False, steps_per_epoch=3, epochs=2
    )
    assert_equivalent(reference, model, expected, history)
    assert int(model.optimizer.iterations) == 6


def test_the_inputs_fit_accepts() -> None:
    """numpy arrays, a cs.Dataset (with class_weight), a DataLoader and a PyDataset."""
    import centralstore as cs

    x, y = data()

    class Batches(keras.utils.PyDataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return x[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16]

    tensors = (torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), batch_size=16)
    inputs: list[tuple[Any, dict[str, Any]]] = [
        (cs.Dataset.from_tensor_slices(tensors).batch(16), {}),
        (cs.Dataset.from_tensor_slices(tensors).batch(16), {"class_weight": {0: 2.0, 1: 1.0}}),
        (cs.Dataset.from_tensor_slices(tensors).batch(16).filter(lambda a, b: True), {}),
        (loader, {}),
        (Batches(), {}),
    ]
    for source, kwargs in inputs:
        reference, model = twins(strategy_of(3))
        expected, history = fit_both(reference, model, source, epochs=2, shuffle=False, **kwargs)
        assert_equivalent(reference, model, expected, history)
        assert max_difference(model.evaluate(source, verbose=0),
                              reference.evaluate(source, verbose=0)) < TOLERANCE


def test_a_cs_dataset_carries_its_targets() -> None:
    import centralstore as cs

    x, y = data()
    with strategy_of(2).scope():
        model = compile_model(sequential())
    dataset = cs.Dataset.from_tensor_slices((torch.from_numpy(x), torch.from_numpy(y))).batch(16)
    with pytest.raises(ValueError, match="`y` must not be passed beside it"):
        model.fit(dataset, y, verbose=0)


def test_jit_compile_runs_eagerly_with_one_warning() -> None:
    reference, model = twins(strategy_of(2), jit_compile=True)
    x, y = data()
    with pytest.warns(UserWarning, match="jit_compile=True: under a strategy") as caught:
        history = model.fit(x, y, batch_size=16, shuffle=False, epochs=2, verbose=0).history
        model.evaluate(x, y, verbose=0)
    assert sum("jit_compile=True" in str(w.message) for w in caught) == 1
    reference.jit_compile = False  # the reference runs eagerly too: same arithmetic
    expected = reference.fit(x, y, batch_size=16, shuffle=False, epochs=2, verbose=0).history
    assert_equivalent(reference, model, expected, history)


def test_on_batch_calls() -> None:
    reference, model = twins(strategy_of(3))
    x, y = data(10)
    for _ in range(2):
        assert max_difference(model.train_on_batch(x, y), reference.train_on_batch(x, y)) < (
            TOLERANCE
        )
    assert max_difference(model.test_on_batch(x, y), reference.test_on_batch(x, y)) < TOLERANCE
    assert max_difference(model.predict_on_batch(x), reference.predict_on_batch(x)) < TOLERANCE


def test_one_replica_strategies() -> None:
    """OneDeviceStrategy, and one replica where the variables live (runs without views)."""
    import centralstore as cs

    x, y = data()
    for strategy in (cs.OneDeviceStrategy("cpu:0"), strategy_of(1)):
        reference, model = twins(strategy)
        expected, history = fit_both(reference, model, x, y, batch_size=16, shuffle=False)
        assert_equivalent(reference, model, expected, history)
        assert type(model.train_function).__name__ == "TrainStep"


WORKER = """
import os
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np, torch
import centralstore as cs

strategy = cs.MultiWorkerCentralStorageStrategy(["cpu:0", "cpu:1"], timeout=120)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(50, 6)).astype("float32"), rng.integers(0, 3, 50)

def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss="sparse_categorical_crossentropy")
    return model

reference = build()
with strategy.scope():
    model = build()
kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
results = []
for m in (model, reference):
    history = m.fit(x, y, **kwargs).history
    results.append([*m.get_weights(), *history.values(), m.evaluate(x, y, verbose=0),
                    m.predict(x, batch_size=16, verbose=0)])
difference = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(*results))
with open(f"worker{os.environ['RANK']}.txt", "w") as report:
    print(type(model.train_function).__name__, difference, file=report)
torch.distributed.destroy_process_group()
os._exit(0)
"""


def test_two_workers_fit_like_one_device(tmp_path: Path) -> None:
    """MultiWorkerCentralStorageStrategy: two processes of two replicas each, every worker
    given the same global batches, train as one device on them."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(script)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        step, difference = (tmp_path / f"worker{rank}.txt").read_text().split()
        assert step == "TrainStep"
        assert float(difference) < TOLERANCE


class _OwnMetrics(keras.Sequential):  # type: ignore[misc]
    """compute_metrics overridden as Keras' docstring shows: the compiled metrics, then a
    metric of its own, updated there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.largest = keras.metrics.Mean(name="largest")
        self.calls = 0

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        self.calls += 1
        results = super().compute_metrics(x, y, y_pred, sample_weight)
        self.largest.update_state(keras.ops.max(y_pred, axis=-1))
        return {**results, "largest": self.largest.result()}


@pytest.mark.parametrize("replicas", [1, 2])
def test_compute_metrics_runs_where_overridden(replicas: int) -> None:
    # Keras' own compute_metrics only updates the metrics in a replica (the step reads them
    # once, after the replicas); an override runs as written, on every replica with examples.
    strategy = strategy_of(replicas)

    def build() -> keras.Model:
        return _OwnMetrics(sequential().layers)

    reference, model = twins(strategy, build)
    x, y = data()
    reference.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # Keras builds the metrics
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # (a symbolic call) at first
    reference.calls = model.calls = 0
    expected, history = fit_both(reference, model, x, y, batch_size=16, epochs=2, shuffle=False)
    assert "largest" in history
    assert_equivalent(reference, model, expected, history)
    assert reference.calls == 8  # 4 batches (16, 16, 16 and 2 examples), twice
    assert model.calls == 8 * replicas  # the batch of 2 gives both replicas one
    reference.calls = model.calls = 0
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert "largest" in evaluated
    assert max_difference(
        evaluated, reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    ) < TOLERANCE
    assert (reference.calls, model.calls) == (4, 4 * replicas)


class _CountedReads(keras.Sequential):  # type: ignore[misc]
    """Counts the reads of every metric's result (Keras' own compute_metrics makes one)."""

    reads = 0

    def get_metrics_result(self) -> Any:
        self.reads += 1
        return super().get_metrics_result()


@pytest.mark.parametrize("replicas", [1, 2])
def test_metrics_are_read_once_per_step_after_the_replicas(replicas: int) -> None:
    # Inside a replica each read would go through its views of the metric variables, and be
    # thrown away: fit's and evaluate's steps update the metrics there and read them once.
    strategy = strategy_of(replicas)
    reference, model = twins(strategy, lambda: _CountedReads(sequential().layers))
    x, y = data()
    fit_both(reference, model, x[:16], y[:16], batch_size=16, epochs=1)  # builds the metrics
    reference.reads = model.reads = 0
    expected, history = fit_both(reference, model, x, y, batch_size=16, epochs=2, shuffle=False)
    assert_equivalent(reference, model, expected, history)
    assert model.reads == reference.reads == 10  # once per batch (4, twice) and per epoch
    reference.reads = model.reads = 0
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    expected_evaluation = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert max_difference(evaluated, expected_evaluation) < TOLERANCE
    assert model.reads == reference.reads
