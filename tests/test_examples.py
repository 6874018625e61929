"""Each program in examples/ runs to completion and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# One intra-op thread per subprocess: pytest-xdist already runs a worker per core, and more
# threads would oversubscribe the cores, where OpenMP's spin-waiting costs 10x or more.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    """``python examples/NAME ARGS`` in ``cwd``; its stdout, once it exited with status 0."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def test_tf_doc_examples(tmp_path: Path) -> None:
    stdout = run_example("tf_doc_examples.py", cwd=tmp_path)
    expected = [
        "train_step(x): tensor([1, 2])",  # the class docstring, default strategy
        "reduce(SUM, axis=None): array([ 4,  6,  8, 10])",
        "reduce(SUM, per-replica result, axis=0): tensor(28)",
        "reduce(SUM, the reduced result, axis=0) as the doc writes it: array(56)",
        "as written (an unbatched dataset) -> ValueError: Cannot split a scalar tensor",
        "  central: True",
        "  central: False",
        "dataset_fn received InputContext(num_input_pipelines=1, input_pipeline_id=0, "
        "num_replicas_in_sync=2)",
        "get_per_replica_batch_size(5) with 2 replicas -> ValueError",
        "2. distributed values input (every replica returned the same 4): 4",
        "total: tensor(1)",
        "reduce(MEAN, axis=0) (denominator 6): tensor(2.5000)",
        "of a PerReplica: (0, 10)",
        "3. num_replicas_in_sync: (2, 2)",
        "1. directly constructed: 0.5",
        "gather of (1, 2, 3) x 4, axis=2, shape (1, 2, 12)",
        "all_reduce(SUM, [1., 2.]): ([tensor(2.), tensor(4.)], [tensor(2.), tensor(4.)])",
        "local results: (tensor([1, 2, 3, 1, 2, 3]), tensor([1, 2, 3, 1, 2, 3]))",
        "{'a': tensor([0, 1]), 'b': tensor([[0, 1],",
        "merge_fn runs once; in cross-replica context: True",
        "merge_call(reduce SUM) gives every replica: tensor(3.)",
        "epoch 1: sum of 0..11: tensor(66)",
        "all examples ran",
    ]
    for line in expected:
        assert line in stdout, f"missing {line!r}"
    assert stdout.count("merge_fn runs once") == 1


def test_custom_training_loop(tmp_path: Path) -> None:
    stdout = run_example("custom_training_loop.py", "--checkpoint-dir", "checkpoints", cwd=tmp_path)
    assert (tmp_path / "checkpoints" / "checkpoint.pt").is_file()
    assert "(the job stops here, as if preempted, after epoch 2)" in stdout
    assert "resumed from checkpoint.pt at epoch 2" in stdout
    assert "epoch 4/4: " in stdout
    assert "BatchNorm num_batches_tracked: 60 (one per step" in stdout
    assert "resumed vs uninterrupted run: max |weight difference| = 0.0e+00" in stdout
    last = next(line for line in stdout.splitlines() if line.startswith("checkpoint loaded"))
    assert float(last.rsplit(maxsplit=1)[1]) > 0.9


def test_cpu_parameters_gpu_compute(tmp_path: Path) -> None:
    stdout = run_example("cpu_parameters_gpu_compute.py", cwd=tmp_path)
    if torch.cuda.device_count() == 0:
        assert "no GPU is visible: computing on the logical CPU devices cpu:0 and cpu:1" in stdout
    assert "parameters live on: ['cpu']" in stdout
    assert "gradients arrive on: cpu" in stdout
    assert "optimizer state lives on: cpu" in stdout
    assert "one copy of each variable: True" in stdout
    losses = [
        float(line.split("loss ")[1].split()[0]) for line in stdout.splitlines() if "loss" in line
    ]
    assert len(losses) == 5 and losses[-1] < losses[0] / 5


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_use_only_the_public_api(name: str) -> None:
    source = (EXAMPLES / name).read_text()
    assert "import centralstore as cs" in source
    assert not re.search(r"(from|import) centralstore\.", source)  # no private modules
    assert not re.search(r"\bcs\._[a-z]", source)  # no private names
