"""``Checkpoint``: TensorFlow's ``tf.train.Checkpoint`` over objects with ``state_dict()``.

A checkpoint is one file: ``torch.save`` of ``{"format", "save_counter", "objects"}``, the
objects' states by name, written atomically (``_files.py``). It holds plain ``state_dict``s,
so ``torch.load(path)["objects"]["model"]`` is the model's ``state_dict``, loadable at any
number of replicas or without centralstore.

Restores are strict, as ``tf.train.Checkpoint.restore(...).assert_consumed()``: a tracked
object without a state in the file, or a state in the file without an object, is an error
naming it. States are read onto the CPU and loaded into the existing objects, so each
central variable keeps its own device (``load_state_dict`` copies into it).

Several workers: every worker calls ``save``/``write`` (and ``restore``); the chief writes
and the others wait for it (``_workers.py``). Most states are the same on every worker and
only the chief's is written; the states that differ per worker (a ``DistributedIterator``
over each worker's shard, the ``RNGState``) are gathered, and each worker restores its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, final

import torch

from ..input.iterator import DistributedIterator
from ._files import read_verified, write_atomic
from ._writers import Writers
from .rng import RNGState

FORMAT = "centralstore.Checkpoint/1"
_PER_WORKER = "centralstore.per_worker"  # the key of a state saved by every worker
PathLike = str | os.PathLike[str]


def _kind(value: object) -> str:
    """What a ``Checkpoint`` tracks ``value`` as; ``TypeError`` for what it cannot."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.Generator):
        return "generator"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "stateful"
    raise TypeError(
        "cs.Checkpoint tracks objects with state_dict() and load_state_dict() (modules, "
        "optimizers, LR schedulers, GradScalers, distributed iterators, RNGState, nested "
        "Checkpoints), tensors and torch.Generators. Wrap other values in an object with "
        f"those two methods. Received: a {type(value).__name__}"
    )


def _state_of(value: Any) -> Any:
    kind = _kind(value)
    if kind == "tensor":
        return value.detach()
    if kind == "generator":
        return value.get_state()
    return value.state_dict()


