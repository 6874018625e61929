"""Input throughput: a source iterated directly, and through ``distribute_dataset``.

Two MNIST-shaped sources of 25,600 float samples of 28x28 and int64 labels, global batch 256
(100 batches a pass): a ``DataLoader`` over a ``TensorDataset``, and a tf.data port of it that
normalizes each image, ``cs.Dataset.from_tensor_slices(...).map(normalize).batch(256)``. Both
make each batch in Python, element by element, as input pipelines do, and every batch costs
about the same (a ``shuffle`` would make the first batch fill its whole buffer, which no step
can overlap).

Three tables. The first times passes whose loop body is empty, so it shows the distributed
dataset's own cost: the time ratio of a pass over the distributed dataset to a pass over its
source, taken within each round and then the median over rounds, with the quartiles of the
rounds' ratios, in wall time and in the process's CPU time (which a busy machine disturbs
less: time spent waiting for a core is not in it). ``source again`` is the source against
itself, the noise of the machine: a ratio whose quartiles hold 1.000, or that lies within the
source-again spread, is inside the noise. The target (issue 22) is at most 1.03 at R = 1 and
R = 2.

The second gives the cost of a step in microseconds over batches made in advance (a list),
which is the distributed dataset's cost alone, whatever the source.

The third runs a step that sleeps as long as the source takes to make a batch (its median,
measured before the rounds): ``both`` is the pass with that step, against the larger of
``loading`` (the distributed dataset, empty loop) and ``stepping`` (the sleeps alone). With
full overlap the ratio is 1 + 1/100 (the first batch is loaded before any step, and the last
step runs after the last batch); made one after the other, 2. The target is at most 1.05.
``thread`` is the floor of any overlap on this machine: the source alone, made ahead by a bare
thread and a ``queue.Queue`` of two, with the same step. On a virtual machine the Python that
makes a batch runs slower when sleeps come between batches than back to back (the core idles
and comes back slow), so a batch made beside the step takes longer than ``loading``;
``both / thread`` is then what the distributed dataset adds to the overlap itself.

Each source has its rounds to itself, in two blocks: the passes with an empty loop, then the
passes that sleep (a pass right after sleeping ones runs slower, so mixing them charged the
distributed passes, which came after sleeping cases in both orders, up to 20% here). Each
block runs one round that is not kept, then rounds that run each of its cases once, the order
reversed every other round, so that drifts in the machine's load hit the cases alike. The
third table's ``loading`` is the first block's pass of the same round.

Run: ``python benchmarks/bench_input.py [--rounds 9]``
"""

from __future__ import annotations

import argparse
import gc
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from bench_train import quartiles
from torch.utils.data import DataLoader, TensorDataset

from centralstore.cli import at_least
from centralstore.input.dataset import Dataset
from centralstore.input.distributed import distribute_dataset

SAMPLES = 25_600
GLOBAL_BATCH = 256
REPLICAS = (1, 2, 4)
OVERLAP_REPLICAS = (1, 2)


