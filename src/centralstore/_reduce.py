"""``ReduceOp`` and the arithmetic of reduce and gather over replicas.

The rules are TensorFlow's, measured: SUM adds components in replica order; MEAN divides by
the number of replicas, or, with an ``axis``, by the total number of elements along it over
all replicas (the true global mean). Pure functions of the components; devices are the
caller's business except for the final placement.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

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
        parsed = _BY_NAME.get(op.upper()) if isinstance(op, str) else None
        if parsed is not None:
            return parsed
        raise ValueError(
            f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN (or the strings 'SUM', 'MEAN' in "
            f"any case). Received: reduce_op={op!r}"
        )


# the members by name, read without ``EnumMeta``'s Python-level ``__members__`` and ``[]``
_BY_NAME = {op.value: op for op in ReduceOp}

# -- arguments ---------------------------------------------------------------------------------


def _is_index(value: object) -> TypeGuard[int | np.integer[Any]]:
    # bool is an int to Python, but axis=True is a mistake, not dimension 1
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def reduce_axes(axis: object, call: str = "strategy.reduce") -> tuple[int, ...] | None:
    """``axis`` of ``call`` as a tuple of ints (``None`` stays ``None``); anything but None, an
    int or a list or tuple of ints raises ``TypeError``.

    >>> reduce_axes(None), reduce_axes(0), reduce_axes([-1, 0]), reduce_axes(())
    (None, (0,), (-1, 0), ())
    """
    if axis is None:
        return None
    if _is_index(axis):
        return (int(axis),)
    if isinstance(axis, (tuple, list)):
        axes = [int(a) for a in axis if _is_index(a)]
        if len(axes) == len(axis):
            return tuple(axes)
    raise TypeError(
        f"{call}(axis=...) must be None, an int or a tuple of ints naming the dimensions to "
        "reduce over (negative ones count from the end), e.g. axis=0 or axis=(0, 1). "
        f"Received: axis={axis!r}"
    )


def gather_axis(axis: object, call: str = "strategy.gather") -> int:
    """``axis`` of ``call`` as an int; anything else raises ``TypeError``.

    >>> gather_axis(-1)
    -1
    """
    if _is_index(axis):
        return int(axis)
    raise TypeError(
        f"{call}(axis=...) must be an int naming the dimension to concatenate along (negative "
        f"ones count from the end), e.g. axis=0. Received: axis={axis!r}"
    )


def as_tensor(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """``value`` as a tensor: tensors pass (moved to ``device`` when given), numbers and numpy
    arrays are converted; anything else raises ``TypeError``."""
    if isinstance(value, torch.Tensor):
        return value if device is None or value.device == device else value.to(device)
    try:
        if isinstance(value, np.ndarray):
            tensor = torch.from_numpy(value)
        else:
            tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            "reduce, gather, all_reduce and all_gather combine tensors, numpy arrays and "
            f"numbers, but got a {type(value).__name__}, which has no numeric tensor form. "
            f"Keep it out of the value, or convert it first. Received: {value!r}"
        ) from error
    return tensor if device is None else tensor.to(device)


def _tensors(components: Sequence[Any], device: torch.device, call: str) -> list[torch.Tensor]:
    parts = []
    for replica, component in enumerate(components):
        try:
            parts.append(as_tensor(component, device))
        except TypeError as error:
            raise TypeError(
                f"{call} takes tensors, numpy arrays or numbers, but the value of replica "
                f"{replica} is a {type(component).__name__}. Return numeric values from the "
                f"replicas, or read the others with experimental_local_results. "
                f"Received: {component!r}"
            ) from error.__cause__
    return parts


# -- the arithmetic ----------------------------------------------------------------------------


def mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a MEAN of values of ``dtype``: floating and complex dtypes are kept;
    integers and bools give torch's default float dtype (TensorFlow's integer MEAN truncates).

    >>> for dtype in (torch.float16, torch.float64, torch.complex64, torch.int64, torch.uint8,
    ...               torch.bool):
    ...     print(dtype, "->", mean_dtype(dtype))
    torch.float16 -> torch.float16
    torch.float64 -> torch.float64
    torch.complex64 -> torch.complex64
    torch.int64 -> torch.float32
    torch.uint8 -> torch.float32
    torch.bool -> torch.float32
    """
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.get_default_dtype()