@final
class Checkpoint:
    """Objects to save and restore together, by name: TensorFlow's ``tf.train.Checkpoint``.

    Tracks anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR
    schedulers, ``torch.amp.GradScaler``, distributed iterators, ``cs.RNGState``, nested
    ``Checkpoint``s), tensors (restored in place: a step counter as ``cs.Variable(0)``) and
    ``torch.Generator``s. ``save(prefix)`` numbers its files (``prefix-1``, ``prefix-2``, ...,
    counting with ``save_counter``, which is saved too); ``write(path)`` writes exactly
    ``path``. ``restore`` reads what ``save`` wrote, ``save_counter`` included; ``read`` what
    ``write`` wrote. Assigning an attribute (``checkpoint.extra = obj``) tracks one more.

    Writes are atomic: a process killed while writing leaves the previous files as they were.
    In a job of several workers every worker calls ``save``/``write``: the chief writes, the
    others wait for it. See ``CheckpointManager`` for numbering, retention and resuming.

    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> checkpoint = Checkpoint(model=model, step=torch.tensor(0))
    >>> path = checkpoint.save(tempfile.mkdtemp() + "/ckpt")
    >>> path.endswith("ckpt-1"), checkpoint.save_counter
    (True, 1)
    >>> with torch.no_grad():
    ...     _ = model.weight.zero_()
    >>> checkpoint.restore(path)
    >>> bool(model.weight.abs().sum() > 0)
    True
    """

    def __init__(self, **objects: Any) -> None:
        self._objects: dict[str, Any] = {}
        self._save_counter = 0
        for name, value in objects.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name in ("save_counter",):
            raise AttributeError(f"Checkpoint.{name} is set by save() and restore()")
        try:
            _kind(value)
        except TypeError as error:
            raise TypeError(f"{error}, as Checkpoint({name}=...)") from None
        self._objects[name] = value

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(
            f"This Checkpoint tracks no object named {name!r}; it tracks {sorted(objects)}."
        )

    @property
    def save_counter(self) -> int:
        """How many times ``save`` has run, over every run that restored this count."""
        return self._save_counter

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"

    # -- states --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every tracked object's state, by name (so that a Checkpoint nests in another)."""
        return {name: _state_of(value) for name, value in self._objects.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load each tracked object's state; missing or unexpected names raise ``KeyError``."""
        later: list[tuple[str, Any, Any]] = []
        self._load(state_dict, "", later)
        for name, value, state in later:
            _load_one(name, value, state)

    def _load(
        self, states: Mapping[str, Any], prefix: str, later: list[tuple[str, Any, Any]]
    ) -> None:
        missing = [f"{prefix}{name}" for name in self._objects if name not in states]
        unexpected = [f"{prefix}{name}" for name in states if name not in self._objects]
        if missing or unexpected:
            raise KeyError(
                f"The checkpoint does not match the tracked objects: missing state for "
                f"{missing}, unexpected state for {unexpected}. Track the same objects, under "
                f"the same names, as the run that saved it. Received: states for "
                f"{sorted(f'{prefix}{name}' for name in states)}"
            )
        for name, value in self._objects.items():
            if isinstance(value, Checkpoint):
                value._load(states[name], f"{prefix}{name}.", later)
            elif isinstance(value, RNGState):  # last: restoring iterators may draw numbers
                later.append((f"{prefix}{name}", value, states[name]))
            else:
                _load_one(f"{prefix}{name}", value, states[name])

    # -- files ---------------------------------------------------------------------------

    def save(self, file_prefix: PathLike) -> str:
        """Write a numbered checkpoint ``{file_prefix}-{save_counter}``; returns its path.

        Every worker of a multi-worker job calls it; the chief writes.
        """
        self._save_counter += 1
        return self.write(f"{os.fspath(file_prefix)}-{self._save_counter}")

    def write(self, file_prefix: PathLike) -> str:
        """Write the tracked objects' states to the file ``file_prefix``; returns the path.

        Atomic: written to a temporary file, flushed, ``fsync``-ed and renamed. Every worker of
        a multi-worker job calls it; the chief writes, and every worker returns once the file
        is complete (or raises if the chief failed).
        """
        path = Path(os.fspath(file_prefix))
        workers = Writers()
        objects = self._collect(workers)
        error: BaseException | None = None
        if workers.is_chief:
            try:
                payload = {"format": FORMAT, "save_counter": self._save_counter, "objects": objects}
                write_atomic(path, payload)
            except BaseException as failure:
                error = failure
        workers.outcome(error, f"writing the checkpoint {str(path)!r}")
        if error is not None:
            raise error
        return str(path)

    def restore(self, save_path: PathLike | None) -> None:
        """Load a checkpoint that ``save`` (or a ``CheckpointManager``) wrote, and its
        ``save_counter``. ``None`` does nothing, so that
        ``checkpoint.restore(manager.latest_checkpoint)`` starts afresh when there is none.

        ``FileNotFoundError`` for a missing file; ``cs.errors.DataLossError`` naming the file
        for a truncated or corrupt one; ``KeyError`` naming each object without a state, and
        each state without an object.
        """
        if save_path is None:
            return
        payload = self._read(save_path)
        self._save_counter = int(payload["save_counter"])

    def read(self, save_path: PathLike) -> None:
        """Load a checkpoint that ``write`` wrote (``save_counter`` stays as it is); errors as
        ``restore``."""
        self._read(save_path)

    def _read(self, save_path: PathLike) -> dict[str, Any]:
        path = Path(os.fspath(save_path))
        payload = read_verified(path, FORMAT)
        workers = Writers()
        states = _own_states(payload["objects"], _per_worker(self, ""), workers)
        try:
            self.load_state_dict(states)
        except Exception as error:
            error.add_note(f"while restoring the checkpoint {str(path)!r}")
            raise
        return payload

    def _collect(self, workers: Writers) -> dict[str, Any]:
        """The states to write: the chief's, with per-worker states from every worker."""
        per_worker = _per_worker(self, "")
        local = {name: _state_of(value) for name, value in per_worker.items()}
        gathered = workers.gather(local, "the per-worker checkpoint states")
        if not workers.is_chief:
            return {}
        states = self.state_dict() if not per_worker else self._states_except(per_worker)
        for name in per_worker:
            _place(states, name, {_PER_WORKER: [g[name] for g in gathered]})
        return states

    def _states_except(self, per_worker: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict()`` without computing the per-worker states twice."""
        states: dict[str, Any] = {}
        for name, value in self._objects.items():
            if isinstance(value, Checkpoint):
                inner = {
                    key[len(name) + 1 :]: obj
                    for key, obj in per_worker.items()
                    if key.startswith(f"{name}.")
                }
                states[name] = value._states_except(inner)
            elif name not in per_worker:
                states[name] = _state_of(value)
            else:
                states[name] = None  # placed by _collect
        return states


def _per_worker(checkpoint: Checkpoint, prefix: str) -> dict[str, Any]:
    """The tracked objects whose state differs per worker, by dotted name."""
    found: dict[str, Any] = {}
    for name, value in checkpoint._objects.items():
        if isinstance(value, Checkpoint):
            found.update(_per_worker(value, f"{prefix}{name}."))
        elif isinstance(value, (DistributedIterator, RNGState)):
            found[f"{prefix}{name}"] = value
    return found


def _place(states: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for part in path:
        states = states[part]
    states[last] = value


def _own_states(
    states: dict[str, Any], per_worker: Mapping[str, Any], workers: Writers
) -> dict[str, Any]:
    """``states`` with each per-worker entry (by dotted name) replaced by this worker's state.

    Saved by as many workers as there are now: each takes its own. Otherwise the states must
    all be equal (an iterator of ``experimental_distribute_dataset`` is the same on every
    worker), and any worker count may restore them.
    """
    for dotted in per_worker:
        *path, last = dotted.split(".")
        container: Any = states
        for part in path:
            container = container.get(part) if isinstance(container, dict) else None
        entry = container.get(last) if isinstance(container, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get(_PER_WORKER), list)):
            continue  # missing: the strict check of load_state_dict names it
        saved = entry[_PER_WORKER]
        if len(saved) == workers.count:
            container[last] = saved[workers.rank]
        elif all(_equal(saved[0], other) for other in saved[1:]):
            container[last] = saved[0]
        else:
            raise ValueError(
                f"The checkpoint holds the per-worker state {dotted!r} (a distributed iterator "
                f"over each worker's shard, or random generators) saved by {len(saved)} "
                f"worker(s), which differ, and {workers.count} worker(s) restore it. Restore "
                f"with {len(saved)} workers, or track only states that every worker shares. "
                f"Received: {len(saved)} per-worker states"
            )
    return states


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _load_one(name: str, value: Any, state: Any) -> None:
    """Load ``state`` into the tracked object ``value``, named ``name`` in errors."""
    kind = _kind(value)
    if kind == "generator":
        value.set_state(state)
        return
    if kind == "stateful":
        try:
            value.load_state_dict(state)
        except Exception as error:
            error.add_note(f"while loading the state of {name!r} ({type(value).__name__})")
            raise
        return
    if not isinstance(state, torch.Tensor) or state.shape != value.shape:
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(
            f"Cannot restore the tensor {name!r} of shape {tuple(value.shape)} from a saved "
            f"value of shape {got}. Track a tensor of the saved shape. Received: {got}"
        )
    with torch.no_grad():
        value.copy_(state)
