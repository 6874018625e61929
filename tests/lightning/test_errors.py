"""Unsupported configurations fail early, saying what to do instead."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from lightning_models import MLP, loader

import centralstore as cs


def strategy() -> cs.lightning.CentralStorageStrategy:
    return cs.lightning.CentralStorageStrategy(["cpu:0", "cpu:1"])


def test_several_trainer_devices_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Trainer\(devices=2\).*Pass Trainer\(devices=1\)"):
        pl.Trainer(strategy=strategy(), accelerator="cpu", devices=2, logger=False)


def test_manual_optimization_is_refused() -> None:
    class Manual(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    run = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=1, max_epochs=1,
                     logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="automatic optimization only"):
        run.fit(Manual(), loader())


def test_bad_loss_reduction() -> None:
    with pytest.raises(ValueError, match="loss_reduction must be"):
        cs.lightning.CentralStorageStrategy(["cpu:0"], loss_reduction="none")  # type: ignore[arg-type]


def test_unsupported_reduce_fx() -> None:
    class Median(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = super().training_step(batch, batch_idx)
            self.log("median", loss, reduce_fx=torch.median)
            return loss

    run = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=1, max_epochs=1,
                     logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="reduce_fx 'mean', 'sum', 'max' or 'min' only"):
        run.fit(Median(), loader())


def test_replica_error_names_the_replica() -> None:
    class Fails(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if cs.get_replica_context().replica_id_in_sync_group == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Fails()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=1, max_epochs=1,
                     logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="boom") as info:
        run.fit(model, loader())
    assert any("replica 1" in note for note in info.value.__notes__)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_importing_without_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from centralstore.lightning import _load

    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'centralstore\[lightning\]'"):
        _load.load()


def test_core_does_not_import_the_integration() -> None:
    # Statically (a fresh interpreter costs seconds): no module of the core imports
    # centralstore.lightning or Lightning.
    import ast
    from pathlib import Path

    root = Path(cs.__file__).parent
    for path in root.rglob("*.py"):
        if "lightning" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.split(".")[-1] == "lightning" or n.startswith("lightning")
                           for n in names), (path, names)


def test_accelerator_of_another_kind_than_the_parameter_device() -> None:
    from lightning.pytorch.accelerators import CUDAAccelerator

    chosen = strategy()
    chosen.accelerator = CUDAAccelerator()  # as Trainer(accelerator="gpu") would set it
    with pytest.raises(ValueError, match=r"Pass Trainer\(accelerator='cpu', devices=1\)"):
        chosen.setup_environment()
