"""The demo training job: a small CNN on scikit-learn's handwritten digits.

It trains with ``CentralStorageStrategy`` the way TensorFlow code does (model and optimizer built
in ``scope()``, global batches through ``experimental_distribute_dataset``, the loss scaled by
the global batch, metrics through ``reduce``), then trains the same model once more as a plain
one-device PyTorch loop, from the same initial weights on the same global batches in the same
order, and measures how far apart the two final sets of weights are: float32 rounding apart.

The data ship inside scikit-learn (``sklearn.datasets.load_digits``: 1,797 8x8 images), so the
demo needs no download. Everything here is ordinary public API (``import centralstore as cs``)
except the report (``_demo_report.py``).

Under ``torchrun`` the same job runs in every worker process with
``MultiWorkerCentralStorageStrategy``; only the chief (worker 0) prints and writes.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import centralstore as cs

from . import _demo_report

LEARNING_RATE = 1e-2  # Adam, annealed to 0 over the run (cosine): 0.97-0.99 test accuracy
ADAM_EPSILON = 1e-3
TEST_FRACTION = 0.2
LOGICAL_CPU_DEVICES = ("cpu:0", "cpu:1")  # the compute devices when no GPU is visible


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the user chose on the command line (``centralstore demo --help``)."""

    epochs: int = 12
    batch_size: int = 64
    seed: int = 0
    out: Path = Path("demo-out")
    compare: bool = True


class Digits(NamedTuple):
    """The seeded, stratified 80/20 split of scikit-learn's digits: images ``[N, 1, 8, 8]`` in
    [0, 1], labels ``[N]`` (int64)."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


@dataclasses.dataclass
class History:
    """Per-epoch metrics: mean training loss, training accuracy, test accuracy."""

    loss: list[float] = dataclasses.field(default_factory=list)
    accuracy: list[float] = dataclasses.field(default_factory=list)
    test_accuracy: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Run:
    """One finished training run: the model, its metrics and how long training took."""

    model: nn.Module
    history: History
    train_seconds: float
    samples: int  # training examples processed (epochs x training set)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("inf")


def make_strategy(
    compute_devices: list[str] | None, parameter_device: str | None
) -> cs.Strategy:
    """The demo's strategy: the given devices, else every visible GPU, else two logical CPU
    devices (so that a laptop without a GPU still shows two replicas in sync).

    Launched by torchrun (which sets ``WORLD_SIZE``), one ``MultiWorkerCentralStorageStrategy``
    per worker process instead: the given devices, else this process's share of the GPUs,
    else one replica on the CPU (two workers then split a global batch as two logical CPU
    devices do in one process).
    """
    no_gpu = torch.cuda.device_count() == 0
    if "WORLD_SIZE" in os.environ:
        if compute_devices is None and no_gpu:
            compute_devices = ["cpu:0"]
        return cs.MultiWorkerCentralStorageStrategy(compute_devices, parameter_device)
    if compute_devices is None and no_gpu:
        compute_devices = list(LOGICAL_CPU_DEVICES)
    return cs.CentralStorageStrategy(compute_devices, parameter_device)


def load_digits(seed: int) -> Digits:
    """scikit-learn's bundled digits, scaled to [0, 1], split 80/20 (stratified, seeded)."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=seed, stratify=labels
    )
    return Digits(train_x, train_y, test_x, test_y)


