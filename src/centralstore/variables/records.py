"""The record of one central variable: a weak reference to it, its aggregation, and the
module slots that hold it."""

from __future__ import annotations

import weakref

import torch

from .._aggregation import VariableAggregation


class Central:
    """A central variable as its store knows it: held weakly, so that a dropped model leaves
    no trace; ``key`` is ``id`` of the tensor, the key of the store's records. ``owners``
    are the modules (held weakly) and attribute names under which it was registered. ``stamp``
moves at each optimizer step over it: fused kernels write without moving the version
counter, and views must see the new value."""

    __slots__ = ("aggregation", "is_buffer", "key", "owners", "ref", "stamp")

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


def default_buffer_aggregation(buffer: torch.Tensor) -> VariableAggregation:
    """Floating buffers (running statistics) average over replicas; integer ones (counters
    such as ``num_batches_tracked``) take the first replica's write."""
    if buffer.is_floating_point() or buffer.is_complex():
        return VariableAggregation.MEAN
    return VariableAggregation.ONLY_FIRST_REPLICA
