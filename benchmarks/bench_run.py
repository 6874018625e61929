"""Microseconds per call of ``strategy.run`` and ``strategy.reduce``, next to a plain call.

For R = 1, 2 and 4 replicas on logical CPU devices, each case is timed against the same
function called plainly in the same process:
  run(lambda: None)             the dispatch cost of run with nothing to do
  the same, 26 variables        with the small transformer of bench_train.py (26 parameters)
                                built in the strategy's scope: what a run costs per variable
  run(lambda x: x, (tensor,))   the same with an argument passed to every replica
  run(f, (PerReplica, PerReplica))  a step's input: two PerReplica arguments, each replica
                                its components; f returns nothing
  run(f, (PerReplica, 64))      the same with a Python number beside the batch (a global
                                batch size): each replica gets the number as it is
  run(f, (PerReplica,)) -> (x, {'accuracy': x})  a step's outputs: each replica returns
                                its component and a dict of it, which run regroups into
                                PerReplica leaves of the same structure
  reduce(SUM, PerReplica)       R tensors of 4 floats summed; plain: the same additions
  reduce(MEAN, PerReplica)      the same divided by R, as a step's loss is reduced; plain:
                                the additions and the division
  reduce(MEAN, tensor)          a plain tensor, as run returns it with one replica: itself,
                                at any R; plain: the tensor
  gather(PerReplica, axis=0)    the R tensors concatenated; plain: ``torch.cat``
  run with one all_reduce       the threaded path: replica 0 meets a rendezvous, so the other
                                replicas run on replica threads; plain: the same all_reduce
                                in the default replica context (outside any strategy)
  run with one merge_call       the same with ``merge_call(lambda strategy: None)``: a sync
                                point (of no variables) on replica 0's thread, which TF-style
                                steps make to apply their gradients inside the replica
Calls are timed in batches and the table shows the median over batches, per call. The
machine is shared, so the cases are interleaved round by round (the call through the
strategy and the plain one in turns, the first of the two alternating): a drift in load
hits them alike. The target (docs/design.md §7) is a median under 25 us for a trivial run
with R = 2, aiming at 15.

A second table times accumulation: a step over a chain of N ``Linear(4, 4)`` (N tensors,
N / 2 layers) with R = 2, its run beginning with ``.grad`` filled (a second micro-batch
without ``zero_grad``) or empty (``.grad`` set to None before each run, untimed), against
plain PyTorch doing the two half-batch passes from the same state; and a no-op run with the
same N variables in scope. A run beginning filled should cost no more per tensor than one
beginning empty, and both should follow the work.

A third table times ``run(lambda: None)`` with the small transformer's 26 variables in scope
right after a sweep through 64 MB of memory (untimed), as a training loop's run follows an
optimizer step whose sweep over a model larger than the caches leaves none of the run's code
and data in them, right after sleeping 1 ms (untimed: the process touches nothing, so
whatever the run finds evicted, the machine's other work evicted), and the same run repeated
at once: a run's Python costs several times more after either (docs/design.md §7), which is
what a training step pays. A fourth column splits the cold cost: the run right after the
sweep and an untimed run of a twin strategy over a model of its own, which brings back the
code and the structures every run shares (the interpreter's, torch's, centralstore's
functions and classes) but none of the timed run's own objects (its store, records and
tensors): what is left over the run repeated at once is what its own data costs cold, the
rest of the cold cost is the code it runs.

Times are the process's CPU time by default (``--clock wall`` for wall-clock time): on a
machine with several times more runnable threads than cores (a load average of 8 to 13 on 2
cores while this was written), wall-clock time measures the neighbours. The threaded row's
waits for the baton cost wall time that CPU time does not count.

Run: ``python benchmarks/bench_run.py [--rounds 30] [--batch 200] [--cold-runs 200]
[--clock cpu]``
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
from centralstore.cli import at_least

REPLICAS = (1, 2, 4)
TARGET_US = 25.0


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["cpu"]


def batch_time(call: Callable[[], Any], calls: int) -> float:
    """Microseconds per call over one batch of ``calls`` calls."""
    start = _clock()
    for _ in range(calls):
        call()
    return (_clock() - start) / calls * 1e6


def transformer_in(strategy: cs.Strategy) -> nn.Module:
    """bench_train.py's small transformer (26 parameters), built in ``strategy``'s scope."""
    with strategy.scope():
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        model = nn.Sequential(
            nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 10)
        )
    assert sum(1 for _ in model.parameters()) == 26
    return model


def cases(replicas: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (call through the strategy, the plain call, calls per batch divisor)."""
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    tensor = torch.ones(4)
    components = [torch.full((4,), float(r)) for r in range(replicas)]
    value = cs.PerReplica(components)
    with_variables = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    model = transformer_in(with_variables)  # kept alive by the closure below

    def nothing() -> None:
        return None

    def consume(x: torch.Tensor, y: torch.Tensor | int) -> None:
        return None

    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    def plain_sum() -> torch.Tensor:
        total = components[0]
        for part in components[1:]:
            total = total + part
        return total

    def step_outputs(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x, {"accuracy": x}

    def one_all_reduce() -> Any:
        context = cs.get_replica_context()
        assert context is not None
        return context.all_reduce(cs.ReduceOp.SUM, tensor)

    def one_merge_call() -> Any:
        context = cs.get_replica_context()
        assert context is not None
        return context.merge_call(nothing_merged)

    def nothing_merged(strategy: cs.Strategy) -> None:
        return None

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
        "run(f, (PerReplica, 64))": (
            lambda: strategy.run(consume, args=(value, 64)),
            lambda: consume(components[0], 64), 1,
        ),
        "run(f, (PerReplica,)) -> (x, {'accuracy': x})": (
            lambda: strategy.run(step_outputs, args=(value,)),
            lambda: step_outputs(components[0]), 1,
        ),
        "reduce(SUM, PerReplica)": (
            lambda: strategy.reduce(cs.ReduceOp.SUM, value), plain_sum, 1,
        ),
        "reduce(MEAN, PerReplica)": (
            lambda: strategy.reduce(cs.ReduceOp.MEAN, value), lambda: plain_sum() / replicas, 1,
        ),
        "reduce(MEAN, tensor)": (
            lambda: strategy.reduce(cs.ReduceOp.MEAN, tensor), lambda: tensor, 1,
        ),
        "gather(PerReplica, axis=0)": (
            lambda: strategy.gather(value, axis=0), lambda: torch.cat(components), 1,
        ),
        # Thread hand-offs cost tens of microseconds: fewer calls per batch keep rounds short.
        "run with one all_reduce": (lambda: strategy.run(one_all_reduce), one_all_reduce, 20),
        "run with one merge_call": (lambda: strategy.run(one_merge_call), one_merge_call, 20),
    }