def make_model() -> nn.Module:
    """Three 3x3 convolutions (two of stride 2: 8x8 -> 4x4 -> 2x2) and two linear layers,
    22,954 parameters, with SiLU activations.

    Smooth on purpose: with ReLU and max-pooling, float32 rounding differences (which any two
    summation orders have) flip kinks and argmaxes, and training amplifies them until the
    replicas' run and the one-device run end visibly apart, though both are correct. No batch
    norm either: it normalizes over each replica's slice, not over the global batch.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.SiLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.SiLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.SiLU(),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 64),
        nn.SiLU(),
        nn.Linear(64, 10),
    )


def make_optimizer(
    model: nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Adam with a cosine learning-rate schedule over the whole run, stepped once per step.

    ``eps=1e-3`` rather than 1e-8: Adam divides by sqrt(v) + eps, so with a tiny eps a weight
    whose gradient is nearly zero takes full-size steps driven by rounding noise.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    return optimizer, schedule


def train_batches(data: Digits, batch_size: int, seed: int) -> DataLoader[Any]:
    """Shuffled global batches, a new order each epoch, drawn from a seeded generator: two
    loaders made with the same seed yield the same batches in the same order."""
    return DataLoader(
        TensorDataset(data.train_images, data.train_labels),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def held_out_batches(data: Digits, batch_size: int) -> DataLoader[Any]:
    """The test set in order, in global batches."""
    return DataLoader(TensorDataset(data.test_images, data.test_labels), batch_size=batch_size)


def global_size(strategy: cs.Strategy, value: Any) -> int:
    """The global batch size behind a distributed batch: the sum of its replicas' slices.

    Through ``gather``, which spans every worker: the local results hold only this worker's
    slices.
    """
    return len(strategy.gather(value, axis=0))


def train_distributed(
    strategy: cs.Strategy,
    data: Digits,
    settings: Settings,
    progress: Callable[[int, int], _demo_report.Progress],
) -> tuple[Run, dict[str, torch.Tensor]]:
    """Train with ``strategy``; return the run and the initial weights (for the comparison)."""
    torch.manual_seed(settings.seed)
    loader = train_batches(data, settings.batch_size, settings.seed)
    with strategy.scope():  # the variables live once, on the parameter device
        model = make_model()
        optimizer, schedule = make_optimizer(model, settings.epochs * len(loader))
    initial = copy.deepcopy(model.state_dict())
    dataset = strategy.experimental_distribute_dataset(loader)
    test_dataset = strategy.experimental_distribute_dataset(
        held_out_batches(data, settings.batch_size)
    )

    def train_step(
        images: torch.Tensor, labels: torch.Tensor, global_batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One replica's share of a step: its slice of the global batch."""
        logits = model(images)
        per_example = F.cross_entropy(logits, labels, reduction="none")
        # Divided by the *global* batch: summed over the replicas (what folding the
        # gradients does) this is the mean over the global batch, as on one device.
        loss = cs.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach(), (logits.argmax(1) == labels).sum()

    history = History()
    seconds = 0.0
    for epoch in range(settings.epochs):
        bar = progress(epoch, len(dataset))
        loss_sum, correct, seen = 0.0, 0, 0
        start = time.perf_counter()
        for images, labels in dataset:
            batch = global_size(strategy, labels)
            optimizer.zero_grad()
            loss, hits = strategy.run(train_step, args=(images, labels, batch))
            optimizer.step()  # once, on the central variables, with the summed gradients
            schedule.step()
            loss_sum += float(strategy.reduce(cs.ReduceOp.SUM, loss, axis=None)) * batch
            correct += int(strategy.reduce(cs.ReduceOp.SUM, hits, axis=None))
            seen += batch
            bar.step(loss_sum / seen, correct / seen)
        seconds += time.perf_counter() - start
        history.loss.append(loss_sum / seen)
        history.accuracy.append(correct / seen)
        history.test_accuracy.append(evaluate(strategy, model, test_dataset))
        bar.close(history.test_accuracy[-1])
    samples = settings.epochs * len(data.train_labels)
    return Run(model, history, seconds, samples), initial


def evaluate(strategy: cs.Strategy, model: nn.Module, dataset: Any) -> float:
    """Test accuracy, computed by the replicas on their slices of each test batch and summed
    over the whole batch with ``reduce(SUM, ..., axis=0)``."""

    def hits(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(images)
        return (logits.argmax(1) == labels).float()

    correct, total = 0.0, 0
    with torch.no_grad():
        for images, labels in dataset:
            correct += float(strategy.reduce("SUM", strategy.run(hits, (images, labels)), axis=0))
            total += global_size(strategy, labels)
    return correct / total


def run(strategy: cs.Strategy, settings: Settings, out: TextIO = sys.stdout) -> dict[str, Any]:
    """The whole job: train, compare with one device, print the report, write ``curves.png``
    and ``summary.json`` into ``settings.out``. Returns the summary.

    Every worker runs all of it (the one-device comparison too: it needs no other worker),
    but only the chief prints the report on ``out``, shows progress bars and writes files.
    """
    from ._demo_one_device import max_abs_difference, reference_device, train_one_device

    started = time.perf_counter()
    # One intra-op thread: at this size (8x8 images, slices of 32) more threads only add
    # synchronization, and on a busy machine their spinning costs 10x or more.
    torch.set_num_threads(1)
    chief = strategy.extended.should_save_summary
    report = _demo_report.Report(out if chief else io.StringIO())
    data = load_digits(settings.seed)
    report.header(strategy, settings, len(data.train_labels), len(data.test_labels))
    distributed, initial = train_distributed(
        strategy,
        data,
        settings,
        lambda epoch, steps: _demo_report.Progress(epoch, settings.epochs, steps, shown=chief),
    )
    report.results(distributed)
    reference: Run | None = None
    difference: float | None = None
    device = reference_device(strategy)
    if settings.compare:
        reference = train_one_device(initial, data, settings, device)
        difference = max_abs_difference(distributed.model, reference.model)
        report.comparison(device, reference, difference, steps=_steps(settings, data))
    summary = _demo_report.summary(
        strategy, settings, data, distributed, reference, difference, device
    )
    summary["wall_seconds"] = time.perf_counter() - started
    if strategy.extended.should_checkpoint:  # one writer, however many workers
        report.written(_demo_report.write(settings.out, summary), summary["wall_seconds"])
    return summary


def _steps(settings: Settings, data: Digits) -> int:
    per_epoch = -(-len(data.train_labels) // settings.batch_size)
    return settings.epochs * per_epoch
