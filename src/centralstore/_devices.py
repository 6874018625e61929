"""Device names: parse every accepted spelling once into one canonical name.

A canonical name is torch's spelling: ``"cpu:k"`` for logical CPU device k, ``"cuda:i"`` for
GPU i, ``"mps"``. Logical CPU devices are names for the one host CPU, so that several replicas
can run on a machine without GPUs; tensors on any of them live on ``torch.device("cpu")``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, final

import torch

DeviceLike = str | torch.device

_PATTERN = re.compile(
    r"""^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?   # TensorFlow's full names
        (?:/device:|/)?                                   # "/device:GPU:0", "/cpu:0"
        (?P<type>cpu|gpu|cuda|mps)(?::(?P<index>\d+))?$""",
    re.IGNORECASE | re.VERBOSE,
)


def visible_devices() -> list[str]:
    """The canonical names of the devices torch can see: ``cpu:0``, every GPU, ``mps``."""
    names = ["cpu:0"]
    names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def canonical(device: DeviceLike) -> str:
    """The canonical name of ``device``; raises ``ValueError`` for unknown or missing devices.

    >>> canonical("/job:localhost/replica:0/task:0/device:CPU:1")
    'cpu:1'
    >>> canonical("cpu")
    'cpu:0'
    """
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        match = _PATTERN.match(device.strip())
        if match is None:
            raise ValueError(
                f"Cannot parse the device name {device!r}. Expected a name such as 'CPU:0', "
                f"'GPU:1', '/device:CPU:0', 'cuda:1', 'cpu' or 'mps'; visible devices: "
                f"{visible_devices()}."
            )
        kind = match["type"].lower()
        index = None if match["index"] is None else int(match["index"])
    else:
        raise TypeError(
            f"A device must be a string or a torch.device, but got {type(device).__name__}; "
            f"visible devices: {visible_devices()}. Received: device={device!r}"
        )
    if kind == "cpu":
        return f"cpu:{index or 0}"
    if kind in ("gpu", "cuda"):
        index = index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"The device {device!r} names GPU {index}, but torch sees "
                f"{torch.cuda.device_count()} GPU(s); visible devices: {visible_devices()}."
            )
        return f"cuda:{index}"
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(
                f"The device {device!r} is not available on this machine; visible devices: "
                f"{visible_devices()}."
            )
        return "mps"
    raise ValueError(
        f"Unsupported device type {kind!r} in {device!r}: centralstore runs replicas on 'cpu', "
        f"'cuda' and 'mps' devices; visible devices: {visible_devices()}."
    )


def canonical_list(devices: Sequence[DeviceLike], what: str) -> tuple[str, ...]:
    """Canonical names for a list of devices, in order, duplicates kept.

    As in TensorFlow (measured on 2.21: ``CentralStorageStrategy(["/cpu:0", "/cpu:0"])`` has
    2 replicas, both on CPU:0), a device named twice runs two replicas: replica ``i`` runs on
    ``names[i]``, and placement, input slices, results and reductions are kept per replica,
    never merged by device.
    ``"cpu"`` and ``"cpu:0"`` are one device, so ``["cpu", "cpu:0"]`` is two replicas on it.

    >>> canonical_list(["CPU:1", "/device:CPU:0"], "compute_devices")
    ('cpu:1', 'cpu:0')
    >>> canonical_list(["/cpu:0", "cpu"], "compute_devices")
    ('cpu:0', 'cpu:0')
    """
    if isinstance(devices, (str, torch.device)):
        raise TypeError(
            f"{what} must be a list of devices, not a single device. "
            f"Wrap it in a list: {what}=[{devices!r}]. Visible devices: {visible_devices()}."
        )
    if not isinstance(devices, Sequence) or isinstance(devices, bytes):
        raise TypeError(
            f"{what} must be a list or tuple of devices; visible devices: "
            f"{visible_devices()}. Received: {what}={devices!r}"
        )
    if len(devices) == 0:
        raise ValueError(
            f"{what} is empty; name at least one device, e.g. ['cpu:0', 'cpu:1']. "
            f"Visible devices: {visible_devices()}. Received: {what}={devices!r}"
        )
    return tuple(canonical(d) for d in devices)


def torch_device(name: str) -> torch.device:
    """The ``torch.device`` for a canonical name (``torch.device("cpu", 1)`` for ``cpu:1``)."""
    if name == "mps":
        return torch.device("mps")
    kind, index = name.split(":")
    return torch.device(kind, int(index))


def storage_device(name: str) -> torch.device:
    """Where tensors on ``name`` physically live: every logical CPU device is the host CPU."""
    if name.startswith("cpu"):
        return torch.device("cpu")
    return torch_device(name)


def default_compute_devices() -> tuple[str, ...]:
    """TensorFlow's default: every visible GPU, else the CPU."""
    gpus = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    return gpus or ("cpu:0",)


