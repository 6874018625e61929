"""The Hugging Face ``Trainer`` on a centralstore strategy, instead of ``nn.DataParallel``.

``transformers.Trainer`` wraps the model in ``nn.DataParallel`` whenever it sees several GPUs
in one process. ``centralstore.transformers.Trainer`` takes the same arguments plus
``strategy=``: the model's parameters are the strategy's central variables (stored once, on
its parameter device), every global batch is split over the replicas by TensorFlow's rule,
each replica's forward and backward run inside ``strategy.run`` with its loss weighted as one
device would weight the whole batch, and the optimizer steps once on the summed gradients.
Evaluation and prediction are gathered in batch order; checkpoints are one device's.

Hugging Face transformers is an optional dependency:
``pip install 'centralstore[transformers]'``. Importing this module without it raises
``ModuleNotFoundError`` (an ``ImportError``) saying so.

>>> import centralstore as cs
>>> import centralstore.transformers
>>> cs.transformers.Trainer.__mro__[1].__module__
'transformers.trainer'

See docs/huggingface.md for a guide.
"""

from __future__ import annotations

from ._trainer import Trainer as Trainer

__all__ = ["Trainer"]
