"""A Trainer batch cut into the replicas' slices, and how much of the loss each slice carries.

The Trainer's collators make each step one global batch: a mapping (a ``dict`` or a
``BatchEncoding``) of tensors whose first dimension is the batch. Every such tensor is cut at
the same rows by the split rule (slices of ceil(g / R) rows, the last ones short or empty), as
``experimental_distribute_dataset`` cuts a batch; anything else (a flag, a scalar) reaches
every replica whole.

A replica's loss is weighted so that the replicas' losses, and so their gradients, add up to
the loss one device computes on the whole batch (``Shares``):

* A loss that divides by ``num_items_in_batch`` (Hugging Face's token-level losses) is handed
  the global count, as one device is; its replicas' losses add up as they are (weight 1).
* A mean loss that ignores ``num_items_in_batch`` (``BertForSequenceClassification``'s
  ``CrossEntropyLoss``) is weighted by the slice's share of the items the Trainer counts
  (labels other than -100), which is the mean's own divisor.
* Without ``num_items_in_batch`` (no labels, or a model that takes no loss keyword), by the
  slice's share of the examples, n / g.

Which of the first two a loss is shows at run time: the count reaches it as an
``ItemCount``, a tensor that notes whether any torch call used it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..input.split import split_sizes


def rows(batch: Any) -> int:
    """The number of examples in ``batch``: the first dimension of its first tensor.

    >>> rows({"input_ids": torch.zeros(5, 8), "labels": torch.zeros(5)})
    5
    """
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    if isinstance(batch, Mapping) and not batch:
        raise ValueError(
            "The Trainer's batch is empty: it removed every column that the model's forward "
            "does not name (remove_unused_columns=True). A model compiled with "
            "torch.compile(model) hides those names; pass TrainingArguments("
            "torch_compile=True) with the model itself, or remove_unused_columns=False and "
            "label_names=[...]. Received: {}"
        )
    raise ValueError(
        "A Trainer batch under a strategy needs at least one tensor with a batch dimension, "
        f"so that it can be split over the replicas. Received: {_describe(batch)}"
    )


def split(batch: Any, num_replicas: int) -> list[Any]:
    """The slices of ``batch`` for replicas 0 to ``num_replicas - 1``, in order. One
    replica takes the batch as it is, as one device does.

    >>> slices = split({"x": torch.arange(5), "flag": True}, 3)
    >>> [s["x"].tolist() for s in slices], slices[2]["flag"]
    ([[0, 1], [2, 3], [4]], True)
    """
    size = rows(batch)
    if num_replicas == 1:
        return [batch]
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and int(leaf.shape[0]) != size:
            raise ValueError(
                "Every tensor of a Trainer batch must hold the same number of examples (its "
                "first dimension), so that each replica's slice pairs them up, but one holds "
                f"{size} and another {int(leaf.shape[0])}. Received: {_describe(batch)}"
            )
    slices = []
    start = 0
    for count in split_sizes(size, num_replicas):
        stop = start + count
        slices.append(_map(_rows_of(start, stop), batch))
        start = stop
    return slices


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (a logical CPU device means the CPU)."""
    if device.type == "cpu":
        return batch
    return _map(lambda t: t.to(device, non_blocking=True), batch)


def concat(parts: Sequence[Any], device: torch.device) -> Any:
    """The replicas' outputs (same structure) joined along the batch dimension, in order, on
    ``device``; a 0-d tensor or another leaf is taken from the first part.

    >>> concat([(torch.ones(2, 3),), (torch.zeros(1, 3),)], torch.device("cpu"))[0].shape
    torch.Size([3, 3])
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first.to(device)
        return torch.cat([part.to(device) for part in parts])
    if isinstance(first, Mapping):
        kind: Any = type(first)
        return kind({key: concat([part[key] for part in parts], device) for key in first})
    if isinstance(first, (list, tuple)):
        joined = [concat([part[i] for part in parts], device) for i in range(len(first))]
        return type(first)(joined) if not hasattr(first, "_fields") else type(first)(*joined)
    return first


class ItemCount(torch.Tensor):
    """``num_items_in_batch`` as handed to one replica's loss: the global count, noting in
    ``used`` whether any torch call received it (a loss that divides by it does).

    >>> count = ItemCount.of(torch.tensor(12), torch.device("cpu"))
    >>> count.used, float(torch.tensor(6.0) / count), count.used
    (False, 0.5, True)
    """

    used: bool

    @staticmethod
    def of(count: torch.Tensor, device: torch.device) -> ItemCount:
        """A fresh ``ItemCount`` holding ``count``, on ``device``."""
        held = count.detach().to(device, copy=True).as_subclass(ItemCount)
        held.used = False
        return held

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, ItemCount):
                    item.used = True
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@dataclass(frozen=True)
class Shares:
    """How each replica's loss is weighted (see the module's docstring).

    ``rows``: each slice's examples. ``fallback``: each replica's weight when its loss does
    not use the count it was handed (or is handed none).
    """

    rows: list[int]
    fallback: list[float]

    @staticmethod
    def plan(
        slices: Sequence[Any],
        num_items_in_batch: Any,
        count_items: Callable[[Any], Any],
    ) -> Shares:
        """The shares of ``slices``; ``count_items(slice)`` counts a slice's items as the
        Trainer counts a batch's (a tensor, or None where it counts nothing). One slice, the
        whole batch, weighs 1 whatever it counts."""
        if len(slices) == 1:
            return Shares([rows(slices[0])], [1.0])
        sizes = [rows(s) for s in slices]
        total = sum(sizes)
        fallback = [n / total for n in sizes]
        if isinstance(num_items_in_batch, torch.Tensor):
            counts = [count_items(s) if n else None for s, n in zip(slices, sizes)]
            if all(c is not None or n == 0 for c, n in zip(counts, sizes)):
                items = [0 if c is None else int(c) for c in counts]
                if sum(items) > 0:
                    fallback = [c / sum(items) for c in items]
        return Shares(sizes, fallback)


def _rows_of(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[start:stop] if tensor.dim() > 0 else tensor

    return cut


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return [leaf for value in batch.values() for leaf in _leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [leaf for value in batch for leaf in _leaves(value)]
    return [batch]


def _map(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        kind: Any = type(batch)
        return kind({key: _map(fn, value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        mapped = [_map(fn, value) for value in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else type(batch)(mapped)
    return batch


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, torch.Tensor):
        return f"tensor of shape {tuple(batch.shape)}"
    return type(batch).__name__
