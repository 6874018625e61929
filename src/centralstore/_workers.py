"""``Workers``: the worker processes a strategy spans, and ``OneProcess``, the usual one.

The one place where one process and several differ: every call that crosses a process
boundary is a method here (glossary: a worker is a process; the replicas of one process run
on its replica threads).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, final

import torch

from ._autograd import no_grad
from ._reduce import Axis, ReduceOp, gather_components, reduce_components
from .variables import folding
from .variables.views import View

if TYPE_CHECKING:
    from .variables.buckets import GradientBuckets
    from .variables.store import VariableStore


class Workers(abc.ABC):
    """The worker processes a strategy spans, and how replica values combine across them.

    Everything that crosses a process boundary goes through here: reductions and gathers
    over the replicas of every worker, the broadcast that makes new central variables
    identical on every worker, and the sync points (where gradients are exchanged).
    ``OneProcess`` is the single-process case; ``MultiWorkerCentralStorageStrategy`` passes
    one built on ``torch.distributed``.
    """

    num_workers: int  # how many worker processes
    worker_index: int  # which one this is (its rank)
    # whether ``on_gradient`` wants each replica's gradient as backward accumulates it
    watches_gradients = False

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
    def sync(self, store: VariableStore, error: BaseException | None) -> None:
        """A sync point of ``store``: fold what its replicas left into the central
        variables, over every worker. ``error`` is what a local replica of the run raised:
        then the run's work is discarded on every worker and the error raised."""

    @abc.abstractmethod
    def gradient_after_run(self, store: VariableStore, view: View) -> None:
        """A gradient reached ``view`` outside ``run`` (a backward on a reduced loss)."""

    def sync_step(self, store: VariableStore) -> None:
        """The sync point of an optimizer step over ``store``'s variables: what gradients a
        backward after ``run`` left (``store.pending``) is folded in, over every worker."""
        self.sync(store, None)

    @abc.abstractmethod
    def describe(self) -> str:
        """Extra text for the strategy's ``repr``."""

    # -- defaults ------------------------------------------------------------------------------

    def on_gradient(  # noqa: B027
        self, buckets: GradientBuckets, view: View, tensor: torch.Tensor
    ) -> None:
        """A replica's gradient has just accumulated on ``view`` (``tensor``) while backward
        runs (the views' hooks call it only when ``watches_gradients``): the multi-worker
        exchange starts its buckets."""

    def copy_gradients(
        self, copy: Callable[[GradientBuckets, View, torch.Tensor], None]
    ) -> None:
        """(When ``watches_gradients``.) The replicas' gradients are on GPUs and the
        variables in host memory: ``on_gradient`` must call ``copy`` first, which starts the
        gradient's copy there (``folding.start_copy``)."""
        raise NotImplementedError(
            f"{type(self).__name__} watches gradients but cannot copy them to host memory"
        )


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

    def sync(self, store: VariableStore, error: BaseException | None) -> None:
        store.fold(discard=error is not None)

    def gradient_after_run(self, store: VariableStore, view: View) -> None:
        with no_grad():  # folded at once, so that .grad is complete after backward
            received = folding.fold_gradients([view])
        folding.run_post_accumulate_hooks(received)

    def describe(self) -> str:
        return ""