def default_parameter_device(compute_devices: Sequence[str]) -> str:
    """TensorFlow's default: the only compute device when there is one, else the CPU."""
    if len(compute_devices) == 1:
        return compute_devices[0]
    return "cpu:0"


_MAX_STREAMS = 256  # the streams a ``CurrentStreams`` keeps before it starts again


@final
class CurrentStreams:
    """The current stream of a device, as ``torch.cuda.current_stream`` finds it, for a
    caller that asks at every step or gradient (a replica's views and gradient buckets, a
    strategy's replica threads, a GPU's input copier): found by its raw handle, which torch
    reads in C, among the streams this object has handed out before. torch's function runs
    16 lines of Python (torch 2.13) and builds a new ``Stream`` at every call.

    Keyed by device and handle (every device's default stream has the handle 0). The first
    call goes through torch, which initializes CUDA if need be; so does a stream not seen
    before, and a ``torch.device`` without an index."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], torch.cuda.Stream] = {}

    def __call__(self, device: torch.device) -> torch.cuda.Stream:
        known, index = self._known, device.index
        if index is not None and known:
            found = known.get((index, torch._C._cuda_getCurrentRawStream(index)))
            if found is not None:
                return found
        stream: torch.cuda.Stream = torch.cuda.current_stream(index)
        if len(known) >= _MAX_STREAMS:  # streams made and dropped again and again
            known.clear()
        known[stream.device_index, stream.cuda_stream] = stream
        return stream

    def switch(self, stream: torch.cuda.Stream) -> StreamSwitch:
        """``with torch.cuda.stream(stream)``, for a caller that switches at every step (a
        bucket's copy to host memory, an input's copies to a GPU): ``stream`` is current on
        its device, and that device the current one, until the block ends; then the stream
        current before on that device, and the device current before, are again. torch's
        context parses "the current device" twice (its ``__init__`` and the
        ``current_stream(None)`` of its ``__enter__``, each asking ``is_available``): 125
        lines of torch 2.13's Python a use besides ``os.getenv``'s; this runs 42."""
        return StreamSwitch(self, stream)


@final
class StreamSwitch:
    """The block of ``CurrentStreams.switch``."""

    __slots__ = ("_current", "_device", "_previous", "_stream")

    def __init__(self, current: CurrentStreams, stream: torch.cuda.Stream) -> None:
        self._current = current
        self._stream = stream

    def __enter__(self) -> None:
        stream = self._stream
        self._device = torch.cuda.current_device()
        self._previous = self._current(stream.device)
        torch.cuda.set_stream(stream)  # (which makes its device current, in C)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self._previous)
        if self._device != self._stream.device_index:
            torch.cuda.set_device(self._device)


def wait_through(waiter: torch.cuda.Stream, stream: torch.cuda.Stream, event: Any) -> None:
    """``waiter.wait_stream(stream)`` through ``event``, recorded on ``stream`` again: the
    waiter's wait holds what ``stream`` had queued when it was made, whatever the event is
    recorded at later. torch's ``wait_stream`` makes a new event at every call (20 lines of
    torch 2.13's Python, and CUDA's creation and destruction of an event); this runs 7.
    ``event`` (a ``torch.cuda.Event``) serves one thread at a time, on ``stream``'s
    device."""
    event.record(stream)
    waiter.wait_event(event)
