"""``MultiWorkerCentralStorageStrategy``: CentralStorage inside each process, ``torch.distributed``
across processes, launched by ``torchrun``."""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore  # dist's, untyped there

from .. import _devices
from .._devices import DeviceLike
from ._exchange import ProcessGroup
from .base import Strategy

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _local_compute_devices(compute_devices: Sequence[DeviceLike] | None) -> tuple[str, ...]:
    """The given devices, or this process's share of the visible GPUs (torchrun starts
    ``LOCAL_WORLD_SIZE`` processes per host; process ``LOCAL_RANK`` takes the k-th group),
    else the CPU."""
    if compute_devices is not None:
        return _devices.canonical_list(compute_devices, "compute_devices")
    visible = _devices.default_compute_devices()
    if not visible[0].startswith("cuda"):
        return visible
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if len(visible) % processes:
        raise ValueError(
            f"Cannot share {len(visible)} visible GPUs equally between the LOCAL_WORLD_SIZE="
            f"{processes} processes of this host. Start as many processes per host as "
            "divides the GPUs (torchrun --nproc-per-node), or pass compute_devices."
        )
    share = len(visible) // processes
    return visible[local_rank * share : (local_rank + 1) * share]


def _seconds(timeout: float | timedelta) -> timedelta:
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise ValueError(
            "timeout must be positive: it bounds how long a worker waits for the others "
            f"before raising. Received: timeout={timeout!r}"
        )
    return value


