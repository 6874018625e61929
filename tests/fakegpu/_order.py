"""Happens-before over the host and every fake stream: vector clocks, memory blocks, hazards.

Each *agent* (the host, one for all host threads; each stream) has a vector clock. An access
ticks its agent's own entry and is recorded on the memory block it touches (a storage: every
view of it is the same block). Two accesses of a block conflict when one of them writes; a
conflict is a hazard when neither is ordered before the other, that is when the later agent's
clock has not seen the earlier access. Ordering comes only from what CUDA orders:

* work the host enqueues on a stream comes after everything the host did before (the launch);
* ``event.record(s)`` snapshots ``s``; ``s2.wait_event(e)`` and ``s2.wait_stream(s)`` join it;
* ``event.synchronize()``, ``stream.synchronize()``, ``torch.cuda.synchronize()`` and blocking
  copies join a stream into the host.

The host is one agent: the threads of one Python program hand tensors to each other through
queues and locks this model does not see, and treating them as one program keeps it from
reporting races between host threads, which are not its subject.

Allocator rule: a device block freed while a stream other than the one that allocated it may
still use it, and that stream was not named with ``record_stream``, is a hazard: CUDA's caching
allocator hands the block to the allocating stream's next allocation at once. "May still use
it": its last access there is ordered neither before the allocating stream's present nor
before the host's (work that reuses the block is enqueued by the host after the free, so a
host that has waited for the access, through an event or a synchronize, makes the free safe).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

Agent = Hashable  # HOST or a stream object
HOST = "host"


class Clock(dict[Agent, int]):
    """A vector clock: for each agent, the latest of its accesses known to be ordered before."""

    def join(self, other: dict[Agent, int]) -> None:
        for agent, time in other.items():
            if self.get(agent, 0) < time:
                self[agent] = time


@dataclass(frozen=True)
class Access:
    agent: Agent
    time: int
    op: str
    write: bool


@dataclass
class Block:
    """One storage: where it lives, the stream that allocated it (None on the host) and its
    latest write and the reads since."""

    serial: int
    device: str
    shape: tuple[int, ...]
    dtype: str
    stream: Agent | None
    recorded: set[Agent] = field(default_factory=set)
    write: Access | None = None
    reads: dict[Agent, Access] = field(default_factory=dict)

    def accesses(self) -> Iterator[Access]:
        if self.write is not None:
            yield self.write
        yield from self.reads.values()

    def describe(self) -> str:
        return f"a {self.device} block of shape {self.shape} ({self.dtype})"


@dataclass(frozen=True)
class Hazard:
    """Two unordered conflicting accesses, or a free that a stream may still be using."""

    kind: str  # "write/write", "read/write", "write/read", "free"
    block: str
    first: str
    second: str

    def __str__(self) -> str:
        if self.kind == "free":
            return f"allocator hazard on {self.block}: {self.first}, {self.second}"
        return (
            f"{self.kind} race on {self.block}: {self.first} and then {self.second}, with no "
            "event, wait_stream, wait_event or synchronize ordering them"
        )


class Order:
    """The clocks of every agent, the tracked blocks and the hazards found so far."""

    def __init__(self, name: Callable[[Agent], str]) -> None:
        self._name = name
        self._clocks: dict[Agent, Clock] = {}
        self.blocks: dict[int, Block] = {}
        self.hazards: list[Hazard] = []
        self.lock = threading.RLock()
        self._serial = 0

    def clock(self, agent: Agent) -> Clock:
        clock = self._clocks.get(agent)
        if clock is None:
            clock = self._clocks[agent] = Clock()
        return clock

    # -- ordering ------------------------------------------------------------------------

    def launch(self, stream: Agent) -> None:
        """The host enqueues work on ``stream``: it comes after what the host did so far."""
        with self.lock:
            self.clock(stream).join(self.clock(HOST))

    def join(self, into: Agent, source: Agent | dict[Agent, int]) -> None:
        """``into`` waits for ``source`` (an agent, or a snapshot such as an event's)."""
        with self.lock:
            snapshot = source if isinstance(source, dict) else self.clock(source)
            self.clock(into).join(dict(snapshot))

    def snapshot(self, agent: Agent) -> dict[Agent, int]:
        with self.lock:
            return dict(self.clock(agent))

    # -- blocks --------------------------------------------------------------------------

    def block(
        self, key: int, device: str, shape: tuple[int, ...], dtype: str, stream: Agent | None
    ) -> tuple[Block, bool]:
        """The block stored at ``key``, created (allocated on ``stream``) if new."""
        with self.lock:
            block = self.blocks.get(key)
            if block is not None:
                return block, False
            self._serial += 1
            block = self.blocks[key] = Block(self._serial, device, shape, dtype, stream)
            return block, True

    def access(self, agent: Agent, block: Block, write: bool, op: str) -> None:
        """``agent`` reads or writes ``block`` in ``op``; conflicts unordered with it are
        hazards."""
        with self.lock:
            clock = self.clock(agent)
            clock[agent] = clock.get(agent, 0) + 1
            mine = Access(agent, clock[agent], op, write)
            earlier = [block.write] if block.write is not None else []
            if write:
                earlier += block.reads.values()
            for other in earlier:
                if other.agent != agent and clock.get(other.agent, 0) < other.time:
                    kind = f"{'write' if other.write else 'read'}/{'write' if write else 'read'}"
                    self.hazards.append(
                        Hazard(kind, block.describe(), self._what(other), self._what(mine))
                    )
            if write:
                block.write, block.reads = mine, {}
            else:
                block.reads[agent] = mine

    def free(self, key: int, serial: int) -> None:
        """The storage of block ``key`` was deallocated (if it is still the same block)."""
        with self.lock:
            block = self.blocks.get(key)
            if block is None or block.serial != serial:
                return
            del self.blocks[key]
            owner = block.stream
            if owner is None:  # host memory: CUDA's host allocator waits for its streams
                return
            present = Clock(self.clock(owner))
            present.join(self.clock(HOST))  # later work on ``owner`` is enqueued after now
            for access in block.accesses():
                agent = access.agent
                if agent in (owner, HOST) or agent in block.recorded:
                    continue
                if present.get(agent, 0) < access.time:
                    self.hazards.append(Hazard(
                        "free", block.describe(),
                        f"allocated on {self._name(owner)} and freed while "
                        f"{self._what(access)} may still be running",
                        f"without {self._name(agent)} in record_stream, so the next "
                        f"allocation on {self._name(owner)} may reuse it",
                    ))

    def _what(self, access: Access) -> str:
        verb = "writes" if access.write else "reads"
        return f"`{access.op}` on {self._name(access.agent)} ({verb})"
