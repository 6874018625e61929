"""What glibc's heap costs a training step on the CPU, and what ``cs.keep_host_memory()`` gives.

PyTorch takes CPU tensors from glibc, which maps a block over its mmap threshold afresh and
unmaps it when it is freed, and gives back free memory at the top of its heap; a step that
makes and frees the same large tensors every time can fault their pages in again at every
step. Which blocks it keeps depends on everything the process did before, so each
configuration here runs in a process of its own, twice: with the heap as glibc leaves it
(``default``) and after ``cs.keep_host_memory()`` (``kept``); the processes take turns, in an
order reversed every round. Each makes WARMUP untimed steps, then ``--steps`` timed ones:
the median ms per step of the process's CPU time, user and system (a page fault is the
system's part; ``--clock wall`` for wall-clock time, which on a shared machine also
measures the neighbours), and the median of the page faults each step took. The table
gives the medians over ``--rounds`` rounds.

Configurations, AdamW's default update (no ``fused``), a global batch of 64, one intra-op
thread (``--threads``):
  mlp1024, mlp2048   MLP 784-W-W-10 (W = 1024: 2.9 million parameters; 2048: 5.8 million)
    plain    one device
    cs R=1   CentralStorageStrategy on cpu:0
    halves   one device, two passes of 32 whose gradients accumulate
    cs R=2   cpu:0 and cpu:1, 32 each: the run holds the first replica's gradients apart
             while the second's are made
  update     Adam's default update alone over 45.7 million parameters on the host
             (``gpu_check.py``'s ``large``): where the variables live on the CPU and GPUs
             compute, the update runs on the host at every step

    python benchmarks/bench_host_memory.py [--rounds 3] [--steps 20] [--models mlp1024 ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import centralstore as cs
from centralstore.cli import at_least

BATCH = 64
WARMUP = 5
WIDTHS = {"mlp1024": 1024, "mlp2048": 2048}
STEP_CONFIGS = ("plain", "cs R=1", "halves", "cs R=2")
MODELS = (*WIDTHS, "update")
HEAPS = ("default", "kept")


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 10),
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="sum") / BATCH


def _step(model_name: str, config: str) -> Callable[[], None]:
    """One training step of ``config`` (or, for ``update``, one optimizer step)."""
    torch.manual_seed(0)
    if model_name == "update":
        from gpu_check import Large

        large = Large()
        for parameter in large.parameters():
            parameter.grad = torch.randn_like(parameter) * 1e-3
        return torch.optim.Adam(large.parameters(), lr=1e-3).step
    width = WIDTHS[model_name]
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    half = BATCH // 2
    if config.startswith("cs"):
        devices = ["cpu:0"] if config == "cs R=1" else ["cpu:0", "cpu:1"]
        strategy = cs.CentralStorageStrategy(devices)
        with strategy.scope():
            model = _mlp(width)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = (x, y) if len(devices) == 1 else (
            cs.PerReplica([x[:half], x[half:]]), cs.PerReplica([y[:half], y[half:]])
        )

        def replica(xs: torch.Tensor, ys: torch.Tensor) -> None:
            _loss(model, xs, ys).backward()  # type: ignore[no-untyped-call]

        def cs_step() -> None:
            optimizer.zero_grad()
            strategy.run(replica, args=inputs)
            optimizer.step()

        return cs_step
    model = _mlp(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    slices = [(x, y)] if config == "plain" else [(x[:half], y[:half]), (x[half:], y[half:])]

    def plain_step() -> None:
        optimizer.zero_grad()
        for xs, ys in slices:
            _loss(model, xs, ys).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return plain_step


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def child(
    model_name: str, config: str, heap: str, steps: int, threads: int, clock: str
) -> None:
    """One process: print the median ms and page faults of ``steps`` steps, as JSON."""
    torch.set_num_threads(threads)
    if heap == "kept" and not cs.keep_host_memory():
        raise SystemExit("this C library has no mallopt: there is nothing to compare")
    step = _step(model_name, config)
    for _ in range(WARMUP):
        step()
    times, faults = [], []
    now = CLOCKS[clock]
    for _ in range(steps):
        before, start = _faults(), now()
        step()
        times.append((now() - start) * 1e3)
        faults.append(_faults() - before)
    print(json.dumps({"ms": statistics.median(times), "faults": statistics.median(faults)}))


def _measure(
    model_name: str, config: str, heap: str, options: argparse.Namespace
) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", model_name, config, heap,
         "--steps", str(options.steps), "--threads", str(options.threads),
         "--clock", options.clock],
        capture_output=True, text=True, check=False,
    )
    if done.returncode:  # (no mallopt here, or a configuration that failed: its own words)
        raise SystemExit(f"{model_name} {config} ({heap}): " + done.stderr.strip())
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed steps per process")
    parser.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "CONFIG", "HEAP"),
                        help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        model_name, config, heap = options.child
        child(model_name, config, heap, options.steps, options.threads, options.clock)
        return
    runs = [
        (model_name, config, heap)
        for model_name in options.models
        for config in (("update",) if model_name == "update" else STEP_CONFIGS)
        for heap in HEAPS
    ]
    results: dict[tuple[str, str, str], list[dict[str, float]]] = {run: [] for run in runs}
    for round_ in range(options.rounds):
        print(f"round {round_ + 1}/{options.rounds}: {len(runs)} processes", file=sys.stderr,
              flush=True)
        for run in runs if round_ % 2 == 0 else list(reversed(runs)):
            results[run].append(_measure(run[0], run[1], run[2], options))
    medians = {
        run: (statistics.median(r["ms"] for r in rs), statistics.median(r["faults"] for r in rs))
        for run, rs in results.items()
    }
    print(f"torch {torch.__version__}, {options.threads} intra-op thread(s), a process per "
          f"configuration and heap, {options.steps} steps after {WARMUP}, medians of "
          f"{options.clock} time over {options.rounds} rounds; page faults per step in "
          "brackets\n")
    print(f"{'model':<8} {'config':<7} {'default ms':>20} {'kept ms':>18} {'kept / default':>15}")
    for model_name, config, heap in runs:
        if heap != "default":
            continue
        (ms, faults), (kept_ms, kept_faults) = (
            medians[model_name, config, h] for h in HEAPS
        )
        print(f"{model_name:<8} {config:<7} {ms:9.2f} [{faults:>8.0f}] "
              f"{kept_ms:8.2f} [{kept_faults:>7.0f}] {kept_ms / ms:15.3f}")
    for model_name in options.models:
        if model_name == "update":
            continue
        cells = []
        for config, base in (("cs R=1", "plain"), ("cs R=2", "halves")):
            ratios = [
                f"{medians[model_name, config, h][0] / medians[model_name, base, h][0]:.3f}"
                for h in HEAPS
            ]
            cells.append(f"{config} / {base} {ratios[0]} default, {ratios[1]} kept")
        print(f"{model_name}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