def _process_group(group: Any, parameter_device: str, timeout: timedelta) -> Any:
    """The given group, or None for the default one, initialized from torchrun's variables
    when there is none yet."""
    if group is not None:
        return group
    if not dist.is_initialized():
        missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise RuntimeError(
                "MultiWorkerCentralStorageStrategy needs torchrun's environment or an "
                f"initialized process group, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Launch the script with "
                "`torchrun --nproc-per-node N script.py` (one process per host or GPU group), "
                "or call torch.distributed.init_process_group(...) first, or pass "
                "process_group=."
            )
        backend = "gloo"
        if parameter_device.startswith("cuda") and dist.is_nccl_available():
            torch.cuda.set_device(_devices.storage_device(parameter_device))
            backend = "nccl"
        dist.init_process_group(
            backend,
            store=_attempt_store(timeout),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
        # The group this strategy created is destroyed at exit (unless the script does it
        # first): a process that exits with a live group can abort in torch's teardown.
        atexit.register(_destroy_process_group)
    return None


def _attempt_store(timeout: timedelta) -> Store:
    """The rendezvous store of this attempt of the job: torchrun's store (or one hosted by
    rank 0 when the variables were set by hand), under a prefix naming the attempt.

    torchrun (``--max-restarts``) restarts every worker after one failed, and the restarted
    workers meet in the same store as the failed attempt. Keyed as torch keys it, a new
    group finds the dead attempt's keys there: with plain ``init_process_group("gloo")``,
    3 restarts of 3 failed (``Gloo connectFullMesh failed ... Connection refused`` twice, a
    hang until the timeout once). Under a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``)
    3 of 3 succeeded.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"centralstore/attempt{attempt}/", store)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective_device(group: Any, parameter_device: str) -> torch.device:
    """Where collective buffers live: the parameter GPU for NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and (backend == "nccl" or parameter_device.startswith("cuda")):
        if parameter_device.startswith("cuda"):
            return _devices.storage_device(parameter_device)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@final
class MultiWorkerCentralStorageStrategy(Strategy):
    """``CentralStorageStrategy`` in every worker process, gradients all-reduced across them.

    Launch one process per host (or per GPU group) with ``torchrun``; each builds this
    strategy with its local ``compute_devices``. Inside a process everything works as with
    ``CentralStorageStrategy``; across processes the gradients already summed over the local
    replicas are all-reduced (SUM) with ``torch.distributed`` at the end of each ``run``
    (gloo for CPU tensors, NCCL for CUDA), in flat buckets of ``bucket_cap_mb``: one
    gradient per worker crosses the network, not one per device.

    * ``num_replicas_in_sync`` counts the replicas of every worker, and
      ``replica_id_in_sync_group`` is global (the worker's offset plus the local index);
      every worker must have the same number of local replicas.
    * Central variables are broadcast from worker 0 when the scope that created them exits,
      and all of them once more at the first ``run`` (so a checkpoint loaded after the scope
      by worker 0 alone still reaches every worker): they start identical without seeding,
      and every worker then applies the same update.
    * A backward after ``run`` (on a reduced loss) leaves its gradients pending until the next
      sync point, normally ``optimizer.step()``, where they are exchanged: code that reads
      ``.grad`` in between (``clip_grad_norm_``) must call backward inside ``run`` instead.
      Such a backward must happen on every worker or on none (a loss reduced over the
      workers has the same value on each): an optimizer step with nothing pending makes no
      collective, so that a training step meets the other workers once, at the end of
      ``run``; a worker whose backward the others did not make raises at its step.
    * To accumulate gradients over micro-batches, loop over them inside one ``run``: the
      workers exchange once per step, and once the first such run has shown how many
      backward passes a run makes, the buckets leave during the last one, as DDP's do under
      ``no_sync``. A ``run`` per micro-batch exchanges at each (DDP without ``no_sync``).
    * ``reduce``, ``gather``, ``all_reduce``, ``all_gather`` and ``merge_call`` span every
      worker (``merge_call``'s function runs once per worker); ``experimental_local_results``
      returns this worker's components. With one local replica, the plain values ``run``
      returns are this worker's component in ``reduce`` and ``gather``.
    * ``experimental_distribute_dataset`` gives each worker its replicas' slices of every
      global batch (every worker iterates the same batches; ``AutoShardPolicy`` AUTO/DATA;
      with ``OFF`` each worker splits every global batch over its own replicas);
      ``dataset_fn`` receives
      ``InputContext(num_input_pipelines=num_workers, input_pipeline_id=worker_index, R)``.
    * A worker whose step raises makes the others raise at the same sync point, and the run
      is discarded on every worker; a worker that dies or hangs makes them raise after
      ``timeout`` (seconds or a ``timedelta``), never forever, and a process that then ends
      on that error exits with status 1.

    Without an initialized process group it calls ``torch.distributed.init_process_group``
    (gloo, or NCCL when the parameter device is a GPU) with torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, in the rendezvous store under a
    prefix per attempt (``TORCHELASTIC_RESTART_COUNT``), so that workers torchrun restarts
    (``--max-restarts``) meet cleanly and resume from a ``cs.CheckpointManager``'s latest
    checkpoint; it destroys that group at exit;
    otherwise it uses the default group, or ``process_group`` (one from
    ``torch.distributed.new_group``). ``timeout`` defaults to 10 minutes: set it above the
    slowest step. Only the chief (``is_chief``, worker 0) should write checkpoints and logs;
    every worker reads them.

    >>> import centralstore as cs, torch.distributed as dist
    >>> from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> strategy = MultiWorkerCentralStorageStrategy(["cpu:0", "cpu:1"], timeout=30)
    >>> strategy.num_replicas_in_sync, strategy.num_workers, strategy.is_chief
    (2, 1, True)
    >>> strategy.reduce("SUM", strategy.run(lambda: torch.ones(2)), axis=None)
    tensor([2., 2.])
    >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        compute_devices: Sequence[DeviceLike] | None = None,
        parameter_device: DeviceLike | None = None,
        *,
        process_group: Any = None,
        timeout: float | timedelta = 600.0,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        devices = _local_compute_devices(compute_devices)
        if parameter_device is None:
            parameter = _devices.default_parameter_device(devices)
        else:
            parameter = _devices.canonical(parameter_device)
        if not bucket_cap_mb > 0:
            raise ValueError(
                "bucket_cap_mb must be positive: it is the size of one gradient all-reduce. "
                f"Received: bucket_cap_mb={bucket_cap_mb!r}"
            )
        seconds = _seconds(timeout)
        group = _process_group(process_group, parameter, seconds)
        workers = ProcessGroup(
            group, seconds, int(bucket_cap_mb * 2**20), _collective_device(group, parameter)
        )
        workers.check_local_replicas(devices)
        super().__init__(devices, parameter, workers)
        self._collectives = workers

    @property
    def num_workers(self) -> int:
        """How many worker processes train together (the process group's size)."""
        return self._collectives.num_workers

    @property
    def worker_index(self) -> int:
        """This worker's rank in the process group, 0 to ``num_workers - 1``."""
        return self._collectives.worker_index

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0: the one that writes checkpoints, logs and output."""
        return self._collectives.worker_index == 0

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` process group the workers communicate in."""
        group = self._collectives.group
        return dist.group.WORLD if group is None else group

    @property
    def timeout(self) -> timedelta:
        """How long a worker waits for the others in one collective before raising."""
        return self._collectives.timeout

    @property
    def traffic(self) -> dict[str, int]:
        """What this worker has given to collectives so far: their number and payload bytes
        (a ring all-reduce sends about 2 (W-1)/W times its payload)."""
        return dict(self._collectives.traffic)