def normalize(image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST's usual normalization, one element at a time."""
    return (image - 0.1307) / 0.3081, label


def devices(replicas: int) -> tuple[str, ...]:
    return tuple(f"cpu:{i}" for i in range(replicas))


class Timing(NamedTuple):
    """Seconds per batch of one pass: wall time and the process's CPU time."""

    wall: float
    cpu: float


def seconds_per_batch(source: Iterable[Any], step: float = 0.0) -> Timing:
    """One full pass over ``source``, sleeping ``step`` seconds after each batch.

    The pass starts after a full collection, so that every pass meets the collector at the
    same points: a pass over a ``cs.Dataset`` that shuffles 10,000 elements allocates enough
    to trigger a generation-2 collection every other pass (about a third of the pass here),
    which would otherwise land on the same cases round after round.
    """
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    count = 0
    for _ in source:
        count += 1
        if step:
            time.sleep(step)
    return Timing((time.perf_counter() - start) / count, (time.process_time() - cpu) / count)


def timed(source: Iterable[Any], step: float = 0.0) -> Callable[[], Timing]:
    """A case: one pass over ``source`` with ``step`` seconds of sleep per batch."""
    return lambda: seconds_per_batch(source, step)


def bare_thread(source: Iterable[Any]) -> Iterable[Any]:
    """``source``'s items made ahead by a plain thread, at most two waiting: the overlap any
    Python program gets, and the floor for ``both``."""
    items: queue.Queue[Any] = queue.Queue(maxsize=2)
    end = object()

    def produce() -> None:
        for item in source:
            items.put(item)
        items.put(end)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    while (item := items.get()) is not end:
        yield item
    thread.join()


class BareThread:
    """A re-iterable ``bare_thread`` over ``source``: a fresh thread each pass."""

    def __init__(self, source: Iterable[Any]) -> None:
        self._source = source

    def __iter__(self) -> Iterator[Any]:
        return bare_thread(self._source)


def sleeping(step: float, count: int) -> Timing:
    """The step alone: ``count`` sleeps of ``step`` seconds, seconds per step."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        time.sleep(step)
    return Timing((time.perf_counter() - start) / count, (time.process_time() - cpu) / count)


def interleaved(cases: dict[str, Callable[[], Timing]], rounds: int) -> dict[str, list[Timing]]:
    """Every case once per round, in reversed order every other round, after one round that
    is not kept (the first pass after other work pays for the allocator's and caches' state)."""
    times: dict[str, list[Timing]] = {name: [] for name in cases}
    names = list(cases)
    for case in cases.values():
        case()
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(cases[name]())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=15, help="rounds of every case")
    args = parser.parse_args()

    torch.manual_seed(0)
    features, labels = torch.randn(SAMPLES, 28, 28), torch.randint(0, 10, (SAMPLES,))
    sources: dict[str, Iterable[Any]] = {
        "DataLoader": DataLoader(TensorDataset(features, labels), batch_size=GLOBAL_BATCH),
        "cs.Dataset": Dataset.from_tensor_slices((features, labels))
        .map(normalize)
        .batch(GLOBAL_BATCH),
    }
    batches = len(sources["DataLoader"])  # type: ignore[arg-type]

    # Each source in a block of rounds of its own: the first pass over one source after
    # passes over the other is slower, which interleaving them would charge to one case.
    times: dict[str, list[Timing]] = {}
    loading: dict[str, float] = {}
    for name, source in sources.items():
        seconds_per_batch(source)  # warm-up: first-touch allocations
        loading[name] = step = statistics.median(seconds_per_batch(source).wall for _ in range(3))
        # Two blocks: a pass right after passes that sleep runs slower (the core idles and
        # comes back slow), so empty loops interleaved with sleeping ones would be charged
        # for whichever sleeping case comes before them.
        empty: dict[str, Callable[[], Timing]] = {}
        sleeps: dict[str, Callable[[], Timing]] = {}
        empty[f"{name}|source"] = timed(source)
        empty[f"{name}|source again"] = timed(source)
        sleeps[f"{name}|stepping"] = lambda t=step: sleeping(t, batches)
        sleeps[f"{name}|thread"] = timed(BareThread(source), step)
        for r in REPLICAS:
            dist = distribute_dataset(source, devices(r))
            empty[f"{name}|R = {r}"] = timed(dist)
            if r in OVERLAP_REPLICAS:
                sleeps[f"{name}|R = {r} both"] = timed(dist, step)
        times.update(interleaved(empty, args.rounds))
        times.update(interleaved(sleeps, args.rounds))

    print(
        f"{SAMPLES} samples of 28x28 float32, global batch {GLOBAL_BATCH}, {args.rounds} "
        f"rounds; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    )
    header = (
        f"{'case':<24} {'batches/s':>10} {'wall ratio':>11} {'quartiles':>15} "
        f"{'CPU ratio':>10} {'quartiles':>15}"
    )
    print(header)
    print("-" * len(header))
    for name in sources:
        base = times[f"{name}|source"]
        rate = 1 / statistics.median(t.wall for t in base)
        print(f"{name + ' (source)':<24} {rate:>10.0f} {1:>11.3f} {'':>15} {1:>10.3f}")
        for case in ["source again", *(f"R = {r}" for r in REPLICAS)]:
            values = times[f"{name}|{case}"]
            pairs = list(zip(values, base, strict=True))
            w1, wall, w3 = quartiles([v.wall / b.wall for v, b in pairs])
            c1, cpu, c3 = quartiles([v.cpu / b.cpu for v, b in pairs])
            rate = 1 / statistics.median(t.wall for t in values)
            print(
                f"  {case:<22} {rate:>10.0f} {wall:>11.3f} [{w1:.3f}, {w3:.3f}] "
                f"{cpu:>10.3f} [{c1:.3f}, {c3:.3f}]"
            )

    print()
    premade = list(sources["DataLoader"])
    per_step = interleaved(
        {f"R = {r}": timed(distribute_dataset(premade, devices(r))) for r in REPLICAS},
        args.rounds * 5,
    )
    print("cost of a step over batches made in advance (a list of DataLoader batches), us:")
    print(
        "  "
        + "   ".join(
            f"{k}: {statistics.median(t.wall for t in v) * 1e6:.1f}" for k, v in per_step.items()
        )
    )

    print()
    header = (
        f"{'step sleeping one loading time':<30} {'step ms':>8} {'loading':>8} {'stepping':>9} "
        f"{'both':>8} {'both / max':>11} {'quartiles':>15} {'thread':>7} {'both / thread':>14} "
        f"{'quartiles':>15}"
    )
    print(header)
    print("-" * len(header))
    for name in sources:
        stepping, thread = times[f"{name}|stepping"], times[f"{name}|thread"]
        for r in OVERLAP_REPLICAS:
            load, both = times[f"{name}|R = {r}"], times[f"{name}|R = {r} both"]
            ratios = [
                b.wall / max(lo.wall, s.wall) for b, lo, s in zip(both, load, stepping, strict=True)
            ]
            q1, median, q3 = quartiles(ratios)
            t1, floor, t3 = quartiles([b.wall / t.wall for b, t in zip(both, thread, strict=True)])
            ms = [
                1e3 * statistics.median(t.wall for t in v) for v in (load, stepping, both, thread)
            ]
            print(
                f"{name + f', R = {r}':<30} {loading[name] * 1e3:>8.2f} {ms[0]:>8.2f} "
                f"{ms[1]:>9.2f} {ms[2]:>8.2f} {median:>11.3f} [{q1:.3f}, {q3:.3f}] "
                f"{ms[3]:>7.2f} {floor:>14.3f} [{t1:.3f}, {t3:.3f}]"
            )


if __name__ == "__main__":
    main()
