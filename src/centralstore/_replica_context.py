"""``ReplicaContext``: what a replica can do with its peers inside ``run``.

``all_reduce`` and ``all_gather`` are differentiable as in TensorFlow: the gradient of a SUM
all-reduce is the SUM all-reduce of the replicas' incoming gradients (so every replica must
run its backward inside ``run``), and the gradient of an all-gather is the replica's slice of
the summed incoming gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from . import _tree
from ._placement import Placement
from ._reduce import ReduceOp, as_tensor, gather_axis
from ._values import regroup, select
from ._workers import Workers

if TYPE_CHECKING:
    from ._replicas import RunState, Switch

S = TypeVar("S")

# The strategy's cross-replica call: ``merge(fn, args, kwargs, rendezvous)`` runs
# ``fn(strategy, *args, **kwargs)`` once, in cross-replica context, after a sync point
# (``rendezvous``: several replicas wait for it).
Merge = Callable[[Callable[..., Any], Sequence[Any], dict[str, Any], bool], Any]


class ReplicaContext(Generic[S]):
    """The context of one replica inside ``strategy.run``; ``get_replica_context()`` returns it.

    Generic in the type of its strategy (``get_replica_context()`` gives a
    ``ReplicaContext[Strategy]``), so that this module, which strategies use, needs none.

    >>> import centralstore as cs
    >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> total = s.run(lambda: cs.get_replica_context().all_reduce("sum", 1.0))
    >>> [float(t) for t in s.experimental_local_results(total)]
    [2.0, 2.0]
    """

    __slots__ = ("_merge", "_placement", "_replica_id", "_state", "_strategy", "_workers")

    def __init__(
        self,
        strategy: S,
        placement: Placement,
        workers: Workers,
        merge: Merge,
        replica_id: int,
        state: RunState | None = None,
    ) -> None:
        self._strategy = strategy
        self._placement = placement
        self._workers = workers
        self._merge = merge
        self._replica_id = replica_id
        self._state = state

    @property
    def strategy(self) -> S:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, 0 to ``num_replicas_in_sync - 1`` (a Python int); with
        several workers it counts the replicas of the workers before this one too."""
        return self._placement.replica_offset + self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._placement.num_replicas

    @property
    def device(self) -> torch.device:
        """The compute device of this replica, e.g. ``torch.device("cpu", 1)``."""
        return self._placement.torch_devices[self._replica_id]

    @property
    def _storage_device(self) -> torch.device:
        # Where this replica's tensors live: ``device`` names a logical CPU device, and
        # ``tensor.to(torch.device("cpu", 1))`` would copy even a CPU tensor.
        return self._placement.storage_devices[self._replica_id]

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync}, device={self.device})"
        )

    # -- collectives -----------------------------------------------------------------------

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` over replicas; every replica gets the result on its own device.

        Nested structures are reduced leaf by leaf; shapes must agree across replicas.
        """
        op = ReduceOp.parse(reduce_op)
        leaves, spec = _tree.flatten(value)
        tensors = [as_tensor(leaf, self._storage_device) for leaf in leaves]
        reduced = _AllReduce.apply(self, op, spec, *tensors)  # type: ignore[no-untyped-call]
        return _tree.unflatten(list(reduced), spec)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` from every replica along ``axis``; each replica gets its own
        copy on its device. Sizes along ``axis`` may differ."""
        axis = gather_axis(axis, "ReplicaContext.all_gather")
        leaves, spec = _tree.flatten(value)
        tensors = [as_tensor(leaf, self._storage_device) for leaf in leaves]
        gathered = _AllGather.apply(self, axis, spec, *tensors)  # type: ignore[no-untyped-call]
        return _tree.unflatten(list(gathered), spec)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica waits; their ``args`` arrive regrouped as PerReplica values. Pending
        gradients are folded into the central variables first, so
        ``merge_call(lambda s: optimizer.step())`` works. A PerReplica result gives each replica
        its component; anything else reaches every replica as the same object.
        """
        kwargs = {} if kwargs is None else kwargs
        state = self._state
        if state is None:  # the default replica context: no run
            return self._merged([(tuple(args), kwargs)], merge_fn)[0]
        return state.meet(
            self._replica_id, "merge_call", (tuple(args), kwargs),
            lambda arrived: self._merged(arrived, merge_fn),
        )

    def _merged(self, arrived: list[Any], merge_fn: Callable[..., Any]) -> list[Any]:
        several = len(arrived) > 1
        args, kwargs = regroup(arrived) if several else arrived[0]
        result = self._merge(merge_fn, args, kwargs, several)
        return [select(result, replica) for replica in range(len(arrived))]

    def _collective(
        self, kind: str, value: Any, combine: Callable[[list[Any]], list[Any]],
        switch: Switch | None = None,
    ) -> Any:
        """``kind`` over every replica (``switch``: for a backward, the switch of the run
        that made the forward, which must still be in progress)."""
        state = self._state
        if state is None:  # the default replica context: no run
            return combine([value])[0]
        return state.meet(self._replica_id, kind, value, combine, switch)

    def _switch(self) -> Switch | None:
        """What identifies the run in progress, for a collective's backward to check."""
        return None if self._state is None else self._state.switch


