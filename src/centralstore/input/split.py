"""How input becomes per-replica slices: the split rule and the deal rule (docs/design.md 3.7).

TensorFlow's rule, measured: a global batch of actual size ``g`` over ``R`` replicas is cut
into consecutive slices of ``c = ceil(g / R)`` rows; replica ``i`` gets rows
``[min(i*c, g), min((i+1)*c, g))``. Slices may be short or empty. Every leaf of a nested
batch is cut by this rule applied to *its own* first dimension ``g``, as in TensorFlow
(measured: ``zip(range(8).batch(4), range(8).batch(2))`` over 2 replicas gives ``([0, 1],
[0])`` and ``([2, 3], [1])``); leaves that share their first dimension are therefore cut at
the same rows. These are pure functions (no devices, no threads) so that the rule is
tested on literal tables; every tensor slice is a view (``split_with_sizes``), never a copy,
and a batch of strings (``Strings``) is cut into lists.

Several processes can share one global batch: each keeps only its contiguous range of
replicas ``[replica_offset, replica_offset + local_replicas)`` of the ``num_replicas`` in sync.

The deal rule (``distribute_datasets_from_function``) hands whole elements out round-robin
instead, padding the last incomplete step with empty batches.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .. import _tree
from .strings import Strings, num_rows

Columns = list[list[Any]]  # columns[k][i]: leaf k of local replica i


def split_sizes(size: int, num_replicas: int) -> list[int]:
    """How many rows each replica gets from a global batch of ``size`` rows.

    The one place of the rule's arithmetic: slices of ``c = ceil(size / num_replicas)`` rows,
    replica ``i`` taking rows ``[min(i*c, size), min((i+1)*c, size))``.

    >>> split_sizes(6, 2), split_sizes(5, 3), split_sizes(4, 3), split_sizes(1, 2)
    ([3, 3], [2, 2, 1], [2, 2, 0], [1, 0])
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1. Received: num_replicas={num_replicas}")
    per_replica = -(-size // num_replicas)
    return [min(per_replica, max(size - i * per_replica, 0)) for i in range(num_replicas)]


def from_numpy(leaf: Any) -> Any:
    """``leaf`` as a tensor when it is a numpy array (sharing its memory), else unchanged.

    ``torch.from_numpy`` shares memory; only arrays it cannot wrap (negative strides) are
    copied once into a contiguous array first.

    >>> a = np.arange(3)
    >>> t = from_numpy(a)
    >>> t[0] = 7
    >>> int(a[0])
    7
    """
    if not isinstance(leaf, np.ndarray):
        return leaf
    if any(stride < 0 for stride in leaf.strides):
        leaf = np.ascontiguousarray(leaf)
    return torch.from_numpy(leaf)


def split_leaves(
    batch: Any,
    num_replicas: int,
    *,
    replica_offset: int = 0,
    local_replicas: int | None = None,
) -> tuple[Columns, _tree.TreeSpec]:
    """Every leaf of ``batch`` cut into the slices of the local replicas, and the structure.

    ``columns[k][i]`` is leaf ``k`` of local replica ``i`` (global replica
    ``replica_offset + i``). This column layout is what the distributed iterator needs: each
    column becomes one ``PerReplica`` leaf. With ``num_replicas == 1`` the leaves are returned
    whole (numpy arrays become tensors), scalars included; with more, a scalar leaf raises
    ``ValueError``.

    Each leaf is cut by ``split_sizes`` of its own first dimension, as TensorFlow does: leaves
    of one size are cut at the same rows, and leaves of different sizes each on their own
    (leaves of 5 and 2 rows over 3 replicas give 2/2/1 and 1/1/0 rows).

    >>> columns, spec = split_leaves((torch.arange(5), torch.zeros(5, 2)), 2)
    >>> [[tuple(s.shape) for s in column] for column in columns]
    [[(3,), (2,)], [(3, 2), (2, 2)]]
    >>> columns, spec = split_leaves((torch.arange(5), torch.arange(2)), 3)
    >>> [[s.tolist() for s in column] for column in columns]
    [[[0, 1], [2, 3], [4]], [[0], [1], []]]
    """
    if local_replicas is None:
        local_replicas = num_replicas - replica_offset
    _check_counts(num_replicas, replica_offset, local_replicas)
    leaves, spec = _tree.flatten(batch, is_leaf=_is_string_batch)
    leaves = [Strings(leaf) if _is_string_batch(leaf) else from_numpy(leaf) for leaf in leaves]
    if num_replicas == 1:
        return [[leaf] for leaf in leaves], spec
    first, stop = replica_offset, replica_offset + local_replicas
    whole = local_replicas == num_replicas
    by_size: dict[int, list[int]] = {}  # most leaves share one first dimension
    columns = []
    for leaf in leaves:
        size = _rows(leaf, num_replicas)
        sizes = by_size.get(size)
        if sizes is None:
            sizes = by_size[size] = split_sizes(size, num_replicas)
        columns.append(_split_leaf(leaf, sizes, first, stop, whole))
    return columns, spec


def _is_string_batch(node: Any) -> bool:
    """A plain list or tuple of strings (``default_collate``'s batch of strings) is one leaf:
    a scalar string could not be split anyway."""
    return (
        type(node) in (list, tuple)
        and bool(node)
        and all(isinstance(s, (str, bytes)) for s in node)
    )


def split_steps(
    batches: Iterable[Any], num_replicas: int, replica_offset: int, local_replicas: int
) -> Iterator[tuple[Columns, _tree.TreeSpec]]:
    """``split_leaves`` of every global batch: one step per batch, none dropped."""
    for batch in batches:
        yield split_leaves(
            batch, num_replicas, replica_offset=replica_offset, local_replicas=local_replicas
        )


def deal_steps(
    elements: Iterable[Any], num_replicas: int
) -> Iterator[tuple[Columns, _tree.TreeSpec]]:
    """Element ``j`` whole to replica ``j mod num_replicas``; steps in ``split_leaves``' layout.

    The last, incomplete step is padded with empty batches (0 rows, the trailing shape and
    dtype of the last element, as views). Scalar elements cannot be padded, so that step is
    dropped with a ``UserWarning`` counting the dropped elements.

    >>> steps = deal_steps([torch.ones(2, 3)] * 3, 2)
    >>> [[tuple(s.shape) for s in columns[0]] for columns, _ in steps]
    [[(2, 3), (2, 3)], [(2, 3), (0, 3)]]
    """
    step: list[Any] = []
    for element in elements:
        step.append(element)
        if len(step) == num_replicas:
            yield _columns(step)
            step = []
    if step:
        padding = _empty_like(step[-1])
        if padding is None:
            warnings.warn(
                f"Dropped the last {len(step)} element(s) of the dataset: they fill only "
                f"{len(step)} of {num_replicas} replicas, and scalar elements cannot be padded "
                "with empty batches. Batch the elements in dataset_fn to keep them.",
                UserWarning,
                stacklevel=2,
            )
            return
        yield _columns(step + [padding] * (num_replicas - len(step)))


def _columns(step: list[Any]) -> tuple[Columns, _tree.TreeSpec]:
    """The leaves of one element per replica, as columns; every element alike in structure."""
    leaves, spec = _tree.flatten(step[0])
    columns = [[from_numpy(leaf)] for leaf in leaves]
    for replica, element in enumerate(step[1:], start=1):
        leaves, other = _tree.flatten(element)
        if other != spec:
            raise ValueError(
                "Every element of the dataset must have the same structure, but replica 0 got "
                f"{spec} and replica {replica} got {other} in the same step."
            )
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(from_numpy(leaf))
    return columns, spec


def _empty_like(element: Any) -> Any:
    """A 0-row batch shaped like ``element`` (a view), or None when a leaf has no rows."""
    leaves, spec = _tree.flatten(element)
    leaves = [from_numpy(leaf) for leaf in leaves]
    if any(num_rows(leaf) is None for leaf in leaves):
        return None
    return _tree.unflatten([leaf[:0] for leaf in leaves], spec)


def _rows(leaf: Any, num_replicas: int) -> int:
    """The first dimension of one leaf of a global batch, which the split rule cuts; a
    ``ValueError`` for a scalar (design 3.7.4), a ``TypeError`` for a leaf without rows."""
    size = num_rows(leaf)
    if size is not None:
        return size
    if isinstance(leaf, (torch.Tensor, bool, int, float, complex, np.generic, str, bytes)):
        _raise_scalar(leaf, num_replicas)
    raise TypeError(
        f"experimental_distribute_dataset(dataset) cannot split a leaf of type "
        f"{type(leaf).__name__} over {num_replicas} replicas: the leaves of a global batch "
        "must be tensors, numpy arrays or lists of strings with a batch dimension. "
        f"Received: {leaf!r}"
    )


def _split_leaf(
    leaf: torch.Tensor | Strings, sizes: list[int], first: int, stop: int, whole: bool
) -> list[Any]:
    """Slices ``first .. stop - 1`` of one leaf along its first dimension.

    One ``split_with_sizes`` call makes every tensor view (half the cost of a ``narrow``
    each); strings are sliced into lists.
    """
    if isinstance(leaf, torch.Tensor):
        pieces = leaf.split_with_sizes(sizes)
        return list(pieces if whole else pieces[first:stop])
    starts = itertools.accumulate(sizes, initial=0)
    bounds = list(zip(starts, sizes, strict=False))[first:stop]
    return [leaf[start : start + size] for start, size in bounds]


def _raise_scalar(leaf: Any, num_replicas: int) -> None:
    what = "tensor (shape [])" if isinstance(leaf, torch.Tensor) else f"({type(leaf).__name__})"
    raise ValueError(
        f"Cannot split a scalar {what} over {num_replicas} replicas in "
        "experimental_distribute_dataset(dataset): an element of a distributed dataset is a "
        "global batch and needs a batch (first) dimension to split. Batch the dataset first, "
        f"e.g. dataset.batch(global_batch_size). Received: {leaf!r}"
    )


def _check_counts(num_replicas: int, replica_offset: int, local_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(
            f"num_replicas must be at least 1. Received: num_replicas={num_replicas}"
        )
    if replica_offset < 0 or local_replicas < 1 or replica_offset + local_replicas > num_replicas:
        raise ValueError(
            "The local replicas must be a non-empty range inside the replicas in sync: "
            "0 <= replica_offset and replica_offset + local_replicas <= num_replicas, "
            f"but got replica_offset={replica_offset}, local_replicas={local_replicas} and "
            f"num_replicas={num_replicas}."
        )
