"""The public namespace (docs/design.md §2): pinned names, and every method of the
strategy classes."""

from __future__ import annotations

import importlib
import types

import pytest

import centralstore as cs

PUBLIC = [
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

STRATEGY_METHODS = [
    "scope",
    "run",
    "experimental_run_v2",
    "reduce",
    "gather",
    "experimental_local_results",
    "experimental_distribute_dataset",
    "experimental_distribute_datasets_from_function",
    "distribute_datasets_from_function",
    "experimental_make_numpy_dataset",
    "experimental_distribute_values_from_function",
]
STRATEGY_PROPERTIES = ["extended", "num_replicas_in_sync", "compute_devices", "parameter_device"]
EXTENDED_METHODS = [
    "reduce_to",
    "batch_reduce_to",
    "update",
    "variable_created_in_scope",
    "colocate_vars_with",
    "value_container",
]
EXTENDED_PROPERTIES = ["parameter_devices", "worker_devices"]


def test_the_public_names_are_pinned() -> None:
    assert sorted(cs.__all__) == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_name_is_importable(name: str) -> None:
    module = importlib.import_module("centralstore")
    assert getattr(module, name) is getattr(cs, name)
    exec(f"from centralstore import {name}", {})


PUBLIC_MODULES = {"data", "errors"}  # cs.data and cs.errors, as tf.data and tf.errors


def test_nothing_else_is_public_in_the_namespace() -> None:
    # Submodules appear as attributes once imported (by the re-exports, or by another test).
    public = {
        name for name in dir(cs)
        if not name.startswith("_") and not isinstance(getattr(cs, name), types.ModuleType)
    }
    assert public | PUBLIC_MODULES == set(PUBLIC)
    assert all(isinstance(getattr(cs, name), types.ModuleType) for name in PUBLIC_MODULES)


@pytest.mark.parametrize(
    "strategy",
    [cs.CentralStorageStrategy(["cpu:0", "cpu:1"]), cs.OneDeviceStrategy("cpu:0")],
    ids=["central_storage", "one_device"],
)
def test_strategies_expose_every_method_of_the_design(strategy: cs.Strategy) -> None:
    assert isinstance(strategy, cs.Strategy)
    for name in STRATEGY_METHODS:
        assert callable(getattr(strategy, name)), name
    for name in STRATEGY_PROPERTIES:
        assert isinstance(getattr(type(strategy), name), property), name
    extended = strategy.extended
    assert isinstance(extended, cs.StrategyExtended)
    for name in EXTENDED_METHODS:
        assert callable(getattr(extended, name)), name
    for name in EXTENDED_PROPERTIES:
        assert isinstance(getattr(type(extended), name), property), name
    assert extended.worker_devices == strategy.compute_devices
    assert extended.parameter_devices == (strategy.parameter_device,)


def test_aliases_are_the_same_functions() -> None:
    for cls in (cs.CentralStorageStrategy, cs.OneDeviceStrategy):
        assert cls.experimental_run_v2 is cls.run
        assert (
            cls.distribute_datasets_from_function
            is cls.experimental_distribute_datasets_from_function
        )


def test_strategy_is_abstract() -> None:
    with pytest.raises(TypeError):
        cs.Strategy(["cpu:0"], "cpu:0")  # type: ignore[abstract]


def test_replica_context_exposes_its_calls() -> None:
    for name in ["all_reduce", "all_gather", "merge_call"]:
        assert callable(getattr(cs.ReplicaContext, name)), name
    for name in ["replica_id_in_sync_group", "num_replicas_in_sync", "strategy", "device"]:
        assert isinstance(getattr(cs.ReplicaContext, name), property), name
