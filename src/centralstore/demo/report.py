"""What the demo shows: the console report, each epoch's progress, ``curves.png``,
``summary.json``.

Kept apart from the training (``train.py``) so that the training reads as training code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, final

import torch

import centralstore as cs
from centralstore.input.split import split_sizes

from .job import (
    ADAM_EPSILON,
    LEARNING_RATE,
    WARM_UP_EPOCHS,
    Digits,
    History,
    Run,
    Settings,
    steps_per_epoch,
)

_WIDTH = 20  # the column of the report's labels


class Progress(Protocol):
    """One epoch's progress display, told of every step and of the test accuracy at the end."""

    def step(self, loss: float, accuracy: float) -> None:
        """One step done; ``loss`` and ``accuracy`` are the epoch's running means."""

    def close(self, test_accuracy: float, seconds: float) -> None:
        """The epoch is trained, in ``seconds`` of its own steps (the comparisons' steps
        between them left out), and evaluated."""


def progress(epoch: int, epochs: int, steps: int, stream: TextIO) -> Progress:
    """Epoch ``epoch`` (from 0) of ``epochs``, ``steps`` steps long, shown on ``stream``: a
    tqdm bar on a terminal, elsewhere (a pipe, a log file) one plain line at the epoch's end.

    tqdm redraws its bar with carriage returns, which a file keeps: each epoch would leave one
    long line of every redraw.
    """
    label = f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs}"
    return _Bar(label, steps, stream) if stream.isatty() else _Line(label, steps, stream)


_STEPS = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps"  # tqdm's bar, without its clock


@final
class _Bar:
    """A tqdm bar with the running loss and accuracy, then the epoch's time and its test
    accuracy, as ``_Line`` prints them. tqdm's own elapsed time and rate are left out: its
    clock is the wall's, in which the comparisons' steps, taken between the epoch's, count."""

    def __init__(self, label: str, steps: int, stream: TextIO) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=steps, desc=label, file=stream, leave=True, dynamic_ncols=True,
            bar_format=_STEPS + "{postfix}",
        )

    def step(self, loss: float, accuracy: float) -> None:
        self._bar.set_postfix_str(f"loss={loss:.4f}, acc={accuracy:.4f}", refresh=False)
        self._bar.update(1)

    def close(self, test_accuracy: float, seconds: float) -> None:
        self._bar.bar_format = _STEPS + f" in {seconds:.1f} s" + "{postfix}"
        self._bar.set_postfix_str(f"{self._bar.postfix}, test_acc={test_accuracy:.4f}")
        self._bar.close()


@final
class _Line:
    """One line when the epoch ends: ``epoch 1/12: 23/23 steps in 0.4 s, loss=..., acc=...,
    test_acc=...``, the time that of the epoch's own steps."""

    def __init__(self, label: str, steps: int, stream: TextIO) -> None:
        self._label, self._steps, self._stream = label, steps, stream
        self._done, self._loss, self._accuracy = 0, float("nan"), float("nan")

    def step(self, loss: float, accuracy: float) -> None:
        self._done, self._loss, self._accuracy = self._done + 1, loss, accuracy

    def close(self, test_accuracy: float, seconds: float) -> None:
        print(
            f"{self._label}: {self._done}/{self._steps} steps in {seconds:.1f} s, "
            f"loss={self._loss:.4f}, acc={self._accuracy:.4f}, test_acc={test_accuracy:.4f}",
            file=self._stream,
            flush=True,
        )


