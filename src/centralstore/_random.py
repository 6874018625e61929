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
>>> randomness = ReplicaRandomness(Placement.build(["cpu:0", "cpu:1"], "cpu:0"))
>>> def draws():
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

    __slots__ = ("_base", "_buffer", "_generators", "_global", "_ids", "_saved")

    def __init__(self, placement: Placement) -> None:
        self._ids = tuple(placement.replica_offset + r for r in range(placement.local_replicas))
        self._generators: tuple[tuple[Any, ...], ...] = tuple(
            (torch.default_generator,)
            + ((torch.cuda.default_generators[device.index],) if device.type == "cuda" else ())
            for device in placement.storage_devices
        ) if any(d.type == "cuda" for d in placement.storage_devices) else tuple(
            (torch.default_generator,) for _ in placement.storage_devices
        )
        self._buffer = torch.empty((), dtype=torch.int64, device="cpu")
        self._base = 0
        self._global: dict[Any, Any] = {}  # generator -> the global state it had
        self._saved: dict[int, list[tuple[Any, Any]]] = {}  # replica -> its own states

    def begin(self) -> None:
        """A run begins: one draw from the global CPU generator seeds its replicas' streams,
        whatever happens in the run, so that every path agrees."""
        self._base = int(self._buffer.random_(generator=torch.default_generator))
        self._saved.clear()

    def enter(self, replica: int) -> None:
        """Replica ``replica`` starts or runs on: its streams in place of the global ones."""
        global_id = self._ids[replica]
        if global_id == 0:
            return
        generators = self._generators[replica]
        for generator in generators:
            self._global[generator] = generator.get_state()
        saved = self._saved.pop(replica, None)
        if saved is not None:
            for generator, state in saved:
                generator.set_state(state)
            return
        seed = replica_seed(self._base, global_id)
        for generator in generators:
            generator.manual_seed(seed)

    def leave(self, replica: int) -> None:
        """Replica ``replica`` ends: the global streams are back."""
        if self._ids[replica] != 0:
            for generator in self._generators[replica]:
                generator.set_state(self._global.pop(generator))

    def suspend(self, replica: int) -> None:
        """Replica ``replica`` waits in a rendezvous: its streams are kept for ``enter``,
        and the global ones are back."""
        if self._ids[replica] != 0:
            self._saved[replica] = [(g, g.get_state()) for g in self._generators[replica]]
            self.leave(replica)
