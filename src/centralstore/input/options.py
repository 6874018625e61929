"""``InputOptions`` (placement and prefetch of distributed input) and ``InputContext``."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset places and prefetches its per-replica slices.

    Works in both ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    (TensorFlow's first one rejects every options object through a typo).

    Args:
        experimental_fetch_to_device: place every slice on its replica's device (``True``) or
            keep it on the host (``False``), e.g. to move it yourself inside the step.
        experimental_per_replica_buffer_size: how many steps a background thread prepares
            ahead of the training loop (at least 1) when replicas compute on GPUs, so that
            the host-to-device copies overlap the step. For replicas on the host the first
            steps are made on the calling thread, and the thread starts once the loop's steps
            take time (an eighth of a batch's making time, twice in a row; at the first step
            of the passes after one where that paid), so that making the next batch overlaps
            the step.
        experimental_replication_mode: ``None`` or ``"PER_WORKER"`` (one input pipeline per
            process, TensorFlow's default); ``"PER_REPLICA"`` raises ``ValueError``.
        experimental_place_dataset_on_device: run the pipeline on the calling thread, placing
            each step on the devices when it is requested, without a prefetch thread. As in
            TensorFlow it requires ``experimental_fetch_to_device=False``.

    >>> InputOptions(experimental_per_replica_buffer_size=2).experimental_fetch_to_device
    True
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    experimental_replication_mode: Any = None
    experimental_place_dataset_on_device: bool = False

    def __post_init__(self) -> None:
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"InputOptions.{name} must be a bool. Received: {name}={value!r}")
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(
                "InputOptions.experimental_per_replica_buffer_size must be an int. "
                f"Received: experimental_per_replica_buffer_size={size!r}"
            )
        if size < 1:
            raise ValueError(
                "InputOptions.experimental_per_replica_buffer_size must be at least 1 (the "
                "number of steps prepared ahead). "
                f"Received: experimental_per_replica_buffer_size={size}"
            )
        _check_replication_mode(self.experimental_replication_mode)
        if self.experimental_place_dataset_on_device and self.experimental_fetch_to_device:
            raise ValueError(
                "`experimental_place_dataset_on_device` can not be set to True when "
                "`experimental_fetch_to_device` is True: a pipeline placed on the device is "
                "not fetched to it again. Pass experimental_fetch_to_device=False as well."
            )


def _check_replication_mode(mode: Any) -> None:
    """Accept ``None`` and PER_WORKER, spelled as a string in any case or as an enum member."""
    if mode is None:
        return
    name = mode if isinstance(mode, str) else getattr(mode, "name", None)
    if isinstance(name, str) and name.upper() == "PER_WORKER":
        return
    if isinstance(name, str) and name.upper() == "PER_REPLICA":
        raise ValueError(
            "experimental_replication_mode=PER_REPLICA is not supported by this strategy: it "
            "would need one input pipeline per replica, and centralstore runs one per process. "
            "PER_WORKER is what both experimental_distribute_dataset and "
            "distribute_datasets_from_function do: one pipeline whose global batches are "
            "split, or whose per-replica batches are dealt round-robin, over the replicas. "
            "Pass experimental_replication_mode=None (or 'PER_WORKER'); for batches made per "
            "replica, return them from the dataset_fn of distribute_datasets_from_function. "
            f"Received: experimental_replication_mode={mode!r}"
        )
    raise ValueError(
        "InputOptions.experimental_replication_mode must be None or 'PER_WORKER'. "
        f"Received: experimental_replication_mode={mode!r}"
    )


class InputContext:
    """What ``dataset_fn`` receives in ``distribute_datasets_from_function``.

    It says how many input pipelines there are (one per process), which one this is, and how
    many replicas consume the input, so ``dataset_fn`` can shard and size its batches.

    >>> ctx = InputContext(num_replicas_in_sync=2)
    >>> ctx.get_per_replica_batch_size(8)
    4
    >>> ctx
    InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    """

    __slots__ = ("_input_pipeline_id", "_num_input_pipelines", "_num_replicas_in_sync")

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ) -> None:
        num_input_pipelines = as_int("num_input_pipelines", num_input_pipelines)
        input_pipeline_id = as_int("input_pipeline_id", input_pipeline_id)
        num_replicas_in_sync = as_int("num_replicas_in_sync", num_replicas_in_sync)
        if num_input_pipelines < 1 or num_replicas_in_sync < 1:
            raise ValueError(
                "InputContext needs num_input_pipelines >= 1 and num_replicas_in_sync >= 1. "
                f"Received: num_input_pipelines={num_input_pipelines}, "
                f"num_replicas_in_sync={num_replicas_in_sync}"
            )
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(
                "InputContext needs 0 <= input_pipeline_id < num_input_pipelines, but got "
                f"input_pipeline_id == {input_pipeline_id} and "
                f"num_input_pipelines == {num_input_pipelines}."
            )
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are: one per process."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """Which input pipeline this is, in ``[0, num_input_pipelines)``."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas consume the input, over all pipelines."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size of each replica: ``global_batch_size // num_replicas_in_sync``.

        Raises ``ValueError`` when the global batch does not divide evenly.

        >>> InputContext(1, 0, 2).get_per_replica_batch_size(0)
        0
        """
        global_batch_size = as_int("global_batch_size", global_batch_size)
        if global_batch_size < 0:
            raise ValueError(
                f"global_batch_size must be >= 0. Received: global_batch_size={global_batch_size}"
            )
        replicas = self._num_replicas_in_sync
        if global_batch_size % replicas != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {replicas}; use a multiple of {replicas}."
            )
        return global_batch_size // replicas

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def as_int(name: str, value: Any, call: str = "") -> int:
    """Argument ``name`` (of the public ``call``) as an int; bools and floats raise.

    numpy and 0-d integer tensors are ints too.

    >>> import numpy as np
    >>> as_int("batch_size", np.int64(4))
    4
    """
    where = f"{call}({name})" if call else name
    if isinstance(value, bool):
        raise TypeError(f"{where} must be an int, not a bool. Received: {name}={value!r}")
    try:
        return int(operator.index(value))
    except TypeError:
        raise TypeError(f"{where} must be an int. Received: {name}={value!r}") from None
