"""Fake CUDA devices for the test suite: logical ``cuda:i`` devices over real CPU tensors.

``with fakegpu.devices(2) as gpus:`` makes ``torch.cuda`` report two GPUs. Tensors created
on or moved to ``cuda:i`` are ``FakeCudaTensor`` wrappers that report ``cuda:i`` and compute
on the CPU tensors they hold, with real autograd; mixing devices in one op raises as CUDA
does; moves between devices are real copies. Streams, events and pinned memory behave as
their CUDA counterparts order work, and a happens-before checker over the host and every
stream (``_order``) records each access of device memory and of pinned host memory by the
stream that issued it: unordered conflicting accesses, and blocks freed while another
stream may still use them, are hazards (``gpus.hazards``, ``gpus.check()``). ``gpus.calls``
counts the CUDA runtime calls made, by kind and stream, and ``gpus.pinned`` models the pinned
memory torch's caching host allocator would hold.

The fake GPUs check placement and synchronization, not numerics or speed: kernels are the
CPU's, every stream runs at once, and there is no NCCL. See docs/design.md, "The fake-GPU
model".

Usage (``tests/conftest.py`` has the ``fake_gpus`` fixture, which checks at teardown)::

    def test_copy(fake_gpus):
        x = torch.randn(4, device="cuda:1")
        assert x.device == torch.device("cuda:1") and x.is_cuda
        assert torch.equal(x.cpu(), x.to("cuda:0").cpu())
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from ._harness import FakeGPUs, HazardError
from ._order import Hazard
from ._tensor import FakeCudaTensor, is_fake

__all__ = [
    "FakeCudaTensor", "FakeGPUs", "Hazard", "HazardError", "checked", "devices", "is_fake",
    "visible",
]


def devices(count: int = 2) -> FakeGPUs:
    """``count`` fake CUDA devices for a ``with`` block (see ``FakeGPUs``)."""
    return FakeGPUs(count)


@contextlib.contextmanager
def checked(count: int = 2) -> Iterator[FakeGPUs]:
    """``devices(count)`` that raises ``HazardError`` at the end of a block that did not
    raise, if a hazard was recorded and not taken (``take_hazards``)."""
    with devices(count) as gpus:
        yield gpus
        gc.collect()  # frees of blocks held by reference cycles, while the checker runs
        gpus.check()


@contextlib.contextmanager
def visible(count: int) -> Iterator[None]:
    """Only ``torch.cuda.is_available()`` and ``device_count()`` report ``count`` GPUs:
    enough for a test module's ``skipif`` marks while it is imported, nothing else."""
    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: count
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved
