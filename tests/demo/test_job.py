"""What the demo's runs share (``centralstore.demo.job``): the data split, the model, the
batches, the optimizer, the strategy."""

from __future__ import annotations

import pytest
import torch

import centralstore as cs
from centralstore.demo import job


def test_load_digits_is_a_seeded_stratified_80_20_split() -> None:
    data = job.load_digits(seed=0)
    assert data.train_images.shape == (1437, 1, 8, 8) and data.test_images.shape == (360, 1, 8, 8)
    assert (len(data.train_labels), len(data.test_labels)) == (1437, 360)
    assert data.train_images.dtype == torch.float32 and data.train_labels.dtype == torch.int64
    assert float(data.train_images.min()) == 0.0 and float(data.train_images.max()) == 1.0
    assert torch.bincount(data.test_labels).tolist() == pytest.approx([36] * 10, abs=1)
    again, other = job.load_digits(seed=0), job.load_digits(seed=1)
    assert torch.equal(again.test_labels, data.test_labels)
    assert not torch.equal(other.test_images, data.test_images)


def test_the_model_has_22954_parameters_and_maps_8x8_images_to_10_logits() -> None:
    model = job.make_model()
    assert sum(p.numel() for p in model.parameters()) == 22_954
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)


def test_train_batches_with_one_seed_come_in_one_order() -> None:
    data = job.load_digits(seed=0)
    first, second = job.train_batches(data, 64, seed=3), job.train_batches(data, 64, seed=3)
    for _ in range(2):  # two epochs: a new order each, the same in both loaders
        for (x1, y1), (x2, y2) in zip(first, second, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert len(first) == job.steps_per_epoch(1437, 64) == 23
    other = next(iter(job.train_batches(data, 64, seed=4)))[1]
    assert not torch.equal(other, next(iter(job.train_batches(data, 64, seed=3)))[1])


def test_held_out_batches_are_the_test_set_in_order() -> None:
    data = job.load_digits(seed=0)
    labels = torch.cat([y for _, y in job.held_out_batches(data, 100)])
    assert torch.equal(labels, data.test_labels)


def test_the_learning_rate_anneals_to_zero_over_the_run() -> None:
    optimizer, schedule = job.make_optimizer(job.make_model(), total_steps=4)
    assert optimizer.param_groups[0]["lr"] == job.LEARNING_RATE
    assert optimizer.param_groups[0]["eps"] == job.ADAM_EPSILON
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_the_global_size_sums_every_replicas_slice() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    batches = strategy.experimental_distribute_dataset([torch.arange(5), torch.arange(2)])
    assert [job.global_size(strategy, batch) for batch in batches] == [5, 2]


def test_make_strategy_takes_the_given_devices() -> None:
    strategy = job.make_strategy(["cpu:0", "cpu:1", "cpu:2"], "cpu:0")
    assert isinstance(strategy, cs.CentralStorageStrategy)
    assert strategy.compute_devices == ("cpu:0", "cpu:1", "cpu:2")
    assert strategy.parameter_device == "cpu:0"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the default without a GPU")
def test_make_strategy_without_a_gpu_takes_two_logical_cpu_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not a torchrun worker
    strategy = job.make_strategy(None, None)
    assert strategy.compute_devices == job.LOGICAL_CPU_DEVICES
    assert strategy.num_replicas_in_sync == 2
