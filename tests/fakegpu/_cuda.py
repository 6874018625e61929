"""``torch.cuda`` as the fake GPUs answer it: devices, streams, events, generators.

``Runtime`` holds the state of one ``fakegpu.devices(n)`` context: N logical devices, a
default stream for each, each thread's current device and its current stream on each device
(as CUDA keeps them, per thread), one CPU ``torch.Generator`` per device, and the ``Order``
that streams, events and synchronizations feed. ``namespace()`` is what is installed on the
``torch.cuda`` module while the context is active.

``Runtime.calls`` counts the CUDA runtime calls a real process would make, by what they are
and the stream they are for (``tally``): stream and event calls, ``record_stream``, kernels,
copies and pinned allocations (``Runtime.pinned`` models what the host allocator then holds).

Streams and events keep no clock of their own: the active runtime's ``Order`` holds them, so
that a stream cached across tests (as ``centralstore.variables.folding`` caches its side
streams) simply starts afresh in the next test's runtime.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._order import HOST, Agent, Order
from ._pinned import PinnedPool

_DEFAULT_SEED = 67280421310721  # torch's default seed, on the CPU as on CUDA
_ids = itertools.count(1)


class _Current(threading.local):
    """This thread's current device, and its current stream on each device."""

    def __init__(self) -> None:
        self.device = 0
        self.streams: dict[int, FakeStream] = {}
        self.skipping: set[str] = set()


