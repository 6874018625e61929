"""What the demo shows (``centralstore.demo.report``): each epoch's progress, the report's
lines, ``summary.json`` and ``curves.png``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from demo.reading import PNG_SIGNATURE, SUMMARY_KEYS, field, rate, small_digits

import centralstore as cs
from centralstore.demo import job, report


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def show_epochs(stream: io.StringIO, epochs: int, steps: int) -> str:
    """Drive ``progress`` through ``epochs`` epochs of ``steps`` steps; return what it wrote."""
    for epoch in range(epochs):
        shown = report.progress(epoch, epochs, steps, stream)
        for step in range(1, steps + 1):
            shown.step(loss=1.0 / step, accuracy=step / steps)
        shown.close(test_accuracy=0.5 + epoch / 100, seconds=1.5 + epoch)
    return stream.getvalue()


def test_progress_off_a_terminal_is_one_plain_line_per_epoch() -> None:
    text = show_epochs(io.StringIO(), epochs=10, steps=4)
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10
    # the time is the epoch's own steps' (the comparisons' between them left out)
    assert lines[0] == "epoch  1/10: 4/4 steps in 1.5 s, loss=0.2500, acc=1.0000, test_acc=0.5000"
    assert lines[9].startswith("epoch 10/10: 4/4 steps in 10.5 s, ")
    assert lines[9].endswith(", test_acc=0.5900")


def test_progress_on_a_terminal_is_a_tqdm_bar_per_epoch() -> None:
    text = show_epochs(Terminal(), epochs=2, steps=4)
    assert "\r" in text  # redrawn in place
    assert text.count("\n") == 2  # each bar left standing when its epoch ends
    last = text.split("\n")[0].split("\r")[-1]
    assert last.startswith("epoch 1/2: 100%")
    # the epoch's own time, as off a terminal (tqdm's wall clock and rate left out)
    assert last.endswith("| 4/4 steps in 1.5 s, loss=0.2500, acc=1.0000, test_acc=0.5000")


@pytest.mark.parametrize(
    ("devices", "batch_size", "slices"),
    [
        (["cpu:0", "cpu:1"], 64, "64 = 32 + 32"),
        (["cpu:0", "cpu:1", "cpu:2"], 100, "100 = 34 + 34 + 32"),
        (["cpu:0", "cpu:1", "cpu:2"], 4, "4 = 2 + 2 + 0"),
    ],
)
def test_the_header_shows_each_replicas_slice_of_the_global_batch(
    devices: list[str], batch_size: int, slices: str
) -> None:
    out = io.StringIO()
    strategy = cs.CentralStorageStrategy(devices)
    settings = job.Settings(epochs=3, batch_size=batch_size, seed=7)
    report.Report(out).header(strategy, settings, train_samples=1437, test_samples=360)
    text = out.getvalue()
    assert text.startswith(f"centralstore {cs.__version__} demo: ")
    steps = job.steps_per_epoch(1437, batch_size)
    assert field(text, "global batch") == (
        f"{slices} (one slice per replica), {steps} steps per epoch, 3 epochs"
    )
    assert field(text, "data").endswith("split with seed 7")
    assert field(text, "strategy") == f"CentralStorageStrategy, {len(devices)} replicas in sync"


def test_without_a_comparison_the_summary_says_none_and_the_files_are_written(
    tmp_path: Path,
) -> None:
    data = small_digits(train=10, test=4)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    history = job.History(loss=[2.3, 2.0], accuracy=[0.1, 0.3], test_accuracy=[0.25, 0.5])
    run = job.Run(job.make_model(), history, train_seconds=0.5, samples=20)
    settings = job.Settings(epochs=2, batch_size=4, compare=False)
    summary = report.summary(strategy, settings, data, run, None, None, torch.device("cpu"))
    assert set(summary) == SUMMARY_KEYS - {"wall_seconds"}  # run adds the wall time
    assert summary["one_device"] is None and summary["max_abs_weight_difference"] is None
    assert (summary["train_samples"], summary["test_samples"]) == (10, 4)
    assert summary["samples_per_second"] == 40.0 and summary["test_accuracy"] == 0.5
    assert summary["steady_samples_per_second"] == 40.0  # no epoch times: the whole run
    assert summary["one_device_in_slices"] is None
    assert summary["history"] == {
        "loss": [2.3, 2.0],
        "accuracy": [0.1, 0.3],
        "test_accuracy": [0.25, 0.5],
    }
    paths = report.write(tmp_path / "new" / "dir", summary)
    assert [p.name for p in paths] == ["curves.png", "summary.json"]
    assert paths[0].read_bytes().startswith(PNG_SIGNATURE)
    assert json.loads(paths[1].read_text()) == summary


def timed(epoch_seconds: list[float], samples_per_epoch: int = 1000) -> job.Run:
    """A finished run of ``len(epoch_seconds)`` epochs that took these times."""
    epochs = len(epoch_seconds)
    history = job.History([1.0] * epochs, [0.5] * epochs, [0.5] * epochs)
    return job.Run(
        job.make_model(), history, sum(epoch_seconds), samples_per_epoch * epochs,
        epoch_seconds=epoch_seconds,
    )  # fmt: skip


def test_the_steady_state_is_the_median_epoch_after_the_warm_up() -> None:
    run = timed([3.0, 0.1, 0.2, 5.0, 0.1])  # a slow warm-up, and one epoch slowed by load
    assert run.steady_samples_per_second == pytest.approx(1000 / 0.15)
    assert run.samples_per_second == pytest.approx(5000 / 8.4)
    assert timed([2.0]).steady_samples_per_second == 500.0  # one epoch: nothing to leave out


def test_the_speed_lines_separate_centralstores_cost_from_the_smaller_batches() -> None:
    out = io.StringIO()
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    replicas, sliced, whole = timed([2, 0.5, 0.5]), timed([1, 0.4, 0.4]), timed([1, 0.2, 0.2])
    report.Report(out).speed(strategy, job.Settings(epochs=3), replicas, whole, sliced)
    text = out.getvalue()
    assert field(text, "samples per second") == (
        "steady state, the median of epochs 2-3 (epoch 1 is warm-up); in brackets, all 3 epochs"
    )
    assert field(text, "  2 replicas") == "2,000 (1,000 in 3.0 s)"
    assert field(text, "  1 device, slices") == (
        "2,500 (1,667 in 1.8 s): the replicas' 32 + 32 one after the other, a backward pass "
        "each, one optimizer step"
    )
    assert field(text, "  1 device, whole") == (
        "5,000 (2,143 in 1.4 s): one pass per global batch of 64"
    )
    assert [rate(text, "  2 replicas"), rate(text, "  1 device, whole")] == [2000, 5000]
    assert field(text, "  centralstore") == (
        "0.80x the same slices on one device: centralstore's own cost"
    )
    assert field(text, "  smaller batches") == (
        "0.50x: slices of 32 against whole batches of 64, with or without centralstore"
    )
    assert field(text, "  about speed") == (
        "logical CPU devices share one host's cores: they prove the semantics and measure "
        "centralstore's own overhead, not a speed-up (that takes GPUs)"
    )


def test_without_a_comparison_or_with_one_epoch_the_speed_says_what_it_has() -> None:
    out = io.StringIO()
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    report.Report(out).speed(strategy, job.Settings(epochs=1, batch_size=100), timed([0.5]))
    text = out.getvalue()
    assert field(text, "samples per second").startswith("one epoch, warm-up included")
    assert field(text, "  3 replicas") == "2,000 (2,000 in 0.5 s)"
    for missing in ("1 device, slices", "1 device, whole", "centralstore", "smaller batches"):
        assert f"  {missing} " not in text
    assert "logical CPU devices share" in field(text, "  about speed")


def test_one_replica_on_the_host_cpu_has_no_note_on_logical_devices() -> None:
    out = io.StringIO()
    strategy = cs.CentralStorageStrategy(["cpu:0"])
    report.Report(out).speed(strategy, job.Settings(), timed([1.0, 0.5]), timed([1.0, 0.5]))
    assert "about speed" not in out.getvalue()
    assert field(out.getvalue(), "  1 replica").startswith("2,000 ")
