"""The demo's oracle: the same training as a plain PyTorch loop on one device.

Same initial weights, same global batches in the same order, the mean loss over each global
batch, no strategy at all. The distance between its final weights and the replicas' is what
the demo reports: float32 rounding, since R replicas compute the same sums in another order.

Run once more with ``slices=R``, the same loop cuts each global batch into the replicas'
slices (the split rule) and makes one forward and backward pass per slice before its one
optimizer step: the replicas' work without centralstore, so that the report can tell what
the smaller per-replica batches cost from what centralstore itself costs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import centralstore as cs
from centralstore.input.split import split_sizes

from .job import (
    Digits,
    History,
    Run,
    Settings,
    Training,
    make_model,
    make_optimizer,
    timed,
    train_batches,
)


def reference_device(strategy: cs.Strategy) -> torch.device:
    """Where the one-device comparison runs: the first compute device's memory."""
    name = strategy.compute_devices[0]
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def one_device_training(
    initial: dict[str, torch.Tensor],
    data: Digits,
    settings: Settings,
    device: torch.device,
    slices: int = 1,
) -> Training:
    """The same training as plain PyTorch on one device, a step at a time
    (``job.interleaved``; ``job.finish`` runs it whole): same initial weights, same global
    batches in the same order, the mean loss over each global batch, no strategy at all.
    Each step is timed on its own (fetching its batch included), so that an epoch's time
    leaves out whatever runs between two steps.

    With ``slices`` > 1, each global batch is cut into that many consecutive slices by the
    split rule (32 + 32 for 64 over two), each slice makes its own forward pass and its own
    backward pass of its summed loss over the global batch size (autograd adds the slices'
    gradients in ``.grad``), then the optimizer steps once: what R replicas compute, one after
    the other, without centralstore.
    """
    model = make_model().to(device)
    model.load_state_dict(initial)
    loader = train_batches(data, settings.batch_size, settings.seed)
    optimizer, schedule = make_optimizer(model, settings.epochs * len(loader))
    history = History()
    epoch_seconds: list[float] = []
    for _ in range(settings.epochs):
        loss_sum, correct, seen, seconds = 0.0, 0, 0, 0.0
        for (images, labels), start in timed(_to(device, loader)):
            optimizer.zero_grad()
            if slices == 1:
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
                loss.backward()  # type: ignore[no-untyped-call]
                batch_loss, batch_correct = loss.item(), int((logits.argmax(1) == labels).sum())
            else:
                batch_loss, batch_correct = _slice_passes(model, images, labels, slices)
            optimizer.step()
            schedule.step()
            loss_sum += batch_loss * len(labels)
            correct += batch_correct
            seen += len(labels)
            seconds += time.perf_counter() - start
            yield None
        epoch_seconds.append(seconds)
        history.loss.append(loss_sum / seen)
        history.accuracy.append(correct / seen)
        with torch.no_grad():
            predictions = model(data.test_images.to(device)).argmax(1).cpu()
        history.test_accuracy.append(float((predictions == data.test_labels).float().mean()))
    samples = settings.epochs * len(data.train_labels)
    yield Run(model, history, sum(epoch_seconds), samples, epoch_seconds=epoch_seconds)


def _slice_passes(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, slices: int
) -> tuple[float, int]:
    """One forward and backward pass per slice of a global batch (an empty slice makes none);
    the batch's mean loss and its number of right answers."""
    loss_sum, correct, start = 0.0, 0, 0
    for size in split_sizes(len(labels), slices):
        if size == 0:
            continue
        x, y = images[start : start + size], labels[start : start + size]
        start += size
        logits = model(x)
        loss = F.cross_entropy(logits, y, reduction="sum") / len(labels)
        loss.backward()  # type: ignore[no-untyped-call]
        loss_sum += loss.item()
        correct += int((logits.argmax(1) == y).sum())
    return loss_sum, correct


def _to(device: torch.device, loader: DataLoader[Any]) -> Iterator[tuple[torch.Tensor, ...]]:
    for batch in loader:
        yield tuple(t.to(device) for t in batch)


def max_abs_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' weights, over every tensor."""
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in pairs)
