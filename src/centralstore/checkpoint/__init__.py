"""Checkpoints that survive faults: ``Checkpoint``, ``CheckpointManager``, ``RNGState``.

TensorFlow's ``tf.train.Checkpoint`` and ``tf.train.CheckpointManager`` over PyTorch's
``state_dict``s, written atomically, with distributed iterators' positions and the random
generators, for jobs that torchrun restarts after a worker died.
"""

from .checkpoint import Checkpoint as Checkpoint
from .manager import CheckpointManager as CheckpointManager
from .rng import RNGState as RNGState

__all__ = ["Checkpoint", "CheckpointManager", "RNGState"]
