"""The trainers people use, with and without centralstore: Lightning, Hugging Face, Keras.

Each trainer trains a small model at 4 examples per replica, plainly and through
centralstore's integration, and the script reports per optimizer step:
  lines    the Python lines executed (all of them: the trainer's, the model's, centralstore's),
           counted in one step under ``sys.settrace``, each configuration in a process of its
           own; they do not move with the machine's load, so a change to an integration shows
           exactly
  cs       of those, centralstore's own
  - base   lines over the configuration doing the same work without centralstore
  ms       the median CPU time of a step (``--time``)
  ratio    that median over the baseline's
Configurations (each trainer's own way to do the same work, where it has one):
  plain       the trainer alone, a batch of 4
  cs R=1      centralstore's integration, one replica on cpu:0, a batch of 4
  plain x2    the trainer accumulating two batches of 4 per step: the same work as R = 2
              (Lightning's accumulate_grad_batches, Hugging Face's gradient_accumulation_steps;
              Keras has none: its row is Keras' own train step written out over two halves
              of a batch of 8, the losses weighted, one update)
  cs R=2      two replicas on cpu:0 and cpu:1, a global batch of 8
Models: the demo's CNN as a LightningModule and in Keras (the same layers), GPT-2 tiny
(bench_models' configuration) in Hugging Face's Trainer, eager and, as
``transformers-compiled``, with ``torch_compile=True``; AdamW (Adam in Keras), one intra-op
thread. ``keras-eval`` is Keras' ``evaluate`` of the same model, a step per test batch (its
``plain x2`` is Keras' own test step over the two halves).

``--time`` runs a trainer's four configurations in one process, each training on a thread
of its own, taking turns step by step: a baton passes from one to the next at every step's
end, so only one computes at a time and the machine's drift hits all alike (separate
processes, one after another, read ratios of 0.6 to 1.5 for the same code here). Each step
is timed by its thread's CPU clock; the first ``--warmup`` steps are left out.

    python benchmarks/bench_trainers.py [--trainers lightning transformers
        transformers-compiled keras keras-eval]
        [--time] [--steps 300] [--warmup 50]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

from centralstore.cli import at_least

PER_REPLICA = 4
CONFIGS = ("plain", "cs R=1", "plain x2", "cs R=2")
BASELINES = {"cs R=1": "plain", "cs R=2": "plain x2"}  # the same work without centralstore
COUNTED_STEP = 20  # the step counted, after warm-up
ROUND = 20  # steps of each configuration between reversals of the turns' order


class _Baton:
    """Turns between the configurations' threads: one computes at a time, and each step's
    end hands the turn to the next configuration still training, in an order reversed
    every ``ROUND`` turns of each (what comes before a step changes its time: the other
    configurations' work has just evicted its code and data)."""

    def __init__(self, count: int) -> None:
        self._turns = [threading.Event() for _ in range(count)]
        self._done = [False] * count
        self._order = list(range(count))
        self._passes = 0

    def wait(self, i: int) -> None:
        self._turns[i].wait()
        self._turns[i].clear()

    def pass_on(self, i: int) -> None:
        self._passes += 1
        if self._passes % (ROUND * len(self._order)) == 0:
            self._order.reverse()
        at = self._order.index(i)
        for k in range(1, len(self._order) + 1):
            j = self._order[(at + k) % len(self._order)]
            if not self._done[j]:
                self._turns[j].set()
                return

    def start(self) -> None:
        self._turns[self._order[0]].set()

    def finish(self, i: int) -> None:
        self._done[i] = True
        self.pass_on(i)


class _Steps:
    """Step ends, from a trainer's callback: the step's CPU time on its thread, and the one
    step counted; with a baton, the turn passes on at each end."""

    def __init__(self, count: bool, baton: _Baton | None = None, index: int = 0) -> None:
        self.times: list[float] = []
        self.lines: collections.Counter[str] = collections.Counter()
        self._count = count
        self._baton = baton
        self._index = index
        self._start = time.thread_time()

    def ended(self) -> None:
        self.times.append(time.thread_time() - self._start)
        if self._count:
            if len(self.times) == COUNTED_STEP:
                sys.settrace(self._tracer)
            elif len(self.times) == COUNTED_STEP + 1:
                sys.settrace(None)
        if self._baton is not None:
            if len(self.times) % 50 == 0:  # the collector is off in a race (_race): it
                gc.collect()  # runs here, between steps, untimed
            self._baton.pass_on(self._index)
            self._baton.wait(self._index)
        self._start = time.thread_time()

    def _tracer(self, frame: FrameType, event: str, arg: Any) -> Any:
        where = frame.f_code.co_filename
        lines = self.lines

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                lines[where] += 1
            return local

        return local

    def counts(self) -> dict[str, int]:
        return {
            "lines": sum(self.lines.values()),
            "cs": sum(n for where, n in self.lines.items() if "/centralstore/" in where),
        }


def _strategy(config: str) -> Any:
    import centralstore as cs

    replicas = 2 if config == "cs R=2" else 1
    return cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])