def _same_structure(specs: Sequence[Any], what: str) -> None:
    for replica, spec in enumerate(specs):
        if spec != specs[0]:
            raise ValueError(
                f"{what} requires the same structure on every replica, but replica 0 gave "
                f"{specs[0]} and replica {replica} gave {spec}."
            )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rc: ReplicaContext[Any], op: ReduceOp, spec: Any, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rc, ctx.op, ctx.switch = rc, op, rc._switch()
        return _all_reduce(rc, op, spec, tensors, "all_reduce")

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = _all_reduce(
            ctx.rc, ctx.op, None, grads, "the backward of all_reduce", ctx.switch
        )
        return (None, None, None, *reduced)


def _all_reduce(
    rc: ReplicaContext[Any], op: ReduceOp, spec: Any, tensors: Sequence[torch.Tensor], what: str,
    switch: Switch | None = None,
) -> tuple[torch.Tensor, ...]:
    devices = rc._placement.storage_devices

    def combine(arrived: list[Any]) -> list[Any]:
        _same_structure([s for s, _ in arrived], what)
        home = devices[0]
        columns = list(zip(*(ts for _, ts in arrived), strict=True))
        totals = rc._workers.reduce(op, columns, None, home)  # over every worker
        return [
            tuple(t.to(devices[r], copy=r > 0) for t in totals) for r in range(len(arrived))
        ]

    return rc._collective(  # type: ignore[no-any-return]
        what, (spec, tuple(tensors)), combine, switch
    )


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rc: ReplicaContext[Any], axis: int, spec: Any, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rc, ctx.axis, ctx.switch = rc, axis, rc._switch()
        devices = rc._placement.storage_devices

        def combine(arrived: list[Any]) -> list[Any]:
            _same_structure([s for s, _ in arrived], "all_gather")
            columns = list(zip(*(ts for _, ts in arrived), strict=True))
            # over every worker; sizes in global replica order, for the backward's slices
            gathered, sizes = rc._workers.gather(columns, axis, devices[0])
            return [
                (tuple(g.to(devices[r], copy=r > 0) for g in gathered), sizes)
                for r in range(len(arrived))
            ]

        gathered, ctx.sizes = rc._collective("all_gather", (spec, tensors), combine)
        return gathered  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        summed = _all_reduce(
            ctx.rc, ReduceOp.SUM, None, grads, "the backward of all_gather", ctx.switch
        )
        replica = ctx.rc.replica_id_in_sync_group
        slices = []
        for grad, sizes in zip(summed, ctx.sizes, strict=True):
            start = sum(sizes[:replica])
            slices.append(grad.narrow(ctx.axis, start, sizes[replica]))
        return (None, None, None, *slices)
