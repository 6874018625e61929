"""``PinnedPool``: how much pinned host memory torch's caching host allocator holds.

The fake GPUs pin nothing (their "pinned" tensors are ordinary CPU tensors the checker
tracks), so the memory a real process would pin is modelled here, by the allocator's rules
(``CachingHostAllocator``): each request is rounded up to a power of two, a freed block is
kept in the free list of its size and handed to the next request of that size, and nothing
is given back to the system. ``reserved`` is then what the process holds pinned, ``in_use``
what live tensors use of it.
"""

from __future__ import annotations

import threading
from collections import Counter


def rounded(nbytes: int) -> int:
    """The size of the block that serves a request of ``nbytes``: the next power of two.

    >>> [rounded(n) for n in (1, 2, 3, 1000, 1024, 1025)]
    [1, 2, 4, 1024, 1024, 2048]
    """
    return 1 << max(nbytes - 1, 0).bit_length()


class PinnedPool:
    """The caching host allocator's holdings, block by block (see the module docstring)."""

    def __init__(self) -> None:
        self.reserved = 0
        self.in_use = 0
        self._free: Counter[int] = Counter()
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int:
        """Serve a request of ``nbytes``; returns the size of the block it took."""
        size = rounded(nbytes)
        with self._lock:
            if self._free[size]:
                self._free[size] -= 1
            else:
                self.reserved += size
            self.in_use += size
        return size

    def free(self, size: int) -> None:
        """A block of ``size`` bytes goes back to its free list (kept, not released)."""
        with self._lock:
            self._free[size] += 1
            self.in_use -= size