class Report:
    """The lines the demo prints, as ``label: value`` so that they read (and parse) easily."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def line(self, label: str, value: str) -> None:
        print(f"{label:<{_WIDTH}}: {value}", file=self._out, flush=True)

    def header(
        self, strategy: cs.Strategy, settings: Settings, train_samples: int, test_samples: int
    ) -> None:
        replicas = strategy.num_replicas_in_sync
        workers = num_workers(strategy)
        title = "a small CNN on scikit-learn's handwritten digits"
        print(f"centralstore {cs.__version__} demo: {title}", file=self._out)
        self.line(
            "data",
            f"{train_samples:,} training / {test_samples:,} test images (8x8, 10 classes), "
            f"split with seed {settings.seed}",
        )
        self.line("strategy", f"{type(strategy).__name__}, {plural(replicas, 'replica')} in sync")
        self.line(
            "compute devices", placement(strategy.compute_devices, workers) + _cpu_note(strategy)
        )
        self.line("parameter device", placement([strategy.parameter_device], workers))
        slices = " + ".join(str(n) for n in split_sizes(settings.batch_size, replicas))
        steps = steps_per_epoch(train_samples, settings.batch_size)
        self.line(
            "global batch",
            f"{settings.batch_size} = {slices} (one slice per replica), {steps} steps per "
            f"epoch, {plural(settings.epochs, 'epoch')}",
        )

    def results(self, run: Run) -> None:
        if run.resumed_from is not None:
            self.line("resumed from", run.resumed_from)
        self.line("test accuracy", f"{run.history.test_accuracy[-1]:.4f}")

    def comparison(
        self, device: torch.device, reference: Run, difference: float, steps: int
    ) -> None:
        self.line(
            "one device",
            f"{device}, a plain PyTorch loop: same initial weights, same {steps} global "
            "batches in the same order",
        )
        self.line("  test accuracy", f"{reference.history.test_accuracy[-1]:.4f}")
        weights = sum(t.numel() for t in reference.model.state_dict().values())
        why = "(float32 rounding)" if difference > 0 else "(bitwise identical)"
        self.line(
            "weight difference",
            f"max |replicas - one device| = {difference:.1e} over {weights:,} weights {why}",
        )

    def speed(
        self,
        strategy: cs.Strategy,
        settings: Settings,
        distributed: Run,
        reference: Run | None = None,
        sliced: Run | None = None,
    ) -> None:
        """Samples per second in the steady state (the warm-up epoch left out), of the
        replicas and of the plain loops; what centralstore costs apart from what smaller
        batches cost; and what logical CPU devices can show about speed."""
        replicas = strategy.num_replicas_in_sync
        epochs = len(distributed.epoch_seconds)
        if epochs > WARM_UP_EPOCHS:
            how = (
                f"steady state, the median of epochs {WARM_UP_EPOCHS + 1}-{epochs} (epoch 1 is "
                f"warm-up); in brackets, all {epochs} epochs"
            )
        else:
            how = "one epoch, warm-up included (no steady state to isolate: run more epochs)"
        self.line("samples per second", how)
        self.line(f"  {plural(replicas, 'replica')}", _rate(distributed))
        slices = " + ".join(str(n) for n in split_sizes(settings.batch_size, replicas))
        if sliced is not None:
            self.line(
                "  1 device, slices",
                f"{_rate(sliced)}: the replicas' {slices} one after the other, a backward "
                "pass each, one optimizer step",
            )
        if reference is not None:
            self.line(
                "  1 device, whole",
                f"{_rate(reference)}: one pass per global batch of {settings.batch_size}",
            )
        if sliced is not None:
            own = distributed.steady_samples_per_second / sliced.steady_samples_per_second
            self.line(
                "  centralstore",
                f"{own:.2f}x the same slices on one device: centralstore's own cost",
            )
            if reference is not None:
                smaller = sliced.steady_samples_per_second / reference.steady_samples_per_second
                self.line(
                    "  smaller batches",
                    f"{smaller:.2f}x: slices of {max(split_sizes(settings.batch_size, replicas))}"
                    f" against whole batches of {settings.batch_size}, with or without "
                    "centralstore",
                )
        note = _speed_note(strategy)
        if note:
            self.line("  about speed", note)

    def written(self, paths: list[Path], seconds: float) -> None:
        self.line("wrote", ", ".join(str(p) for p in paths))
        self.line("wall time", f"{seconds:.1f} s")


def num_workers(strategy: cs.Strategy) -> int:
    """How many worker processes train together: the replicas in sync over this worker's
    (every worker holds as many)."""
    return strategy.num_replicas_in_sync // len(strategy.compute_devices)


def placement(devices: Sequence[str], workers: int) -> str:
    """The devices of one worker, and how many workers hold such devices.

    >>> placement(["cpu:0", "cpu:1"], 1), placement(["cpu:0"], 2)
    ('cpu:0, cpu:1', 'cpu:0 on each of 2 workers')
    """
    names = ", ".join(devices)
    return names if workers == 1 else f"{names} on each of {workers} workers"


def plural(count: int, noun: str) -> str:
    """``"1 replica"``, ``"2 replicas"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cpu_note(strategy: cs.Strategy) -> str:
    devices = strategy.compute_devices
    if not all(d.startswith("cpu") for d in devices):
        return ""
    what = "logical CPU devices" if len(devices) > 1 else "the host CPU"
    if torch.cuda.device_count() == 0:
        return f" ({what}: no GPU is visible)"
    return f" ({what})"


def _rate(run: Run) -> str:
    """``"11,342 (all epochs: 7,479 in 2.3 s)"``: steady state, then the whole run."""
    return (
        f"{run.steady_samples_per_second:,.0f} "
        f"({run.samples_per_second:,.0f} in {run.train_seconds:.1f} s)"
    )