_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The active fake-GPU runtime; ``RuntimeError`` outside ``fakegpu.devices()``."""
    if _runtime is None:
        raise RuntimeError("fakegpu: no fake GPUs are active (use fakegpu.devices(n))")
    return _runtime


def set_runtime(value: Runtime | None) -> None:
    global _runtime
    _runtime = value


class FakeStream:
    """``torch.cuda.Stream``: a queue of work on one fake device (all work runs at once on
    the CPU; the stream exists for the ordering it gives)."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        index = runtime().index(device)
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.device_type = 1  # c10::DeviceType::CUDA
        self.priority = priority
        self.stream_id = next(_ids)
        self.cuda_stream = self.stream_id
        self.default = False

    def __repr__(self) -> str:
        return f"<fakegpu stream {self.stream_id} on {self.device}>"

    def name(self) -> str:
        kind = "default stream" if self.default else f"stream {self.stream_id}"
        return f"{self.device} {kind}"

    def wait_event(self, event: FakeEvent) -> None:
        event.wait(self)

    def wait_stream(self, stream: FakeStream) -> None:
        """As torch's: an event recorded on ``stream`` now, which this stream waits for (so
        the calls counted are CUDA's two, an ``Event.record`` and a ``Stream.wait_event``)."""
        if runtime().skipped("Stream.wait_stream"):
            return
        self.wait_event(stream.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = FakeEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        self.synchronize()  # everything has run: the host may now rely on it
        return True

    def synchronize(self) -> None:
        rt = runtime()
        if not rt.skipped("Stream.synchronize"):
            rt.tally("Stream.synchronize", self)
            rt.order.join(HOST, self)

    def __enter__(self) -> FakeStream:
        self._context = stream(self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


class FakeEvent:
    """``torch.cuda.Event``: a snapshot of a stream's work, to wait for."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self._snapshot: dict[Any, int] | None = None
        self._stream: FakeStream | None = None  # where it was last recorded
        self.enable_timing = enable_timing

    def record(self, stream: FakeStream | None = None) -> None:
        rt = runtime()
        if rt.skipped("Event.record"):
            return
        stream = rt.current_stream() if stream is None else stream
        rt.tally("Event.record", stream)
        rt.order.launch(stream)
        self._snapshot = rt.order.snapshot(stream)
        self._stream = stream

    def wait(self, stream: FakeStream | None = None) -> None:
        rt = runtime()
        stream = rt.current_stream() if stream is None else stream
        if rt.skipped("Stream.wait_event") or rt.skipped("Event.wait"):
            return
        rt.tally("Stream.wait_event", stream)
        rt.order.launch(stream)
        if self._snapshot is not None:
            rt.order.join(stream, self._snapshot)

    def query(self) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        rt = runtime()
        if self._snapshot is not None and not rt.skipped("Event.synchronize"):
            rt.tally("Event.synchronize", self._stream)
            rt.order.join(HOST, self._snapshot)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        return 0.0


@dataclass(frozen=True)
class _Properties:
    name: str = "fakegpu (a logical CUDA device over CPU tensors)"
    total_memory: int = 16 * 2**30
    major: int = 8
    minor: int = 0
    multi_processor_count: int = 1
    is_integrated: bool = False


@contextlib.contextmanager
def stream(s: FakeStream | None) -> Iterator[None]:
    """``torch.cuda.stream(s)``: ``s`` is this thread's current stream on its device, and
    its device the current device, until the block ends."""
    if s is None:
        yield
        return
    current = runtime().current
    previous_device = current.device
    previous = current.streams.get(s.device_index)
    current.device = s.device_index
    current.streams[s.device_index] = s
    try:
        yield
    finally:
        if previous is None:
            current.streams.pop(s.device_index, None)
        else:
            current.streams[s.device_index] = previous
        current.device = previous_device


class device:  # lower case: torch.cuda.device's name
    """``torch.cuda.device(d)``: ``d`` is this thread's current device until the block ends."""

    def __init__(self, device: Any) -> None:
        self._index = None if device is None or device == -1 else runtime().index(device)
        self._previous = -1

    def __enter__(self) -> None:
        if self._index is not None:
            current = runtime().current
            self._previous, current.device = current.device, self._index

    def __exit__(self, *exc: object) -> None:
        if self._index is not None:
            runtime().current.device = self._previous


class Runtime:
    """The fake CUDA state of one active ``fakegpu.devices(n)``."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.current = _Current()
        self.order = Order(self.name)
        self._defaults: list[FakeStream] = []
        self.generators = [torch.Generator().manual_seed(_DEFAULT_SEED) for _ in range(count)]
        self._rng_lock = threading.RLock()
        self.calls: Counter[tuple[str, Agent | None]] = Counter()
        self.moved: Counter[str] = Counter()  # bytes copied, by kind of copy
        self.pinned = PinnedPool()

    def tally(self, what: str, agent: Agent | None, nbytes: int = 0) -> None:
        """One CUDA runtime call: ``what`` it is, for ``agent`` (a stream, or ``HOST``);
        ``nbytes``: the bytes it copies, for a copy."""
        with self.order.lock:
            self.calls[what, agent] += 1
            if nbytes:
                self.moved[what] += nbytes

    def start(self) -> None:
        """Create the default streams (needs the runtime to be the active one)."""
        for _ in range(self.count):
            s = FakeStream(len(self._defaults))
            s.default = True
            s.cuda_stream = 0  # as CUDA's: the null handle, on every device
            self._defaults.append(s)

    @staticmethod
    def name(agent: Any) -> str:
        return "the host" if agent == HOST else agent.name()

    def index(self, device: Any) -> int:
        """The device index of ``device`` (None: the current device), checked."""
        if device is None:
            return self.current.device
        if isinstance(device, FakeStream):
            return device.device_index
        if isinstance(device, int):
            index = device
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {d}")
            index = self.current.device if d.index is None else d.index
        if not 0 <= index < self.count:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (fakegpu has {self.count} devices, "
                f"asked for {index})"
            )
        return index

    def default_stream(self, device: Any = None) -> FakeStream:
        return self._defaults[self.index(device)]

    def current_stream(self, device: Any = None) -> FakeStream:
        if not torch.cuda.default_generators:  # work on a GPU initializes CUDA
            self.initialize()
        index = self.index(device)
        return self.current.streams.get(index) or self._defaults[index]

    def raw_stream(self, index: int) -> int:
        """``torch._C._cuda_getCurrentRawStream``: the handle of the current stream."""
        return self.current_stream(index).cuda_stream

    def initialize(self) -> None:
        """CUDA's lazy initialization, which fills ``torch.cuda.default_generators`` (empty
        before it): at ``torch.cuda.init()`` and at the first work on a GPU, as on a real one."""
        torch.cuda.default_generators = tuple(self.generators)  # (undone with the patches)

    def skipped(self, primitive: str) -> bool:
        """Whether a test has switched ``primitive`` off on this thread (``skipping``)."""
        return primitive in self.current.skipping

    def synchronize(self, device: Any = None) -> None:
        if self.skipped("synchronize"):
            return
        index = self.index(device)
        self.tally("synchronize", HOST)
        for agent in list(self.order._clocks):
            if agent != HOST and getattr(agent, "device_index", None) == index:
                self.order.join(HOST, agent)

    @contextlib.contextmanager
    def rng(self, index: int) -> Iterator[None]:
        """Random ops on device ``index`` draw from its generator (swapped into the CPU's)."""
        with self._rng_lock:
            cpu = torch.default_generator
            saved = cpu.get_state()
            cpu.set_state(self.generators[index].get_state())
            try:
                yield
            finally:
                self.generators[index].set_state(cpu.get_state())
                cpu.set_state(saved)

    def namespace(self) -> dict[str, Any]:
        """The attributes installed on ``torch.cuda`` while active."""
        gens = self.generators

        def seed_all(seed: int) -> None:
            for g in gens:
                g.manual_seed(seed)

        def set_stream(s: FakeStream | None) -> None:
            if s is not None:
                self.current.streams[s.device_index] = s
                self.current.device = s.device_index

        def set_device(d: Any) -> None:
            if d is not None and d != -1:
                self.current.device = self.index(d)

        def get_rng_state(d: Any = "cuda") -> torch.Tensor:
            return gens[self.index(d)].get_state()

        def set_rng_state(state: torch.Tensor, d: Any = "cuda") -> None:
            gens[self.index(d)].set_state(state)

        def set_rng_state_all(states: Any) -> None:
            for g, s in zip(gens, states, strict=True):
                g.set_state(s)

        def nothing(*_: Any, **__: Any) -> None:
            return None

        def properties(d: Any = None) -> _Properties:
            self.index(d)  # checked, as CUDA checks the ordinal
            return _Properties()

        zero: Callable[..., int] = lambda *_, **__: 0  # noqa: E731
        return {
            "is_available": lambda: True,
            "is_initialized": lambda: bool(torch.cuda.default_generators),
            "device_count": lambda: self.count,
            "init": self.initialize,
            "_lazy_init": self.initialize,
            "current_device": lambda: self.current.device,
            "set_device": set_device,
            "device": device,
            "device_of": lambda t: device(t.device if t.is_cuda else None),
            "Stream": FakeStream,
            "Event": FakeEvent,
            "stream": stream,
            "set_stream": set_stream,
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "synchronize": self.synchronize,
            "get_device_properties": properties,
            "get_device_name": lambda d=None: properties(d).name,
            "get_device_capability": lambda d=None: (properties(d).major, properties(d).minor),
            "empty_cache": nothing,
            "memory_allocated": zero,
            "max_memory_allocated": zero,
            "reset_peak_memory_stats": nothing,
            "manual_seed": lambda seed: gens[self.current.device].manual_seed(int(seed)),
            "manual_seed_all": lambda seed: seed_all(int(seed)),
            "seed": lambda: gens[self.current.device].seed(),
            "seed_all": lambda: seed_all(torch.Generator().seed()),
            "initial_seed": lambda: gens[self.current.device].initial_seed(),
            "get_rng_state": get_rng_state,
            "set_rng_state": set_rng_state,
            "get_rng_state_all": lambda: [g.get_state() for g in gens],
            "set_rng_state_all": set_rng_state_all,
            "default_generators": (),  # empty until initialized, as on CUDA
        }