def _lightning(config: str, steps: _Steps, count: int) -> None:
    import logging

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import centralstore as cs
    import centralstore.lightning
    from centralstore.demo.job import make_model

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class CNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:  # a step ended
                steps.ended()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    batch = PER_REPLICA * (2 if config == "cs R=2" else 1)
    batches = count * (2 if config == "plain x2" else 1)
    x, y = torch.randn(batch * batches, 1, 8, 8), torch.randint(0, 10, (batch * batches,))
    options: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False,
        "enable_progress_bar": False, "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    if config.startswith("cs"):
        options["strategy"] = cs.lightning.CentralStorageStrategy(
            compute_devices=_strategy(config).compute_devices
        )
    elif config == "plain x2":
        options["accumulate_grad_batches"] = 2
    torch.manual_seed(0)
    pl.Trainer(**options).fit(CNN(), DataLoader(TensorDataset(x, y), batch_size=batch))


def _transformers(config: str, steps: _Steps, count: int, compiled: bool = False) -> None:
    """Hugging Face's Trainer on GPT-2 tiny (``compiled``: ``torch_compile=True``, the model
    compiled whole by inductor)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers
    from bench_models import _gpt2
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import centralstore as cs
    import centralstore.transformers

    class Ended(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            steps.ended()

    rows = PER_REPLICA * 2 * count
    ids = torch.randint(2, 512, (rows, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    arguments = TrainingArguments(
        "/tmp/bench_trainers", per_device_train_batch_size=PER_REPLICA, max_steps=count,
        report_to=[], disable_tqdm=True, dataloader_pin_memory=False, save_strategy="no",
        logging_steps=10**9, use_cpu=True,
        gradient_accumulation_steps=2 if config == "plain x2" else 1, torch_compile=compiled,
    )
    torch.manual_seed(0)
    if config.startswith("cs"):
        strategy = _strategy(config)
        with strategy.scope():
            model = _gpt2()
        trainer: Any = cs.transformers.Trainer(
            model=model, args=arguments, train_dataset=data, strategy=strategy,
            callbacks=[Ended()],
        )
    else:
        trainer = Trainer(model=_gpt2(), args=arguments, train_dataset=data, callbacks=[Ended()])
    transformers.logging.set_verbosity_error()
    trainer.remove_callback(PrinterCallback)  # its log lines would interleave with the table
    trainer.train()


def _keras(config: str, steps: _Steps, count: int) -> None:
    """Keras' ``fit``: the demo CNN trained for ``count`` steps."""
    model, x, y, batch = _keras_setup(config, count)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[_keras_ended(steps)],
              shuffle=False)


def _keras_evaluate(config: str, steps: _Steps, count: int) -> None:
    """Keras' ``evaluate``: the demo CNN over ``count`` batches (a step is a test step)."""
    model, x, y, batch = _keras_setup(config, count)
    model.evaluate(x, y, batch_size=batch, verbose=0, callbacks=[_keras_ended(steps)])


