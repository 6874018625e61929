"""``CentralStorageStrategy``: variables stored once, replicas on several compute devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from .. import _devices
from .._devices import DeviceLike
from .base import Strategy


@final
class CentralStorageStrategy(Strategy):
    """Variables live once on ``parameter_device``; ``run`` replicates the step over
    ``compute_devices``, each replica on its slice of the global batch, and gradients come back
    summed onto the central variables, which the optimizer updates once.

    Defaults, as TensorFlow: every visible GPU computes (else the CPU), and the parameters
    live on the only GPU when exactly one computes, else on the CPU. Without GPUs, logical
    CPU devices (``"cpu:0"``, ``"cpu:1"``, ...) give several replicas on the host.

    >>> import centralstore as cs
    >>> strategy = cs.CentralStorageStrategy(compute_devices=["CPU:0", "CPU:1"])
    >>> strategy
    CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], parameter_device='cpu:0')
    >>> strategy.num_replicas_in_sync
    2
    """

    def __init__(
        self,
        compute_devices: Sequence[DeviceLike] | None = None,
        parameter_device: DeviceLike | None = None,
    ) -> None:
        if compute_devices is None:
            devices = _devices.default_compute_devices()
        else:
            devices = _devices.canonical_list(compute_devices, "compute_devices")
        if parameter_device is None:
            parameter = _devices.default_parameter_device(devices)
        else:
            parameter = _devices.canonical(parameter_device)
        super().__init__(devices, parameter)
