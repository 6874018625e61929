"""The loss helpers TensorFlow users rely on: scale by the *global* batch."""

from __future__ import annotations

from typing import Any

import torch

from .strategies import context


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """The sum of ``per_example_loss * sample_weight`` divided by ``global_batch_size``.

    Summed over replicas (which is what folding their gradients does), this is the mean
    over the global batch, so R replicas train exactly like one device. Pass
    ``global_batch_size``: without it, in a replica, the divisor is the local batch size
    times R (TensorFlow's rule), which is wrong when the global batch does not split evenly.
    A scalar ``per_example_loss`` raises ``ValueError``, as in TensorFlow: it is almost always
    a loss already averaged over the batch (a loss module without ``reduction="none"``).

    >>> import centralstore as cs
    >>> cs.compute_average_loss(torch.tensor([1., 2., 3.]), global_batch_size=6)
    tensor(1.)
    """
    loss = (  # (``as_tensor`` of a tensor returns it, after parsing its arguments)
        per_example_loss if isinstance(per_example_loss, torch.Tensor)
        else torch.as_tensor(per_example_loss)
    )
    if loss.dim() == 0:
        raise ValueError(
            "compute_average_loss(per_example_loss=...) needs one loss per example (a tensor "
            "of rank 1 or more), but got a scalar: the loss was probably averaged over the "
            'batch already. Create the loss with reduction="none" (e.g. '
            'torch.nn.CrossEntropyLoss(reduction="none")) and pass the per-example losses. '

            f"Received: per_example_loss={per_example_loss!r}"
        )
    if sample_weight is not None:
        weight = torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
        if weight.dim() == 1 and loss.dim() > 1:
            weight = weight.reshape(-1, *([1] * (loss.dim() - 1)))
        loss = loss * weight
    if global_batch_size is None:
        replica = context.get_replica_context()
        if replica is None:
            raise RuntimeError(
                "compute_average_loss was called in cross-replica context without "
                "global_batch_size, so the number of replicas sharing the batch is unknown. "
                "Pass global_batch_size=..."
            )
        global_batch_size = loss.shape[0] * replica.num_replicas_in_sync
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool):
        raise TypeError(
            f"global_batch_size must be an int. Received: global_batch_size={global_batch_size!r}"
        )
    total = loss.sum()
    if global_batch_size == 0:
        return total * 0.0
    return total / global_batch_size


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """Sum a regularization loss and divide it by R, so that folding the replicas' gradients
    counts it once. Call it in the replica (inside ``run``).

    >>> import centralstore as cs
    >>> cs.scale_regularization_loss(torch.tensor([1.0, 3.0]))
    tensor(4.)
    """
    if context.has_strategy() and context.in_cross_replica_context():
        raise RuntimeError(
            "scale_regularization_loss was called in cross-replica context; call it inside the "
            "function given to strategy.run, where the number of replicas sharing it is known."
        )
    replicas = context.get_strategy().num_replicas_in_sync
    return torch.as_tensor(regularization_loss).sum() / replicas


def weighted(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """``loss * weight``, or ``loss`` itself when ``weight`` is 1: the same values and
    gradients, without a multiplication and its backward node (the trainers' integrations
    weight each replica's loss by its share of the batch, which is 1 for one replica).

    >>> loss = torch.tensor(3.0)
    >>> weighted(loss, 1.0) is loss, float(weighted(loss, 0.5))
    (True, 1.5)
    """
    return loss if weight == 1.0 else loss * weight