def _keras_ended(steps: _Steps) -> Any:
    import keras

    class Ended(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps.ended()

        def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
            steps.ended()

    return Ended()


def _keras_setup(config: str, count: int) -> tuple[Any, Any, Any, int]:
    """The demo CNN in Keras layers, compiled (built in the strategy's scope for ``cs``), the
    data of ``count`` batches, and the batch size."""
    os.environ["KERAS_BACKEND"] = "torch"
    import keras
    import numpy as np
    import torch

    def halves(size: int) -> tuple[tuple[int, int], tuple[int, int]]:
        half = (size + 1) // 2
        return (0, half), (half, size)

    class Halves(keras.Sequential):  # type: ignore[misc]
        """Keras' own train and test steps (its torch trainer's) over the batch's two
        halves, each half's loss weighted by its share, one optimizer update: two replicas'
        work."""

        def train_step(self, data: Any) -> Any:
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            self.zero_grad()
            size = x.shape[0]
            for start, stop in halves(size):
                xs, ys = x[start:stop], y[start:stop]
                y_pred = self(xs, training=True)
                loss = self._compute_loss(x=xs, y=ys, y_pred=y_pred, training=True)
                self._loss_tracker.update_state(loss, sample_weight=stop - start)
                self.optimizer.scale_loss(loss * ((stop - start) / size)).backward()
                self._compile_metrics.update_state(ys, y_pred)
            trainable = self.trainable_weights[:]
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in trainable], trainable)
            return self.get_metrics_result()

        def test_step(self, data: Any) -> Any:
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            for start, stop in halves(x.shape[0]):
                xs, ys = x[start:stop], y[start:stop]
                y_pred = self(xs, training=False)
                loss = self._compute_loss(x=xs, y=ys, y_pred=y_pred, training=False)
                self._loss_tracker.update_state(loss, sample_weight=stop - start)
                self._compile_metrics.update_state(ys, y_pred)
            return self.get_metrics_result()

    def build() -> Any:  # the demo's CNN in Keras layers
        model = (Halves if config == "plain x2" else keras.Sequential)([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    batch = PER_REPLICA * (1 if config in ("plain", "cs R=1") else 2)
    keras.utils.set_random_seed(0)
    if config.startswith("cs"):
        with _strategy(config).scope():
            model = build()
    else:
        model = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * count, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, batch * count)
    return model, x, y, batch


TRAINERS: dict[str, tuple[str, Callable[[str, _Steps, int], None]]] = {
    "lightning": ("the demo CNN", _lightning),
    "transformers": ("GPT-2 tiny", _transformers),
    "transformers-compiled": ("GPT-2 compiled", functools.partial(_transformers, compiled=True)),
    "keras": ("the demo CNN", _keras),
    "keras-eval": ("the demo CNN", _keras_evaluate),
}


def _count(trainer: str, config: str) -> dict[str, int]:
    """One configuration's lines per step, in a fresh process (no other trainer's state)."""
    result = subprocess.run(
        [sys.executable, __file__, "--count", trainer, config],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode:
        raise RuntimeError(f"{trainer} {config} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _race(trainer: str, steps: int, warmup: int) -> dict[str, float]:
    """The median CPU time of a step (ms) of each configuration, taking turns (docstring)."""
    baton = _Baton(len(CONFIGS))
    recorders = [_Steps(False, baton, i) for i in range(len(CONFIGS))]
    failures: list[BaseException] = []

    def train(i: int) -> None:
        baton.wait(i)
        try:
            TRAINERS[trainer][1](CONFIGS[i], recorders[i], steps)
        except BaseException as error:  # reported after the others finish
            failures.append(error)
        finally:
            baton.finish(i)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(CONFIGS))]
    collecting = gc.isenabled()
    gc.disable()
    try:
        for thread in threads:
            thread.start()
        baton.start()
        for thread in threads:
            thread.join()
    finally:
        if collecting:
            gc.enable()
    if failures:
        raise failures[0]
    return {
        config: statistics.median(recorder.times[warmup:]) * 1e3
        for config, recorder in zip(CONFIGS, recorders)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    parser.add_argument("--time", action="store_true", help="also time the steps")
    parser.add_argument("--steps", type=at_least(1), default=300, help="steps per configuration")
    parser.add_argument("--warmup", type=at_least(0), default=50, help="first steps not timed")
    parser.add_argument("--count", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if options.count:
        trainer, config = options.count
        steps = _Steps(count=True)
        TRAINERS[trainer][1](config, steps, COUNTED_STEP + 5)
        print(json.dumps(steps.counts()))
        return
    if options.warmup >= options.steps:
        parser.error(f"--warmup ({options.warmup}) must be less than --steps ({options.steps})")
    wide = max(len("trainer"), *map(len, options.trainers))
    print(f"{'trainer':<{wide}} {'model':<14} {'config':<9} {'lines':>6} {'cs':>5} {'- base':>7}"
          + (f" {'ms':>7} {'ratio':>6}" if options.time else ""))
    for trainer in options.trainers:
        counts = {config: _count(trainer, config) for config in CONFIGS}
        times = _race(trainer, options.steps, options.warmup) if options.time else {}
        for config in CONFIGS:
            lines, own = counts[config]["lines"], counts[config]["cs"]
            base = BASELINES.get(config)
            more = f"{lines - counts[base]['lines']:>+7}" if base else ""
            row = (f"{trainer:<{wide}} {TRAINERS[trainer][0]:<14} {config:<9} {lines:>6} {own:>5} "
                   f"{more:>7}")
            if times:
                row += f" {times[config]:>7.2f}"
                if base:
                    row += f" {times[config] / times[base]:>6.3f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
