"""``ReduceOp`` and the arithmetic of reduce and gather over replicas.

The rules are TensorFlow's, measured: SUM adds components in replica order; MEAN divides by
the number of replicas, or, with an ``axis``, by the total number of elements along it over
all replicas (the true global mean). Pure functions of the components; devices are the
caller's business except for the final placement.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

Axis = int | Sequence[int] | None


class ReduceOp(enum.Enum):
    """How values from several replicas combine: ``SUM`` or ``MEAN``.

    The names are accepted in any case wherever a ``ReduceOp`` is expected.

    >>> ReduceOp.parse("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """``op`` as a ``ReduceOp``; anything else raises ``ValueError``."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(
            f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN (or the strings 'SUM', 'MEAN' in "
            f"any case). Received: reduce_op={op!r}"
        )


def as_tensor(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """``value`` as a tensor: tensors pass (moved to ``device`` when given), numbers and numpy
    arrays are converted."""
    if isinstance(value, torch.Tensor):
        return value if device is None or value.device == device else value.to(device)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value).to(device)
    return torch.as_tensor(value, device=device)


_CPU = torch.device("cpu")


def result_device() -> torch.device:
    """Where reductions land: the CPU, or the device of an active ``torch.device`` context."""
    # A torch.device context (or set_default_device) is a mode on the torch-function stack;
    # with none, skip get_default_device, which walks the stack (a few microseconds).
    if not torch._C._len_torch_function_stack():
        return _CPU
    return torch.get_default_device()


def _axes(axis: Axis, component: torch.Tensor, replica: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)  # type: ignore[arg-type]
    ndim = component.dim()
    for a in axes:
        if not -ndim <= a < max(ndim, 0) or ndim == 0:
            raise ValueError(
                f"axis {axis} is out of range for the component of replica {replica} with shape "
                f"{tuple(component.shape)}; every component must have that axis."
            )
    dims = tuple(a % ndim for a in axes)
    if len(set(dims)) != len(dims):
        raise ValueError(
            f"axis {axis} names the same dimension twice for the component of replica "
            f"{replica} with shape {tuple(component.shape)}; name each axis once."
        )
    return dims


def _add_in_order(parts: Sequence[torch.Tensor], op: ReduceOp, axis: Axis) -> torch.Tensor:
    shape = parts[0].shape
    for replica, part in enumerate(parts):
        if part.shape != shape:
            what = f"reduce({op.name})" if axis is None else f"reduce({op.name}, axis={axis})"
            raise ValueError(
                f"{what} requires every replica's value to have the same shape, but replica 0 "
                f"has {tuple(shape)} and replica {replica} has {tuple(part.shape)}."
            )
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _mean_dtype(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor
    return tensor.to(torch.get_default_dtype())


def reduce_components(
    op: ReduceOp, components: Sequence[Any], axis: Axis, device: torch.device
) -> torch.Tensor:
    """Reduce the per-replica ``components`` to one tensor on ``device``.

    >>> reduce_components(ReduceOp.MEAN, [torch.tensor([0., 1, 2, 3]), torch.tensor([4., 5])],
    ...                   0, torch.device("cpu"))
    tensor(2.5000)
    """
    parts = [as_tensor(c, device) for c in components]
    if axis is None:
        total = _add_in_order(parts, op, None)
        if op is ReduceOp.MEAN:
            return _mean_dtype(total) / len(parts)
        return total
    sums, count = [], 0
    for replica, part in enumerate(parts):
        axes = _axes(axis, part, replica)
        sums.append(part.sum(dim=axes) if axes else part)  # torch sums all dims for dim=()
        count += int(np.prod([part.shape[a] for a in axes]))
    total = _add_in_order(sums, op, axis)
    if op is ReduceOp.MEAN:
        return _mean_dtype(total) / count
    return total


def reduce_plain(op: ReduceOp, value: Any, num_replicas: int, axis: Axis) -> Any:
    """Reduce a value that is not distributed: it counts as present on every replica."""
    if axis is None:
        if op is ReduceOp.MEAN or num_replicas == 1:
            return value
        raise ValueError(
            "reduce(SUM) of a value that is not a PerReplica is ambiguous with "
            f"{num_replicas} replicas (is it one value, or {num_replicas} copies?). Pass the "
            f"PerReplica that strategy.run returned, or use MEAN. Received: value={value!r}"
        )
    return reduce_components(op, [value] * num_replicas, axis, result_device())


def gather_components(components: Sequence[Any], axis: int, device: torch.device) -> torch.Tensor:
    """Concatenate the per-replica ``components`` along ``axis`` on ``device``."""
    parts = [as_tensor(c, device) for c in components]
    ref = parts[0]
    for replica, part in enumerate(parts):
        if part.dim() == 0:
            raise ValueError(
                f"gather needs components with at least one dimension, but replica {replica} "
                "gave a scalar. Reshape it to [1] first."
            )
        if part.dim() != ref.dim():
            raise ValueError(
                f"gather requires components of equal rank, but replica 0 has shape "
                f"{tuple(ref.shape)} and replica {replica} has shape {tuple(part.shape)}."
            )
    if not -ref.dim() <= axis < ref.dim():
        raise ValueError(f"axis {axis} is out of range for components of rank {ref.dim()}.")
    dim = axis % ref.dim()
    for replica, part in enumerate(parts):
        if [s for i, s in enumerate(part.shape) if i != dim] != [
            s for i, s in enumerate(ref.shape) if i != dim
        ]:
            raise ValueError(
                f"gather along axis {axis} requires equal sizes on the other axes, but replica "
                f"0 has shape {tuple(ref.shape)} and replica {replica} has shape "
                f"{tuple(part.shape)}."
            )
    return torch.cat(parts, dim=dim)
