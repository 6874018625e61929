"""Keras variables as central variables, with the aggregation Keras declared for them.

A Keras variable on PyTorch holds its value in a ``torch.nn.Parameter`` (``variable.value``).
Created inside ``strategy.scope()`` it becomes a central variable of the strategy like any
tensor registered there, and it keeps its declared aggregation: ``"sum"``, ``"mean"`` and
``"only_first_replica"`` map onto ``VariableAggregation``. Keras declares ``"none"`` for
nearly everything, so ``"none"`` means NONE for a trainable variable (only the optimizer
writes it, after ``run``) and, for a non-trainable one such as ``BatchNormalization``'s moving
statistics, what a torch buffer of its dtype gets: MEAN for floating point, as torch's
``BatchNorm`` running statistics, ONLY_FIRST_REPLICA for integers (seed states, counters).
Metric variables declare ``"sum"`` and ``synchronization="on_read"``: a variable synchronized
on read becomes an ON_READ central variable (``cs.VariableSynchronization``), one copy per
replica folded into the central value at each sync point, so that a metric updated with
``var.assign(var + x)`` (AUC, Precision, F1Score, ...) counts every replica's ``x`` once.

Variables that Keras creates later, outside the scope (the compiled metrics, a model built on
its first batch), are made central variables of the model's strategy when ``fit``,
``evaluate`` or ``predict`` first runs under it (``prepare``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .._aggregation import VariableAggregation, VariableSynchronization
from ..strategies.base import Strategy
from ..strategies.context import get_strategy, has_strategy, in_cross_replica_context
from ..variables.declare import set_aggregation
from ..variables.records import default_buffer_aggregation
from ..variables.store import current_store

_DECLARED = {
    "sum": VariableAggregation.SUM,
    "mean": VariableAggregation.MEAN,
    "only_first_replica": VariableAggregation.ONLY_FIRST_REPLICA,
}

# The strategy of each registered Keras variable, by id, while the variable lives: as in
# TensorFlow, a model keeps its strategy alive (``with cs.CentralStorageStrategy().scope():``
# keeps no reference to it).
_owners: dict[int, Strategy] = {}


def aggregation_of(variable: Any) -> VariableAggregation:
    """The ``VariableAggregation`` of a Keras variable (see the module's docstring).

    >>> from centralstore.keras._backend import load
    >>> keras = load()  # Keras, on its PyTorch backend
    >>> aggregation_of(keras.Variable(0.0, trainable=False, aggregation="sum"))
    <VariableAggregation.SUM: 'SUM'>
    >>> aggregation_of(keras.Variable(0.0, trainable=False))  # a moving statistic
    <VariableAggregation.MEAN: 'MEAN'>
    >>> aggregation_of(keras.Variable(0.0))  # a weight
    <VariableAggregation.NONE: 'NONE'>
    """
    declared = _DECLARED.get(str(variable.aggregation))
    if declared is not None:
        return declared
    if variable.trainable:
        return VariableAggregation.NONE
    return default_buffer_aggregation(variable.value)


def synchronization_of(variable: Any) -> VariableSynchronization:
    """ON_READ for a Keras variable declared ``synchronization="on_read"`` (metric
    variables) that has an aggregation to reduce its copies by; ON_WRITE otherwise."""
    if str(getattr(variable, "synchronization", "auto")) == "on_read" and (
        aggregation_of(variable) is not VariableAggregation.NONE
    ):
        return VariableSynchronization.ON_READ
    return VariableSynchronization.ON_WRITE


def scope_strategy() -> Strategy | None:
    """The strategy whose scope (cross-replica context) the caller is in, if any."""
    if has_strategy() and in_cross_replica_context():
        return get_strategy()
    return None


def register(variable: Any, strategy: Strategy) -> None:
    """Make ``variable`` a central variable of ``strategy`` with its aggregation; call it
    inside ``strategy.scope()``."""
    tensor = variable.value
    if not strategy.extended.variable_created_in_scope(tensor):
        # Registered as a module's parameters and buffers are in the scope: Keras stores
        # every variable, trainable or not, as an nn.Parameter.
        holder = torch.nn.Module()
        if isinstance(tensor, torch.nn.Parameter):
            holder.register_parameter("variable", tensor)
        else:
            holder.register_buffer("variable", tensor)
    aggregation = aggregation_of(variable)
    set_aggregation(tensor, aggregation)
    current_store().register(tensor, aggregation, synchronization=synchronization_of(variable))
    key = id(variable)
    if _owners.get(key) is not strategy:
        _owners[key] = strategy
        weakref.finalize(variable, _owners.pop, key, None)


def strategy_of(model: Any) -> Strategy | None:
    """The strategy that holds the variables of ``model`` (weights or metrics), or None.

    Raises ``ValueError`` when they belong to several strategies.
    """
    owners: list[Strategy] = []
    for variable in _variables_of(model):
        strategy = _owners.get(id(variable))
        if (
            strategy is not None
            and all(strategy is not owner for owner in owners)
            and strategy.extended.variable_created_in_scope(variable.value)
        ):
            owners.append(strategy)
    if len(owners) > 1:
        raise ValueError(
            f"The variables of Keras model {model.name!r} belong to {len(owners)} strategies, "
            "so it is unclear which one distributes its training. Create the whole model, "
            "and compile it, inside one strategy's scope. Received: "
            + ", ".join(repr(s) for s in owners)
        )
    return owners[0] if owners else None


def prepare(model: Any, strategy: Strategy) -> None:
    """Make every variable of ``model`` (weights and metric variables, including those Keras
    built outside the scope) a central variable of ``strategy`` with its aggregation."""
    with strategy.scope():
        for variable in _variables_of(model):
            register(variable, strategy)


def _variables_of(model: Any) -> Iterable[Any]:
    yield from model.variables
    yield from model.metrics_variables
