"""The memory blocks the checker tracks: device storages and pinned host storages.

A block is one storage (every view of it is the same block), known by its address while it
lives: ``register`` creates it on first sight, allocated on a stream (device memory) or on
none (pinned host memory), and a ``weakref.finalize`` on the storage reports its free to the
``Order``. Host tensors that are not pinned are not tracked: only pinned memory can be read or
written by a stream behind the host's back. A pinned block is also counted in the runtime's
``PinnedPool``, the model of torch's caching host allocator (what pinned memory it holds).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import _cuda
from ._order import HOST, Block
from ._tensor import FakeCudaTensor

PINNED = "cpu (pinned)"


def storage_key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def register(rt: _cuda.Runtime, inner: torch.Tensor, device: str,
             stream: Any | None) -> Block | None:
    """The block of ``inner``'s storage, created (allocated on ``stream``) if new."""
    key = storage_key(inner)
    if key is None:
        return None
    block, new = rt.order.block(
        key, device, tuple(inner.shape), str(inner.dtype).removeprefix("torch."), stream
    )
    if new:
        freed = weakref.finalize(inner.untyped_storage(), rt.order.free, key, block.serial)
        freed.atexit = False  # nothing to check once the interpreter is exiting
        if device == PINNED:
            size = rt.pinned.allocate(inner.untyped_storage().nbytes())
            rt.tally("pinned allocation", HOST)
            weakref.finalize(inner.untyped_storage(), rt.pinned.free, size).atexit = False
    return block


def device_block(rt: _cuda.Runtime, fake: FakeCudaTensor) -> Block | None:
    index = fake._fakegpu_index
    return register(rt, fake._fakegpu_inner, f"cuda:{index}", rt.current_stream(index))


def host_block(rt: _cuda.Runtime, t: torch.Tensor) -> Block | None:
    """The tracked (pinned) block of host tensor ``t``, if it is one."""
    if not rt.order.blocks:
        return None
    key = storage_key(t)
    block = None if key is None else rt.order.blocks.get(key)
    return block if block is not None and block.device == PINNED else None


def pin(rt: _cuda.Runtime, t: torch.Tensor) -> None:
    register(rt, t, PINNED, None)


def is_pinned(rt: _cuda.Runtime, t: torch.Tensor) -> bool:
    block = host_block(rt, t)
    return block is not None and block.device == PINNED


def record_gradient_write(rt: _cuda.Runtime, leaf: FakeCudaTensor) -> None:
    """A gradient was just accumulated into ``leaf.grad`` by the device's current stream."""
    grad = leaf._fakegpu_inner.grad
    if grad is None:
        return
    index = leaf._fakegpu_index
    stream = rt.current_stream(index)
    block = register(rt, grad, f"cuda:{index}", stream)
    if block is not None:
        rt.order.launch(stream)
        rt.order.access(stream, block, True, "AccumulateGrad (backward)")
