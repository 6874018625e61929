"""centralstore: TensorFlow's ``tf.distribute`` Strategy API for PyTorch.

Variables live once on a parameter device; ``strategy.run`` replicates a step over compute
devices and folds the replicas' gradients back onto the central variables.
"""

from ._aggregation import VariableAggregation as VariableAggregation
from ._aggregation import VariableSynchronization as VariableSynchronization
from ._host_memory import keep_host_memory as keep_host_memory
from ._losses import compute_average_loss as compute_average_loss
from ._losses import scale_regularization_loss as scale_regularization_loss
from ._reduce import ReduceOp as ReduceOp
from ._replica_context import ReplicaContext as ReplicaContext
from ._values import PerReplica as PerReplica
from ._values import ValueContext as ValueContext
from .checkpoint import Checkpoint as Checkpoint
from .checkpoint import CheckpointManager as CheckpointManager
from .checkpoint import RNGState as RNGState
from .input import data as data
from .input import errors as errors
from .input.dataset import Dataset as Dataset
from .input.options import InputContext as InputContext
from .input.options import InputOptions as InputOptions
from .input.spec import TensorSpec as TensorSpec
from .strategies.base import Strategy as Strategy
from .strategies.central_storage import CentralStorageStrategy as CentralStorageStrategy
from .strategies.context import get_replica_context as get_replica_context
from .strategies.context import get_strategy as get_strategy
from .strategies.context import has_strategy as has_strategy
from .strategies.context import in_cross_replica_context as in_cross_replica_context
from .strategies.extended import StrategyExtended as StrategyExtended
from .strategies.multi_worker import (
    MultiWorkerCentralStorageStrategy as MultiWorkerCentralStorageStrategy,
)
from .strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from .variables.declare import Variable as Variable
from .variables.declare import set_aggregation as set_aggregation

__version__ = "0.1.0"

__all__ = [
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointManager",
    "Dataset",
    "InputContext",
    "InputOptions",
    "MultiWorkerCentralStorageStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "RNGState",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "TensorSpec",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "compute_average_loss",
    "data",
    "errors",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "keep_host_memory",
    "scale_regularization_loss",
    "set_aggregation",
]
