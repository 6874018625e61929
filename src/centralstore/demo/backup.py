"""The demo's checkpoints (``centralstore demo --checkpoint-dir DIR``), as Keras's
``BackupAndRestore`` keeps them: an interrupted demo run again with the same directory
resumes at the step after its last checkpoint and ends with the weights of an
uninterrupted run.

``TrainingState`` is where the training loop stands (epoch, the running sums of the epoch,
the history, the time spent, the initial weights the comparison starts from, and the
position of the epoch's iterator); ``manager`` tracks it with the model, the optimizer, the
schedule and the random generators in a ``CheckpointManager``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from centralstore.checkpoint import Checkpoint, CheckpointManager, RNGState
from centralstore.input.distributed import DistributedDataset
from centralstore.input.iterator import DistributedIterator

from .job import History

CHECKPOINT_EVERY = 10  # steps between two checkpoints (and one at the end of every epoch)


class TrainingState:
    """Where the training loop stands, as an object a ``Checkpoint`` tracks."""

    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        self.initial = initial
        self.epoch = 0
        self.history = History()
        self.seconds = 0.0
        self.epoch_seconds: list[float] = []  # each finished epoch's training time
        self._epoch_began = 0.0  # ``seconds`` when this epoch began
        self.loss_sum, self.correct, self.seen, self.steps = 0.0, 0, 0, 0  # this epoch's
        self._iterator: DistributedIterator | None = None
        self._restored_position: Mapping[str, Any] | None = None

    def begin_epoch(self, dataset: DistributedDataset) -> DistributedIterator:
        """The epoch's iterator, at the restored position when the run resumes mid-epoch."""
        iterator = iter(dataset)
        if self._restored_position is not None:
            with warnings.catch_warnings():  # the report says that the run resumed
                warnings.filterwarnings("ignore", message="Restoring the position of a distrib")
                iterator.load_state_dict(self._restored_position)
            self._restored_position = None
        self._iterator = iterator
        return iterator

    def end_epoch(self, test_accuracy: float) -> None:
        self.history.loss.append(self.loss_sum / self.seen)
        self.history.accuracy.append(self.correct / self.seen)
        self.history.test_accuracy.append(test_accuracy)
        self.epoch_seconds.append(self.seconds - self._epoch_began)
        self._epoch_began = self.seconds
        self.epoch += 1
        self.loss_sum, self.correct, self.seen, self.steps = 0.0, 0, 0, 0
        self._iterator = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "initial": self.initial,
            "epoch": self.epoch,
            "history": dataclasses.asdict(self.history),
            "seconds": self.seconds,
            "epoch_seconds": [*self.epoch_seconds, self._epoch_began],
            "epoch_sums": [self.loss_sum, self.correct, self.seen, self.steps],
            "iterator": None if self._iterator is None else self._iterator.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.initial = dict(state["initial"])
        self.epoch = int(state["epoch"])
        self.history = History(**state["history"])
        self.seconds = float(state["seconds"])
        *finished, began = state.get("epoch_seconds", [self.seconds])
        self.epoch_seconds, self._epoch_began = [float(s) for s in finished], float(began)
        loss_sum, correct, seen, steps = state["epoch_sums"]
        self.loss_sum, self.correct, self.seen, self.steps = loss_sum, correct, seen, steps
        self._restored_position = state["iterator"]


def manager(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
) -> CheckpointManager:
    """The demo's checkpoints in ``directory``: the last two kept."""
    checkpoint = Checkpoint(
        model=model, optimizer=optimizer, schedule=schedule, progress=state, rng=RNGState()
    )
    return CheckpointManager(checkpoint, directory, max_to_keep=2)
