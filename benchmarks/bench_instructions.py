"""Instructions per training step, counted by valgrind: centralstore against plain PyTorch.

Timings on a shared machine move by 2 to 4% from run to run (``bench_models.py`` prints its
own noise), as much as the per-step gaps this project chases on small models. An instruction
count does not move with the machine: each configuration of ``bench_models.py`` runs in a
process of its own under callgrind, whose counting is switched on for the counted steps only
(after 10 uncounted ones), with one OpenMP thread, a fixed hash seed, glibc's mmap threshold
fixed as ``bench_models.py`` fixes it for its timings and, where ``setarch`` exists, the same
address layout: so fixed, two runs counted the same instructions to the last (without the
fixed seed and layout, the same code's count moved by 0.7% between runs). The table
gives the instructions a step executes (all of them: the interpreter's, torch's kernels',
the allocator's) and their ratio to the same work without centralstore (``cs R=1`` /
``plain``, ``cs R=2`` / ``halves``), and ``cs R=2`` / ``apart``: ``apart`` is the halves
keeping each pass's gradients apart, as two replicas must, so that ratio is centralstore's
bookkeeping alone. With ``--cache`` callgrind also simulates the caches and branch
predictors (about four times slower) and adds the first-level data and instruction misses
and the mispredicted branches per step; ``--functions N`` names, for each comparison, the N
functions whose own instructions differ most (``callgrind_annotate``; Python code shows as
the interpreter's functions); the table's ``outside`` column is a difference without
glibc's allocator's functions. Only the same program counts the same: a change anywhere in
it (even in the script that drives the steps) can move the heap's layout, and a difference
between two configurations by up to about 45,000 instructions, the allocator's functions
moving most (benchmarks/README.md).

An instruction is not a unit of time: the gap in time is larger than the gap in instructions
when the extra instructions miss the caches more often, which ``--cache`` shows. Needs
``valgrind`` (its ``callgrind.h`` header) and a C compiler; without them the script says so
and exits. Each process takes minutes (the interpreter under valgrind runs about 50x
slower), and they run two at a time.

    python benchmarks/bench_instructions.py [--models cnn gpt2] [--steps 10] [--cache]
        [--functions 12]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from centralstore.cli import at_least

CONFIGS = ("plain", "cs R=1", "halves", "apart", "cs R=2")
# each configuration's baselines: the same work without centralstore first; ``cs R=2`` also
# against ``apart``, the halves keeping each pass's gradients apart as two replicas must
BASELINES = {"cs R=1": ("plain",), "apart": ("halves",), "cs R=2": ("halves", "apart")}
WARM = 10  # untimed steps before the counted ones
EVENTS = {  # callgrind's event -> the column
    "Ir": "instructions",
    "D1mr": "D1 read misses",
    "D1mw": "D1 write misses",
    "I1mr": "I1 misses",
    "Bcm": "branch misses",
    "Bim": "indirect misses",
}
_CONTROL = r"""
#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""
_STEPS = """
import ctypes, sys
sys.path.insert(0, {benchmarks!r})
import torch
torch.set_num_threads(1)
import bench_models
import centralstore
centralstore.keep_host_memory()  # glibc's heap as bench_models.py times it
control = ctypes.CDLL({library!r})
step = bench_models.make_step({model!r}, {config!r}, 4, False)
for _ in range({warm}):
    step()
control.toggle()
for _ in range({steps}):
    step()
control.toggle()
"""


def _control_library(directory: Path) -> Path | None:
    """The shared library whose call switches callgrind's counting, or None without a
    compiler or valgrind's header."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = directory / "control.c", directory / "control.so"
    source.write_text(_CONTROL)
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
        capture_output=True, text=True,
    )
    return library if built.returncode == 0 else None


ALLOCATOR = "(glibc's allocator)"  # the key of its total among a run's functions
_ANNOTATED = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+(\S.*)$")  # "1,234 (5.6%)  file:function [lib]"


def _by_function(out: Path, steps: int) -> tuple[dict[str, float], float]:
    """The instructions each function executed itself, per step, as ``callgrind_annotate``
    reads ``out`` (code that torch generates at run time, which has no symbol, counts as one
    function), and those of glibc's allocator (its ``malloc`` directory) among them."""
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
        capture_output=True, text=True, check=True,
    ).stdout
    functions: collections.Counter[str] = collections.Counter()
    allocator = 0
    for line in annotated.splitlines():
        found = _ANNOTATED.match(line)
        if found is None or "PROGRAM TOTALS" in line:
            continue
        name, count = found[2].split(" [")[0], int(found[1].replace(",", ""))
        name = "??? (generated at run time)" if name.startswith("???:0x") else name
        functions[name.rsplit("/", 1)[-1]] += count
        if "/malloc/" in name:  # glibc's sources: ./malloc/./malloc/malloc.c, arena.c
            allocator += count
    return {name: count / steps for name, count in functions.items()}, allocator / steps


