"""String components: a batch of strings is a ``Strings`` list that splits like a tensor.

torch has no string tensors. A string element of a ``tf.data`` pipeline is a Python ``str``
(or ``bytes``) here, and a batch of them is a ``Strings``: a ``list`` subclass, so that user
code sees a plain list, which torch's pytree treats as one leaf (it registers ``list``
itself, not its subclasses). As a leaf it is cut by the split rule along its length, like a
tensor's first dimension, and the distributed iterator hands it over without placing it on
a device. A batch of string batches is a ``Strings`` of ``Strings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex, final, overload

import numpy as np
import torch


@final
class Strings(list[Any]):
    """A batch of strings: a list that counts as one component (one leaf) of an element.

    Slicing gives a ``Strings`` again, so slices of a batch stay batches.

    >>> batch = Strings(["a", "c", "e"])
    >>> batch[1:], batch == ["a", "c", "e"], isinstance(batch[1:], Strings)
    (['c', 'e'], True, True)
    """

    __slots__ = ()

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> Strings: ...

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        item = super().__getitem__(index)
        return Strings(item) if isinstance(index, slice) else item


def is_text(value: Any) -> bool:
    """Whether ``value`` is one string component: a ``str`` or ``bytes``.

    >>> is_text("a"), is_text(b"a"), is_text(["a"])
    (True, True, False)
    """
    return isinstance(value, (str, bytes))


def to_strings(value: Any, call: str = "Dataset") -> Strings | None:
    """``value`` as a ``Strings`` when it is a non-empty (nested) list or array of strings.

    Nested lists become a ``Strings`` of ``Strings`` and must be rectangular, as a string
    tensor is. Anything else gives None.

    >>> to_strings(["a", "b"]), to_strings(np.array([["x"], ["y"]])), to_strings([1, 2])
    (['a', 'b'], [['x'], ['y']], None)
    """
    if isinstance(value, np.ndarray) and value.dtype.kind in "USO" and value.ndim > 0:
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or isinstance(value, Strings):
        return value if isinstance(value, Strings) else None
    if all(is_text(item) for item in value):
        return Strings(value)
    rows = [to_strings(item, call) for item in value]
    if any(row is None for row in rows):
        return None
    return stack(rows, call)


def stack(column: Sequence[Any], call: str) -> Strings:
    """String components (``str`` or ``Strings`` of one length) stacked into one batch.

    >>> stack(["a", "b"], "Dataset.batch"), stack([Strings("ab"), Strings("cd")], "batch")
    (['a', 'b'], [['a', 'b'], ['c', 'd']])
    """
    lengths = {len(item) for item in column if isinstance(item, Strings)}
    kinds = {isinstance(item, Strings) for item in column}
    if len(kinds) > 1 or len(lengths) > 1 or not all(map(_is_string_leaf, column)):
        shapes = [len(x) if isinstance(x, Strings) else type(x).__name__ for x in column]
        raise ValueError(
            f"{call} cannot stack string components of different shapes (lengths or types "
            f"{shapes}): every element must have the same shape. Use padded_batch to pad "
            f"string batches to one length. Received: {list(column)!r}"
        )
    return Strings(column)


def num_rows(leaf: Any) -> int | None:
    """The size of ``leaf``'s first (batch) dimension, or None for a scalar or non-tensor.

    >>> num_rows(torch.zeros(3, 2)), num_rows(Strings(["a"])), num_rows(torch.tensor(1.0))
    (3, 1, None)
    """
    if isinstance(leaf, torch.Tensor):
        return leaf.shape[0] if leaf.dim() > 0 else None
    if isinstance(leaf, Strings):
        return len(leaf)
    return None


def rows(leaf: torch.Tensor | Strings) -> Iterable[Any]:
    """The rows of a batch component along its first dimension (``num_rows`` of them)."""
    return leaf.unbind(0) if isinstance(leaf, torch.Tensor) else leaf


def _is_string_leaf(item: Any) -> bool:
    return is_text(item) or isinstance(item, Strings)
