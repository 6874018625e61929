"""Declaring central variables by hand: ``cs.Variable`` and ``cs.set_aggregation``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _context
from .._aggregation import VariableAggregation, VariableSynchronization
from .store import current_store


def Variable(
    initial_value: Any,
    aggregation: VariableAggregation | str = VariableAggregation.NONE,
    trainable: bool = True,
    synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
) -> torch.Tensor:
    """A central variable of the current strategy, stored once on its parameter device.

    ``trainable`` means ``requires_grad`` (floating dtypes only). ``aggregation`` says how
    writes from several replicas combine. Inside ``run`` it is a replica-local tensor on the
    replica's device, like every tensor created there.

    ``synchronization=ON_READ`` (as TensorFlow's sync-on-read variables, which Keras metrics
    use): each replica keeps a copy of its own across runs, reads and writes only that copy
    inside ``run``, and the variable itself holds the copies' reduction by ``aggregation``
    (SUM, MEAN or ONLY_FIRST_REPLICA), updated at each sync point; so does every read outside
    ``run`` (``state_dict``, checkpoints). Set outside ``run``, every copy starts again from
    the new value: for SUM each gets the value divided by the number of replicas.


    >>> import centralstore as cs
    >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     steps = cs.Variable(0, aggregation="ONLY_FIRST_REPLICA", trainable=False)
    >>> _ = strategy.run(lambda: steps.add_(1))
    >>> int(steps)
    1
    >>> with strategy.scope():
    ...     seen = cs.Variable(0.0, "SUM", trainable=False, synchronization="ON_READ")
    >>> for _ in range(2):
    ...     _ = strategy.run(lambda: seen.copy_(seen + 1.0))  # each replica its own copy
    >>> float(seen)
    4.0
    """
    parsed = VariableAggregation.parse(aggregation)
    on_read = VariableSynchronization.parse(synchronization)
    value = torch.from_numpy(initial_value) if isinstance(initial_value, np.ndarray) else (
        torch.as_tensor(initial_value)
    )
    entry = _context.current()
    in_replica = entry.replica_context is not None and entry is not _context.default()
    store = current_store()
    device = torch.get_default_device() if in_replica else store.placement.parameter_storage
    tensor = value.detach().to(device, copy=True)
    if trainable and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    if not in_replica:
        store.register(tensor, parsed, synchronization=on_read)
    return tensor


def set_aggregation(tensor: torch.Tensor, aggregation: VariableAggregation | str) -> None:
    """Give a central variable of the current strategy an aggregation for writes in ``run``.

    >>> import centralstore as cs
    >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     total = torch.zeros((), requires_grad=True)
    ...     cs.set_aggregation(total, "SUM")
    >>> with torch.no_grad():
    ...     _ = strategy.run(lambda: total.add_(1.0))
    >>> total.item()
    2.0
    """
    store = current_store()
    if store.record(tensor) is None:
        raise ValueError(
            f"set_aggregation needs a central variable of {_context.current().strategy!r}, "
            f"but got a tensor of "
            f"shape {tuple(tensor.shape)} that is not one. Create it inside strategy.scope() "
            "(on a module, with requires_grad=True, or with cs.Variable) and call "
            "set_aggregation inside that scope."
        )
    store.register(tensor, VariableAggregation.parse(aggregation))
