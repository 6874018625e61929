"""``VariableAggregation``: how writes to a central variable from several replicas combine.

A module of its own, imported at load time by everything that compares aggregations by
identity, so that there is exactly one enum class.
"""

from __future__ import annotations

import enum
from typing import TypeVar


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
        return _member(cls, value, "aggregation")


class VariableSynchronization(enum.Enum):
    """When the replicas' copies of a variable are combined, as TensorFlow names it.

    ``AUTO``, ``ON_WRITE`` and ``NONE``: one central value that the replicas' writes update
    at each sync point, combined by the variable's aggregation. ``ON_READ``: each replica keeps
    a copy of its own across runs (a metric's running totals), reads and writes only that
    copy inside ``run``, and reads outside ``run`` see the copies reduced by the aggregation
    (SUM, MEAN, ONLY_FIRST_REPLICA); a write outside ``run`` sets every copy (for SUM, each
    copy gets the value divided by the number of replicas).
    """

    AUTO = "AUTO"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"
    NONE = "NONE"

    @classmethod
    def parse(cls, value: VariableSynchronization | str) -> VariableSynchronization:
        return _member(cls, value, "synchronization")


E = TypeVar("E", bound=enum.Enum)


def _member(cls: type[E], value: E | str, what: str) -> E:
    """The member of ``cls`` that ``value`` is or names (any case), else ``ValueError``."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    raise ValueError(
        f"{what} must be one of {[m.name for m in cls]}. Received: {what}={value!r}"
    )
