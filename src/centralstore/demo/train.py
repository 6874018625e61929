"""The demo's distributed run, and the whole job around it.

It trains with ``CentralStorageStrategy`` the way TensorFlow code does (model and optimizer built
in ``scope()``, global batches through ``experimental_distribute_dataset``, the loss scaled by
the global batch, metrics through ``reduce``), then (``run``) trains the same model once more
as a plain one-device PyTorch loop (``one_device.py``), from the same initial weights on the
same global batches in the same order, and measures how far apart the two final sets of
weights are: float32 rounding apart.

Under ``torchrun`` the same job runs in every worker process with
``MultiWorkerCentralStorageStrategy``; only the chief (worker 0) prints and writes.
"""

from __future__ import annotations

import copy
import io
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import centralstore as cs

from . import backup, report
from .job import (
    Digits,
    Run,
    Settings,
    Training,
    finish,
    global_size,
    held_out_batches,
    interleaved,
    load_digits,
    make_model,
    make_optimizer,
    steps_per_epoch,
    timed,
    train_batches,
)
from .one_device import max_abs_difference, one_device_training, reference_device


def train_distributed(
    strategy: cs.Strategy,
    data: Digits,
    settings: Settings,
    progress: Callable[[int, int], report.Progress],
) -> tuple[Run, dict[str, torch.Tensor]]:
    """Train with ``strategy``; return the run and the initial weights (for the comparison).

    ``progress(epoch, steps)`` makes each epoch's progress display.
    """
    initial, training = distributed_training(strategy, data, settings, progress)
    return finish(training), initial


def distributed_training(
    strategy: cs.Strategy,
    data: Digits,
    settings: Settings,
    progress: Callable[[int, int], report.Progress],
) -> tuple[dict[str, torch.Tensor], Training]:
    """``train_distributed`` a step at a time (``job.interleaved``): the model is built
    (or restored from a checkpoint) at once, so that the initial weights are known before
    the first step. Each step is timed on its own (fetching its batch included), so that an
    epoch's time leaves out whatever runs between two steps."""
    torch.manual_seed(settings.seed)
    loader = train_batches(data, settings.batch_size, settings.seed)
    with strategy.scope():  # the variables live once, on the parameter device
        model = make_model()
        optimizer, schedule = make_optimizer(model, settings.epochs * len(loader))
    state = backup.TrainingState(copy.deepcopy(model.state_dict()))
    checkpoints, resumed = None, None
    if settings.checkpoint_dir is not None:  # resume where an interrupted run stopped
        checkpoints = backup.manager(settings.checkpoint_dir, model, optimizer, schedule, state)
        resumed = checkpoints.restore_or_initialize()
    options = None
    if settings.compare:
        # The comparison's plain loops take turns with this one step by step (``run``): a
        # thread making this loop's batches ahead would make them during their steps too,
        # and slow them. So each batch is made when the loop asks, as theirs are.
        options = cs.InputOptions(
            experimental_fetch_to_device=False, experimental_place_dataset_on_device=True
        )
    dataset = strategy.experimental_distribute_dataset(loader, options)
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

    def steps() -> Training:
        for epoch in range(state.epoch, settings.epochs):
            yield from train_epoch(epoch)
        samples = settings.epochs * len(data.train_labels)
        yield Run(
            model, state.history, state.seconds, samples, resumed, list(state.epoch_seconds)
        )

    def train_epoch(epoch: int) -> Iterator[None]:
        bar = progress(epoch, len(dataset))
        began = state.seconds
        for (images, labels), start in timed(state.begin_epoch(dataset)):
            batch = global_size(strategy, labels)
            optimizer.zero_grad()
            loss, hits = strategy.run(train_step, args=(images, labels, batch))
            optimizer.step()  # once, on the central variables, with the summed gradients
            schedule.step()
            state.loss_sum += float(strategy.reduce(cs.ReduceOp.SUM, loss, axis=None)) * batch
            state.correct += int(strategy.reduce(cs.ReduceOp.SUM, hits, axis=None))
            state.seen += batch
            state.steps += 1
            bar.step(state.loss_sum / state.seen, state.correct / state.seen)
            state.seconds += time.perf_counter() - start
            if checkpoints is not None and state.steps % backup.CHECKPOINT_EVERY == 0:
                checkpoints.save()  # every worker calls it; the chief writes
            yield None
        state.end_epoch(evaluate(strategy, model, test_dataset))
        bar.close(state.history.test_accuracy[-1], state.seconds - began)
        if checkpoints is not None:
            checkpoints.save()

    return state.initial, steps()


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


def run(
    strategy: cs.Strategy,
    settings: Settings,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> dict[str, Any]:
    """The whole job: train, compare with one device (whole global batches, and the
    replicas' slices one after the other), print the report with the steady-state speeds,
    write ``curves.png`` and ``summary.json`` into ``settings.out``. Returns the summary.

    The three trainings take turns step by step (``job.interleaved``), so that their
    speeds are measured on the machine in the same state.

    The report goes to ``out``, the progress of each epoch to ``err`` (``sys.stdout`` and
    ``sys.stderr`` when not given, as with ``print``). Every worker runs all of it (the
    one-device comparison too: it needs no other worker), but only the chief prints and
    writes files.
    """
    started = time.perf_counter()
    # One intra-op thread: at this size (8x8 images, slices of 32) more threads only add
    # synchronization, and on a busy machine their spinning costs 10x or more.
    torch.set_num_threads(1)
    chief = strategy.extended.should_save_summary
    if not chief:  # the same calls, into streams nobody reads
        out, err = io.StringIO(), io.StringIO()
    console = report.Report(sys.stdout if out is None else out)
    progress_stream = sys.stderr if err is None else err
    data = load_digits(settings.seed)
    console.header(strategy, settings, len(data.train_labels), len(data.test_labels))
    initial, training = distributed_training(
        strategy,
        data,
        settings,
        lambda epoch, steps: report.progress(epoch, settings.epochs, steps, progress_stream),
    )
    device = reference_device(strategy)
    replicas = strategy.num_replicas_in_sync
    trainings = [training]
    if settings.compare:  # plain PyTorch on one device, a step of each training in turn
        trainings.append(one_device_training(initial, data, settings, device))
        if replicas > 1:  # the replicas' passes without centralstore: what it costs itself
            trainings.append(one_device_training(initial, data, settings, device, replicas))
    distributed, *plain = interleaved(trainings)
    console.results(distributed)
    reference: Run | None = plain[0] if plain else None
    sliced: Run | None = plain[1] if len(plain) > 1 else None
    difference: float | None = None
    sliced_difference: float | None = None
    if reference is not None:
        difference = max_abs_difference(distributed.model, reference.model)
        steps = settings.epochs * steps_per_epoch(len(data.train_labels), settings.batch_size)
        console.comparison(device, reference, difference, steps=steps)
    if sliced is not None:
        sliced_difference = max_abs_difference(distributed.model, sliced.model)
    console.speed(strategy, settings, distributed, reference, sliced)
    summary = report.summary(
        strategy, settings, data, distributed, reference, difference, device,
        sliced=sliced, sliced_difference=sliced_difference,
    )  # fmt: skip
    summary["wall_seconds"] = time.perf_counter() - started
    if strategy.extended.should_checkpoint:  # one writer, however many workers
        console.written(report.write(settings.out, summary), summary["wall_seconds"])
    return summary
