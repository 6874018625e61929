"""Each replica's random numbers: its own generator, seeded from the global seed.

With several replicas, replica 0 draws from the global generators, as one device would;
every other replica draws from streams of its own (the CPU's and, for a CUDA replica, its
GPU's), seeded from the global seed (``torch.initial_seed()``) and the replica's global id
when a run first needs them and continued from run to run; a new global seed
(``torch.manual_seed``) starts new streams. So two identical programs give identical results
on every path (replicas one after another, or passing the baton on threads), and no two
replicas share a dropout mask or a noise sample, on logical CPU devices and on GPUs alike
(``torch.manual_seed`` gives every GPU the same seed). The streams are swapped in when a
replica runs and out when it waits or ends, so code between replicas and after ``run`` draws
from the global streams as before. (Seeding again with the same seed does not restart the
streams of a strategy's replicas after the first: a new strategy does.)

>>> import torch
>>> from centralstore._placement import Placement
>>> def draws():
...     randomness = ReplicaRandomness(Placement.build(["cpu:0", "cpu:1"], "cpu:0"))
...     randomness.begin()
...     out = []
...     for replica in range(2):
...         randomness.enter(replica)
...         out.append(torch.rand(()).item())
...         randomness.leave(replica)
...     return out
>>> _ = torch.manual_seed(0)
>>> first = draws()
>>> _ = torch.manual_seed(0)
>>> first == draws() and first[0] != first[1]
True
"""

from __future__ import annotations

from typing import Any

import torch

from ._placement import Placement

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant (the golden ratio's), to spread seeds
_MASK = (1 << 63) - 1


def replica_seed(base: int, replica: int) -> int:
    """The seed of global replica ``replica``'s stream in a run whose draw was ``base``."""
    return ((base ^ (replica * _MIX)) * _MIX + replica) & _MASK


class ReplicaRandomness:
    """The generators of a strategy's replicas (see the module's docstring): one per
    strategy; ``begin`` starts each run of several replicas."""

    __slots__ = ("_generators", "_global", "_ids", "_seed", "_states")

    def __init__(self, placement: Placement) -> None:
        self._ids = tuple(placement.replica_offset + r for r in range(placement.local_replicas))
        self._generators: tuple[tuple[Any, ...], ...] = tuple(
            (torch.default_generator,)
            + ((torch.cuda.default_generators[device.index],) if device.type == "cuda" else ())
            for device in placement.storage_devices
        ) if any(d.type == "cuda" for d in placement.storage_devices) else tuple(
            (torch.default_generator,) for _ in placement.storage_devices
        )
        self._seed: int | None = None  # the global seed the replicas' streams come from
        self._global: dict[Any, Any] = {}  # generator -> the global state it had
        self._states: dict[int, list[tuple[Any, Any]]] = {}  # replica -> its streams' states

    def begin(self) -> None:
        """A run begins: a new global seed (``torch.manual_seed``) starts new streams."""
        seed = torch.initial_seed()
        if seed != self._seed:
            self._seed = seed
            self._states.clear()

    def enter(self, replica: int) -> None:
        """Replica ``replica`` starts or runs on: its streams in place of the global ones."""
        global_id = self._ids[replica]
        if global_id == 0:
            return
        generators = self._generators[replica]
        for generator in generators:
            self._global[generator] = generator.get_state()
        states = self._states.get(replica)
        if states is not None:
            for generator, state in states:
                generator.set_state(state)
            return
        seed = replica_seed(self._seed or 0, global_id)
        for generator in generators:
            generator.manual_seed(seed)

    def leave(self, replica: int) -> None:
        """Replica ``replica`` waits in a rendezvous or ends: its streams are kept for its
        next ``enter``, and the global ones are back."""
        if self._ids[replica] != 0:
            generators = self._generators[replica]
            self._states[replica] = [(g, g.get_state()) for g in generators]
            for generator in generators:
                generator.set_state(self._global.pop(generator))

    suspend = leave
