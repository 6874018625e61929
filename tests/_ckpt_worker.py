"""A training process that checkpoints, for ``tests/test_checkpoint.py``: killed and resumed.

Run as ``python tests/_ckpt_worker.py OUT_DIR PIPELINE REPLICAS KILL_AFTER_STEP [TORN]``.
It trains ``STEPS`` steps with a ``CheckpointManager`` in ``OUT_DIR/ckpts`` (a save every
``INTERVAL`` steps), resuming from the latest checkpoint there, and SIGKILLs itself right
after step ``KILL_AFTER_STEP`` (-1: never); with ``TORN``, it instead SIGKILLs itself in
the middle of the save of that step, after the data was written and before the rename. At
the end it writes the final weights to ``OUT_DIR/final.pt``. The test runs the same
``train`` in its own process, uninterrupted, as the oracle. Not collected by pytest.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import centralstore as cs
from centralstore.checkpoint import Checkpoint, CheckpointManager, RNGState

STEPS = 9
INTERVAL = 2
GLOBAL_BATCH = 12


def model(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(dropout), nn.Tanh(), nn.Linear(16, 2))


def examples() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(40, 4, generator=generator), torch.randn(40, 2, generator=generator)


def noisy(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 1.5, y


def dataset(strategy: cs.Strategy, pipeline: str) -> Any:
    """The input: a seeded, reshuffled, repeated, mapped, batched, prefetched ``cs.Dataset``
    of global batches; or, from a function, each replica's share of them."""
    if pipeline == "global":
        source = cs.Dataset.from_tensor_slices(examples()).shuffle(16, seed=5).repeat()
        source = source.map(noisy).batch(GLOBAL_BATCH).prefetch(2)
        return strategy.experimental_distribute_dataset(source)

    def per_replica(context: cs.InputContext) -> cs.Dataset:
        batch = context.get_per_replica_batch_size(GLOBAL_BATCH)
        source = cs.Dataset.from_tensor_slices(examples()).shuffle(16, seed=5).repeat()
        return source.map(noisy).batch(batch).prefetch(1)

    return strategy.distribute_datasets_from_function(per_replica)


def train(
    strategy: cs.Strategy, pipeline: str, directory: Path | None, kill_after: int, torn: bool
) -> dict[str, torch.Tensor]:
    """``STEPS`` steps; with ``directory``, checkpointed there and resumed from there."""
    with strategy.scope():
        # Dropout draws from torch's generator in replica order: the same draws at the same R
        # only, so the pipeline resumed at another R runs without it.
        net = model(0.25 if pipeline == "global" else 0.0)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        step = torch.zeros((), dtype=torch.int64)
    torch.manual_seed(2)  # dropout's draws from here on
    iterator = iter(dataset(strategy, pipeline))
    manager = None
    if directory is not None:
        checkpoint = Checkpoint(
            model=net, optimizer=optimizer, schedule=schedule, iterator=iterator, step=step,
            rng=RNGState(),
        )
        manager = CheckpointManager(
            checkpoint, directory, max_to_keep=2, step_counter=step, checkpoint_interval=INTERVAL
        )
        manager.restore_or_initialize()

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = ((net(x) - y) ** 2).sum(dim=1)
        cs.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()

    while int(step) < STEPS:
        x, y = next(iterator)
        optimizer.zero_grad()
        strategy.run(replica_step, args=(x, y))
        optimizer.step()
        schedule.step()
        step += 1
        if manager is not None:
            if torn and int(step) == kill_after:
                _die_in_the_middle_of_the_next_write()
            manager.save()
            if int(step) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _die_in_the_middle_of_the_next_write() -> None:
    """SIGKILL this process once the next checkpoint's bytes are written, before the rename."""
    real_fsync = os.fsync

    def fsync_then_die(descriptor: int) -> None:
        real_fsync(descriptor)
        os.kill(os.getpid(), signal.SIGKILL)

    os.fsync = fsync_then_die


def main() -> None:
    out, pipeline, replicas, kill_after = sys.argv[1:5]
    torn = len(sys.argv) > 5 and sys.argv[5] == "torn"
    torch.set_num_threads(1)
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(int(replicas))])
    final = train(strategy, pipeline, Path(out) / "ckpts", int(kill_after), torn)
    torch.save(final, Path(out) / "final.pt")


if __name__ == "__main__":
    main()
