"""Instructions per training step, counted by valgrind: centralstore against plain PyTorch.

Timings on a shared machine move by 2 to 4% from run to run (``bench_models.py`` prints its
own noise), as much as the per-step gaps this project chases on small models. An instruction
count does not move with the machine: each configuration of ``bench_models.py`` runs in a
process of its own under callgrind, whose counting is switched on for the counted steps only
(after 10 uncounted ones), with one OpenMP thread, a fixed hash seed and, where ``setarch``
exists, the same address layout: so fixed, two runs counted the same instructions to the
last (without the first two, the same code's count moved by 0.7% between runs). The table
gives the instructions a step executes (all of them: the interpreter's, torch's kernels',
the allocator's) and their ratio to the same work without centralstore (``cs R=1`` /
``plain``, ``cs R=2`` / ``halves``). With ``--cache`` callgrind also simulates the caches and
branch predictors (about four times slower) and adds the first-level data and instruction
misses and the mispredicted branches per step.

An instruction is not a unit of time: the gap in time is larger than the gap in instructions
when the extra instructions miss the caches more often, which ``--cache`` shows. Needs
``valgrind`` (its ``callgrind.h`` header) and a C compiler; without them the script says so
and exits. Each process takes minutes (the interpreter under valgrind runs about 50x
slower), and they run two at a time.

    python benchmarks/bench_instructions.py [--models cnn gpt2] [--steps 10] [--cache]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = ("plain", "cs R=1", "halves", "cs R=2")
BASELINES = {"cs R=1": "plain", "cs R=2": "halves"}
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


def _count(
    model: str, config: str, steps: int, cache: bool, library: Path, directory: Path
) -> dict[str, float]:
    """Callgrind's totals for ``steps`` steps of ``config``, per step."""
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
    return {event: total / steps for event, total in zip(events, totals, strict=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn"],
                        choices=["gpt2", "bert", "vit", "cnn", "bn"])
    parser.add_argument("--steps", type=int, default=10, help="counted steps per process")
    parser.add_argument("--cache", action="store_true",
                        help="also simulate the caches and branch predictors")
    options = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed here; nothing counted.")
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
                job: pool.submit(_count, *job, options.steps, options.cache, library, directory)
                for job in jobs
            }
            counts = {job: future.result() for job, future in futures.items()}
    shown = [e for e in EVENTS if e in counts[jobs[0]]]
    print(f"valgrind callgrind, {options.steps} steps counted after {WARM}, per step; "
          "ratio: instructions over the same work without centralstore")
    print(f"{'model':<6} {'config':<8} " + " ".join(f"{EVENTS[e]:>16}" for e in shown)
          + f" {'ratio':>7} {'more':>10}")
    for model, config in jobs:
        row = counts[model, config]
        line = f"{model:<6} {config:<8} " + " ".join(f"{row[e]:>16,.0f}" for e in shown)
        base = BASELINES.get(config)
        if base is not None:
            under = counts[model, base]["Ir"]
            line += f" {row['Ir'] / under:>7.4f} {row['Ir'] - under:>+10,.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
