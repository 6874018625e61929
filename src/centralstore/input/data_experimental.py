"""``cs.data.experimental``: the older ``tf.data.experimental`` spellings of ``cs.data`` names.

>>> from centralstore.input import data_experimental as experimental
>>> experimental.AutoShardPolicy.OFF, experimental.AUTOTUNE
(<AutoShardPolicy.OFF: -1>, -1)
"""

from ._base import INFINITE_CARDINALITY as INFINITE_CARDINALITY
from ._base import UNKNOWN_CARDINALITY as UNKNOWN_CARDINALITY
from .data_options import AUTOTUNE as AUTOTUNE
from .data_options import AutoShardPolicy as AutoShardPolicy
from .data_options import DistributeOptions as DistributeOptions

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "DistributeOptions",
]
