"""A Lightning batch cut into the replicas' slices, and the replicas' outputs put together.

The DataLoader's batch is the global batch. Every tensor leaf is cut at the same rows by
the split rule (slices of ceil(g / R) rows, consecutive, the last ones short or empty), as
``strategy.experimental_distribute_dataset`` cuts it (``centralstore.input.split``), and each
slice is moved to its replica's device (a view, on the host).

The outputs of the replicas that had examples are put together as one device's output on the
whole batch would be, leaf by leaf: a tensor with one row per example is concatenated in
replica order (the batch's order); a floating scalar (a tensor of no dimension, or a float)
is taken to be a mean over the slice, like a loss, and averaged weighted by the slice sizes;
an integer scalar is taken to be a count and summed; a value other than a tensor that every
replica returned equal (``batch_idx``, a name) is returned once; anything else comes back as
the list of the replicas' values.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, eq
from typing import Any

import torch

from .. import _tree
from .._devices import storage_device
from ..input.split import split_leaves
from ..input.strings import Strings


def split(batch: Any, devices: Sequence[str]) -> tuple[list[Any], list[int]]:
    """The slices of ``batch`` for replicas 0 to R - 1 on their devices, and their sizes. One
    replica takes the usual batch as it is (``_whole``).

    >>> slices, sizes = split((torch.arange(5), torch.zeros(5, 2)), ["cpu:0", "cpu:1", "cpu:2"])
    >>> sizes, slices[2][0].tolist()
    ([2, 2, 1], [4])
    """
    replicas = len(devices)
    if replicas == 1:
        rows = _whole(batch, storage_device(devices[0]))
        if rows is not None:
            return [batch], [rows]
    try:
        columns, spec = split_leaves(batch, replicas)
    except (TypeError, ValueError) as error:
        error.add_note(
            "(centralstore.lightning splits every batch of the DataLoader, a global batch, "
            "over the replicas by that rule)"
        )
        raise
    targets = [storage_device(name) for name in devices]
    slices = []
    for r, target in enumerate(targets):
        leaves = [_place(column[r], target) for column in columns]
        slices.append(leaves[0] if spec.is_leaf() else _tree.unflatten(leaves, spec))
    sized = [column for column in columns if _rows(column[0]) is not None]
    sizes = [_rows(sized[0][r]) or 0 for r in range(replicas)] if sized else [0] * replicas
    return slices, sizes


def _whole(batch: Any, device: torch.device) -> int | None:
    """The rows of ``batch`` when one replica on ``device`` takes it as it is: a tensor, or a
    plain tuple, list or dict of tensors (the usual batch), every one already there; the
    first tensor with a dimension gives the rows (0 if none). None for any other batch,
    which takes the split's walk of its tree (about 150 lines a step)."""
    kind = type(batch)
    leaves = batch.values() if kind is dict else batch if kind in (tuple, list) else (batch,)
    if set(map(type, leaves)) != {torch.Tensor}:
        return None
    if not all(map(eq, map(_device_of, leaves), repeat(device))):
        return None
    return next((int(leaf.shape[0]) for leaf in leaves if leaf.dim()), 0)


_device_of = attrgetter("device")


def _place(leaf: Any, device: torch.device) -> Any:
    if isinstance(leaf, Strings):
        return list(leaf)
    if isinstance(leaf, torch.Tensor) and leaf.device != device:
        return leaf.to(device)
    return leaf


def _rows(leaf: Any) -> int | None:
    if isinstance(leaf, torch.Tensor):
        return int(leaf.shape[0]) if leaf.dim() else None
    return len(leaf) if isinstance(leaf, (Strings, list)) else None


def weighted_mean(values: Sequence[Any], sizes: Sequence[int], device: torch.device) -> Any:
    """``sum(v * n) / sum(n)`` over the replicas' values ``v`` and slice sizes ``n``: one
    device's mean over the whole batch when each ``v`` is a mean over its slice.

    >>> float(weighted_mean([torch.tensor(1.0), torch.tensor(4.0)], [2, 1], torch.device("cpu")))
    2.0
    """
    if len(values) == 1:  # one replica's mean is the batch's, exactly (``v * n / n`` may round)
        return _tensor(values[0], device)
    total = sum(sizes)
    tensors = [_tensor(v, device) for v in values]
    combined = tensors[0] * sizes[0]
    for tensor, size in zip(tensors[1:], sizes[1:]):
        combined = combined + tensor * size
    return combined / total


def total(values: Sequence[Any], device: torch.device) -> Any:
    """The sum of the replicas' values, in replica order."""
    tensors = [_tensor(v, device) for v in values]
    combined = tensors[0]
    for tensor in tensors[1:]:
        combined = combined + tensor
    return combined


def _tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    return torch.tensor(value, device=device, dtype=torch.get_default_dtype())


def detached(output: Any) -> Any:
    """``output`` with every tensor detached (what leaves a replica)."""
    if isinstance(output, torch.Tensor):  # the usual loss, without a walk of its tree
        return output.detach()
    return _tree.map_leaves(
        lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, output
    )


def combine(outputs: Sequence[Any], sizes: Sequence[int], device: torch.device) -> Any:
    """The outputs of the replicas that had examples (``sizes`` their slice sizes) as one
    output for the whole batch (module docstring).

    >>> rows = combine([torch.ones(2, 3), torch.zeros(1, 3)], [2, 1], torch.device("cpu"))
    >>> tuple(rows.shape)
    (3, 3)
    >>> combine([{"n": "a", "k": 2}, {"n": "a", "k": 1}], [2, 1], torch.device("cpu"))
    {'n': 'a', 'k': 3}
    """
    if not outputs or all(output is None for output in outputs):
        return None
    if any(output is None for output in outputs):
        raise ValueError(
            "Some replicas' steps returned None and others did not. Under "
            "centralstore.lightning every replica runs the step on its slice of the batch, so "
            "a step must return None on every slice or on none."
        )
    flat = [_tree.flatten(output) for output in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ValueError(
            "The replicas' steps returned outputs of different structures, which cannot be "
            f"put together: {[s for _, s in flat]}"
        )
    leaves = [
        _combine_leaf([f[0][k] for f in flat], sizes, device) for k in range(len(flat[0][0]))
    ]
    return _tree.unflatten(leaves, spec)


def _combine_leaf(values: list[Any], sizes: Sequence[int], device: torch.device) -> Any:
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            if all(v.is_floating_point() or v.is_complex() for v in values):
                return weighted_mean(values, sizes, device)
            return total(values, device)
        if all(v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, sizes)):
            return torch.cat([v.to(device) for v in values])
        return list(values)
    first = values[0]
    if all(_same(first, v) for v in values[1:]):
        return first
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return float(weighted_mean(values, sizes, device))
    return list(values)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False
