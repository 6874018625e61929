"""Checkpoint files: written atomically, read back only when whole.

A file is written under a temporary name in its directory (``.NAME.XXXX.tmp``), flushed,
``fsync``-ed and renamed over ``NAME``; the directory is then ``fsync``-ed so that the rename
itself survives a crash. A process killed mid-write leaves at most a temporary file, which no
reader mistakes for a checkpoint. The content is one ``torch.save`` archive (a zip whose
records carry a CRC-32); reading checks every record's CRC before unpickling, because
``torch.load`` reads a flipped bit in tensor data without complaint.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..input.errors import DataLossError

TEMPORARY_SUFFIX = ".tmp"


def write_atomic(path: Path, payload: Any) -> None:
    """``torch.save(payload)`` into ``path``, all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomic(path, "wb", lambda file: torch.save(payload, file))


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path``, all or nothing (the manager's state file)."""
    _replace_atomic(path, "w", lambda file: file.write(text))


def _replace_atomic(path: Path, mode: str, write: Callable[[Any], Any]) -> None:
    """Write a temporary file beside ``path``, flush and fsync it, and rename it over
    ``path``; a process killed at any point leaves ``path`` as it was."""
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent
    )
    try:
        with os.fdopen(descriptor, mode, encoding=None if "b" in mode else "utf-8") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Make the renames and deletions in ``directory`` durable (where the OS allows it)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def read_verified(path: Path, expected_format: str) -> dict[str, Any]:
    """The payload of the checkpoint file ``path``, every record's CRC checked first.

    ``FileNotFoundError`` when there is no such file; ``DataLossError`` naming the file when it
    is truncated, corrupt or not a checkpoint of ``expected_format``.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"No checkpoint file at {str(path)!r}. Pass the path that Checkpoint.save() or "
            "write() returned, or CheckpointManager.latest_checkpoint (None when there is "
            f"none yet). Received: path={str(path)!r}"
        )
    advice = (
        "It was not written by Checkpoint.save/write (which writes atomically), or the disk "
        "damaged it. Delete it: a CheckpointManager then resumes from the previous checkpoint."
    )
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise DataLossError(
            f"The checkpoint file {str(path)!r} is truncated or is not a checkpoint "
            f"({error}). {advice}"
        ) from error
    if damaged is not None:
        raise DataLossError(
            f"The checkpoint file {str(path)!r} is corrupt: its record {damaged!r} fails its "
            f"CRC-32 check. {advice}"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise DataLossError(
            f"The checkpoint file {str(path)!r} cannot be read back: {error}. A checkpoint "
            "holds tensors and plain Python values (dicts, lists, numbers, strings); a "
            f"state_dict() returning other objects cannot be restored safely. {advice}"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != expected_format:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise DataLossError(
            f"The file {str(path)!r} is not a cs.Checkpoint file (format {expected_format!r}); "
            f"it holds format={found!r}. Restore files written by Checkpoint.save/write, or "
            "read other torch.save files with torch.load."
        )
    return payload
