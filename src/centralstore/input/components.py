"""How Python values become the components of dataset elements, as ``tf.data`` reads them.

Tuples, dicts and namedtuples nest; numpy arrays become tensors sharing their memory; lists
and Python numbers become tensors; strings stay ``str``/``bytes`` and lists of them become
``Strings``. ``from_generator``'s ``output_signature`` adds a dtype and shape check per
component (``conform``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _tree
from .spec import TensorSpec
from .split import from_numpy
from .strings import Strings, is_text, to_strings


def to_components(value: Any, call: str) -> Any:
    """``value`` read as TensorFlow reads a dataset element; ``call`` names the public call.

    >>> to_components(([1, 2], {"s": ["a", "b"]}), "Dataset.from_tensors")
    (tensor([1, 2]), {'s': ['a', 'b']})
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        strings = to_strings(value, call) if isinstance(value, np.ndarray) else None
        return from_numpy(value) if strings is None else strings
    if is_text(value) or isinstance(value, Strings):
        return value
    if isinstance(value, dict):
        return type(value)((key, to_components(item, call)) for key, item in value.items())
    if isinstance(value, tuple):
        items = [to_components(item, call) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        strings = to_strings(value, call)
        if strings is not None:
            return strings
        if any(isinstance(item, (torch.Tensor, np.ndarray)) for item in value):
            return torch.stack([to_components(item, call) for item in value])
    if isinstance(value, (list, bool, int, float, complex, np.generic)):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{call} cannot make a tensor of this list ({error}): a list component must "
                "be rectangular and hold numbers (or only strings). "
                f"Received: {_short(value)}"
            ) from None
    raise TypeError(
        f"{call}: dataset components must be tensors, numpy arrays, Python numbers, strings "
        "or lists of them, nested in tuples, dicts or namedtuples. "
        f"Received: a {type(value).__name__}, {_short(value)}"
    )


def conform(element: Any, signature: Any, call: str) -> Any:
    """``element`` with each component converted to its ``TensorSpec``'s dtype and checked.

    >>> conform((1, [2, 3]), (TensorSpec((), torch.int32), TensorSpec((None,), torch.int32)),
    ...         "Dataset.from_generator")
    (tensor(1, dtype=torch.int32), tensor([2, 3], dtype=torch.int32))
    """
    specs, structure = _tree.flatten(signature)
    try:
        leaves = structure.flatten_up_to(element)
    except (TypeError, ValueError):
        raise ValueError(
            f"{call}: the generator yielded an element whose structure does not match "
            f"output_signature {signature}. Received: {_short(element)}"
        ) from None
    return _tree.unflatten(
        [_conform_leaf(leaf, spec, call) for leaf, spec in zip(leaves, specs, strict=True)],
        structure,
    )


def to_numpy(leaf: Any) -> Any:
    """A tensor as a numpy array (a 0-d one as a numpy scalar); other leaves unchanged.

    >>> to_numpy(torch.tensor(3)), to_numpy("a")
    (np.int64(3), 'a')
    """
    if not isinstance(leaf, torch.Tensor):
        return leaf
    array = leaf.numpy(force=True)
    return array[()] if array.ndim == 0 else array


def _conform_leaf(leaf: Any, spec: TensorSpec, call: str) -> Any:
    if spec.dtype in (str, bytes):
        value = leaf if is_text(leaf) else to_strings(leaf, call)
    else:
        try:
            value = torch.as_tensor(from_numpy(leaf), dtype=spec.dtype)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            value = None
    if value is None or not spec.is_compatible_with(value):
        got = TensorSpec.from_tensor(value) if value is not None else type(leaf).__name__
        raise ValueError(
            f"{call}: the generator yielded a component that does not fit its output_signature "
            f"entry {spec}: it is {got}. Yield components of that dtype and shape, or change "
            f"the signature. Received: {_short(leaf)}"
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