def measure(rounds: int, batch: int) -> dict[tuple[str, int], tuple[float, float]]:
    """(case, R) -> (median us per call through the strategy, median us of the plain call)."""
    setups = {replicas: cases(replicas) for replicas in REPLICAS}
    samples: dict[tuple[str, int, str], list[float]] = {}
    for table in setups.values():  # warm up: first calls start threads, fill caches
        for through, plain, divisor in table.values():
            batch_time(through, max(batch // divisor, 5))
            batch_time(plain, max(batch // divisor, 5))
    for round_ in range(rounds):
        for replicas, table in setups.items():
            for name, (through, plain, divisor) in table.items():
                calls = max(batch // divisor, 5)
                pair = [("cs", through), ("plain", plain)]
                for kind, call in pair if round_ % 2 == 0 else pair[::-1]:  # alternate the order
                    samples.setdefault((name, replicas, kind), []).append(batch_time(call, calls))
    return {
        (name, replicas): (
            statistics.median(samples[name, replicas, "cs"]),
            statistics.median(samples[name, replicas, "plain"]),
        )
        for name, replicas, kind in samples
        if kind == "cs"
    }


CHAIN_TENSORS = (20, 200, 2000)
ACCUMULATION = ("cs filled", "cs empty", "plain filled", "plain empty", "cs no-op")


def chain(tensors: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)])


def accumulation_cases(tensors: int) -> dict[str, tuple[Callable[[], Any], nn.Module, bool]]:
    """name -> (the call, the model whose ``.grad`` it starts from, whether filled)."""
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = chain(tensors)
    plain = chain(tensors)
    x = torch.randn(8, 4)
    halves = cs.PerReplica([x[:4], x[4:]])

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()

    def through() -> None:
        strategy.run(step, args=(halves,))

    def plain_halves() -> None:
        plain(x[:4]).sum().backward()
        plain(x[4:]).sum().backward()

    return {
        "cs filled": (through, model, True),
        "cs empty": (through, model, False),
        "plain filled": (plain_halves, plain, True),
        "plain empty": (plain_halves, plain, False),
        "cs no-op": (lambda: strategy.run(lambda: None), model, True),
    }


def timed_from(call: Callable[[], Any], model: nn.Module, filled: bool, calls: int) -> float:
    """Microseconds per call, each from filled or empty ``.grad`` (emptying it untimed)."""
    parameters = list(model.parameters())
    total = 0.0
    for _ in range(calls):
        if not filled:
            for parameter in parameters:
                parameter.grad = None
        start = _clock()
        call()
        total += _clock() - start
    return total / calls * 1e6


def measure_accumulation(rounds: int) -> dict[tuple[int, str], float]:
    """(tensors, case) -> median microseconds per call over alternating rounds."""
    results: dict[tuple[int, str], float] = {}
    for tensors in CHAIN_TENSORS:
        cases_ = accumulation_cases(tensors)
        calls = max(2, 2000 // tensors)
        for call, model, filled in cases_.values():
            timed_from(call, model, filled, 2)  # warm up, and fill .grad
        samples: dict[str, list[float]] = {name: [] for name in cases_}
        for round_ in range(rounds):
            names = list(cases_) if round_ % 2 == 0 else list(reversed(cases_))
            for name in names:
                samples[name].append(timed_from(*cases_[name], calls))
        for name, values in samples.items():
            results[tensors, name] = statistics.median(values)
    return results


def print_accumulation(results: dict[tuple[int, str], float], rounds: int) -> None:
    print(f"\naccumulation, R = 2: median microseconds per run over {rounds} rounds; "
          "cs - plain per tensor")
    header = f"{'tensors':>7}" + "".join(f"{name:>14}" for name in ACCUMULATION)
    header += f"{'filled/tensor':>15}{'empty/tensor':>14}{'no-op/tensor':>14}"
    print(header)
    print("-" * len(header))
    for tensors in CHAIN_TENSORS:
        row = f"{tensors:>7}" + "".join(
            f"{results[tensors, name]:>14.0f}" for name in ACCUMULATION
        )
        filled = (results[tensors, "cs filled"] - results[tensors, "plain filled"]) / tensors
        empty = (results[tensors, "cs empty"] - results[tensors, "plain empty"]) / tensors
        row += f"{filled:>15.2f}{empty:>14.2f}{results[tensors, 'cs no-op'] / tensors:>14.2f}"
        print(row)


SWEEP_MB = 64
ASLEEP_S = 1e-3


def measure_cold(samples: int) -> dict[int, tuple[float, float, float, float]]:
    """R -> median microseconds of ``run(lambda: None)`` with the small transformer's 26
    variables in scope right after a sweep through ``SWEEP_MB`` of memory (untimed: what an
    optimizer step over a model larger than the caches does to them), right after the sweep
    and a twin strategy's run (untimed: the code warm again, the timed run's own objects
    not), right after sleeping ``ASLEEP_S`` (untimed: what the rest of the machine does to
    them meanwhile), and of the same run repeated at once."""
    sweep = torch.zeros(SWEEP_MB * 2**20 // 4)
    setups = {}
    for replicas in REPLICAS:
        pair = []
        for _ in range(2):  # the timed strategy and its twin, each with a model of its own
            strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
            model = transformer_in(strategy)
            strategy.run(lambda: None)  # the first run, which checks the modules it calls
            pair.append((strategy, model))
        setups[replicas] = pair
    names = ("cold", "code warm", "asleep", "warm")
    times: dict[int, dict[str, list[float]]] = {
        replicas: {name: [] for name in names} for replicas in REPLICAS
    }

    def timed(strategy: cs.Strategy, into: list[float]) -> None:
        start = _clock()
        strategy.run(lambda: None)
        into.append((_clock() - start) * 1e6)

    for sample in range(samples):
        for replicas in REPLICAS if sample % 2 == 0 else REPLICAS[::-1]:
            (strategy, _), (twin, _) = setups[replicas]
            found = times[replicas]
            sweep.add_(1.0)
            timed(strategy, found["cold"])
            sweep.add_(1.0)
            twin.run(lambda: None)
            timed(strategy, found["code warm"])
            time.sleep(ASLEEP_S)
            timed(strategy, found["asleep"])
            timed(strategy, found["warm"])
    return {
        replicas: (
            statistics.median(found["cold"]), statistics.median(found["code warm"]),
            statistics.median(found["asleep"]), statistics.median(found["warm"]),
        )
        for replicas, found in times.items()
    }


def print_cold(results: dict[int, tuple[float, float, float, float]], samples: int) -> None:
    print(f"\nrun(lambda: None), 26 variables: median microseconds over {samples} runs right "
          f"after a {SWEEP_MB} MB sweep, after the sweep and a twin strategy's run (its code "
          f"warm, its own objects not), right after sleeping {ASLEEP_S * 1e3:g} ms, and "
          "repeated at once")
    header = (f"{'R':>3}{'after sweep':>13}{'ratio':>7}{'code warm':>11}{'ratio':>7}"
              f"{'after sleep':>13}{'ratio':>7}{'at once':>10}")
    print(header)
    print("-" * len(header))
    for replicas, (cold, code_warm, asleep, warm) in results.items():
        print(f"{replicas:>3}{cold:>13.1f}{cold / warm:>7.1f}{code_warm:>11.1f}"
              f"{code_warm / warm:>7.1f}{asleep:>13.1f}{asleep / warm:>7.1f}{warm:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=30, help="interleaved rounds")
    parser.add_argument("--batch", type=at_least(1), default=200, help="calls per timed batch")
    parser.add_argument("--accumulation-rounds", type=at_least(0), default=10)
    parser.add_argument("--cold-runs", type=at_least(0), default=200,
                        help="runs timed right after a sweep through memory")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    options = parser.parse_args()
    global _clock
    _clock = CLOCKS[options.clock]
    results = measure(options.rounds, options.batch)

    names = list(dict.fromkeys(name for name, _ in results))
    width = max(len(name) for name in names) + 2
    header = f"{'case':<{width}}" + "".join(f"{f'R={r} cs':>11}{'plain':>9}" for r in REPLICAS)
    print(f"median microseconds ({options.clock} time) per call, {options.rounds} rounds x "
          f"{options.batch} calls, "
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
    if options.accumulation_rounds:
        rounds = options.accumulation_rounds
        print_accumulation(measure_accumulation(rounds), rounds)
    if options.cold_runs:
        print_cold(measure_cold(options.cold_runs), options.cold_runs)


if __name__ == "__main__":
    main()
