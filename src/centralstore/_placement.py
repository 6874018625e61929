"""``Placement``: where a strategy's replicas compute and its variables live, as one value.

Built once by ``Strategy.__init__`` and handed down to everything below it (the variable
store, replica contexts, ``strategy.extended``), so that nothing below the strategy reads its
fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _devices


@dataclass(frozen=True, slots=True)
class Placement:
    """The devices of one strategy in one worker process.

    ``compute_devices`` are canonical names in replica order; ``torch_devices`` the same as
    ``torch.device`` (``cpu:1`` is ``torch.device("cpu", 1)``); ``storage_devices`` where
    their tensors actually live (every logical CPU device stores on ``cpu``). With several
    worker processes, ``replica_offset`` is the global id of this worker's first replica and
    ``num_replicas`` counts the replicas of every worker.

    >>> p = Placement.build(["cpu:0", "cpu:1"], "cpu:0")
    >>> p.storage_devices, p.local_replicas, p.num_replicas
    ((device(type='cpu'), device(type='cpu')), 2, 2)
    """

    compute_devices: tuple[str, ...]
    parameter_device: str
    torch_devices: tuple[torch.device, ...]
    storage_devices: tuple[torch.device, ...]
    parameter_storage: torch.device
    replica_offset: int
    local_replicas: int
    num_replicas: int

    @classmethod
    def build(
        cls,
        compute_devices: Sequence[str],
        parameter_device: str,
        num_workers: int = 1,
        worker_index: int = 0,
    ) -> Placement:
        """The placement of canonical ``compute_devices`` and ``parameter_device`` on worker
        ``worker_index`` of ``num_workers`` (each with as many replicas)."""
        local = len(compute_devices)
        return cls(
            compute_devices=tuple(compute_devices),
            parameter_device=parameter_device,
            torch_devices=tuple(_devices.torch_device(d) for d in compute_devices),
            storage_devices=tuple(_devices.storage_device(d) for d in compute_devices),
            parameter_storage=_devices.storage_device(parameter_device),
            replica_offset=worker_index * local,
            local_replicas=local,
            num_replicas=local * num_workers,
        )
