"""The whole demo job (``centralstore.demo.train``): the distributed run, the comparison with
one device, the report, the progress, the files.

The short runs call ``run`` in this process, into their own ``tmp_path`` and streams
(parallel-safe), for one epoch; the torchrun run is a subprocess per worker; the full default
run, which must reach 0.95 test accuracy, is marked ``slow``.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from demo.reading import (
    ENV,
    PNG_SIGNATURE,
    SUMMARY_KEYS,
    field,
    rate,
    small_digits,
    weight_difference,
)

import centralstore as cs
from centralstore.demo import job, report, train
from centralstore.input import prefetch


class Finished(NamedTuple):
    """A finished ``run``: what it printed, its progress lines, its summary, where it wrote."""

    stdout: str
    stderr: str
    summary: dict[str, object]
    out: Path


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Iterator[None]:
    """``run`` sets one intra-op thread for the process; give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_demo(strategy: cs.Strategy, settings: job.Settings) -> Finished:
    """``run`` with its report and progress captured, failing on any warning."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = train.run(strategy, settings, out=stdout, err=stderr)
    return Finished(stdout.getvalue(), stderr.getvalue(), summary, settings.out)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """Two epochs of the demo on two logical CPU devices (the first is warm-up, the second
    the steady state), into a fresh directory."""
    out = tmp_path_factory.mktemp("demo") / "results"
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    return run_demo(strategy, job.Settings(epochs=2, out=out))


def test_short_demo_prints_placement_accuracy_speed_and_equivalence(short_run: Finished) -> None:
    stdout, out = short_run.stdout, short_run.out
    assert field(stdout, "compute devices").startswith("cpu:0, cpu:1")
    assert field(stdout, "parameter device") == "cpu:0"
    assert field(stdout, "strategy") == "CentralStorageStrategy, 2 replicas in sync"
    assert field(stdout, "global batch").startswith("64 = 32 + 32")
    assert 0.0 <= float(field(stdout, "test accuracy")) <= 1.0
    assert field(stdout, "one device").startswith("cpu, a plain PyTorch loop")
    assert weight_difference(stdout) < 1e-5
    assert str(out / "curves.png") in field(stdout, "wrote")
    # The progress, off a terminal: one plain line per epoch, no carriage return.
    assert re.fullmatch(
        r"(epoch \d/2: 23/23 steps in \S+ s, loss=.+, test_acc=\S+\n){2}", short_run.stderr
    )


def test_short_demo_reports_the_steady_speed_of_replicas_slices_and_one_device(
    short_run: Finished,
) -> None:
    """Three loops' samples per second, the warm-up epoch left out, and the two ratios that
    tell centralstore's own cost from what smaller batches cost. No timing is asserted: a
    loaded machine makes any loop slow."""
    stdout = short_run.stdout
    assert field(stdout, "samples per second").startswith(
        "steady state, the median of epochs 2-2 (epoch 1 is warm-up); in brackets, all 2"
    )
    speeds = [rate(stdout, f"  {label}") for label in ("2 replicas", "1 device, slices",
                                                        "1 device, whole")]  # fmt: skip
    assert all(0 < speed < float("inf") for speed in speeds)
    assert "the replicas' 32 + 32 one after the other" in field(stdout, "  1 device, slices")
    own = float(field(stdout, "  centralstore").split("x")[0])
    smaller = float(field(stdout, "  smaller batches").split("x")[0])
    # (the ratios are printed to two decimals: 0.005 of rounding, beyond 1% below 0.5)
    assert own == pytest.approx(speeds[0] / speeds[1], rel=0.01, abs=0.006)
    assert smaller == pytest.approx(speeds[1] / speeds[2], rel=0.01, abs=0.006)
    assert field(stdout, "  about speed").startswith("logical CPU devices share one host's cores")
    lines = stdout.splitlines()  # the order: accuracy and equivalence first, then speed
    labels = [line.split(":")[0].rstrip() for line in lines]
    assert labels.index("weight difference") < labels.index("samples per second")
    assert "Traceback" not in short_run.stderr and "Warning" not in short_run.stderr


def test_short_demo_writes_curves_and_summary(short_run: Finished) -> None:
    out = short_run.out
    assert (out / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(short_run.summary))  # what run returned
    assert set(summary) == SUMMARY_KEYS
    assert summary["compute_devices"] == ["cpu:0", "cpu:1"]
    assert summary["parameter_device"] == "cpu:0"
    assert summary["num_replicas_in_sync"] == 2 and summary["num_workers"] == 1
    assert (summary["train_samples"], summary["test_samples"]) == (1437, 360)
    assert (summary["epochs"], summary["global_batch_size"], summary["seed"]) == (2, 64, 0)
    assert summary["centralstore_version"] == cs.__version__
    for name in ("loss", "accuracy", "test_accuracy"):
        assert len(summary["history"][name]) == 2
    assert 0 < summary["history"]["loss"][0] < 2.5  # cross-entropy over 10 classes: ~2.3
    assert 0 <= summary["history"]["accuracy"][0] <= 1
    assert summary["history"]["test_accuracy"][-1] == summary["test_accuracy"]
    assert 0 <= summary["test_accuracy"] <= 1
    assert summary["warm_up_epochs"] == 1
    assert 0 <= summary["max_abs_weight_difference"] < 1e-5
    one_device, in_slices = summary["one_device"], summary["one_device_in_slices"]
    assert one_device["device"] == in_slices["device"] == "cpu"
    assert in_slices["slices"] == [32, 32]
    for run in (summary, one_device, in_slices):
        assert run["samples_per_second"] > 0 and run["train_seconds"] > 0
        assert len(run["epoch_seconds"]) == 2 and all(s > 0 for s in run["epoch_seconds"])
        assert sum(run["epoch_seconds"]) == pytest.approx(run["train_seconds"])
        # Two epochs: the steady state is the second one's.
        assert run["steady_samples_per_second"] == pytest.approx(1437 / run["epoch_seconds"][1])
    for run in (one_device, in_slices):
        assert run["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=0.01)
        assert run["history"]["loss"] == pytest.approx(summary["history"]["loss"], rel=1e-4)
    assert 0 <= in_slices["max_abs_weight_difference"] < 1e-5


def test_progress_off_a_terminal_is_one_plain_line_per_epoch() -> None:
    """tqdm on a pipe or a log file would leave one line of carriage-return redraws per epoch;
    off a terminal each epoch ends in one plain line instead."""
    stream = io.StringIO()
    settings = job.Settings(epochs=3, batch_size=16)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    train.train_distributed(
        strategy,
        small_digits(train=40, test=8),
        settings,
        lambda epoch, steps: report.progress(epoch, settings.epochs, steps, stream),
    )
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    for line in lines:  # 40 examples in global batches of 16: 3 steps
        assert re.fullmatch(
            r"epoch \d/3: 3/3 steps in \S+ s, loss=\d\.\d{4}, acc=\d\.\d{4}, test_acc=\d\.\d{4}",
            line,
        ), line


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
    report and the progress and writes the files.

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
    # One progress line (stderr is a pipe here): the chief's.
    assert len(re.findall(r"^epoch 1/1: ", result.stderr, re.MULTILINE)) == 1, result.stderr
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


@pytest.mark.slow
def test_full_default_demo_reaches_95_percent(tmp_path: Path) -> None:
    """The default run (what ``centralstore demo`` runs): about 12 s on two CPU cores."""
    strategy = job.make_strategy(compute_devices=None, parameter_device=None)
    finished = run_demo(strategy, job.Settings(out=tmp_path / "results"))
    assert float(field(finished.stdout, "test accuracy")) >= 0.95
    assert weight_difference(finished.stdout) < 1e-5
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["epochs"] == 12 and len(summary["history"]["test_accuracy"]) == 12
    assert summary["test_accuracy"] >= 0.95
    assert summary["one_device"]["test_accuracy"] >= 0.95
    assert len(finished.stderr.splitlines()) == 12  # one progress line per epoch


class Interrupt(Exception):
    """Raised by the progress display to stop a run in the middle of an epoch."""


class _StopAt:
    """A progress display that interrupts the run at ``step`` of epoch ``epoch``."""

    def __init__(self, epoch: int, step: int, this_epoch: int) -> None:
        self._stop, self._epoch, self._steps = (epoch, step), this_epoch, 0

    def step(self, loss: float, accuracy: float) -> None:
        self._steps += 1
        if (self._epoch, self._steps) == self._stop:
            raise Interrupt

    def close(self, test_accuracy: float, seconds: float) -> None:
        pass


def test_an_interrupted_demo_resumes_with_the_weights_of_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """13 steps per epoch (100 examples, batches of 8), a checkpoint at step 10 and at the end
    of each epoch; interrupted at step 12 of the second epoch, the run resumes from step 10
    of that epoch (the iterator's position included) and ends as the uninterrupted run."""
    data = small_digits(train=100, test=8)
    settings = job.Settings(epochs=3, batch_size=8, checkpoint_dir=tmp_path / "ckpts")
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])

    def quiet(epoch: int, steps: int) -> report.Progress:
        return report.progress(epoch, settings.epochs, steps, io.StringIO())

    with pytest.raises(Interrupt):
        train.train_distributed(strategy, data, settings, lambda e, s: _StopAt(1, 12, e))
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "checkpoint", "ckpt-2", "ckpt-3",
    ]  # epoch 1 at step 10, end of epoch 1, epoch 2 at step 10: the last two kept
    resumed, initial = train.train_distributed(strategy, data, settings, quiet)
    assert resumed.resumed_from == str(tmp_path / "ckpts" / "ckpt-3")
    uninterrupted, initial_too = train.train_distributed(
        strategy, data, job.Settings(epochs=3, batch_size=8), quiet
    )
    for key, value in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
        assert torch.equal(initial[key], initial_too[key]), key
    assert resumed.history == uninterrupted.history
    assert len(resumed.epoch_seconds) == len(uninterrupted.epoch_seconds) == 3
    assert resumed.resumed_from is not None and uninterrupted.resumed_from is None


