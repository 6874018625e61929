"""``CheckpointManager``: TensorFlow's ``tf.train.CheckpointManager``.

Files ``{directory}/{checkpoint_name}-{N}`` and a state file ``{directory}/checkpoint``
(JSON: the managed checkpoints oldest first with their times, the ones kept for good by
``keep_checkpoint_every_n_hours``, and when the last of those was kept), each written
atomically. The checkpoint files are the truth: a complete one that the state file does not
list (the process died between the two writes) is adopted, a listed one that is gone is
dropped, and temporary files of interrupted writes are deleted when a manager starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, final

import torch

from ._files import TEMPORARY_SUFFIX, sync_directory, write_text_atomic
from ._writers import Writers
from .checkpoint import Checkpoint, PathLike

STATE_FILE = "checkpoint"
_STATE_FORMAT = "centralstore.CheckpointManager/1"

StepCounter = torch.Tensor | Callable[[], int]


@final
class CheckpointManager:
    """Numbered checkpoints in a directory: the latest to resume from, the last few kept.

    ``save()`` writes ``{directory}/{checkpoint_name}-{N}`` (N is ``checkpoint_number``, or
    the checkpoint's ``save_counter``) and deletes the oldest beyond ``max_to_keep`` (None
    keeps all), except one every ``keep_checkpoint_every_n_hours``, kept for good.
    ``latest_checkpoint`` is the newest path (None before the first), ``checkpoints`` the
    managed paths, oldest first. ``restore_or_initialize()`` restores the latest, or calls
    ``init_fn`` when there is none.

    With ``checkpoint_interval``, ``save()`` writes only when ``step_counter`` (a 0-d integer
    tensor, such as ``cs.Variable(0)``, or a function returning the step) has advanced by
    that much since the last save, and returns None otherwise: call it every step.

    Every worker of a multi-worker job makes the same calls: the chief writes and deletes,
    the others wait for it, and all of them restore the same checkpoint.

    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> manager = CheckpointManager(Checkpoint(model=model), tempfile.mkdtemp(), max_to_keep=2)
    >>> print(manager.restore_or_initialize())
    None
    >>> paths = [manager.save() for _ in range(3)]
    >>> [Path(p).name for p in manager.checkpoints], manager.latest_checkpoint == paths[-1]
    (['ckpt-2', 'ckpt-3'], True)
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: StepCounter | None = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "CheckpointManager(checkpoint) takes a cs.Checkpoint of the objects to save. "
                f"Received: checkpoint={checkpoint!r}"
            )
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep < 1):
            raise ValueError(
                "max_to_keep must be a positive int (how many checkpoints to keep), or None to "
                f"keep all. Received: max_to_keep={max_to_keep!r}"
            )
        if not checkpoint_name or "/" in checkpoint_name or os.sep in checkpoint_name:
            raise ValueError(
                "checkpoint_name is the start of each file name in directory, without a "
                f"separator. Received: checkpoint_name={checkpoint_name!r}"
            )
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "checkpoint_interval counts steps of step_counter, so it needs one: pass "
                "step_counter= (a 0-d integer tensor or a function returning the step). "
                f"Received: checkpoint_interval={checkpoint_interval!r}, step_counter=None"
            )
        self._checkpoint = checkpoint
        self._directory = Path(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._hours = keep_checkpoint_every_n_hours
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_step: int | None = None
        self._pattern = re.compile(rf"{re.escape(checkpoint_name)}-(\d+)")
        self._workers = Writers()
        self._managed: dict[str, float] = {}  # file name -> time saved, oldest first
        self._preserved: list[str] = []
        self._last_preserved = time.time()
        self._recover()

    @property
    def directory(self) -> str:
        """The directory the checkpoints are written in."""
        return str(self._directory)

    @property
    def checkpoint(self) -> Checkpoint:
        """The ``Checkpoint`` this manager saves and restores."""
        return self._checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """The managed checkpoints' paths, oldest first (not those kept for good)."""
        return [str(self._directory / name) for name in self._managed]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None when there is none."""
        names = list(self._managed)
        return str(self._directory / names[-1]) if names else None

    @property
    def checkpoint_interval(self) -> int | None:
        """How many steps must pass between two saves (None: every ``save()`` writes)."""
        return self._interval

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True) -> str | None:
        """Write a checkpoint and apply the retention rules; returns its path.

        With ``checkpoint_interval``, returns None without writing until ``step_counter``
        has advanced by the interval since the last save (``check_interval=False`` writes
        anyway, unless the step has not moved at all).
        """
        if self._interval is not None:
            step = self._step()
            if self._last_step is not None and (
                step == self._last_step
                or (check_interval and step < self._last_step + self._interval)
            ):
                return None
            self._last_step = step
        self._checkpoint._save_counter += 1
        number = self._checkpoint.save_counter if checkpoint_number is None else checkpoint_number
        name = f"{self._name}-{int(number)}"
        path = self._checkpoint.write(self._directory / name)
        self._managed.pop(name, None)
        self._managed[name] = time.time()
        self._sweep()
        self._write_state()
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path; without one, call ``init_fn``
        (when given) and return None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    # -- state on disk -------------------------------------------------------------------

    def _step(self) -> int:
        counter = self._step_counter
        if isinstance(counter, torch.Tensor):
            return int(counter)
        assert counter is not None  # checked in __init__ with checkpoint_interval
        return int(counter())

    def _sweep(self) -> None:
        """Delete the oldest checkpoints beyond ``max_to_keep``, keeping one for good every
        ``keep_checkpoint_every_n_hours`` (TensorFlow's rule)."""
        if self._max_to_keep is None:
            return
        while len(self._managed) > self._max_to_keep:
            name, saved = next(iter(self._managed.items()))
            del self._managed[name]
            if self._hours is not None and saved - self._hours * 3600 >= self._last_preserved:
                self._last_preserved = saved
                self._preserved.append(name)
                continue
            if self._workers.is_chief:
                with contextlib.suppress(FileNotFoundError):
                    (self._directory / name).unlink()

    def _write_state(self) -> None:
        if not self._workers.is_chief:
            return
        state = {
            "format": _STATE_FORMAT,
            "checkpoints": [{"name": n, "time": t} for n, t in self._managed.items()],
            "preserved": self._preserved,
            "last_preserved_time": self._last_preserved,
        }
        write_text_atomic(self._directory / STATE_FILE, json.dumps(state, indent=1) + "\n")

    def _recover(self) -> None:
        """What an earlier run left in the directory: its state file, checked against the
        files there; temporary files of interrupted writes are deleted."""
        directory = self._directory
        if not directory.is_dir():
            return
        state = self._read_state()
        if state is not None:
            self._preserved = [str(n) for n in state.get("preserved", [])]
            self._last_preserved = float(state.get("last_preserved_time", self._last_preserved))
            listed = {str(e["name"]): float(e["time"]) for e in state.get("checkpoints", [])}
        else:
            listed = {}
        present = {p.name for p in directory.iterdir() if self._pattern.fullmatch(p.name)}
        found = {n: listed.get(n, (directory / n).stat().st_mtime) for n in present}
        found = {n: t for n, t in found.items() if n not in self._preserved}
        by_number = sorted(found, key=lambda n: (int(n.rsplit("-", 1)[1]), found[n]))
        self._managed = {n: found[n] for n in by_number}
        if self._workers.is_chief:
            stale = [
                p
                for p in directory.iterdir()
                if p.name.startswith(".") and p.name.endswith(TEMPORARY_SUFFIX)
            ]
            for path in stale:
                with contextlib.suppress(OSError):
                    path.unlink()
            if stale:
                sync_directory(directory)

    def _read_state(self) -> dict[str, Any] | None:
        path = self._directory / STATE_FILE
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
                raise ValueError(f"not a {_STATE_FORMAT} file")
            return state
        except (OSError, ValueError) as error:
            warnings.warn(
                f"Ignoring the checkpoint manager's state file {str(path)!r} ({error}): the "
                f"checkpoints are found from the files named {self._name}-N in the directory "
                "instead; those kept by keep_checkpoint_every_n_hours are then managed again.",
                UserWarning,
                stacklevel=3,
            )
            return None
