"""Each replica's random numbers: its own stream, derived from the global generator.

With several replicas, the replica with global id 0 draws on from the global generators, as
one device would; every other replica draws from a stream of its own, seeded when it first
runs from its global id and the run's base: the seed the global CPU generator was last given
(``torch.manual_seed``, ``set_rng_state``, or the last replica of the run before). The
generators hold the stream of the replica running: replicas run one at a time, and one that
has finished needs its stream no more, so the next replica's seed simply replaces it, and
after the run the global generators go on from the last replica's stream, whose seed is the
next run's base. Only a replica that waits in a rendezvous (``suspend``) has its state saved,
and put back when it runs on; while all wait, the function of a ``merge_call`` draws from a
stream of its own (``merge``), not from the one the last replica draws again when it runs
on. So two identical programs give identical results on every path (replicas one after
another, or passing the baton on threads), re-seeding with ``torch.manual_seed`` or
restoring a saved state reproduces a run, and no two replicas share a dropout mask or a
noise sample, on logical CPU devices and on GPUs alike (``torch.manual_seed`` gives every
GPU the same seed). A replica's generators are the CPU's and, for a CUDA replica, its GPU's.

Not restoring the global state after each replica is what makes this cheap: a run of two
replicas costs one read of a seed and one ``manual_seed``, where saving and restoring the
global state around every replica after the first cost a ``get_state`` copy (5 kB) and a
``set_state`` more. (Drawing the base from the generator, as this module first did, ran a
kernel cold after the optimizer step: about 13 us of the demo CNN's R = 2 run, against about
1 to read the seed.)

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

import torch

from ._placement import Placement

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant (the golden ratio's), to spread seeds
_MASK = (1 << 63) - 1
_MERGE = 0x5BD1E9955BD1E995  # mixed into the seed of a merge function's stream


def _generators_of(device: torch.device) -> tuple[Any, ...]:
    """The generators that torch draws from on ``device``: the CPU's, and a GPU's own.
    (``torch.cuda.default_generators`` stays empty until CUDA is initialized, which torch
    does lazily at the first CUDA call: a strategy built before any may be that call.)"""
    if device.type != "cuda":
        return (torch.default_generator,)
    torch.cuda.init()  # type: ignore[no-untyped-call]
    return (torch.default_generator, torch.cuda.default_generators[device.index])


def replica_seed(base: int, replica: int) -> int:
    """The seed of global replica ``replica``'s stream in a run of base ``base``."""
    return ((base ^ (replica * _MIX)) * _MIX + replica) & _MASK


class ReplicaRandomness:
    """The generators of a strategy's replicas (see the module's docstring): one per
    strategy; ``begin`` starts the streams of each run of several replicas."""

    __slots__ = ("_generators", "_ids", "_merge_generators")

    def __init__(self, placement: Placement) -> None:
        self._ids = tuple(placement.replica_offset + r for r in range(placement.local_replicas))
        self._generators: tuple[tuple[Any, ...], ...] = tuple(
            map(_generators_of, placement.storage_devices)
        )
        self._merge_generators = _generators_of(placement.parameter_storage)

    def merge(self) -> None:
        """The function of a ``merge_call`` of several replicas runs, every replica waiting
        with its streams saved: the generators hold the last replica's, which it will draw
        again when it runs on. The parameter device's generators (where the function runs)
        get a stream of the function's own instead, seeded from that replica's seed, so
        that neither the function's draws nor those of a run inside it repeat a replica's."""
        seed = ((torch.default_generator.initial_seed() ^ _MERGE) * _MIX) & _MASK
        for generator in self._merge_generators:
            generator.manual_seed(seed)

    def begin(self) -> Streams:
        """A run begins: its replicas' streams derive from the global CPU generator's seed,
        whatever happens in the run, so that every path agrees."""
        base = (torch.default_generator.initial_seed() * _MIX) & _MASK
        return Streams(base, self._ids, self._generators)


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
