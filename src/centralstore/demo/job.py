"""What the demo's runs share: the settings, the data, the model, the optimizer, the batches.

The distributed run (``train.py``), the one-device oracle (``one_device.py``) and the report
(``report.py``) all build on these, so that the two runs train the same model on the same
global batches in the same order and the report describes exactly what ran.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import centralstore as cs

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
    checkpoint_dir: Path | None = None  # where checkpoints go, and an interrupted run resumes


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


WARM_UP_EPOCHS = 1  # left out of the steady-state throughput: first calls, caches, allocator


@dataclasses.dataclass
class Run:
    """One finished training run: the model, its metrics and how long training took."""

    model: nn.Module
    history: History
    train_seconds: float
    samples: int  # training examples processed (epochs x training set)
    resumed_from: str | None = None  # the checkpoint the training resumed from, if any
    epoch_seconds: list[float] = dataclasses.field(default_factory=list)  # training, per epoch

    @property
    def samples_per_second(self) -> float:
        """Over the whole run, warm-up included."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("inf")

    @property
    def steady_samples_per_second(self) -> float:
        """Steady state: one epoch's samples over the median time of the epochs after the
        warm-up (the first). With a single epoch there is none to leave out: the whole run."""
        return steady_samples_per_second(self.samples, self.epoch_seconds, self.train_seconds)


def steady_samples_per_second(
    samples: int, epoch_seconds: list[float], total_seconds: float
) -> float:
    """Samples per second in the median epoch after the warm-up epoch, else over the run.

    The median, not the mean: on a shared machine one epoch now and then takes ten times
    the others, and says nothing about what training costs.

    >>> steady_samples_per_second(300, [2.0, 0.1, 0.5, 0.1], 2.7)  # 75 a epoch, median 0.1 s
    750.0
    >>> steady_samples_per_second(100, [2.0], 2.0)  # one epoch: no steady state to isolate
    50.0
    """
    if len(epoch_seconds) <= WARM_UP_EPOCHS:
        return samples / total_seconds if total_seconds > 0 else float("inf")
    median = statistics.median(epoch_seconds[WARM_UP_EPOCHS:])
    per_epoch = samples / len(epoch_seconds)
    return per_epoch / median if median > 0 else float("inf")


# A training a step at a time: None after each optimizer step, then the finished run.
Training = Iterator[Run | None]


def finish(training: Training) -> Run:
    """Every step of one training; its run."""
    for result in training:
        if result is not None:
            return result
    raise RuntimeError("The training ended without a run: every training yields its run last.")


T = TypeVar("T")


def timed(batches: Iterable[T]) -> Iterator[tuple[T, float]]:
    """Each batch with the ``time.perf_counter()`` at which fetching it began: a step timed
    from there counts its batch's making, and not whatever ran since the step before.

    >>> [batch for batch, began in timed("ab")]
    ['a', 'b']
    """
    iterator = iter(batches)
    while True:
        began = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch, began


def interleaved(trainings: Sequence[Training]) -> list[Run]:
    """Several trainings, a step of each in turn (the order reversed every other round),
    until all have ended; their runs, in the order given.

    Timed one after the other, each training would meet the shared machine in another state
    (its load drifts over seconds), and comparing their speeds would compare those states.
    Taking turns epoch by epoch was not fine enough: on two shared cores the load moved one
    training's epoch against the next one's by 0.69 to 1.51 within a run, and the demo's
    ratio of the replicas to the same slices on one device read 0.71 to 0.88 from run to
    run; step by step, every step of one training meets the machine as the others' around it.

    >>> def counting(name, steps, log):
    ...     for step in range(steps):
    ...         log.append(f"{name}{step}")
    ...         yield None
    ...     yield name
    >>> log = []
    >>> interleaved([counting("a", 2, log), counting("b", 3, log)]), log
    (['a', 'b'], ['a0', 'b0', 'b1', 'a1', 'b2'])
    """
    runs: list[Run | None] = [None] * len(trainings)
    live = list(range(len(trainings)))
    round_ = 0
    while live:
        for i in live if round_ % 2 == 0 else live[::-1]:
            result = next(trainings[i])
            if result is not None:
                runs[i] = result
        live = [i for i in live if runs[i] is None]
        round_ += 1
    return [run for run in runs if run is not None]


def make_strategy(compute_devices: list[str] | None, parameter_device: str | None) -> cs.Strategy:
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


def steps_per_epoch(samples: int, batch_size: int) -> int:
    """How many global batches one pass over ``samples`` examples takes (the last one short).

    >>> steps_per_epoch(1437, 64), steps_per_epoch(128, 64)
    (23, 2)
    """
    return -(-samples // batch_size)


def global_size(strategy: cs.Strategy, value: Any) -> int:
    """The global batch size behind a distributed batch: the sum of its replicas' slices.

    Through ``gather``, which spans every worker: the local results hold only this worker's
    slices.
    """
    return len(strategy.gather(value, axis=0))
