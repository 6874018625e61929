"""validate, test and predict per replica: metrics weighted by slice sizes, predictions in
the batch's order, as one device's."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import torch
from lightning_models import MLP, loader, trainer

TOLERANCE = 1e-5


@pytest.mark.parametrize("replicas", [2, 3])
def test_validate_and_test_equal_one_device(replicas: int) -> None:
    torch.manual_seed(0)
    model = MLP()
    batches = loader(rows=23, batch_size=5)  # 5, 5, 5, 5, 3: uneven at R = 2 and R = 3
    one_val = trainer(0).validate(model, batches, verbose=False)
    one_test = trainer(0).test(model, batches, verbose=False)
    many_val = trainer(replicas).validate(model, batches, verbose=False)
    many_test = trainer(replicas).test(model, batches, verbose=False)
    assert many_val[0].keys() == one_val[0].keys() == {"val_loss"}
    assert many_val[0]["val_loss"] == pytest.approx(one_val[0]["val_loss"], abs=TOLERANCE)
    assert many_test[0]["test_loss"] == pytest.approx(one_test[0]["test_loss"], abs=TOLERANCE)
    assert many_test[0]["test_count"] == one_test[0]["test_count"] == 23.0


@pytest.mark.parametrize("replicas", [2, 3])
def test_predict_concatenates_in_order(replicas: int) -> None:
    class Rows(MLP):
        def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, _ = batch
            return {"y": self(x), "x": x, "batch": batch_idx}

    torch.manual_seed(0)
    model = Rows()
    batches = loader(rows=11, batch_size=4)  # 4, 4, 3
    one = trainer(0).predict(model, batches)
    many = trainer(replicas).predict(model, batches)
    assert len(many) == len(one) == 3
    for a, b in zip(one, many):
        assert torch.equal(a["x"], b["x"])  # the rows come back in the batch's order
        assert torch.allclose(a["y"], b["y"], atol=TOLERANCE)
        assert a["batch"] == b["batch"]
    whole = torch.cat([b["x"] for b in many])
    assert torch.equal(whole, loader(rows=11).dataset.tensors[0])


def test_predict_plain_tensors() -> None:
    torch.manual_seed(0)
    model = MLP()
    batches = loader(rows=10, batch_size=7)  # 7, 3: 3/3/1 then 1/1/1
    one = torch.cat(trainer(0).predict(model, batches))
    many = torch.cat(trainer(3).predict(model, batches))
    assert torch.allclose(one, many, atol=TOLERANCE)
    assert many.shape == (10, 1)


def test_validation_during_fit_equals_one_device() -> None:
    from lightning_models import fit, max_difference, metrics

    one, one_run = fit(0, rows=23, check_val_every_n_epoch=1)
    many, many_run = fit(3, rows=23, check_val_every_n_epoch=1)
    assert metrics(many_run)["val_loss"] == pytest.approx(metrics(one_run)["val_loss"],
                                                          abs=TOLERANCE)
    assert max_difference(one, many) < TOLERANCE


def test_torchmetrics_metrics_accumulate_over_replicas() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")

    class Metered(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.train_mse = torchmetrics.MeanSquaredError()
            self.val_mse = torchmetrics.MeanSquaredError()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.train_mse.update(self(x), y)
            self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.val_mse.update(self(x), y)
            self.log("val_mse", self.val_mse)

    from lightning_models import fit, metrics

    torch.manual_seed(0)
    _, one_run = fit(0, Metered())
    torch.manual_seed(0)
    _, many_run = fit(3, Metered())
    for key in ("train_mse", "val_mse"):  # float32 metric states
        assert metrics(many_run)[key] == pytest.approx(metrics(one_run)[key], abs=1e-6), key


def test_a_metric_collection_accumulates_over_replicas() -> None:
    """(A Lightning module's usual collection, updated in ``training_step`` and logged with
    ``log_dict``: it groups mean squared error with its root, as on one device.)"""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Metered(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.train_metrics = torchmetrics.MetricCollection({
                "mse": torchmetrics.MeanSquaredError(),
                "rmse": torchmetrics.MeanSquaredError(squared=False),
                "mae": torchmetrics.MeanAbsoluteError(),
            }, prefix="train_")

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.train_metrics.update(self(x), y)
            self.log_dict(self.train_metrics, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    from lightning_models import fit, metrics

    torch.manual_seed(0)
    one, one_run = fit(0, Metered(), max_epochs=1)  # (the epoch of the groups' first update)
    torch.manual_seed(0)
    many, many_run = fit(3, Metered(), max_epochs=1)
    assert many.train_metrics.compute_groups == one.train_metrics.compute_groups
    assert len(one.train_metrics.compute_groups) == 2
    for key in ("train_mse", "train_rmse", "train_mae"):  # float32 metric states
        assert metrics(many_run)[key] == pytest.approx(metrics(one_run)[key], abs=1e-6), key


def test_a_metric_logged_on_step_reports_the_whole_batch() -> None:
    """(``self.log(name, metric, on_step=True)`` logs the metric's forward value of the
    step: over the whole batch, as on one device, not the last replica's slice.)"""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Metered(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.train_mse = torchmetrics.MeanSquaredError()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.train_mse(self(x), y)
            self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    from lightning_models import fit, metrics

    torch.manual_seed(0)
    _, one_run = fit(0, Metered(), rows=20, shuffle=False)  # (batches of 5: 2, 2, 1 a replica)
    torch.manual_seed(0)
    _, many_run = fit(3, Metered(), rows=20, shuffle=False)
    for key in ("train_mse_step", "train_mse_epoch"):  # float32 metric states
        assert metrics(many_run)[key] == pytest.approx(metrics(one_run)[key], abs=1e-6), key
