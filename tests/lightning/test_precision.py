"""Precision plugins behave as on one device: "32-true", "64-true" and "bf16-mixed"."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import torch
from lightning_models import MLP, fit, max_difference, metrics


class Float32(MLP):
    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.net = self.net.float()

    def _cast(self, batch):  # type: ignore[no-untyped-def]
        dtype = next(self.parameters()).dtype  # float32, or float64 under "64-true"
        return tuple(t.to(dtype) for t in batch)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return super().training_step(self._cast(batch), batch_idx)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return super().validation_step(self._cast(batch), batch_idx)


@pytest.mark.parametrize(
    ("precision", "tolerance"),
    [("32-true", 1e-5), ("64-true", 1e-10), ("bf16-mixed", 2e-2)],
)
def test_precision_equals_one_device(precision: str, tolerance: float) -> None:
    torch.manual_seed(0)
    one, one_run = fit(0, Float32(), precision=precision, max_epochs=1)
    torch.manual_seed(0)
    many, many_run = fit(3, Float32(), precision=precision, max_epochs=1)
    dtype = torch.float64 if precision == "64-true" else torch.float32
    assert all(p.dtype == dtype for p in many.parameters())
    assert max_difference(one, many) < tolerance
    for key, value in metrics(one_run).items():
        assert metrics(many_run)[key] == pytest.approx(value, abs=tolerance), key


def test_bf16_mixed_autocasts_each_replica() -> None:
    seen: list[torch.dtype] = []

    class Watch(Float32):
        def forward(self, x):  # type: ignore[no-untyped-def]
            out = self.net(x)
            seen.append(out.dtype)
            return out

    torch.manual_seed(0)
    fit(2, Watch(), precision="bf16-mixed", max_epochs=1, val=False)
    assert seen and set(seen) == {torch.bfloat16}
