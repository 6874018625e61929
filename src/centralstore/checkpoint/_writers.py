"""Who writes a checkpoint in a job of several worker processes, and how the others wait.

Every worker calls ``save``/``write``; the chief (rank 0 of ``torch.distributed``'s default
group, the strategy's ``extended.should_checkpoint`` worker) writes, and the others wait until
it has. The wait is an all-gather of the chief's outcome, so that a failed write raises on
every worker instead of leaving them at a barrier. A collective that fails (a dead peer, the
group's timeout) marks the process for exit with status 1 at an uncaught error, as the
strategy's own collectives do, so that torchrun sees a Python error and restarts the job.
"""

from __future__ import annotations

import atexit
from typing import Any, final

import torch.distributed as dist

from ..strategies._cross_worker import _exit_on_uncaught_error


@final
class Writers:
    """This process's place among the workers: rank and count, 0 and 1 without a group."""

    def __init__(self) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if grouped else 0
        self.count = dist.get_world_size() if grouped else 1

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def gather(self, value: Any, what: str) -> list[Any]:
        """``value`` from every worker, in rank order (just ``[value]`` alone)."""
        if self.count == 1:
            return [value]
        gathered: list[Any] = [None] * self.count
        try:
            dist.all_gather_object(gathered, value)
        except Exception as error:
            atexit.register(_exit_on_uncaught_error)
            raise RuntimeError(
                f"The workers could not exchange {what} (worker {self.rank} of {self.count}): "
                f"{error}. Another worker most likely failed or exited; let the process exit "
                "so that torchrun restarts the workers from the last checkpoint."
            ) from error
        return gathered

    def outcome(self, error: BaseException | None, what: str) -> None:
        """Wait until the chief has done ``what``; raise on every worker if it failed."""
        if self.count == 1:
            return
        text = None if error is None else f"{type(error).__name__}: {error}"
        chief = self.gather(text if self.is_chief else None, f"the outcome of {what}")[0]
        if chief is not None and error is None:
            raise RuntimeError(
                f"The chief (worker 0) failed in {what}: {chief}. Worker {self.rank} raises "
                "too, so that no worker continues past a checkpoint that was not written."
            )
