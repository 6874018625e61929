"""The generators behind ``batch``, ``padded_batch`` and ``unbatch``, and how they stack.

Elements are stacked component by component (leaf by leaf) and the containers kept, unlike
torch's ``default_collate``, which turns tuples into lists. Tensors stack with torch's
collate; strings stack into ``Strings``. ``padded_batch`` first pads every component to
one shape: the largest in the batch along each dimension, or the shape asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from .. import _tree
from .spec import as_shape
from .split import from_numpy
from .strings import Strings, is_text, num_rows, rows, stack


def batched(source: Iterable[Any], batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    for elements in _groups(source, batch_size, drop_remainder):
        yield collate(elements, "Dataset.batch")


def batched_slices(
    leaves: list[Any], spec: _tree.TreeSpec, n: int, batch_size: int, drop_remainder: bool
) -> Iterator[Any]:
    """``from_tensor_slices(...).batch``: whole batches cut from the arrays, as views."""
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        yield _tree.unflatten([leaf[start : start + batch_size] for leaf in leaves], spec)


def padded(
    source: Iterable[Any],
    batch_size: int,
    drop_remainder: bool,
    padded_shapes: Any,
    padding_values: Any,
) -> Iterator[Any]:
    for elements in _groups(source, batch_size, drop_remainder):
        columns, spec = _columns(elements, "Dataset.padded_batch")
        shapes = _per_component(spec, padded_shapes, "padded_shapes")
        values = _per_component(spec, padding_values, "padding_values")
        yield _tree.unflatten(
            [
                _pad_stack(column, shape, value)
                for column, shape, value in zip(columns, shapes, values, strict=True)
            ],
            spec,
        )


def unbatched(source: Iterable[Any]) -> Iterator[Any]:
    for element in source:
        leaves, spec = _tree.flatten(element)
        leaves = [from_numpy(leaf) for leaf in leaves]
        sizes = [num_rows(leaf) for leaf in leaves]
        if len(set(sizes)) != 1 or None in sizes:
            raise ValueError(
                "Dataset.unbatch needs every component of an element to have the same first "
                f"dimension, but got the shapes {[_shape(leaf) for leaf in leaves]}. Received: "
                f"sizes={sizes}"
            )
        for row in zip(*(rows(leaf) for leaf in leaves), strict=True):
            yield _tree.unflatten(list(row), spec)


def collate(elements: list[Any], call: str) -> Any:
    """Stack elements component by component, keeping the container types.

    >>> collate([(torch.tensor(1), "a"), (torch.tensor(2), "b")], "Dataset.batch")
    (tensor([1, 2]), ['a', 'b'])
    """
    columns, spec = _columns(elements, call)
    return _tree.unflatten([_stack(column, call) for column in columns], spec)


def _groups(source: Iterable[Any], size: int, drop_remainder: bool) -> Iterator[list[Any]]:
    iterator = iter(source)
    while elements := list(itertools.islice(iterator, size)):
        if drop_remainder and len(elements) < size:
            return
        yield elements


def _columns(elements: list[Any], call: str) -> tuple[list[list[Any]], _tree.TreeSpec]:
    """The components of ``elements`` as columns (leaf k of every element), and the structure."""
    leaves, spec = _tree.flatten(elements[0])
    columns: list[list[Any]] = [[leaf] for leaf in leaves]
    for element in elements[1:]:
        leaves, other = _tree.flatten(element)
        if other != spec:
            raise ValueError(
                f"{call} needs elements of one structure, but got {spec} and {other}. "
                "Make every element the same structure (e.g. with map) before batching."
            )
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    return columns, spec


def _stack(column: list[Any], call: str) -> Any:
    if is_text(column[0]) or isinstance(column[0], Strings):
        return stack(column, call)
    try:
        return default_collate(column)
    except RuntimeError as error:
        raise ValueError(
            f"{call} cannot stack elements of different shapes ({error}). Make every element "
            "the same shape (e.g. with map), or pad them with padded_batch."
        ) from error


def _per_component(spec: _tree.TreeSpec, value: Any, argument: str) -> list[Any]:
    """``padded_shapes`` or ``padding_values`` as one entry per component.

    None, or a single padding value, applies to every component; otherwise the argument has
    the element's structure, with a shape (a list) or a value where each component is.
    """
    single = value is None or (argument == "padding_values" and _is_scalar(value))
    if single:
        return [value] * spec.num_leaves
    try:
        return list(spec.flatten_up_to(value))
    except (TypeError, ValueError):
        raise ValueError(
            f"Dataset.padded_batch({argument}) must have the structure of the elements, {spec}, "
            f"with one entry per component. Received: {argument}={value!r}"
        ) from None


def _pad_stack(column: list[Any], shape: Any, value: Any) -> Any:
    """The components of one batch padded to one shape, then stacked."""
    first = column[0]
    if is_text(first):
        return stack(column, "Dataset.padded_batch")
    if isinstance(first, Strings):
        return _pad_strings(column, shape, "" if value is None else value)
    tensors = [torch.as_tensor(from_numpy(item)) for item in column]
    ranks = {t.dim() for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(ranks) > 1 or len(dtypes) > 1:
        raise ValueError(
            "Dataset.padded_batch pads components of one rank and dtype, but a component has "
            f"the shapes and dtypes {[(tuple(t.shape), t.dtype) for t in tensors]}."
        )
    size = _padded_size([tuple(t.shape) for t in tensors], shape)
    fill = 0 if value is None else _scalar(value)
    batch = torch.full((len(tensors), *size), fill, dtype=tensors[0].dtype)
    for row, tensor in zip(batch, tensors, strict=True):
        row[tuple(slice(0, d) for d in tensor.shape)] = tensor
    return batch


def _pad_strings(column: list[Any], shape: Any, value: Any) -> Strings:
    if not all(isinstance(item, Strings) and not any(map(_nested, item)) for item in column):
        raise ValueError(
            "Dataset.padded_batch pads string components of one rank: 1-D lists of strings. "
            f"Received: {column!r}"
        )
    (length,) = _padded_size([(len(item),) for item in column], shape)
    return Strings(Strings([*item, *[value] * (length - len(item))]) for item in column)


def _padded_size(shapes: list[tuple[int, ...]], padded_shape: Any) -> tuple[int, ...]:
    """Each dimension's size in the batch: the largest, or the size of ``padded_shape``."""
    largest = tuple(max(sizes) for sizes in zip(*shapes, strict=True))
    if padded_shape is None:
        return largest
    target = as_shape("Dataset.padded_batch", "padded_shapes", padded_shape)
    if len(target) != len(largest) or any(
        want is not None and want < have for want, have in zip(target, largest, strict=True)
    ):
        raise ValueError(
            f"Dataset.padded_batch cannot pad components of shape {list(largest)} (the largest "
            f"in the batch) to {list(target)}: padded_shapes needs the component's rank and at "
            "least its size in each dimension (None or -1 for the batch's largest). "
            f"Received: padded_shapes={padded_shape!r}"
        )
    return tuple(
        have if want is None else want for want, have in zip(target, largest, strict=True)
    )


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return is_text(value) or isinstance(value, (bool, int, float, complex))


def _scalar(value: Any) -> Any:
    if not _is_scalar(value) or is_text(value):
        raise ValueError(
            "Dataset.padded_batch(padding_values) must give a number (or a 0-d tensor) for "
            f"each tensor component. Received: padding_values={value!r}"
        )
    return value.item() if isinstance(value, torch.Tensor) else value


def _nested(item: Any) -> bool:
    return isinstance(item, Strings)


def _shape(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return list(leaf.shape)
    return [len(leaf)] if isinstance(leaf, Strings) else type(leaf).__name__
