"""Host memory that freed tensors leave, kept for the tensors that follow (glibc's heap).

PyTorch takes every CPU tensor from the C library's allocator and hands it back when the
tensor dies. glibc maps a block over its mmap threshold afresh from the system and unmaps it
when it is freed, and gives back the free memory at the top of its heap once more than its
trim threshold lies there; it moves both thresholds as the program runs, the first up to 32
MiB. A training step makes and frees the same large tensors at every step (gradients, an
optimizer's temporaries), so each step may fault the same pages in again, a few
microseconds per 4 KiB page. On the project's machine (benchmarks/README.md,
``bench_host_memory.py``) that was three fifths of Adam's update over 45.7 million
parameters, a fifth to a third of the step of two replicas on the CPU over 5.8 million
(they hold the first one's gradients apart), and a sixth to a quarter of plain PyTorch's.
A GPU's caching allocator keeps its blocks; ``keep_host_memory`` does the same for glibc's
heap, for the whole process.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_INT_MAX = 2**31 - 1  # mallopt takes a C int
_MAX_BLOCK_MB = _INT_MAX >> 20


def _mallopt() -> Callable[[int, int], int] | None:
    """The C library's ``mallopt``, or None where it has none (macOS, Windows)."""
    try:
        function = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # no such symbol; no process library
        return None
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return function


def keep_host_memory(max_block_mb: int = 1024) -> bool:
    """Keep the host memory that freed tensors leave, so that the next step's tensors reuse
    it instead of faulting fresh pages in: blocks under ``max_block_mb`` MiB come from the
    heap, and the heap keeps up to twice that free at its top (glibc's ``mallopt``; both
    stop moving with the program). The process stays at its peak size from then on, as
    with a GPU's caching allocator. For the whole process, from the call on; the same as
    starting it with ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set.

    Worth it where host tensors of a few MiB or more are made at every step: the optimizer's
    update with the variables on the CPU (Adam's default, without ``fused=True``, makes
    temporaries as large as its tensors), and replicas on logical CPU devices, whose
    gradients the run holds apart. Returns whether the C library took the settings: False
    where it has no such settings (macOS and Windows have no ``mallopt``, musl's ignores
    them); with another allocator preloaded (jemalloc, tcmalloc) glibc's change nothing.

    >>> import centralstore as cs
    >>> cs.keep_host_memory()  # doctest: +SKIP
    True
    """
    if (
        isinstance(max_block_mb, bool) or not isinstance(max_block_mb, int)
        or not 1 <= max_block_mb <= _MAX_BLOCK_MB
    ):
        raise ValueError(
            f"max_block_mb must be a whole number of MiB from 1 to {_MAX_BLOCK_MB} (mallopt "
            f"takes a C int of bytes). Received: max_block_mb={max_block_mb!r}"
        )
    mallopt = _mallopt()
    if mallopt is None:
        return False
    block = max_block_mb << 20
    return bool(mallopt(_M_MMAP_THRESHOLD, block)) and bool(
        mallopt(_M_TRIM_THRESHOLD, min(2 * block, _INT_MAX))
    )