def _speed_note(strategy: cs.Strategy) -> str:
    """What replicas on logical CPU devices can show about speed, or nothing."""
    devices = strategy.compute_devices
    if num_workers(strategy) > 1 or len(devices) < 2:
        return ""
    if not all(d.startswith("cpu") for d in devices):
        return ""
    return (
        "logical CPU devices share one host's cores: they prove the semantics and measure "
        "centralstore's own overhead, not a speed-up (that takes GPUs)"
    )


def summary(
    strategy: cs.Strategy,
    settings: Settings,
    data: Digits,
    distributed: Run,
    reference: Run | None,
    difference: float | None,
    device: torch.device,
    sliced: Run | None = None,
    sliced_difference: float | None = None,
) -> dict[str, Any]:
    """Everything the run measured, as JSON-ready values (``summary.json``)."""
    one_device = None
    if reference is not None:
        one_device = {
            "device": str(device),
            "test_accuracy": reference.history.test_accuracy[-1],
            **_speeds(reference),
            "history": _history(reference.history),
        }
    in_slices = None
    if sliced is not None:
        in_slices = {
            "device": str(device),
            "slices": split_sizes(settings.batch_size, strategy.num_replicas_in_sync),
            "test_accuracy": sliced.history.test_accuracy[-1],
            **_speeds(sliced),
            "max_abs_weight_difference": sliced_difference,
            "history": _history(sliced.history),
        }
    return {
        "centralstore_version": cs.__version__,
        "torch_version": torch.__version__,
        "strategy": type(strategy).__name__,
        "compute_devices": list(strategy.compute_devices),
        "parameter_device": strategy.parameter_device,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "num_workers": num_workers(strategy),
        "dataset": "sklearn.datasets.load_digits",
        "train_samples": len(data.train_labels),
        "test_samples": len(data.test_labels),
        "epochs": settings.epochs,
        "global_batch_size": settings.batch_size,
        "seed": settings.seed,
        "optimizer": f"Adam(lr={LEARNING_RATE}, eps={ADAM_EPSILON}), cosine schedule",
        "history": _history(distributed.history),
        "test_accuracy": distributed.history.test_accuracy[-1],
        "warm_up_epochs": WARM_UP_EPOCHS,
        **_speeds(distributed),
        "one_device": one_device,
        "one_device_in_slices": in_slices,
        "max_abs_weight_difference": difference,
        "resumed_from": distributed.resumed_from,
    }


def _speeds(run: Run) -> dict[str, Any]:
    """A run's training time and throughput: overall, per epoch, in the steady state."""
    return {
        "train_seconds": run.train_seconds,
        "epoch_seconds": run.epoch_seconds,
        "samples_per_second": run.samples_per_second,
        "steady_samples_per_second": run.steady_samples_per_second,
    }


def _history(history: History) -> dict[str, list[float]]:
    return {
        "loss": history.loss,
        "accuracy": history.accuracy,
        "test_accuracy": history.test_accuracy,
    }


def write(directory: Path, summary: dict[str, Any]) -> list[Path]:
    """Write ``curves.png`` and ``summary.json`` into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    curves = directory / "curves.png"
    plot_curves(curves, summary)
    path = directory / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return [curves, path]


def plot_curves(path: Path, summary: dict[str, Any]) -> None:
    """Loss and accuracy per epoch, with the one-device run dashed on top when there is one.

    Drawn through matplotlib's object API on an Agg canvas: no pyplot, no global backend
    switch, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history = summary["history"]
    epochs = list(range(1, len(history["loss"]) + 1))
    replicas = plural(summary["num_replicas_in_sync"], "replica")
    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    loss, accuracy = figure.subplots(1, 2)
    loss.plot(epochs, history["loss"], marker="o", label=f"training, {replicas}")
    accuracy.plot(epochs, history["accuracy"], marker="o", label=f"training, {replicas}")
    accuracy.plot(epochs, history["test_accuracy"], marker="s", label=f"test, {replicas}")
    if summary["one_device"] is not None:
        one = summary["one_device"]["history"]
        loss.plot(epochs, one["loss"], "k--", label="training, one device")
        accuracy.plot(epochs, one["test_accuracy"], "k--", label="test, one device")
    loss.set(title="loss (cross-entropy)", xlabel="epoch", yscale="log")
    accuracy.set(title="accuracy", xlabel="epoch", ylim=(0, 1.02))
    for axes in (loss, accuracy):
        axes.grid(alpha=0.3)
        axes.legend()
    where = placement(summary["compute_devices"], summary["num_workers"])
    figure.suptitle(f"centralstore demo: {summary['strategy']} on {where}")
    figure.savefig(path, dpi=100)
