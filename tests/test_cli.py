"""The ``centralstore`` command line, run as users run it: in a subprocess.

Every run writes into its own ``tmp_path`` (parallel-safe). The short demo runs use one epoch;
the full default demo, which must reach 0.95 test accuracy, is marked ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import centralstore as cs
from centralstore import cli

# One intra-op thread per subprocess: pytest-xdist already runs a worker per core, and more
# threads would oversubscribe the cores, where OpenMP's spin-waiting costs 10x or more.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "centralstore_version",
    "torch_version",
    "strategy",
    "compute_devices",
    "parameter_device",
    "num_replicas_in_sync",
    "num_workers",
    "dataset",
    "train_samples",
    "test_samples",
    "epochs",
    "global_batch_size",
    "seed",
    "optimizer",
    "history",
    "test_accuracy",
    "train_seconds",
    "samples_per_second",
    "one_device",
    "max_abs_weight_difference",
    "wall_seconds",
}


def centralstore(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m centralstore ARGS`` in ``cwd``, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "centralstore", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=ENV,
    )


def field(stdout: str, label: str) -> str:
    """The value of a ``label: value`` line of the demo's report."""
    match = re.search(rf"^{re.escape(label)}\s*: (.+)$", stdout, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{stdout}"
    return match[1]


def weight_difference(stdout: str) -> float:
    match = re.search(r"max \|replicas - one device\| = (\S+)", field(stdout, "weight difference"))
    assert match is not None
    return float(match[1])


@pytest.fixture(scope="module")
def short_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One epoch of the demo on two logical CPU devices, into a fresh directory."""
    work = tmp_path_factory.mktemp("demo")
    out = work / "results"
    result = centralstore(
        "demo", "--compute-devices", "cpu:0,cpu:1", "--epochs", "1", "--out", str(out), cwd=work
    )
    assert result.returncode == 0, result.stderr
    return result, out


def test_short_demo_prints_placement_accuracy_speed_and_equivalence(
    short_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, out = short_run
    stdout = result.stdout
    assert field(stdout, "compute devices").startswith("cpu:0, cpu:1")
    assert field(stdout, "parameter device") == "cpu:0"
    assert field(stdout, "strategy") == "CentralStorageStrategy, 2 replicas in sync"
    assert field(stdout, "global batch").startswith("64 = 32 + 32")
    assert 0.0 <= float(field(stdout, "test accuracy")) <= 1.0
    assert float(field(stdout, "samples per second").split()[0].replace(",", "")) > 0
    assert field(stdout, "one device").startswith("cpu, a plain PyTorch loop")
    assert weight_difference(stdout) < 1e-5
    assert str(out / "curves.png") in field(stdout, "wrote")
    assert "epoch 1/1" in result.stderr and "100%" in result.stderr  # the progress bar
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr


def test_short_demo_writes_curves_and_summary(
    short_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = short_run
    assert (out / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["compute_devices"] == ["cpu:0", "cpu:1"]
    assert summary["parameter_device"] == "cpu:0"
    assert summary["num_replicas_in_sync"] == 2 and summary["num_workers"] == 1
    assert (summary["train_samples"], summary["test_samples"]) == (1437, 360)
    assert (summary["epochs"], summary["global_batch_size"], summary["seed"]) == (1, 64, 0)
    assert summary["centralstore_version"] == cs.__version__
    for name in ("loss", "accuracy", "test_accuracy"):
        assert len(summary["history"][name]) == 1
    assert 0 < summary["history"]["loss"][0] < 2.5  # cross-entropy over 10 classes: ~2.3
    assert 0 <= summary["history"]["accuracy"][0] <= 1
    assert summary["history"]["test_accuracy"][0] == summary["test_accuracy"]
    assert 0 <= summary["test_accuracy"] <= 1
    assert summary["samples_per_second"] > 0 and summary["train_seconds"] > 0
    assert 0 <= summary["max_abs_weight_difference"] < 1e-5
    one_device = summary["one_device"]
    assert one_device["device"] == "cpu"
    assert one_device["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=0.01)
    assert one_device["history"]["loss"] == pytest.approx(summary["history"]["loss"], rel=1e-4)


def test_demo_with_three_replicas_and_no_comparison(tmp_path: Path) -> None:
    result = centralstore(
        "demo",
        "--compute-devices", "CPU:0, /device:CPU:1,cpu:2",
        "--parameter-device", "/cpu:0",
        "--epochs", "1",
        "--batch-size", "100",
        "--seed", "3",
        "--no-compare",
        "--out", "results",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert field(result.stdout, "compute devices").startswith("cpu:0, cpu:1, cpu:2")
    assert field(result.stdout, "global batch").startswith("100 = 34 + 34 + 32")
    assert "one device" not in result.stdout and "weight difference" not in result.stdout
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["num_replicas_in_sync"] == 3 and summary["seed"] == 3
    assert summary["one_device"] is None and summary["max_abs_weight_difference"] is None


def torchrun(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run ARGS`` in ``cwd``, output captured.

    Past ``timeout`` it gets SIGTERM, which torchrun passes on to its workers (they run in
    sessions of their own, out of reach of a kill aimed at torchrun alone), then SIGKILL.
    """
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    with subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                stdout, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            pytest.fail(f"torchrun ran past {timeout} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_demo_under_torchrun_prints_and_writes_once(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m centralstore demo``: two workers of one CPU replica
    split each global batch 32 + 32 and train like one device; the chief alone prints the
    report and the progress bar and writes the files.

    Each worker runs in a directory of its own (``rank0``, ``rank1``) with a relative
    ``--out``, so that a file written by worker 1 shows instead of overwriting worker 0's.
    """
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    demo = 'cd "rank$RANK" && exec "$0" -m centralstore demo --epochs 1 --out results'
    result = torchrun(
        "--standalone", "--nproc-per-node", "2", "--no-python",
        "sh", "-c", demo, sys.executable,
        cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stdout = result.stdout
    for label in ("strategy", "compute devices", "test accuracy", "weight difference", "wrote"):
        assert len(re.findall(rf"^{label}\s*:", stdout, re.MULTILINE)) == 1, stdout
    assert stdout.count(f"centralstore {cs.__version__} demo") == 1, stdout
    assert field(stdout, "strategy") == "MultiWorkerCentralStorageStrategy, 2 replicas in sync"
    assert field(stdout, "compute devices").startswith("cpu:0 on each of 2 workers")
    assert field(stdout, "global batch").startswith("64 = 32 + 32")
    assert 0.0 <= float(field(stdout, "test accuracy")) <= 1.0
    assert weight_difference(stdout) < 1e-5
    assert result.stderr.count("epoch 1/1:   0%") == 1, result.stderr  # one progress bar
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "rank0" / "results").iterdir()) == [
        "curves.png",
        "summary.json",
    ]
    assert list((tmp_path / "rank1").iterdir()) == []  # worker 1 wrote nothing, not even --out
    summary = json.loads((tmp_path / "rank0" / "results" / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["strategy"] == "MultiWorkerCentralStorageStrategy"
    assert summary["compute_devices"] == ["cpu:0"]
    assert (summary["num_workers"], summary["num_replicas_in_sync"]) == (2, 2)
    assert 0 <= summary["max_abs_weight_difference"] < 1e-5


def missing_gpu() -> str:
    """The first GPU name that this machine does not have."""
    return f"GPU:{torch.cuda.device_count()}"


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["demo", "--compute-devices", missing_gpu()], missing_gpu()),
        (["demo", "--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["demo", "--epochs", "-2"], "--epochs: must be at least 1, got -2"),
    ],
)
def test_bad_flags_end_with_one_line_and_status_2(
    args: list[str], complaint: str, tmp_path: Path
) -> None:
    result = centralstore(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("centralstore demo: error: ")
    assert complaint in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["demo", "--parameter-device", "gpu:99"], "GPU 99"),
        (["demo", "--compute-devices", "tpu:0"], "Cannot parse the device name 'tpu:0'"),
        (["demo", "--compute-devices", "cpu:0,,cpu:1"], "comma-separated device names"),
        (["demo", "--batch-size", "many"], "expected an integer, got 'many'"),
        (["demo", "--seed", "-1"], "--seed: must be at least 0"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["train"], "invalid choice: 'train'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_more_bad_command_lines(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and complaint in lines[0], lines


@pytest.mark.parametrize(
    ("out", "complaint"),
    [("a-file", "exists and is not a directory"), ("a-file/results", "cannot create")],
)
def test_out_must_be_a_usable_directory(
    out: str, complaint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--epochs", "1", "--out", str(tmp_path / out)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and complaint in lines[0], lines


def test_devices_lists_the_devices_and_the_default_placement(tmp_path: Path) -> None:
    result = centralstore("devices", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    default = cs.CentralStorageStrategy()
    assert re.search(r"^  cpu:0 ", result.stdout, re.MULTILINE)
    for index in range(torch.cuda.device_count()):
        assert f"cuda:{index}" in result.stdout and f"GPU:{index}" in result.stdout
    assert f"compute devices : {', '.join(default.compute_devices)}" in result.stdout
    assert f"parameter device: {default.parameter_device}" in result.stdout


def test_version(tmp_path: Path) -> None:
    """Through the installed console script when there is one, else ``python -m``."""
    script = Path(sys.executable).with_name("centralstore")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "centralstore"]
    result = subprocess.run(
        [*command, "--version"], cwd=tmp_path, capture_output=True, text=True, check=False, env=ENV
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"centralstore {cs.__version__}\n"
    assert cs.__version__ == "0.1.0"


@pytest.mark.slow
def test_full_default_demo_reaches_95_percent(tmp_path: Path) -> None:
    """The default run (``centralstore demo``): about 10 s on two idle CPU cores."""
    result = centralstore("demo", "--out", "results", cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr
    assert float(field(result.stdout, "test accuracy")) >= 0.95
    assert weight_difference(result.stdout) < 1e-5
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["epochs"] == 12 and len(summary["history"]["test_accuracy"]) == 12
    assert summary["test_accuracy"] >= 0.95
    assert summary["one_device"]["test_accuracy"] >= 0.95
