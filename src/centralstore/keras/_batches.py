"""A Keras batch cut into the replicas' slices, and how much of the loss each slice carries.

Keras' trainer hands each step one global batch, ``(x, y, sample_weight)`` with nested
structures and ``None`` where a part is absent. Every array leaf is cut at the same rows by
the split rule (slices of ceil(g / R) rows; the last ones short or empty), as
``experimental_distribute_dataset`` cuts a batch.

Keras reduces a loss by ``"sum_over_batch_size"``: the mean over the slice. Weighted by the
slice's share of the batch, n / g, the replicas' losses, and so their gradients, add up to
the loss of the whole batch, regularization terms included (each counts n / g per replica,
once in all).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..input.split import split_sizes
from ._backend import load

keras = load()

# Reductions for which weighting each replica's loss by n / g reproduces the batch's loss.
MEAN_REDUCTIONS = frozenset({"sum_over_batch_size", "mean"})
_ARRAYS = (torch.Tensor, np.ndarray)


def _flat(batch: Any) -> list[Any] | None:
    """The leaves of the usual batch, an array or a plain tuple of arrays and ``None``s
    (``(x, y, sample_weight)``), without a walk of Keras' tree (about 60 lines a walk, a few
    walks a step); None for any other structure."""
    if isinstance(batch, _ARRAYS):
        return [batch]
    if type(batch) is tuple and all(leaf is None or isinstance(leaf, _ARRAYS) for leaf in batch):
        return list(batch)
    return None


def rows(batch: Any) -> int:
    """The number of examples in ``batch``: the first dimension of its first array leaf."""
    flat = _flat(batch)
    return _rows(keras.tree.flatten(batch) if flat is None else flat, batch)


def _rows(leaves: list[Any], batch: Any) -> int:
    present = [leaf for leaf in leaves if leaf is not None]
    if not present:
        raise ValueError(
            "A batch for fit, evaluate or predict needs at least one array, but this one "
            f"holds none. Received: {batch!r}"
        )
    return int(present[0].shape[0])


def split(batch: Any, num_replicas: int) -> list[Any]:
    """The slices of ``batch`` for replicas 0 to ``num_replicas - 1``, in order.

    >>> import numpy as np
    >>> slices = split((np.arange(5), None, np.ones(5)), 3)
    >>> [s[0].tolist() for s in slices], slices[2][1]
    ([[0, 1], [2, 3], [4]], None)
    """
    flat = _flat(batch)
    leaves = keras.tree.flatten(batch) if flat is None else flat
    size = _rows(leaves, batch)
    for leaf in leaves:
        if leaf is not None and int(leaf.shape[0]) != size:
            raise ValueError(
                "Every array of a batch must hold the same number of examples (its first "
                f"dimension), so that each replica's slice pairs them up, but one holds "
                f"{size} and another {int(leaf.shape[0])}. Received: shapes "
                f"{[tuple(x.shape) for x in leaves if x is not None]}"
            )
    slices = []
    start = 0
    for count in split_sizes(size, num_replicas):
        stop = start + count
        if flat is None:
            slices.append(keras.tree.map_structure(
                lambda leaf, a=start, b=stop: None if leaf is None else leaf[a:b], batch
            ))
        elif isinstance(batch, tuple):
            slices.append(tuple(None if leaf is None else leaf[start:stop] for leaf in batch))
        else:
            slices.append(batch[start:stop])
        start = stop
    return slices


def check_reductions(model: Any) -> None:
    """Raise ``ValueError`` when a compiled loss of ``model`` does not reduce by the mean
    over the batch, for which the replicas' weighted losses would not add up to it."""
    compiled = getattr(model, "_compile_loss", None)
    for entry in getattr(compiled, "_flat_losses", None) or ():
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                f"Under a strategy, fit weights each replica's loss by its share of the batch, "
                f"which reproduces a loss reduced by the mean over the batch, but the loss "
                f"{entry.name!r} reduces by {reduction!r}. Create the loss with "
                f'reduction="sum_over_batch_size" (the default), or train without a strategy. '
                f"Received: reduction={reduction!r}"
            )
