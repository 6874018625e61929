"""``TensorSpec``: the shape and dtype of one component, and the spec of a whole element.

TensorFlow knows every pipeline's ``element_spec`` statically; a torch pipeline is plain
Python, so here a spec is read off an actual element (``spec_of``). A batch dimension that
varies from step to step (the split rule makes short and empty slices) is reported as
``None``, as TensorFlow does for it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, final

import torch

from .. import _tree
from .._values import PerReplica
from .strings import Strings, is_text

Shape = tuple[int | None, ...]
DType = torch.dtype | type[str] | type[bytes]


@final
@dataclasses.dataclass(frozen=True, repr=False)
class TensorSpec:
    """The type of one component of an element: its shape (None where unknown) and dtype.

    TensorFlow's ``tf.TensorSpec`` with torch dtypes. String components have the dtype
    ``str`` (or ``bytes``); ``shape=None`` means even the rank is unknown.

    >>> spec = TensorSpec([None, 3], torch.float32)
    >>> spec
    TensorSpec(shape=(None, 3), dtype=torch.float32)
    >>> spec.is_compatible_with(torch.zeros(5, 3)), spec.is_compatible_with(torch.zeros(5, 2))
    (True, False)
    """

    shape: Shape | None
    dtype: DType = torch.float32
    name: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", as_shape("TensorSpec", "shape", self.shape))
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in (str, bytes):
            raise TypeError(
                "TensorSpec(dtype) must be a torch.dtype (e.g. torch.float32), or str or bytes "
                f"for string components. Received: dtype={self.dtype!r}"
            )

    def __repr__(self) -> str:
        dtype = self.dtype.__name__ if isinstance(self.dtype, type) else repr(self.dtype)
        name = "" if self.name is None else f", name={self.name!r}"
        return f"TensorSpec(shape={self.shape}, dtype={dtype}{name})"

    @classmethod
    def from_tensor(cls, tensor: Any, name: str | None = None) -> TensorSpec:
        """The spec of ``tensor`` (or of a string component), every dimension known.

        >>> TensorSpec.from_tensor(torch.zeros(2, dtype=torch.int8))
        TensorSpec(shape=(2,), dtype=torch.int8)
        """
        if isinstance(tensor, Strings):
            return cls(_strings_shape(tensor), _strings_dtype(tensor), name)
        if is_text(tensor):
            return cls((), type(tensor), name)
        try:
            tensor = torch.as_tensor(tensor)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                "TensorSpec.from_tensor(tensor) describes tensors, numpy arrays, numbers and "
                f"strings. Received: a {type(tensor).__name__}"
            ) from None
        return cls(tuple(tensor.shape), tensor.dtype, name)

    def is_compatible_with(self, value: Any) -> bool:
        """Whether ``value`` (a spec or a component) has this dtype and fits this shape.

        >>> TensorSpec((None,), str).is_compatible_with(Strings(["a", "b"]))
        True
        """
        other = value if isinstance(value, TensorSpec) else TensorSpec.from_tensor(value)
        if other.dtype != self.dtype:
            return False
        if self.shape is None or other.shape is None:
            return True
        return len(self.shape) == len(other.shape) and all(
            mine is None or theirs is None or mine == theirs
            for mine, theirs in zip(self.shape, other.shape, strict=True)
        )


def spec_of(element: Any, *, batched: bool) -> Any:
    """The structure of ``element`` with a ``TensorSpec`` for every component.

    With ``batched``, the first dimension of every component that has one is None (the
    batch dimension), and a ``PerReplica`` leaf is described by its first component: one
    replica's slice, as every replica's differs only in that dimension.

    >>> spec_of({"x": torch.zeros(4, 2)}, batched=True)
    {'x': TensorSpec(shape=(None, 2), dtype=torch.float32)}
    """

    def leaf_spec(leaf: Any) -> TensorSpec:
        if isinstance(leaf, PerReplica):
            leaf = leaf.values[0]
        spec = TensorSpec.from_tensor(leaf)
        if batched and spec.shape:
            return TensorSpec((None, *spec.shape[1:]), spec.dtype)
        return spec

    return _tree.map_leaves(leaf_spec, element)


def as_shape(call: str, argument: str, value: Any) -> Shape:
    """A shape as a tuple of ints and Nones; -1 is read as None, an int as a 1-D shape.

    >>> as_shape("f", "shape", [None, -1, 3]), as_shape("f", "shape", 5)
    ((None, None, 3), (5,))
    """
    if isinstance(value, torch.Size):
        return tuple(value)
    items = [value] if _is_dim(value) else value
    try:
        dims = [None if d is None or operator.index(d) == -1 else operator.index(d) for d in items]
    except TypeError:
        dims = [-2]
    if isinstance(value, (str, bytes)) or any(d is not None and d < 0 for d in dims):
        raise TypeError(
            f"{call}({argument}) must be a shape: a list or tuple of non-negative ints and "
            f"None (or -1) for unknown sizes, e.g. [None, 3]. Received: {argument}={value!r}"
        )
    return tuple(dims)


def _is_dim(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and hasattr(value, "__index__"))


def _strings_shape(strings: Strings) -> Shape:
    inner = _strings_shape(strings[0]) if strings and isinstance(strings[0], Strings) else ()
    return (len(strings), *inner)


def _strings_dtype(strings: Strings) -> type[str] | type[bytes]:
    while strings and isinstance(strings[0], Strings):
        strings = strings[0]
    return bytes if strings and isinstance(strings[0], bytes) else str
