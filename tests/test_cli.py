"""The ``centralstore`` command line, run as users run it: in a subprocess, or through
``main`` where only the parsing is under test.

Every run writes into its own ``tmp_path`` (parallel-safe). The demo's job itself (the
training, the report, the files, torchrun) is tested in ``tests/demo/``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo.reading import ENV, field

import centralstore as cs
from centralstore import cli, demo


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
    # stderr is a pipe, not a terminal: the progress is one plain line for the one epoch.
    assert re.fullmatch(r"epoch 1/1: 15/15 steps in .+, test_acc=\S+\n", result.stderr)
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["num_replicas_in_sync"] == 3 and summary["seed"] == 3
    assert summary["one_device"] is None and summary["max_abs_weight_difference"] is None


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


@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir"])
@pytest.mark.parametrize(
    ("out", "complaint"),
    [("a-file", "exists and is not a directory"), ("a-file/results", "cannot create")],
)
def test_out_and_checkpoint_dir_must_be_usable_directories(
    flag: str, out: str, complaint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--epochs", "1", "--out", str(tmp_path / "results"), flag,
                  str(tmp_path / out)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and complaint in lines[0] and f"argument {flag}" in lines[0], lines


def test_devices_lists_the_devices_and_the_default_placement(tmp_path: Path) -> None:
    result = centralstore("devices", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    default = cs.CentralStorageStrategy()
    assert re.search(r"^  cpu:0 ", result.stdout, re.MULTILINE)
    for index in range(torch.cuda.device_count()):
        assert f"cuda:{index}" in result.stdout and f"GPU:{index}" in result.stdout
    assert f"compute devices : {', '.join(default.compute_devices)}" in result.stdout
    assert f"parameter device: {default.parameter_device}" in result.stdout


@pytest.mark.fake_gpus(2)
def test_devices_says_where_the_update_runs_when_the_parameters_are_on_the_host(
    fake_gpus: object,
) -> None:
    """With several GPUs the default puts the variables on the CPU, whose optimizer update
    runs on the host: the report says how to keep that update fast; with one GPU it holds
    the variables, and there is nothing to say."""
    report = cli.devices_report()
    assert "parameter device: cpu:0" in report
    assert "fused=True, or call cs.keep_host_memory() first" in report


@pytest.mark.fake_gpus(1)
def test_devices_gives_no_host_advice_when_one_gpu_holds_the_variables(
    fake_gpus: object,
) -> None:
    report = cli.devices_report()
    assert "parameter device: cuda:0" in report
    assert "keep_host_memory" not in report


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


def test_the_demo_flags_default_to_the_jobs_settings() -> None:
    """``centralstore demo`` with no flags runs ``Settings()``, which the job's tests run."""
    args = cli.build_parser().parse_args(["demo"])
    assert cli.demo_settings(args) == demo.Settings()
    assert args.compute_devices is None and args.parameter_device is None
