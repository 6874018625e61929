"""Autograd bookkeeping cheap enough for every run: a grad-mode switch, and reads and writes
of ``.grad`` over many tensors in C loops.

``torch.no_grad()`` is a decorator class whose entry and exit make several Python calls: about
4.7 us on this project's CI machines, against 1.6 for this class, and a run's sync point
enters it a few times, right after the replicas' compute, when every Python call costs
several times as much (its code and data have left the caches). For the same reason the
passes over every variable in scope are ``map`` loops over attribute getters."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import torch

grad_of = attrgetter("grad")
requires_grad_of = attrgetter("requires_grad")
version_of = attrgetter("_version")
hooks_of = attrgetter("_post_accumulate_grad_hooks")


def some(values: Iterable[torch.Tensor | None]) -> bool:
    """Whether some value is not None, by identity at C speed. (``values.count(None)`` would
    compare each tensor with ``==``, which costs about 20 us per tensor: torch raises a
    ``TypeError`` for ``tensor == None`` and turns it into ``NotImplemented``.)"""
    return any(map(is_not, values, repeat(None)))


def set_grads(tensors: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None]) -> None:
    """``tensor.grad = grad`` for each pair, the loop in C (a map consumed by one
    zero-length deque kept for every call: making one per call costs a keyword argument's
    parsing). Torch's setter costs most of the time; the loop costs nothing."""
    _consume(map(setattr, tensors, repeat("grad"), grads))


# a deque that keeps nothing, its ``extend`` safe on every thread
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend

_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled


class no_grad:
    """``with no_grad():`` as ``torch.no_grad()``, for code that is neither a decorator nor
    scripted."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = _is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self._was)