def _count(
    model: str, config: str, steps: int, cache: bool, library: Path, directory: Path,
) -> tuple[dict[str, float], dict[str, float]]:
    """Callgrind's totals for ``steps`` steps of ``config``, per step, and each function's
    own instructions per step (an empty dict without ``callgrind_annotate``), with the
    allocator's total under ``ALLOCATOR``."""
    name = f"{model}-{config.replace(' ', '_').replace('=', '')}"
    out = directory / f"callgrind.{name}"
    code = _STEPS.format(
        benchmarks=str(Path(__file__).parent), library=str(library), model=model,
        config=config, warm=WARM, steps=steps,
    )
    fixed = ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []
    command = [
        *fixed, "valgrind", "--tool=callgrind", "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
        sys.executable, "-c", code,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True,
        env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"},
    )
    if result.returncode:
        raise RuntimeError(f"{model} {config} failed under valgrind:\n{result.stderr[-3000:]}")
    events, totals = None, None
    for line in out.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("totals:"):
            totals = [int(v) for v in line.split()[1:]]
    if events is None or totals is None:
        raise RuntimeError(f"callgrind wrote no totals for {model} {config} to {out}")
    per_step = {event: total / steps for event, total in zip(events, totals, strict=False)}
    if shutil.which("callgrind_annotate") is None:
        return per_step, {}
    functions, allocator = _by_function(out, steps)
    return per_step, {**functions, ALLOCATOR: allocator}


def _print_functions(
    model: str, config: str, base: str, functions: dict[tuple[str, str], dict[str, float]],
    top: int,
) -> None:
    """The ``top`` functions whose own instructions differ most between the two."""
    mine, theirs = functions[model, config], functions[model, base]
    more = {
        name: mine.get(name, 0.0) - theirs.get(name, 0.0)
        for name in {*mine, *theirs} - {ALLOCATOR}
    }
    print(f"\n{model} {config} over {base}: the functions whose own instructions per step "
          "differ most")
    for name, delta in sorted(more.items(), key=lambda item: -abs(item[1]))[:top]:
        print(f"  {delta:>+10,.0f}  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn"],
                        choices=["gpt2", "bert", "vit", "cnn", "bn"])
    parser.add_argument("--steps", type=at_least(1), default=10, help="counted steps per process")
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches and branch predictors")
    parser.add_argument("--functions", type=at_least(0), default=0, metavar="N",
                        help="after the table, the N functions whose own instructions differ "
                        "most between each configuration and its baselines")
    options = parser.parse_args()
    if options.functions < 0:
        parser.error(f"--functions must be 0 or more, got {options.functions}")
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed here; nothing counted.")
        return
    if options.functions and shutil.which("callgrind_annotate") is None:
        print("bench_instructions: --functions needs valgrind's callgrind_annotate, which is "
              "not installed here; nothing counted.")
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        library = _control_library(directory)
        if library is None:
            print("bench_instructions: no C compiler, or no valgrind/callgrind.h; nothing "
                  "counted.")
            return
        jobs = [(model, config) for model in options.models for config in CONFIGS]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                job: pool.submit(
                    _count, *job, options.steps, options.cache, library, directory
                )
                for job in jobs
            }
            results = {job: future.result() for job, future in futures.items()}
    counts = {job: totals for job, (totals, _) in results.items()}
    functions = {job: by_function for job, (_, by_function) in results.items()}
    shown = [e for e in EVENTS if e in counts[jobs[0]]]
    print(f"valgrind callgrind, {options.steps} steps counted after {WARM}, per step, glibc's "
          "mmap threshold fixed; ratio: instructions over the same work without centralstore; "
          "more: the difference, in all and outside glibc's allocator")
    print(f"{'model':<6} {'config':<8} " + " ".join(f"{EVENTS[e]:>16}" for e in shown)
          + f" {'ratio':>7} {'more':>10} {'outside':>10}  over")
    for model, config in jobs:
        row = counts[model, config]
        line = f"{model:<6} {config:<8} " + " ".join(f"{row[e]:>16,.0f}" for e in shown)
        for k, base in enumerate(BASELINES.get(config, ())):
            under = counts[model, base]["Ir"]
            if k:  # a further baseline: its own line, under the ratio's column
                line += "\n" + " " * (16 + 17 * len(shown))
            outside = "-"
            if functions[model, config] and functions[model, base]:
                mine = row["Ir"] - functions[model, config][ALLOCATOR]
                outside = f"{mine - under + functions[model, base][ALLOCATOR]:+,.0f}"
            line += (
                f" {row['Ir'] / under:>7.4f} {row['Ir'] - under:>+10,.0f} {outside:>10}  {base}"
            )
        print(line, flush=True)
    if options.functions:
        for model, config in jobs:
            for base in BASELINES.get(config, ()):
                _print_functions(model, config, base, functions, options.functions)


if __name__ == "__main__":
    main()