def test_centralstore_demo_resumes_from_its_checkpoint_dir(tmp_path: Path) -> None:
    """A first run leaves its checkpoints; ``centralstore demo --checkpoint-dir`` run again
    resumes from the latest (here at the end of training: nothing left to train) and says so."""
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    settings = job.Settings(
        epochs=1, batch_size=256, compare=False, out=tmp_path / "first",
        checkpoint_dir=tmp_path / "ckpts",
    )
    first = run_demo(strategy, settings)
    assert "resumed from" not in first.stdout
    result = subprocess.run(
        [sys.executable, "-m", "centralstore", "demo", "--epochs", "1", "--batch-size", "256",
         "--no-compare", "--out", "second", "--checkpoint-dir", str(tmp_path / "ckpts")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert field(result.stdout, "resumed from") == str(tmp_path / "ckpts" / "ckpt-1")
    assert field(result.stdout, "test accuracy") == field(first.stdout, "test accuracy")
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["resumed_from"] == str(tmp_path / "ckpts" / "ckpt-1")
    assert first.summary["resumed_from"] is None
    assert "Warning" not in result.stderr


@pytest.mark.parametrize("compare", [True, False])
def test_with_the_comparison_the_replicas_batches_are_made_when_the_loop_asks(
    compare: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain loops take their steps between the replicas' (``job.interleaved``): a
    thread making the replicas' batches ahead would make them during those steps too. With
    the comparison on, no such thread starts, though the loop is away long enough between
    its steps (2 ms here, 24 steps of 128) for the distributed input to start one without
    it."""
    started: list[object] = []
    make = prefetch.PrefetchIterator
    monkeypatch.setattr(
        prefetch, "PrefetchIterator",
        lambda *args, **kwargs: started.append(args) or make(*args, **kwargs),
    )
    data = small_digits(train=1437, test=8)
    settings = job.Settings(epochs=2, batch_size=128, compare=compare)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    _, training = train.distributed_training(
        strategy, data, settings, lambda e, s: report.progress(e, 2, s, io.StringIO())
    )
    for result in training:
        if result is None:
            time.sleep(0.002)  # the other loops' steps
    assert bool(started) is not compare


def test_the_demo_with_its_comparison_trains_on_two_gpus(
    fake_gpus: object, tmp_path: Path
) -> None:
    """On GPUs, with the comparison on, the replicas' batches go to their GPUs when the loop
    asks for them (no prefetch thread): the demo trains on two fake GPUs, its weights
    within float32 rounding of the plain loop's on ``cuda:0``, with no stream hazard (the
    fixture checks)."""
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"])
    settings = job.Settings(epochs=1, batch_size=256, out=tmp_path)  # 6 steps
    summary = train.run(strategy, settings, io.StringIO(), io.StringIO())
    assert summary["compute_devices"] == ["cuda:0", "cuda:1"]
    assert summary["one_device"]["device"] == "cuda:0"
    assert summary["max_abs_weight_difference"] < 1e-5
    assert summary["one_device_in_slices"]["max_abs_weight_difference"] < 1e-5
