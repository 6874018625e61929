"""The record of one central variable: a weak reference to it, its aggregation, and the
module slots that hold it."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from itertools import repeat
from operator import call, is_not
from typing import Any

import torch

from .._aggregation import VariableAggregation


class Central:
    """A central variable as its store knows it: held weakly, so that a dropped model leaves
    no trace; ``key`` is ``id`` of the tensor, the key of the store's records. ``owners``
    are the modules (held weakly) and attribute names under which it was registered. ``stamp``
    moves at each optimizer step over it: fused kernels write without moving the version
    counter, and views must see the new value. ``optimized``: some optimizer holds it (noted
    at the optimizer's steps), so a run that leaves it without a gradient may still train it
    later; one that no optimizer holds and no run trains is idle (``runs.Plan``).

    ``on_read``: synchronized on read (``VariableSynchronization.ON_READ``): each replica
    keeps a copy of its own across runs (its view, ``views.py``), and the central value is
    their reduction, updated at each sync point. ``synced`` stamps the central value (its
    version and storage) as the copies last agreed with it; a central value written since
    (in cross-replica context: ``assign``, ``load_state_dict``) starts a new ``generation``,
    whose copies each begin from ``reset`` (TensorFlow's rule, ``on_read_reset``)."""

    __slots__ = (
        "aggregation", "generation", "is_buffer", "key", "on_read", "optimized", "owners", "ref",
        "reset", "stamp", "synced",
    )

    def __init__(
        self, key: int, ref: weakref.ref[torch.Tensor], aggregation: VariableAggregation,
        is_buffer: bool,
    ) -> None:
        self.key = key
        self.ref = ref
        self.aggregation = aggregation
        self.is_buffer = is_buffer
        self.owners: list[tuple[weakref.ref[torch.nn.Module], str]] = []
        self.stamp = 0  # moved by every optimizer step over the variable (steps.py)
        self.optimized = False  # some optimizer that stepped holds it (steps.py)
        self.on_read = False
        self.synced: tuple[int, int] | None = None
        self.generation = 0
        self.reset: tuple[torch.Tensor, torch.Tensor] | None = None

    def add_owner(self, module: torch.nn.Module, name: str) -> bool:
        """Note that ``module`` holds this variable as ``name``; False if already known."""
        for ref, known in self.owners:
            if known == name and ref() is module:
                return False
        self.owners.append((weakref.ref(module), name))
        return True


def check_aggregation(tensor: torch.Tensor, aggregation: VariableAggregation) -> None:
    """Integer variables cannot be MEAN-aggregated."""
    if aggregation is VariableAggregation.MEAN and not (
        tensor.is_floating_point() or tensor.is_complex()
    ):
        raise ValueError(
            f"An integer variable (dtype {tensor.dtype}) cannot be MEAN-aggregated: the mean of "
            "integers is not an integer. Use SUM or ONLY_FIRST_REPLICA, or a floating dtype."
        )


def check_on_read(tensor: torch.Tensor, aggregation: VariableAggregation) -> None:
    """A variable synchronized on read needs an aggregation that reduces its copies."""
    if aggregation is VariableAggregation.NONE:
        raise ValueError(
            f"A variable synchronized on read (shape {tuple(tensor.shape)}) keeps one copy "
            "per replica and is read as their reduction, so it needs an aggregation that "
            "reduces them: SUM, MEAN or ONLY_FIRST_REPLICA. Received: aggregation=NONE"
        )


def on_read_reset(
    central: torch.Tensor, aggregation: VariableAggregation, num_replicas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values the replicas' copies of an ON_READ variable take when its central value
    was set in cross-replica context, as TensorFlow's ``on_read_assign_cross_replica``
    (``distribute/values_util.py``) sets them: for SUM, the value divided by the number of
    replicas (so that the copies sum to it), otherwise the value itself. Returns (replica
    0's, every other replica's): an integer SUM divides with the remainder on replica 0,
    so that the copies sum to the value exactly (TensorFlow truncates)."""
    value = central.detach().clone()
    if aggregation is not VariableAggregation.SUM or num_replicas == 1:
        return value, value
    if value.is_floating_point() or value.is_complex():
        share = value / num_replicas
        return share, share
    share = torch.div(value, num_replicas, rounding_mode="floor")
    return value - share * (num_replicas - 1), share


def default_buffer_aggregation(buffer: torch.Tensor) -> VariableAggregation:
    """Floating buffers (running statistics) average over replicas; integer ones (counters
    such as ``num_batches_tracked``) take the first replica's write."""
    if buffer.is_floating_point() or buffer.is_complex():
        return VariableAggregation.MEAN
    return VariableAggregation.ONLY_FIRST_REPLICA


def alive(refs: Iterable[weakref.ref[Any]]) -> list[Any]:
    """The variables that ``refs`` still reach, in order: followed in one pass in C, with a
    second pass only when one is dying right now."""
    found: list[Any] = list(map(call, refs))
    if all(map(is_not, found, repeat(None))):
        return found
    return [value for value in found if value is not None]
