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
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn, final

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
    return Split(num_replicas, replica_offset, local_replicas).leaves(batch)


@final
class Split:
    """The split rule for one range of local replicas, keeping each batch size's cut.

    A distributed dataset makes one per pass and cuts every global batch with it: the slice
    sizes of a first dimension are computed once (most batches share one), and ``tensor``
    is one ``split_with_sizes`` call per leaf, the whole per-leaf cost of the rule.

    >>> split = Split(3, replica_offset=1, local_replicas=2)
    >>> split.sizes(5), [s.tolist() for s in split.tensor(torch.arange(5))]
    ((2, 2, 1), [[2, 3], [4]])
    """

    def __init__(
        self, num_replicas: int, replica_offset: int = 0, local_replicas: int | None = None
    ) -> None:
        if local_replicas is None:
            local_replicas = num_replicas - replica_offset
        _check_counts(num_replicas, replica_offset, local_replicas)
        self.num_replicas = num_replicas
        self._first, self._stop = replica_offset, replica_offset + local_replicas
        self._whole = local_replicas == num_replicas
        self._sizes: dict[int, tuple[int, ...]] = {}

    def sizes(self, size: int) -> tuple[int, ...]:
        """``split_sizes(size, num_replicas)``, computed once per ``size`` (a tuple, which
        ``split_with_sizes`` parses faster than a list)."""
        sizes = self._sizes.get(size)
        if sizes is None:
            sizes = self._sizes[size] = tuple(split_sizes(size, self.num_replicas))
        return sizes

    def tensor(self, leaf: torch.Tensor) -> Sequence[torch.Tensor]:
        """The local replicas' slices of one tensor leaf, as views; with one replica the
        leaf itself, scalars included. ``ValueError`` for a scalar with several."""
        if self.num_replicas == 1:
            return (leaf,)
        if not leaf.dim():
            _raise_scalar(leaf, self.num_replicas)
        pieces = leaf.split_with_sizes(self.sizes(leaf.shape[0]))
        return pieces if self._whole else pieces[self._first : self._stop]

    def leaves(self, batch: Any) -> tuple[Columns, _tree.TreeSpec]:
        """``split_leaves`` of ``batch``: any structure pytree knows, numpy arrays and lists
        of strings included."""
        leaves, spec = _tree.flatten(batch, is_leaf=_is_string_batch)
        leaves = [Strings(leaf) if _is_string_batch(leaf) else from_numpy(leaf) for leaf in leaves]
        if self.num_replicas == 1:
            return [[leaf] for leaf in leaves], spec
        columns = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dim():
                columns.append(list(self.tensor(leaf)))
            else:
                columns.append(self._sliced(leaf))
        return columns, spec

    def _sliced(self, leaf: Any) -> list[Any]:
        """A leaf other than a tensor with rows: a ``Strings`` is sliced into lists, and
        anything else raises (``_rows``)."""
        sizes = self.sizes(_rows(leaf, self.num_replicas))  # raises for what has no rows
        starts = itertools.accumulate(sizes, initial=0)
        bounds = list(zip(starts, sizes, strict=False))[self._first : self._stop]
        return [leaf[start : start + size] for start, size in bounds]


def _is_string_batch(node: Any) -> bool:
    """A plain list or tuple of strings (``default_collate``'s batch of strings) is one leaf:
    a scalar string could not be split anyway."""
    return (
        type(node) in (list, tuple)
        and bool(node)
        and all(isinstance(s, (str, bytes)) for s in node)
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


def _raise_scalar(leaf: Any, num_replicas: int) -> NoReturn:
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
