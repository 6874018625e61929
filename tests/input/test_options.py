"""InputOptions validation and InputContext's per-replica batch size table."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pytest

from centralstore.input.options import InputContext, InputOptions


class ReplicationMode(enum.Enum):  # what a ported tf.distribute.InputReplicationMode looks like
    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


def test_input_options_defaults_match_tensorflow() -> None:
    options = InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_per_replica_buffer_size == 1
    assert options.experimental_replication_mode is None
    assert options.experimental_place_dataset_on_device is False


def test_input_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        InputOptions().experimental_per_replica_buffer_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("mode", [None, "PER_WORKER", "per_worker", ReplicationMode.PER_WORKER])
def test_per_worker_replication_mode_is_accepted(mode: object) -> None:
    assert InputOptions(experimental_replication_mode=mode).experimental_replication_mode is mode


@pytest.mark.parametrize("mode", ["PER_REPLICA", "per_replica", ReplicationMode.PER_REPLICA])
def test_per_replica_mode_is_a_value_error_that_says_how_to_fix_the_call(mode: object) -> None:
    with pytest.raises(ValueError) as caught:
        InputOptions(experimental_replication_mode=mode)
    message = str(caught.value)
    assert "PER_REPLICA is not supported by this strategy" in message
    assert "one input pipeline per replica" in message
    assert "PER_WORKER is what both experimental_distribute_dataset and " in message
    assert "distribute_datasets_from_function do" in message
    assert "Pass experimental_replication_mode=None (or 'PER_WORKER')" in message
    assert message.endswith(f"Received: experimental_replication_mode={mode!r}")


def test_unknown_replication_mode_raises() -> None:
    with pytest.raises(ValueError, match="Received: experimental_replication_mode='sideways'"):
        InputOptions(experimental_replication_mode="sideways")


@pytest.mark.parametrize("size", [0, -1])
def test_buffer_size_below_one_raises(size: int) -> None:
    with pytest.raises(ValueError, match=f"at least 1.*buffer_size={size}"):
        InputOptions(experimental_per_replica_buffer_size=size)


@pytest.mark.parametrize("size", ["2", 2.0, True])
def test_buffer_size_of_the_wrong_type_raises(size: object) -> None:
    with pytest.raises(TypeError, match="must be an int"):
        InputOptions(experimental_per_replica_buffer_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", ["experimental_fetch_to_device", "experimental_place_dataset_on_device"]
)
def test_flags_must_be_bools(field: str) -> None:
    with pytest.raises(TypeError, match=f"{field} must be a bool.*Received: {field}=1"):
        InputOptions(**{field: 1})  # type: ignore[arg-type]


def test_place_dataset_on_device_needs_fetch_to_device_off() -> None:
    with pytest.raises(ValueError, match="experimental_fetch_to_device=False"):
        InputOptions(experimental_place_dataset_on_device=True)
    options = InputOptions(
        experimental_fetch_to_device=False, experimental_place_dataset_on_device=True
    )
    assert options.experimental_place_dataset_on_device


@pytest.mark.parametrize(
    ("global_batch", "replicas", "per_replica"), [(8, 2, 4), (0, 2, 0), (9, 1, 9), (12, 3, 4)]
)
def test_per_replica_batch_size_table(global_batch: int, replicas: int, per_replica: int) -> None:
    assert InputContext(1, 0, replicas).get_per_replica_batch_size(global_batch) == per_replica


def test_per_replica_batch_size_not_divisible_raises_tensorflows_message() -> None:
    with pytest.raises(
        ValueError, match="The `global_batch_size` 9 is not divisible by `num_replicas_in_sync` 2"
    ):
        InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(9)


def test_per_replica_batch_size_of_a_negative_batch_raises() -> None:
    with pytest.raises(ValueError, match="global_batch_size=-4"):
        InputContext().get_per_replica_batch_size(-4)


@pytest.mark.parametrize("value", [8.0, "8", True])
def test_per_replica_batch_size_needs_an_int(value: object) -> None:
    with pytest.raises(TypeError, match="global_batch_size must be an int"):
        InputContext().get_per_replica_batch_size(value)  # type: ignore[arg-type]


def test_input_context_accepts_numpy_ints() -> None:
    context = InputContext(np.int64(2), np.int32(1), np.int64(4))  # type: ignore[arg-type]
    assert context.get_per_replica_batch_size(np.int64(8)) == 2  # type: ignore[arg-type]


def test_input_context_properties_are_read_only_and_repr_is_readable() -> None:
    context = InputContext(2, 1, 4)
    assert (context.num_input_pipelines, context.input_pipeline_id) == (2, 1)
    assert context.num_replicas_in_sync == 4
    assert repr(context) == (
        "InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)"
    )
    with pytest.raises(AttributeError):
        context.num_replicas_in_sync = 2  # type: ignore[misc]


def test_input_context_defaults() -> None:
    assert repr(InputContext()) == (
        "InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)"
    )


@pytest.mark.parametrize(("pipelines", "replicas"), [(0, 1), (1, 0), (-1, 2)])
def test_input_context_counts_below_one_raise(pipelines: int, replicas: int) -> None:
    with pytest.raises(ValueError, match=f"num_input_pipelines={pipelines}"):
        InputContext(pipelines, 0, replicas)


@pytest.mark.parametrize("pipeline_id", [2, -1])
def test_input_pipeline_id_out_of_range_raises(pipeline_id: int) -> None:
    with pytest.raises(ValueError, match=f"input_pipeline_id == {pipeline_id}"):
        InputContext(2, pipeline_id, 2)


def test_input_context_bool_raises() -> None:
    with pytest.raises(TypeError, match="not a bool"):
        InputContext(num_replicas_in_sync=True)
