"""``Workers``: the worker processes a strategy spans, and ``OneProcess``, the usual one."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import torch

from .._reduce import Axis, ReduceOp, gather_components, reduce_components

if TYPE_CHECKING:
    from .._variables import VariableStore


class Workers(abc.ABC):
    """The worker processes a strategy spans, and how replica values combine across them.

    Everything that crosses a process boundary goes through here: reductions and gathers
    over the replicas of every worker, the broadcast that makes new central variables
    identical on every worker, and the end of ``run`` (where gradients are exchanged).
    ``OneProcess`` is the single-process case; ``MultiWorkerCentralStorageStrategy`` passes
    one built on ``torch.distributed``.
    """

    num_workers: int  # how many worker processes
    worker_index: int  # which one this is (its rank)

    @abc.abstractmethod
    def reduce(
        self, op: ReduceOp, parts: Sequence[Sequence[Any]], axis: Axis, device: torch.device
    ) -> list[torch.Tensor]:
        """One tensor per leaf: ``parts[k]`` holds leaf k's local components, reduced by the
        rules of ``reduce`` over the replicas of every worker, on ``device``."""

    @abc.abstractmethod
    def gather(
        self, parts: Sequence[Sequence[Any]], axis: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Per leaf, the concatenation along ``axis`` over the replicas of every worker, and
        each replica's size along ``axis`` (global replica order)."""

    @abc.abstractmethod
    def share_variables(self, store: VariableStore) -> None:
        """At a scope's exit: make the central variables registered since the last call
        identical on every worker."""

    @abc.abstractmethod
    def begin_run(self, store: VariableStore) -> None:
        """Before the replicas of a ``run`` start (variables created or loaded since are
        made identical on every worker)."""

    @abc.abstractmethod
    def end_run(self, store: VariableStore, error: BaseException | None) -> None:
        """Close a ``run`` at its sync point; ``error`` is what a local replica raised."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Extra text for the strategy's ``repr``."""


@final
class OneProcess(Workers):
    """One worker: reductions and gathers over the local replicas only."""

    num_workers = 1
    worker_index = 0

    def reduce(
        self, op: ReduceOp, parts: Sequence[Sequence[Any]], axis: Axis, device: torch.device
    ) -> list[torch.Tensor]:
        return [reduce_components(op, components, axis, device) for components in parts]

    def gather(
        self, parts: Sequence[Sequence[Any]], axis: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        gathered = [gather_components(components, axis, device) for components in parts]
        sizes = [[int(t.shape[axis]) for t in components] for components in parts]
        return gathered, sizes

    def share_variables(self, store: VariableStore) -> None:
        pass

    def begin_run(self, store: VariableStore) -> None:
        pass

    def end_run(self, store: VariableStore, error: BaseException | None) -> None:
        store.end_run()

    def describe(self) -> str:
        return ""
