"""The demo's oracle (``centralstore.demo.one_device``): a plain one-device loop that the
distributed run must match, and the distance between two models' weights."""

from __future__ import annotations

import io

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
    reference = finish(one_device.one_device_epochs(initial, data, settings, torch.device("cpu")))
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
        one_device.one_device_epochs(initial, data, settings, torch.device("cpu"), replicas)
    )
    whole = finish(one_device.one_device_epochs(initial, data, settings, torch.device("cpu")))
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
