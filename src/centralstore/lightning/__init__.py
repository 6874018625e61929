"""Lightning's ``Trainer`` on R replicas in one process: ``centralstore.lightning``.

``CentralStorageStrategy`` is a Lightning ``Strategy``: ``Trainer(strategy=...)`` trains an
unmodified ``LightningModule`` with its parameters stored once, on the parameter device, each
global batch split over the compute devices, each replica's gradients summed, and one
optimizer step, as one device would on the whole batch (docs/lightning.md). It needs Lightning
2: ``pip install 'centralstore[lightning]'``; importing this package without it raises
``ModuleNotFoundError`` saying so.

>>> import centralstore as cs
>>> import centralstore.lightning
>>> cs.lightning.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
lightning.CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], parameter_device='cpu:0')
"""

from __future__ import annotations

from ._strategy import CentralStorageStrategy as CentralStorageStrategy

__all__ = ["CentralStorageStrategy"]
