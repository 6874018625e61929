"""The benchmark scripts still run and print their tables: each at its smallest setting, in a
subprocess, as a user runs it. Nothing here is timed (the scripts' figures are read by
people, in benchmarks/README.md); a refactoring that breaks a script fails here instead of
in the next session that measures. The slowest scripts (the trainers, several workers,
glibc's heap, valgrind's counts, the GPU check) are left to their own runs, but for the
quickest table of several workers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from centralstore.cli import at_least

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# one intra-op thread per subprocess: pytest-xdist already runs a worker per core
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bench(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/SCRIPT ARGS`` in ``cwd``, output captured."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=240, check=False, env=ENV,
    )


def in_benchmarks(script: str) -> subprocess.CompletedProcess[str]:
    """``python -c SCRIPT`` in a process of its own that imports the benchmark modules as the
    scripts do, output captured."""
    return subprocess.run(
        [sys.executable, "-c", script], cwd=BENCHMARKS, capture_output=True, text=True,
        timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(BENCHMARKS)},
    )


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("bench_run.py", ["--rounds", "1", "--batch", "2", "--accumulation-rounds", "1",
                          "--cold-runs", "2"],
         ["reduce(MEAN, PerReplica)", "gather(PerReplica, axis=0)", "target: trivial run",
          "right after a 64 MB sweep", "a twin strategy's run", "code warm"]),
        ("bench_models.py", ["--rounds", "1", "--steps", "1", "--models", "cnn",
                             "--compiled-models", "--no-accumulation"],
         ["cnn    eager     4 cs R=2", "cnn    eager     4 undo", "cnn    eval      4 cs R=1"]),
        ("bench_train.py", ["--rounds", "1", "--steps", "2", "--models", "mlp", "--no-memory"],
         ["cs R=2"]),
        ("bench_overhead.py", ["--models", "cnn"], ["cnn    cs R=2"]),
        ("bench_idioms.py", ["--rounds", "1", "--steps", "1", "--idioms", "none", "EMA", "metric"],
         ["none              cs R=2", "EMA               cs R=1", "metric            cs R=2"]),
    ],
)
def test_a_script_prints_its_table(
    script: str, args: list[str], expected: list[str], tmp_path: Path
) -> None:
    result = bench(script, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in expected:
        assert text in result.stdout, (text, result.stdout)


def test_gpu_replicas_are_sent_the_model_once_each(tmp_path: Path) -> None:
    """``bench_idioms.py --gpu-bytes`` on the fake GPUs: a step copies each replica the
    model's parameters once and brings back each replica's gradients, an EMA copy in the
    scope included (2.000x before the idle variables' slots were left unfilled), in three
    copies to each replica (the two 256 x 256 weights alone, the smaller parameters
    together) and one back (the gradients' bucket)."""
    result = bench("bench_idioms.py", "--gpu-bytes", "--idioms", "none", "EMA", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[3:] if line}
    for name in ("none", "EMA"):
        assert rows[name][1:] == [
            "603,176", "1,206,352", "1.000x", "1,206,352", "1.000x", "6", "2"
        ], result.stdout


def test_the_idioms_across_workers_send_what_they_train(tmp_path: Path) -> None:
    """``bench_multiworker.py --idioms`` in two processes: an EMA copy of the model in the
    scope sends nothing (the gradients' bytes and the agreement row's 120: 1.000x)."""
    result = bench(
        "bench_multiworker.py", "--idioms", "none", "EMA", "--steps", "1", "--rounds", "1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:] if line}
    assert rows["none"][1:4] == ["603,176", "603,296", "1.000x"], result.stdout
    assert rows["EMA"][1:4] == ["603,176", "603,296", "1.000x"], result.stdout
    refused = bench("bench_multiworker.py", "--idioms", "EMAs", cwd=tmp_path)
    assert refused.returncode == 1 and "unknown idioms ['EMAs']" in refused.stderr


def test_a_count_below_its_minimum_is_refused_by_name(tmp_path: Path) -> None:
    result = bench("bench_models.py", "--rounds", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "argument --rounds: must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_count_is_a_whole_number_of_at_least_its_minimum() -> None:
    assert at_least(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1, got 0"):
        at_least(1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer, got '2\.5'"):
        at_least(1)("2.5")


def test_plain_steps_are_timed_without_centralstores_optimizer_hooks(tmp_path: Path) -> None:
    """(bench_models.py's plain configurations step as in a process without centralstore:
    its global optimizer-step hooks are out of torch's tables while one is timed, and back
    after. Checked in a process of its own, whose only strategy is the one made here.)"""
    script = (
        "import sys, torch\n"
        "import bench_models as bm\n"
        "from torch.optim import optimizer as o\n"
        "import centralstore as cs\n"
        "strategy = cs.CentralStorageStrategy(['cpu:0'])\n"
        "with strategy.scope():\n"
        "    layer = torch.nn.Linear(2, 1)\n"
        "seen = []\n"
        "def count():\n"
        "    seen.append(sum(map(bm._ours, o._global_optimizer_pre_hooks.values())))\n"
        "bm._time(bm._plain(lambda: count()), 1)\n"
        "bm._time(count, 1)\n"
        "count()\n"
        "print(seen)\n"
    )
    result = in_benchmarks(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[0,", "1,", "1]"]


def test_the_one_replica_floor_sets_gradients_aside_and_adds_them_back() -> None:
    """(bench_models.py's ``undo`` configuration, the floor of ``cs R=1``, does the record's
    work: ``.grad`` is empty for the pass and then holds the gradients set aside plus the
    pass's, the bits of plain PyTorch accumulating; the integer buffers are copied again
    only when a counter moved. In a process of its own, as the script runs.)"""
    script = (
        "import copy, torch\n"
        "import bench_models as bm\n"
        "torch.manual_seed(0)\n"
        "model = bm._batch_norm_cnn()\n"
        "twin = copy.deepcopy(model)\n"
        "x = torch.randn(4, 3, 8, 8)\n"
        "for m in (model, twin):\n"
        "    m(x).sum().backward()\n"
        "undo = bm._Undo(model)\n"
        "undo.begin()\n"
        "checks = [all(p.grad is None for p in model.parameters())]\n"
        "kept = undo.kept\n"
        "model(x).sum().backward()\n"
        "twin(x).sum().backward()\n"
        "undo.end()\n"
        "pairs = zip(model.parameters(), twin.parameters(), strict=True)\n"
        "checks.append(all(torch.equal(p.grad, q.grad) for p, q in pairs))\n"
        "undo.begin()\n"
        "checks.append(undo.kept is not kept)\n"
        "counters = [b for b in model.buffers() if not b.is_floating_point()]\n"
        "checks.append(torch.equal(undo.kept.view(torch.int64), torch.stack(counters)))\n"
        "model.eval()(x).sum().backward()\n"
        "undo.end()\n"
        "kept = undo.kept\n"
        "undo.begin()\n"
        "checks.append(undo.kept is kept)\n"
        "print(checks)\n"
    )
    result = in_benchmarks(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[True,", "True,", "True,", "True,", "True]"]
