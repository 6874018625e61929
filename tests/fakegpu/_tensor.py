"""``FakeCudaTensor``: a tensor that reports a ``cuda:i`` device and holds a CPU tensor.

The wrapper is made with ``torch.Tensor._make_wrapper_subclass``: it has the CPU tensor's
shape, strides and dtype, the fake device, no storage of its own, and never requires grad
itself. Every torch call that receives one is handled at the ``__torch_function__`` level
(``_ops.handle``), above autograd: the call runs on the CPU tensors inside, so autograd
records its graph there, with real CPU values. (A CPU-only torch build has no CUDA device
guard, which autograd needs for a tensor whose device is CUDA; recording on the CPU tensors
needs none.) The class's ``__torch_function__`` makes that work on every thread, mode or no
mode; ``__torch_dispatch__`` is the fallback for calls that reach the dispatcher with the
torch-function layer switched off (it runs the op on the CPU tensors, without autograd).

Wrapping is identity-preserving: while a wrapper is alive, wrapping its CPU tensor again
returns it, so ``x.add_(1) is x`` and a hook sees the same object the module holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

# Set by _ops: the handler of every torch call that receives a fake tensor.
handler: Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any] | None = None

_wrappers: weakref.WeakValueDictionary[int, FakeCudaTensor] = weakref.WeakValueDictionary()


class FakeCudaTensor(torch.Tensor):
    """A tensor on a fake CUDA device; ``_fakegpu_inner`` holds its values on the CPU."""

    _fakegpu_inner: torch.Tensor
    _fakegpu_index: int

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        assert handler is not None
        return handler(func, types, tuple(args), dict(kwargs or {}))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        index = next(
            (x._fakegpu_index for x in _leaves((args, kwargs)) if is_fake(x)), 0
        )
        # (below the torch-function layer, as on a real device: a mode such as a strategy
        # scope's, which registers new leaves, must not see the CPU tensors inside)
        with torch._C.DisableTorchFunction():
            out = func(*unwrap(tuple(args)), **unwrap(dict(kwargs or {})))
        return tree_map(lambda x: wrap(x, index) if isinstance(x, torch.Tensor) else x, out)


def _leaves(tree: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a tensor on a fake GPU."""
    return isinstance(value, FakeCudaTensor)


def wrap(inner: torch.Tensor, index: int) -> FakeCudaTensor:
    """``inner`` (a CPU tensor) as a tensor on fake device ``index``: its live wrapper if it
    has one there, else a new one."""
    if isinstance(inner, FakeCudaTensor):
        return inner
    existing = _wrappers.get(id(inner))
    if (
        existing is not None
        and existing._fakegpu_inner is inner
        and existing._fakegpu_index == index
    ):
        return existing
    layout = inner.layout
    strides = inner.stride() if layout == torch.strided else None
    where: dict[str, Any] = {}  # a sparse tensor has neither strides nor a storage offset
    if strides is not None:
        where = {"strides": strides, "storage_offset": inner.storage_offset()}
    wrapper = torch.Tensor._make_wrapper_subclass(
        FakeCudaTensor,
        inner.size(),
        **where,
        dtype=inner.dtype,
        layout=layout,
        device=torch.device("cuda", index),
        requires_grad=False,
    )
    wrapper._fakegpu_inner = inner
    wrapper._fakegpu_index = index
    _wrappers[id(inner)] = wrapper
    return wrapper


def inner_of(value: Any) -> Any:
    return value._fakegpu_inner if isinstance(value, FakeCudaTensor) else value


def unwrap(tree: Any) -> Any:
    """``tree`` with every fake tensor replaced by the CPU tensor it holds."""
    return tree_map(inner_of, tree)


def index_of(value: torch.Tensor) -> int | None:
    """The fake device index of ``value``; None for a host tensor."""
    return value._fakegpu_index if isinstance(value, FakeCudaTensor) else None
