"""Microseconds per call of ``strategy.run`` and ``strategy.reduce``, next to a plain call.

For R = 1, 2 and 4 replicas on logical CPU devices, each case is timed against the same
function called plainly in the same process:
  run(lambda: None)             the dispatch cost of run with nothing to do
  the same, 26 variables        with the small transformer of bench_train.py (26 parameters)
                                built in the strategy's scope: what a run costs per variable
  run(lambda x: x, (tensor,))   the same with an argument passed to every replica
  run(f, (PerReplica, PerReplica))  a step's input: two PerReplica arguments, each replica
                                its components; f returns nothing
  reduce(SUM, PerReplica)       R tensors of 4 floats summed; plain: the same additions
  run with one all_reduce       the threaded path: replica 0 meets a rendezvous, so the other
                                replicas run on replica threads; plain: the same all_reduce
                                in the default replica context (outside any strategy)
Calls are timed in batches and the table shows the median over batches, per call. The
machine is shared, so the cases are interleaved round by round: a drift in load hits them
alike. The target (docs/design.md §7) is a median under 25 us for a trivial run with R = 2,
aiming at 15.

Run: ``python benchmarks/bench_run.py [--rounds 30] [--batch 200]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import centralstore as cs

REPLICAS = (1, 2, 4)
TARGET_US = 25.0


def batch_time(call: Callable[[], Any], calls: int) -> float:
    """Microseconds per call over one batch of ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def cases(replicas: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (call through the strategy, the plain call, calls per batch divisor)."""
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    tensor = torch.ones(4)
    components = [torch.full((4,), float(r)) for r in range(replicas)]
    value = cs.PerReplica(components)
    with_variables = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    with with_variables.scope():
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        model = nn.Sequential(  # kept alive by the closure below
            nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 10)
        )
    assert sum(1 for _ in model.parameters()) == 26

    def nothing() -> None:
        return None

    def consume(x: torch.Tensor, y: torch.Tensor) -> None:
        return None

    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    def plain_sum() -> torch.Tensor:
        total = components[0]
        for part in components[1:]:
            total = total + part
        return total

    def one_all_reduce() -> Any:
        context = cs.get_replica_context()
        assert context is not None
        return context.all_reduce(cs.ReduceOp.SUM, tensor)

    return {
        "run(lambda: None)": (lambda: strategy.run(nothing), nothing, 1),
        "the same, 26 variables": (
            lambda: (model, with_variables.run(nothing))[1], nothing, 1,
        ),
        "run(lambda x: x, (t,))": (
            lambda: strategy.run(identity, args=(tensor,)), lambda: identity(tensor), 1,
        ),
        "run(f, (PerReplica, PerReplica))": (
            lambda: strategy.run(consume, args=(value, value)),
            lambda: consume(components[0], components[0]), 1,
        ),
        "reduce(SUM, PerReplica)": (
            lambda: strategy.reduce(cs.ReduceOp.SUM, value), plain_sum, 1,
        ),
        # Thread hand-offs cost tens of microseconds: fewer calls per batch keep rounds short.
        "run with one all_reduce": (lambda: strategy.run(one_all_reduce), one_all_reduce, 20),
    }


def measure(rounds: int, batch: int) -> dict[tuple[str, int], tuple[float, float]]:
    """(case, R) -> (median us per call through the strategy, median us of the plain call)."""
    setups = {replicas: cases(replicas) for replicas in REPLICAS}
    samples: dict[tuple[str, int, str], list[float]] = {}
    for table in setups.values():  # warm up: first calls start threads, fill caches
        for through, plain, divisor in table.values():
            batch_time(through, max(batch // divisor, 5))
            batch_time(plain, max(batch // divisor, 5))
    for _ in range(rounds):
        for replicas, table in setups.items():
            for name, (through, plain, divisor) in table.items():
                calls = max(batch // divisor, 5)
                samples.setdefault((name, replicas, "cs"), []).append(batch_time(through, calls))
                samples.setdefault((name, replicas, "plain"), []).append(batch_time(plain, calls))
    return {
        (name, replicas): (
            statistics.median(samples[name, replicas, "cs"]),
            statistics.median(samples[name, replicas, "plain"]),
        )
        for name, replicas, kind in samples
        if kind == "cs"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--batch", type=int, default=200, help="calls per timed batch")
    options = parser.parse_args()
    results = measure(options.rounds, options.batch)

    names = list(dict.fromkeys(name for name, _ in results))
    width = max(len(name) for name in names) + 2
    header = f"{'case':<{width}}" + "".join(f"{f'R={r} cs':>11}{'plain':>9}" for r in REPLICAS)
    print(f"median microseconds per call, {options.rounds} rounds x {options.batch} calls, "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print(header)
    print("-" * len(header))
    for name in names:
        row = f"{name:<{width}}"
        for replicas in REPLICAS:
            through, plain = results[name, replicas]
            row += f"{through:>11.1f}{plain:>9.2f}"
        print(row)
    trivial = results["run(lambda: None)", 2][0]
    verdict = "met" if trivial < TARGET_US else "MISSED"
    print(f"\ntarget: trivial run with R = 2 under {TARGET_US:.0f} us: {trivial:.1f} us "
          f"({verdict})")


if __name__ == "__main__":
    main()
