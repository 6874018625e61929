"""``cs.data``: the ``tf.data`` names, for code ported by renaming ``tf.data`` to ``cs.data``.

>>> from centralstore.input import data
>>> options = data.Options()
>>> options.experimental_distribute.auto_shard_policy = data.AutoShardPolicy.DATA
>>> [int(x) for x in data.Dataset.range(3).with_options(options).prefetch(data.AUTOTUNE)]
[0, 1, 2]
"""

from . import data_experimental as experimental
from ._base import INFINITE_CARDINALITY as INFINITE_CARDINALITY
from ._base import UNKNOWN_CARDINALITY as UNKNOWN_CARDINALITY
from .data_options import AUTOTUNE as AUTOTUNE
from .data_options import AutoShardPolicy as AutoShardPolicy
from .data_options import DistributeOptions as DistributeOptions
from .data_options import Options as Options
from .dataset import Dataset as Dataset
from .spec import TensorSpec as TensorSpec

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "Dataset",
    "DistributeOptions",
    "Options",
    "TensorSpec",
    "experimental",
]
