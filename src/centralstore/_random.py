"""Each replica's random numbers: its own generator, derived from the global one.

With several replicas, each run begins by drawing one number from the global CPU generator;
replica 0 then draws from the global generators, and every other replica from its own
stream, seeded from that number and the replica's global id. So two identical programs give
identical results on every path (replicas one after another, or passing the baton on
threads), and no two replicas share a dropout mask or a noise sample, on logical CPU devices
and on GPUs alike (``torch.manual_seed`` gives every GPU the same seed). A replica's
generators are those of the CPU and, for a CUDA replica, of its GPU; they are swapped in
when the replica runs and out when it waits or ends, so code between replicas and after
``run`` draws from the global streams as before.

>>> import torch
>>> from centralstore._placement import Placement
>>> def draws():
...     randomness = ReplicaRandomness(Placement.build(["cpu:0", "cpu:1"], "cpu:0"))
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
    """The generators of the replicas of one run (see the module's docstring)."""

    __slots__ = ("_base", "_cuda", "_global", "_offset", "_saved")

    def __init__(self, placement: Placement) -> None:
        self._offset = placement.replica_offset
        self._cuda: tuple[int | None, ...] = tuple(
            device.index if device.type == "cuda" else None
            for device in placement.storage_devices
        )
        # drawn as the run begins, whatever happens in it, so that every path agrees
        self._base = int(
            torch.empty((), dtype=torch.int64).random_(generator=torch.default_generator)
        )
        self._global: dict[Any, Any] = {}  # generator -> the global state it had
        self._saved: dict[int, list[tuple[Any, Any]]] = {}  # replica -> its own states

    def _generators(self, replica: int) -> list[Any]:
        index = self._cuda[replica]
        generators: list[Any] = [torch.default_generator]
        if index is not None:
            generators.append(torch.cuda.default_generators[index])
        return generators

    def enter(self, replica: int) -> None:
        """Replica ``replica`` starts or runs on: its streams in place of the global ones."""
        global_id = self._offset + replica
        if global_id == 0:
            return
        generators = self._generators(replica)
        saved = self._saved.pop(replica, None)
        for generator in generators:
            self._global[generator] = generator.get_state()
        if saved is not None:
            for generator, state in saved:
                generator.set_state(state)
            return
        seed = replica_seed(self._base, global_id)
        for generator in generators:
            generator.manual_seed(seed)

    def leave(self, replica: int) -> None:
        """Replica ``replica`` ends: the global streams are back."""
        if self._offset + replica != 0:
            for generator in self._generators(replica):
                generator.set_state(self._global.pop(generator))

    def suspend(self, replica: int) -> None:
        """Replica ``replica`` waits in a rendezvous: its streams are kept for ``enter``,
        and the global ones are back."""
        if self._offset + replica != 0:
            self._saved[replica] = [(g, g.get_state()) for g in self._generators(replica)]
            self.leave(replica)
