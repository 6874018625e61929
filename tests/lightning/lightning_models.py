"""LightningModules and Trainer runs shared by the tests of centralstore.lightning.

Every model computes in float64, so that R replicas and one device agree to rounding of
float64 (the gradients are summed in another order), far below the 1e-5 the tests allow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from replicas import see_views
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import centralstore as cs
import centralstore.lightning


class MLP(pl.LightningModule):
    """A small regression MLP; logs its loss (train, val, test) and a few other values."""

    def __init__(self, batchnorm: bool = False, lr: float = 0.1, extra_logs: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, 8)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(8))
        layers += [nn.Tanh(), nn.Linear(8, 1)]
        self.net = nn.Sequential(*layers).double()
        self.lr = lr
        self.extra_logs = extra_logs
        self.grad_norms: list[float] = []
        self.backward_hooks = 0
        self.step_outputs: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        if self.extra_logs:
            error = (self(x) - y).abs().detach()
            self.log("train_max_error", error.max(), reduce_fx="max", on_epoch=True)
            self.log("train_sum_error", error.sum(), reduce_fx="sum", on_epoch=True)
            self.log_dict({"train_mean_y": y.mean(), "train_sized": y.mean() * 2},
                          batch_size=len(y), on_epoch=True, sync_dist=True)
            return {"loss": loss, "predictions": self(x).detach(), "count": len(y)}
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_outputs.append(outputs)

    def on_after_backward(self) -> None:
        self.backward_hooks += 1

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))
        self.log("test_count", float(len(y)), reduce_fx="sum")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data(rows: int = 21, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=generator, dtype=torch.float64)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * x[:, 2:3] ** 2
    return TensorDataset(x, y)


def loader(rows: int = 21, batch_size: int = 5, shuffle: bool = False) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(7)
    return DataLoader(data(rows), batch_size=batch_size, shuffle=shuffle, generator=generator)


def strategy(replicas: int, views: bool = False) -> Any:
    """None for one device (Lightning's own), else the strategy on ``replicas`` CPU devices
    (``views``: its replicas see views of the parameters, as GPU replicas do)."""
    if replicas == 0:
        return "auto"
    made = cs.lightning.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    if views:
        see_views(made._strategy)
    return made


def trainer(
    replicas: int, tmp_path: Path | None = None, views: bool = False, **kwargs: Any
) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False,
        "enable_progress_bar": False, "enable_checkpointing": False,
        "enable_model_summary": False, "num_sanity_val_steps": 0,
    }
    if tmp_path is not None:
        options["default_root_dir"] = tmp_path
    options.update(kwargs)
    return pl.Trainer(strategy=strategy(replicas, views), **options)


def fit(replicas: int, model: pl.LightningModule | None = None, tmp_path: Path | None = None,
        rows: int = 21, batch_size: int = 5, val: bool = True, shuffle: bool = True,
        views: bool = False, **kwargs: Any
        ) -> tuple[pl.LightningModule, pl.Trainer]:
    """``model`` (seeded MLP by default) trained by ``trainer(replicas, ...)``."""
    torch.manual_seed(0)
    model = MLP() if model is None else model
    run = trainer(replicas, tmp_path, views, **kwargs)
    run.fit(model, loader(rows, batch_size, shuffle=shuffle),
            loader(rows, batch_size) if val else None)
    return model, run


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between two modules' state_dict entries (weights, buffers)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def metrics(run: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in run.callback_metrics.items()}
