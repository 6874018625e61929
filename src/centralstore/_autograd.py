"""A grad-mode switch for the bookkeeping of every run.

``torch.no_grad()`` is a decorator class whose entry and exit make several Python calls: about
4.7 us on this project's CI machines, against 1.6 for this class, and a run's sync point
enters it a few times, right after the replicas' compute, when every Python call costs
several times as much (its code and data have left the caches)."""

from __future__ import annotations

import torch

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
