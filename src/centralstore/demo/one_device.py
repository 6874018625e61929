"""The demo's oracle: the same training as a plain PyTorch loop on one device.

Same initial weights, same global batches in the same order, the mean loss over each global
batch, no strategy at all. The distance between its final weights and the replicas' is what
the demo reports: float32 rounding, since R replicas compute the same sums in another order.
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

from .job import Digits, History, Run, Settings, make_model, make_optimizer, train_batches


def reference_device(strategy: cs.Strategy) -> torch.device:
    """Where the one-device comparison runs: the first compute device's memory."""
    name = strategy.compute_devices[0]
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def train_one_device(
    initial: dict[str, torch.Tensor], data: Digits, settings: Settings, device: torch.device
) -> Run:
    """The same training as plain PyTorch on one device: same initial weights, same global
    batches in the same order, the mean loss over each global batch, no strategy at all."""
    model = make_model().to(device)
    model.load_state_dict(initial)
    loader = train_batches(data, settings.batch_size, settings.seed)
    optimizer, schedule = make_optimizer(model, settings.epochs * len(loader))
    history = History()
    seconds = 0.0
    for _ in range(settings.epochs):
        loss_sum, correct, seen = 0.0, 0, 0
        start = time.perf_counter()
        for images, labels in _to(device, loader):
            optimizer.zero_grad()
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            schedule.step()
            loss_sum += loss.item() * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
        seconds += time.perf_counter() - start
        history.loss.append(loss_sum / seen)
        history.accuracy.append(correct / seen)
        with torch.no_grad():
            predictions = model(data.test_images.to(device)).argmax(1).cpu()
        history.test_accuracy.append(float((predictions == data.test_labels).float().mean()))
    return Run(model, history, seconds, settings.epochs * len(data.train_labels))


def _to(device: torch.device, loader: DataLoader[Any]) -> Iterator[tuple[torch.Tensor, ...]]:
    for batch in loader:
        yield tuple(t.to(device) for t in batch)


def max_abs_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' weights, over every tensor."""
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in pairs)
