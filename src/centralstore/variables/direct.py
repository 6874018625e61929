"""Runs without views: one replica computing where every variable lives.

Views cost a scan of every torch call's arguments, so one replica on the device of its
variables uses them directly (its writes apply at once, as in TensorFlow). Such a run is still
a transaction: at its start ``Undo`` sets the gradients already in ``.grad`` aside and copies
the variables that do not require grad and are not parameters (buffers, counters), both small
next to a step; the sync point adds the gradients back (commit) or restores both (rollback).
A parameter written in place by a failed run (``p.clamp_()``, or a frozen weight) is the one
thing not undone: copying every frozen weight at every step would cost what fine-tuning a
large frozen model cannot afford.
"""

from __future__ import annotations

import torch

from .records import Central


class Undo:
    """What one run without views changed, and how to take it back."""

    __slots__ = ("_grads", "_state")

    def __init__(self, records: list[Central]) -> None:
        tensors = [t for r in records if (t := r.ref()) is not None]
        self._grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._state: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for tensor in tensors:
                if tensor.requires_grad:
                    self._grads.append((tensor, tensor.grad))
                    tensor.grad = None
                elif not isinstance(tensor, torch.nn.Parameter):  # frozen weights: not copied
                    self._state.append((tensor, tensor.detach().clone()))

    def commit(self) -> None:
        """Keep the run's work: the set-aside gradients come back, added to the new ones."""
        targets, sources = [], []
        for tensor, old in self._grads:
            new = tensor.grad
            if old is None:
                continue
            if new is None or new.is_sparse or old.is_sparse:
                tensor.grad = old if new is None else old + new
            else:
                targets.append(new)
                sources.append(old)
        if targets:
            with torch.no_grad():
                torch._foreach_add_(targets, sources)
        self._forget()

    def rollback(self) -> None:
        """Drop the run's work: gradients and the variables without grad as before it."""
        with torch.no_grad():
            for tensor, old in self._grads:
                tensor.grad = old
            for tensor, value in self._state:
                tensor.copy_(value)
        self._forget()

    def _forget(self) -> None:
        self._grads, self._state = [], []