def element_count(components: Sequence[Any], axis: Axis) -> int:
    """MEAN's divisor: the number of components (replicas) for ``axis=None``, else the number
    of elements along ``axis`` summed over the components. Components are anything with a
    shape (tensors, numpy arrays) or numbers; ``axis`` must be valid for each.

    >>> a, b = np.zeros((2, 3)), np.zeros((1, 3))
    >>> [element_count([a, b], axis) for axis in (None, 0, -1, (0, 1), ())]
    [2, 3, 6, 9, 2]
    >>> element_count([np.zeros(0), np.zeros(0)], 0)  # MEAN of two empty components is nan
    0
    """
    axes = reduce_axes(axis)
    if axes is None:
        return len(components)
    return sum(math.prod(np.shape(c)[a] for a in axes) for c in components)


def mean_of(total: torch.Tensor, count: float) -> torch.Tensor:
    """``total / count`` in ``mean_dtype`` (a count of 0 gives nan, as TensorFlow).

    >>> mean_of(torch.tensor([3, 4]), 2)
    tensor([1.5000, 2.0000])
    """
    dtype = mean_dtype(total.dtype)
    return (total if total.dtype is dtype else total.to(dtype)) / count


_CPU = torch.device("cpu")


def result_device() -> torch.device:
    """Where reductions land: the CPU, or the device of an active ``torch.device`` context."""
    # A torch.device context (or set_default_device) is a mode on the torch-function stack;
    # with none, skip get_default_device, which walks the stack (a few microseconds).
    if not torch._C._len_torch_function_stack():
        return _CPU
    return torch.get_default_device()


def _dims(
    axes: tuple[int, ...], axis: Axis, component: torch.Tensor, replica: int
) -> tuple[int, ...]:
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


def _same_dtype(parts: Sequence[torch.Tensor], what: str) -> None:
    dtype = parts[0].dtype
    if any(part.dtype != dtype for part in parts):
        listing = ", ".join(f"replica {r}: {part.dtype}" for r, part in enumerate(parts))
        raise ValueError(
            f"{what} requires every replica's value to have the same dtype, but they differ "
            f"({listing}). Cast them to one dtype in the replicas, e.g. x.float(); Python ints "
            f"become torch.int64 and floats {torch.get_default_dtype()}."
        )


