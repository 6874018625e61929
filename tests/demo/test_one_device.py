"""The demo's oracle (``centralstore.demo.one_device``): a plain one-device loop that the
distributed run must match, and the distance between two models' weights."""

from __future__ import annotations

import io
import time

import pytest
import torch
from demo.reading import small_digits

import centralstore as cs
from centralstore.demo import job, one_device, report, train
from centralstore.demo.job import finish


def test_distributed_run_matches_its_one_device_twin_on_three_replicas() -> None:
    """Global batches of 16 over three replicas (6 + 6 + 4) train like one device."""
    data = small_digits(train=40, test=8)
    settings = job.Settings(epochs=2, batch_size=16)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    distributed, initial = train.train_distributed(
        strategy, data, settings, lambda e, s: report.progress(e, 2, s, io.StringIO())
    )
    reference = finish(one_device.one_device_training(initial, data, settings, torch.device("cpu")))
    assert one_device.max_abs_difference(distributed.model, reference.model) < 1e-5
    assert distributed.history.loss == pytest.approx(reference.history.loss, rel=1e-4)
    assert distributed.history.test_accuracy == reference.history.test_accuracy
    assert distributed.samples == reference.samples == 2 * 40
    assert len(reference.history.accuracy) == 2 and reference.train_seconds > 0


@pytest.mark.parametrize(("replicas", "batch_size"), [(2, 16), (3, 4)])
def test_the_loop_in_slices_trains_as_the_replicas_do(replicas: int, batch_size: int) -> None:
    """The plain loop cut into the replicas' slices (8 + 8; and 2 + 2 + 0, an empty slice
    making no pass) ends where the replicas and the whole-batch loop end."""
    data = small_digits(train=40, test=8)
    settings = job.Settings(epochs=2, batch_size=batch_size)
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    distributed, initial = train.train_distributed(
        strategy, data, settings, lambda e, s: report.progress(e, 2, s, io.StringIO())
    )
    sliced = finish(
        one_device.one_device_training(initial, data, settings, torch.device("cpu"), replicas)
    )
    whole = finish(one_device.one_device_training(initial, data, settings, torch.device("cpu")))
    assert one_device.max_abs_difference(distributed.model, sliced.model) < 1e-5
    assert one_device.max_abs_difference(whole.model, sliced.model) < 1e-5
    assert sliced.history.loss == pytest.approx(whole.history.loss, rel=1e-4)
    assert sliced.history.accuracy == whole.history.accuracy
    assert len(sliced.epoch_seconds) == 2 and sum(sliced.epoch_seconds) == sliced.train_seconds


def test_max_abs_difference_is_the_largest_over_every_tensor() -> None:
    torch.manual_seed(0)
    a = job.make_model()
    b = job.make_model()
    b.load_state_dict(a.state_dict())
    assert one_device.max_abs_difference(a, b) == 0.0
    first, *_, last = b.parameters()
    with torch.no_grad():
        last[3] += 0.25
        first.view(-1)[0] -= 0.125
    assert one_device.max_abs_difference(a, b) == pytest.approx(0.25)


def test_the_reference_runs_on_the_first_compute_device() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:1", "cpu:0"])
    assert one_device.reference_device(strategy) == torch.device("cpu")


def _stepped(training: job.Training, pause: float) -> tuple[int, job.Run]:
    """Drive ``training`` as ``job.interleaved`` does, pausing ``pause`` s after each of its
    steps (where the other trainings take theirs); how many steps it yielded, and its run."""
    for steps, result in enumerate(training):
        if result is not None:
            return steps, result
        time.sleep(pause)
    raise AssertionError("the training ended without its run")


def test_each_training_yields_after_every_step_and_times_only_its_own_steps() -> None:
    """Two epochs of 3 steps (40 examples in batches of 16): both trainings hand over after
    each step, so that ``run`` takes turns step by step, and their epoch times leave out the
    pauses between steps (6 x 0.2 s here, told apart from the steps by the wall time, not
    by how fast the machine steps), as they leave out the other trainings' steps."""
    data = small_digits(train=40, test=8)
    settings = job.Settings(epochs=2, batch_size=16)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    initial, distributed = train.distributed_training(
        strategy, data, settings, lambda e, s: report.progress(e, 2, s, io.StringIO())
    )
    plain = one_device.one_device_training(initial, data, settings, torch.device("cpu"), 2)
    for training in (distributed, plain):
        began = time.perf_counter()
        steps, run = _stepped(training, pause=0.2)
        elapsed = time.perf_counter() - began
        assert steps == 6
        assert len(run.epoch_seconds) == 2 and all(s > 0 for s in run.epoch_seconds)
        assert sum(run.epoch_seconds) == pytest.approx(run.train_seconds)
        # However slow the machine, the steps' time and the six pauses fit in the wall time
        # only if the pauses were left out of the steps' time.
        assert run.train_seconds + 6 * 0.2 <= elapsed
