"""Input throughput: a DataLoader iterated directly, and through ``distribute_dataset``.

The source is MNIST-shaped: 60,000 float samples of 28x28 and int64 labels in a
``TensorDataset``, global batch 256, so one pass is 235 batches. The loop body is empty, so
the table shows the input pipeline's own cost. Every repeat runs each case once, interleaved,
so that drifts in machine load hit the cases alike; the table shows medians (and the best
pass, which is less sensitive to other processes on a shared machine). The target (docs/design.md
§7) is a time ratio of at most 1.05 against the source.

Run: ``python benchmarks/bench_input.py [--repeats 15]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from centralstore.input.distributed import distribute_dataset

SAMPLES = 60_000
GLOBAL_BATCH = 256
SOURCE = "DataLoader (source)"


def seconds_per_batch(source: Iterable[Any]) -> float:
    """One full pass over ``source``: wall seconds per batch."""
    start = time.perf_counter()
    count = sum(1 for _ in source)
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="passes per case")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 28, 28), torch.randint(0, 10, (SAMPLES,)))
    loader = DataLoader(data, batch_size=GLOBAL_BATCH)
    cases: dict[str, Iterable[Any]] = {SOURCE: loader}
    for replicas in (1, 2, 4):
        devices = tuple(f"cpu:{i}" for i in range(replicas))
        cases[f"distribute_dataset, R = {replicas}"] = distribute_dataset(loader, devices)

    for source in cases.values():  # warm-up: first-touch allocations, thread start-up
        seconds_per_batch(source)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, source in cases.items():
            times[name].append(seconds_per_batch(source))

    median = {name: statistics.median(values) for name, values in times.items()}
    best = {name: min(values) for name, values in times.items()}
    print(
        f"{SAMPLES} samples of 28x28 float32, global batch {GLOBAL_BATCH}, {args.repeats} "
        f"interleaved passes per case; torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    header = f"{'case':<28} {'batches/s':>10} {'time ratio':>11} {'best ratio':>11}"
    print(header)
    print("-" * len(header))
    for name in cases:
        print(
            f"{name:<28} {1 / median[name]:>10.0f} {median[name] / median[SOURCE]:>10.3f}x "
            f"{best[name] / best[SOURCE]:>10.3f}x"
        )


if __name__ == "__main__":
    main()
