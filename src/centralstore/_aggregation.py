"""``VariableAggregation``: how writes to a central variable from several replicas combine.

A module of its own, imported at load time by everything that compares aggregations by
identity, so that there is exactly one enum class.
"""

from __future__ import annotations

import enum


class VariableAggregation(enum.Enum):
    """How writes to a central variable from several replicas combine at the sync point.

    With var = 10 and replicas writing 1 and 2: ``add_`` gives 13 (SUM), 11.5 (MEAN), 11
    (ONLY_FIRST_REPLICA); ``copy_`` gives 3, 1.5, 1. NONE makes a write in a replica an error.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"

    @classmethod
    def parse(cls, value: VariableAggregation | str) -> VariableAggregation:
        if isinstance(value, VariableAggregation):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"aggregation must be one of {[m.name for m in cls]}. Received: aggregation={value!r}"
        )
