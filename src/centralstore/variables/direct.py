"""Runs without views: replicas computing on the variables themselves.

Views cost a scan of every torch call's arguments, so one replica on the device of its
variables uses them directly (its writes apply at once, as in TensorFlow). Such a run is still
a transaction: at its start ``Undo`` sets the gradients already in ``.grad`` aside and copies
the variables that do not require grad and are not parameters (buffers, counters), both small
next to a step; the sync point adds the gradients back (commit) or restores both (rollback).
A parameter written in place by a failed run (``p.clamp_()``, or a frozen weight) is the one
thing not undone: copying every frozen weight at every step would cost what fine-tuning a
large frozen model cannot afford.

Several replicas in one process that compute where the parameters live (logical CPU devices,
or the GPU that holds them) also use directly the parameters that no replica may write
(``DirectReplicas``), one after another on the calling thread, with ``.grad`` holding one
replica's gradients at a time: no views, slots or folding for them, and a ``torch.compile``d
model sees the same parameters in every replica. Buffers and variables whose writes aggregate
keep their views.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._aggregation import VariableAggregation
from .records import Central


class Undo:
    """What one run without views changed, and how to take it back."""

    __slots__ = ("_grads", "_state")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
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
        _add_to_grads(self._grads)
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


def _add_to_grads(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Add each set-aside gradient to its tensor's ``.grad``, which holds this run's and so
    may be added to in place (``held + grad`` and ``grad + held`` are the same bits): one
    ``_foreach_add_`` for the dense ones."""
    targets, sources = [], []
    for tensor, held in pairs:
        if held is None:
            continue
        grad = tensor.grad
        if grad is None:
            tensor.grad = held
        elif grad.is_sparse or held.is_sparse:
            tensor.grad = held + grad
        else:
            targets.append(grad)
            sources.append(held)
    if targets:
        with torch.no_grad():
            torch._foreach_add_(targets, sources)


def shared_parameters(records: list[Central], storage: torch.device) -> list[Central]:
    """The variables that replicas computing on ``storage``, the parameter device, use
    directly in a run of several: module parameters stored there with aggregation NONE,
    which no replica may write. (Buffers and variables whose writes aggregate keep views:
    a replica may not write what the next one reads.)"""
    return [
        record
        for record in records
        if record.owners
        and not record.is_buffer
        and record.aggregation is VariableAggregation.NONE
        and (tensor := record.ref()) is not None
        and tensor.device == storage
    ]


class DirectReplicas:
    """The parameters that the replicas of a run of several compute on directly, one after
    another on the calling thread, when they compute where the parameters live.

    Each replica finds only its own gradients in ``.grad``, as it would alone: the gradients
    already there are set aside when the run begins, and each replica's are taken off when
    it finishes and summed, in replica order, after them. The sync point puts the sum in
    ``.grad`` (commit) or the set-aside gradients back (rollback). No replica may write these
    parameters: a moved version counter raises when the replica finishes.
    """

    __slots__ = ("_old", "_sums", "_versions", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self._versions = [t._version for t in tensors]
        self._old: list[torch.Tensor | None] = [t.grad for t in tensors]
        if self._old.count(None) != len(tensors):
            for tensor, old in zip(tensors, self._old):
                if old is not None:
                    tensor.grad = None
        # the set-aside gradient plus those of the replicas that finished (the old one
        # itself until a replica adds to it: it is never written, so rollback can return it)
        self._sums: list[torch.Tensor | None] = list(self._old)

    def written(self) -> torch.Tensor | None:
        """A parameter whose version counter moved since the run began, if any."""
        if [t._version for t in self.tensors] == self._versions:
            return None
        return next(
            t for t, v in zip(self.tensors, self._versions, strict=True) if t._version != v
        )

    def take_gradients(self) -> None:
        """A replica finished: its gradients join the sum, and ``.grad`` is empty for the
        next one."""
        inplace: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, tensor in enumerate(self.tensors):
            grad = tensor.grad
            if grad is None:
                continue
            tensor.grad = None
            held = self._sums[i]
            if held is None:
                self._sums[i] = grad
            elif held is self._old[i] or held.is_sparse or grad.is_sparse:
                self._sums[i] = held + grad
            else:
                inplace[0].append(held)
                inplace[1].append(grad)
        if inplace[0]:
            with torch.no_grad():
                torch._foreach_add_(*inplace)

    def commit(self) -> None:
        """The sum goes to ``.grad``, after what a backward put there since the last replica
        finished (the last replica's gradients, which were never taken off)."""
        _add_to_grads(zip(self.tensors, self._sums))
        self._forget()

    def rollback(self) -> None:
        """The run failed: ``.grad`` as before it."""
        for tensor, old in zip(self.tensors, self._old):
            tensor.grad = old
        self._forget()

    def _forget(self) -> None:
        self._old, self._sums = [], []
