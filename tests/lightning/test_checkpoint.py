"""Checkpoints under the strategy are ordinary single-device ones: they load into a plain
module, resume under the strategy or without it, and resuming equals not stopping."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import MLP, fit, loader, max_difference, trainer

TOLERANCE = 1e-5


def test_save_and_resume_equal_uninterrupted_training(tmp_path: Path) -> None:
    # (no shuffling: a new DataLoader's generator would not continue the old one's)
    whole, _ = fit(2, max_epochs=3, val=False, shuffle=False)
    # two epochs, a checkpoint, then the third epoch in a new Trainer
    _, run = fit(2, max_epochs=2, val=False, shuffle=False)
    path = tmp_path / "two.ckpt"
    run.save_checkpoint(path)
    torch.manual_seed(123)  # a fresh model, different weights: the checkpoint must restore
    resumed = MLP()
    again = trainer(2, max_epochs=3)
    again.fit(resumed, loader(), ckpt_path=path)
    assert again.global_step == 15
    assert max_difference(whole, resumed) < TOLERANCE
    # and the same checkpoint resumed on one device, without the strategy
    torch.manual_seed(123)
    plain = MLP()
    trainer(0, max_epochs=3).fit(plain, loader(), ckpt_path=path)
    assert max_difference(whole, plain) < TOLERANCE


def test_checkpoint_is_a_plain_state_dict(tmp_path: Path) -> None:
    model, run = fit(3, max_epochs=1, val=False)
    path = tmp_path / "model.ckpt"
    run.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["state_dict"].keys() == MLP().state_dict().keys()  # no wrapper prefix
    assert all(type(t) is torch.Tensor for t in saved["state_dict"].values())
    plain = MLP.load_from_checkpoint(path)
    assert max_difference(model, plain) == 0.0
    state = saved["optimizer_states"][0]["state"]
    assert len(state) == len(list(model.parameters()))  # momentum buffers, one per parameter


def test_model_checkpoint_callback_as_on_one_device(tmp_path: Path) -> None:
    runs = {}
    for replicas in (0, 3):
        directory = tmp_path / str(replicas)
        callback = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=2,
                                   save_last=True)
        fit(replicas, enable_checkpointing=True, callbacks=[callback], max_epochs=3)
        runs[replicas] = (callback, directory)
    (one, one_dir), (many, many_dir) = runs[0], runs[3]
    names = sorted(p.name for p in many_dir.iterdir())
    assert names == sorted(p.name for p in one_dir.iterdir())
    assert "last.ckpt" in names and len(names) == 3
    assert float(many.best_model_score) == pytest.approx(float(one.best_model_score),
                                                         abs=TOLERANCE)
    for name in names:
        a = MLP.load_from_checkpoint(one_dir / name)
        b = MLP.load_from_checkpoint(many_dir / name)
        assert max_difference(a, b) < TOLERANCE, name
