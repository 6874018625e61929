"""``VariableAggregation``: how writes to a central variable from several replicas combine.

A module of its own, imported at load time by everything that compares aggregations by
identity, so that there is exactly one enum class. The arithmetic of the combination lives
here too, once (``write_term``, ``written_value``): a process combines its replicas' writes
with it (``variables/folding.py``), and the workers combine theirs with it across processes
(``strategies/_exchange.py``).
"""

from __future__ import annotations

import enum
from typing import TypeVar

import torch


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


# -- how writes combine: one arithmetic for the replicas of a process and for the workers ----
#
# A *group* of writers is one replica, or one worker's replicas already combined. Each group
# gives a term; the terms are summed (in order on one process, by an all-reduce across
# workers); ``written_value`` turns the sum into the variable's new value. Under SUM a group
# that only added gives its change (a delta), and once any writer assigned the groups give
# final values instead. MEAN and ONLY_FIRST_REPLICA always combine final values: there the
# two differ only in rounding, and a write read off a module slot cannot tell an assignment
# (``out=``, ``copy_``) from an addition, so folding final values gives the same bits on
# every replica path. Only the first group's term counts for ONLY_FIRST_REPLICA: the caller
# leaves the others out (locally) or makes them zeros (across workers).


def by_value(aggregation: VariableAggregation) -> bool:
    """Whether writes under ``aggregation`` combine by their final values whatever their
    kind (MEAN, ONLY_FIRST_REPLICA), rather than as changes unless one assigned (SUM)."""
    return aggregation is not VariableAggregation.SUM


def write_term(
    aggregation: VariableAggregation,
    start: torch.Tensor | None,
    value: torch.Tensor,
    count: int,
    assigned: bool,
    any_assigned: bool,
) -> torch.Tensor:
    """One group's term in the sum that combines the writes to a variable: ``count`` replicas
    moved it from ``start`` to ``value`` (their own combination by ``aggregation``;
    ``assigned``: one of them assigned; ``any_assigned``: some writer of any group did).
    Only SUM reads ``start``: it may be None where writes combine by value (``by_value``).

    >>> c = torch.tensor(10.0)
    >>> write_term(VariableAggregation.SUM, c, torch.tensor(13.0), 2, False, False)
    tensor(3.)
    >>> write_term(VariableAggregation.SUM, c, torch.tensor(13.0), 2, False, True)  # 11 + 12
    tensor(23.)
    >>> write_term(VariableAggregation.MEAN, c, torch.tensor(11.5), 2, False, False)
    tensor(23.)
    """
    if aggregation is VariableAggregation.MEAN:  # final values, a group weighted by its writers
        return value * count if count != 1 else value
    if by_value(aggregation):
        return value
    assert start is not None, "a SUM's writes combine from the value before them"
    if not any_assigned:  # SUM's deltas
        return value - start
    if not assigned and count != 1:
        return value + start * (count - 1)  # the sum of its writers' finals: start + delta each
    return value


def written_value(
    aggregation: VariableAggregation,
    start: torch.Tensor | None,
    total: torch.Tensor,
    count: int,
    any_assigned: bool,
) -> torch.Tensor:
    """The variable's value after its writes: ``total`` is the sum of every group's
    ``write_term`` and ``count`` the number of replicas that wrote (MEAN's denominator).
    As in ``write_term``, only SUM reads ``start``.

    >>> c = torch.tensor(10.0)  # replicas writing 1 and 2 by add_ (SUM's deltas, MEAN's finals)
    >>> [float(written_value(a, c, torch.tensor(t), 2, False)) for a, t in
    ...  ((VariableAggregation.SUM, 3.0), (VariableAggregation.MEAN, 23.0))]
    [13.0, 11.5]
    >>> [float(written_value(a, c, torch.tensor(3.0), 2, True)) for a in  # then by copy_
    ...  (VariableAggregation.SUM, VariableAggregation.MEAN)]
    [3.0, 1.5]
    """
    if aggregation is VariableAggregation.MEAN:
        total = total / count
    if any_assigned or by_value(aggregation):
        return total
    assert start is not None, "a SUM's writes combine from the value before them"
    return start + total


def sum_in_order(terms: list[torch.Tensor]) -> torch.Tensor:
    """``terms[0] + terms[1] + ...``, left to right (reproducible at a fixed number of
    replicas)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