def _add_in_order(parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    shape = parts[0].shape
    for replica, part in enumerate(parts):
        if part.shape != shape:
            raise ValueError(
                f"{what} requires every replica's value to have the same shape, but replica 0 "
                f"has {tuple(shape)} and replica {replica} has {tuple(part.shape)}."
            )
    return _sum_in_order(parts)


def _sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...``, left to right: the additions every path of ``reduce``
    makes, so that each gives the same bits and the same autograd graph."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def added_alike(components: Sequence[Any], device: torch.device) -> torch.Tensor | None:
    """``reduce``'s sum with ``axis=None`` in its usual case, without the general path's
    conversions and checks: plain tensors on ``device``, of one shape and one dtype other
    than bool, added in replica order (``_sum_in_order``, the general path's additions:
    the same bits and graph). None when one is anything else: the general path converts it,
    or names what differs. (Right after the replicas' forwards a ``reduce`` took 22 to 37
    us here through the general path, 15 to 23 through this one.)

    >>> added_alike([torch.tensor([1., 2]), torch.tensor([3., 4])], torch.device("cpu"))
    tensor([4., 6.])
    >>> added_alike([torch.tensor(1.), torch.tensor(2)], torch.device("cpu")) is None
    True
    """
    first = components[0]
    if type(first) is not torch.Tensor or first.dtype is torch.bool or first.device != device:
        return None
    dtype, shape = first.dtype, first.shape
    for part in components[1:]:
        if (
            type(part) is not torch.Tensor or part.dtype is not dtype or part.shape != shape
            or part.device != device
        ):
            return None
    return _sum_in_order(components)


def reduce_components(
    op: ReduceOp, components: Sequence[Any], axis: Axis, device: torch.device
) -> torch.Tensor:
    """Reduce the per-replica ``components`` to one tensor on ``device``.

    The components must share one dtype: a silent promotion (int64 and float32 giving
    float32) would hide a replica that computed something else, and TensorFlow rejects it
    too. Bools add as integers (as ``torch.sum``), so SUM counts and MEAN gives a fraction.

    >>> reduce_components(ReduceOp.MEAN, [torch.tensor([0., 1, 2, 3]), torch.tensor([4., 5])],
    ...                   0, torch.device("cpu"))
    tensor(2.5000)
    """
    axes = reduce_axes(axis)
    what = f"reduce({op.name})" if axes is None else f"reduce({op.name}, axis={axis})"
    parts = _tensors(components, device, "strategy.reduce")
    _same_dtype(parts, what)
    if parts[0].dtype == torch.bool:  # bool + bool is a logical or in torch
        parts = [part.long() for part in parts]
    if axes is None:
        total = _add_in_order(parts, what)
    else:
        sums = []
        for replica, part in enumerate(parts):
            dims = _dims(axes, axis, part, replica)
            sums.append(part.sum(dim=dims) if dims else part)  # torch sums all dims for dim=()
        total = _add_in_order(sums, what)
    if op is ReduceOp.MEAN:
        return mean_of(total, element_count(parts, axes))
    return total


def reduce_plain(op: ReduceOp, value: Any, num_replicas: int, axis: Axis) -> Any:
    """Reduce a value that is not distributed: it counts as present on every replica."""
    axes = reduce_axes(axis)
    if axes is None:
        if op is ReduceOp.MEAN or num_replicas == 1:
            return value
        raise ValueError(
            "reduce(SUM) of a value that is not a PerReplica is ambiguous with "
            f"{num_replicas} replicas (is it one value, or {num_replicas} copies?). Pass the "
            f"PerReplica that strategy.run returned, or use MEAN. Received: value={value!r}"
        )
    device = result_device()
    try:
        tensor = as_tensor(value, device)
    except TypeError as error:
        raise TypeError(
            f"strategy.reduce takes tensors, numpy arrays or numbers, but got a "
            f"{type(value).__name__}. Received: value={value!r}"
        ) from error.__cause__
    return reduce_components(op, [tensor] * num_replicas, axis, device)


def concatenated_alike(
    components: Sequence[Any], axis: int, device: torch.device
) -> torch.Tensor | None:
    """``gather``'s concatenation in its usual case, without the general path's conversions
    and checks: plain tensors on ``device``, of one rank with ``axis`` in range, that
    ``torch.cat`` joins (the general path's call). None when one is anything else, or when
    ``torch.cat`` refuses them: the general path converts it, or names what differs.

    >>> concatenated_alike([torch.ones(1, 2), torch.zeros(2, 2)], 0, torch.device("cpu")).shape
    torch.Size([3, 2])
    >>> concatenated_alike([torch.ones(1, 2), torch.zeros(1, 3)], 0, torch.device("cpu")) is None
    True
    """
    first = components[0]
    if type(first) is not torch.Tensor or first.device != device:
        return None
    rank = first.dim()
    if not -rank <= axis < rank:  # (a scalar has no axis)
        return None
    for part in components[1:]:
        if type(part) is not torch.Tensor or part.dim() != rank or part.device != device:
            return None
    try:
        return torch.cat(components, dim=axis)  # type: ignore[arg-type]
    except RuntimeError:  # (other sizes on another axis)
        return None


def gather_components(components: Sequence[Any], axis: int, device: torch.device) -> torch.Tensor:
    """Concatenate the per-replica ``components`` along ``axis`` on ``device``."""
    axis = gather_axis(axis)
    parts = _tensors(components, device, "strategy.gather")
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
