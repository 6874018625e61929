"""Each replica's random numbers: its own stream, derived from the global generator.

With several replicas, each run begins by drawing one number from the global CPU generator.
The replica with global id 0 then draws on from the global generators, as one device would;
every other replica draws from a stream of its own, seeded from that number and its global
id when it first runs. The generators hold the stream of the replica running: replicas run
one at a time, and one that has finished needs its stream no more, so the next replica's
seed simply replaces it, and after the run the global generators go on from the last
replica's stream. Only a replica that waits in a rendezvous (``suspend``) has its state
saved, and put back when it runs on. So two identical programs give identical results on
every path (replicas one after another, or passing the baton on threads), re-seeding with
``torch.manual_seed`` reproduces a run, and no two replicas share a dropout mask or a noise
sample, on logical CPU devices and on GPUs alike (``torch.manual_seed`` gives every GPU the
same seed). A replica's generators are the CPU's and, for a CUDA replica, its GPU's.

Not restoring the global state after each replica is what makes this cheap: a run of two
replicas costs one draw and one ``manual_seed``, where saving and restoring the global
state around every replica after the first cost a ``get_state`` copy (5 kB) and a
``set_state`` more.

>>> import torch
>>> from centralstore._placement import Placement
>>> randomness = ReplicaRandomness(Placement.build(["cpu:0", "cpu:1"], "cpu:0"))
>>> def draws():
...     streams = randomness.begin()
...     out = []
...     for replica in range(2):
...         streams.enter(replica)
...         out.append(torch.rand(()).item())
...     return out
>>> _ = torch.manual_seed(0)
>>> first = draws()
>>> _ = torch.manual_seed(0)
>>> first == draws() and first[0] != first[1]
True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._placement import Placement

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant (the golden ratio's), to spread seeds
_MASK = (1 << 63) - 1


def replica_seed(base: int, replica: int) -> int:
    """The seed of global replica ``replica``'s stream in a run whose draw was ``base``."""
    return ((base ^ (replica * _MIX)) * _MIX + replica) & _MASK


class ReplicaRandomness:
    """The generators of a strategy's replicas (see the module's docstring): one per
    strategy; ``begin`` starts the streams of each run of several replicas."""

    __slots__ = ("_array", "_buffer", "_generators", "_ids")

    def __init__(self, placement: Placement) -> None:
        self._ids = tuple(placement.replica_offset + r for r in range(placement.local_replicas))
        self._generators: tuple[tuple[Any, ...], ...] = tuple(
            (torch.default_generator,)
            + ((torch.cuda.default_generators[device.index],) if device.type == "cuda" else ())
            for device in placement.storage_devices
        )
        # The draw lands in memory numpy reads: int() of a tensor would cost a dispatch more.
        self._array = np.zeros((), dtype=np.int64)
        self._buffer = torch.from_numpy(self._array)

    def begin(self) -> Streams:
        """A run begins: one draw from the global CPU generator seeds its replicas' streams,
        whatever happens in the run, so that every path agrees."""
        self._buffer.random_()  # the global CPU generator (a keyword costs 0.3 us)
        return Streams(int(self._array), self._ids, self._generators)


class Streams:
    """The replicas' streams in one run (a ``run`` inside ``merge_call`` has its own)."""

    __slots__ = ("_base", "_generators", "_ids", "_saved")

    def __init__(
        self, base: int, ids: tuple[int, ...], generators: tuple[tuple[Any, ...], ...]
    ) -> None:
        self._base = base
        self._ids = ids
        self._generators = generators
        self._saved: dict[int, list[tuple[Any, Any]]] = {}  # suspended replica -> its states

    def enter(self, replica: int) -> None:
        """Replica ``replica`` starts, or runs on after a rendezvous: its streams in the
        generators (the global ones for global replica 0, which starts first)."""
        if self._saved:
            saved = self._saved.pop(replica, None)
            if saved is not None:
                for generator, state in saved:
                    generator.set_state(state)
                return
        global_id = self._ids[replica]
        if global_id:
            seed = replica_seed(self._base, global_id)
            for generator in self._generators[replica]:
                generator.manual_seed(seed)

    def suspend(self, replica: int) -> None:
        """Replica ``replica`` waits in a rendezvous: its streams are kept for ``enter``."""
        self._saved[replica] = [(g, g.get_state()) for g in self._generators[replica]]
