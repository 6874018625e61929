"""``cs.Checkpoint``, ``cs.CheckpointManager`` and ``cs.RNGState``: files, retention,
corrupt files, strict restores, and training killed with SIGKILL then resumed.

The SIGKILL tests run ``tests/_ckpt_worker.py`` in subprocesses; the oracle is the same
training uninterrupted, in this process. The multi-worker restart under torchrun is in
``tests/test_multi_worker.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import centralstore as cs
from centralstore.checkpoint import Checkpoint, CheckpointManager, RNGState
from centralstore.input.errors import DataLossError

WORKER = Path(__file__).with_name("_ckpt_worker.py")
_spec = importlib.util.spec_from_file_location("_ckpt_worker", WORKER)
assert _spec is not None and _spec.loader is not None
helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helper)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- Checkpoint: what it tracks, save/write/restore/read ------------------------------------


def test_save_numbers_files_and_restore_loads_every_kind_of_object(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = linear(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        counter = cs.Variable(0, trainable=False)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    generator = torch.Generator().manual_seed(3)
    inner = Checkpoint(schedule=schedule)
    checkpoint = Checkpoint(
        model=model, optimizer=optimizer, counter=counter, scaler=scaler, generator=generator,
        nested=inner,
    )
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    schedule.step()
    counter.add_(4)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    draw = torch.rand(2, generator=generator)
    generator.manual_seed(3)
    first = checkpoint.save(tmp_path / "run" / "ckpt")
    second = checkpoint.save(tmp_path / "run" / "ckpt")
    assert [Path(first).name, Path(second).name] == ["ckpt-1", "ckpt-2"]
    assert checkpoint.save_counter == 2

    fresh_strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])  # another R
    with fresh_strategy.scope():
        model2 = linear(1)
        optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.1)
        counter2 = cs.Variable(0, trainable=False)
    schedule2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    generator2 = torch.Generator()
    restored = Checkpoint(
        model=model2, optimizer=optimizer2, counter=counter2, scaler=scaler2,
        generator=generator2, nested=Checkpoint(schedule=schedule2),
    )
    restored.restore(first)
    assert restored.save_counter == 1
    assert_same_state(model2.state_dict(), saved_model)
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], saved_optimizer)
    assert int(counter2) == 4 and scaler2.get_scale() == 8.0
    assert schedule2.last_epoch == 1 and optimizer2.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(torch.rand(2, generator=generator2), draw)
    # A plain torch.load file: the model's entry is its state_dict.
    raw = torch.load(first, weights_only=True)
    assert_same_state(raw["objects"]["model"], saved_model)


def test_write_and_read_leave_save_counter_alone(tmp_path: Path) -> None:
    model = linear(0)
    checkpoint = Checkpoint(model=model)
    path = checkpoint.write(tmp_path / "exact-name")
    assert path == str(tmp_path / "exact-name") and checkpoint.save_counter == 0
    with torch.no_grad():
        model.weight.zero_()
    checkpoint.read(path)
    assert_same_state(model.state_dict(), linear(0).state_dict())
    checkpoint.restore(None)  # nothing to restore: a no-op, as TensorFlow's
    assert checkpoint.save_counter == 0


def test_attributes_track_more_objects_and_name_what_is_tracked() -> None:
    checkpoint = Checkpoint(model=linear(0))
    checkpoint.extra = torch.zeros(2)
    assert repr(checkpoint) == "Checkpoint(model, extra)"
    assert checkpoint.extra.shape == (2,)
    with pytest.raises(AttributeError, match=r"tracks no object named 'missing'; it tracks "
                                             r"\['extra', 'model'\]"):
        _ = checkpoint.missing
    with pytest.raises(TypeError, match=r"Received: a int, as Checkpoint\(step=\.\.\.\)"):
        Checkpoint(step=3)
    with pytest.raises(AttributeError, match="set by save"):
        checkpoint.save_counter = 3


def test_a_missing_or_unexpected_object_is_an_error_naming_it(tmp_path: Path) -> None:
    path = Checkpoint(model=linear(0), inner=Checkpoint(a=torch.zeros(1))).write(tmp_path / "c")
    with pytest.raises(KeyError, match=re.escape("missing state for ['other'], unexpected state "
                                                 "for ['inner']")) as info:
        Checkpoint(model=linear(1), other=torch.zeros(1)).read(path)
    assert f"while restoring the checkpoint {path!r}" in "".join(info.value.__notes__)
    with pytest.raises(KeyError, match=re.escape("missing state for ['inner.b']")):
        Checkpoint(model=linear(1), inner=Checkpoint(a=torch.zeros(1), b=torch.zeros(1))).read(
            path
        )
    with pytest.raises(RuntimeError, match="Missing key") as info:
        Checkpoint(model=nn.Sequential(linear(1)), inner=Checkpoint(a=torch.zeros(1))).read(path)
    assert "while loading the state of 'model' (Sequential)" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match=r"tensor 'inner.a' of shape \(2,\) from a saved value "
                                         r"of shape \(1,\)"):
        Checkpoint(model=linear(1), inner=Checkpoint(a=torch.zeros(2))).read(path)


def test_central_variables_keep_their_device_and_storage(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = linear(0)
    weight = model.weight
    pointer = weight.data_ptr()
    path = Checkpoint(model=model).write(tmp_path / "c")
    with torch.no_grad():
        weight.zero_()
    Checkpoint(model=model).read(path)
    assert model.weight is weight and weight.data_ptr() == pointer  # loaded in place
    assert strategy.extended.variable_created_in_scope(model.weight)
    assert torch.equal(weight, linear(0).weight)


# -- Files: missing, truncated, corrupt ------------------------------------------------------


def test_missing_truncated_and_corrupt_files_are_errors_naming_the_file(tmp_path: Path) -> None:
    checkpoint = Checkpoint(model=nn.Linear(64, 64))
    path = Path(checkpoint.write(tmp_path / "good"))
    data = path.read_bytes()
    with pytest.raises(FileNotFoundError, match=re.escape(f"No checkpoint file at "
                                                          f"{str(tmp_path / 'none')!r}")):
        checkpoint.read(tmp_path / "none")
    truncated = tmp_path / "truncated"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataLossError, match=re.escape(f"{str(truncated)!r} is truncated")):
        checkpoint.read(truncated)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(DataLossError, match="is truncated or is not a checkpoint"):
        checkpoint.read(empty)
    corrupt = tmp_path / "corrupt"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the weight's bytes: torch.load would not notice
    corrupt.write_bytes(bytes(flipped))
    with pytest.raises(DataLossError, match=re.escape(f"{str(corrupt)!r} is corrupt: its record")):
        checkpoint.read(corrupt)
    other = tmp_path / "other.pt"
    torch.save({"weight": torch.zeros(1)}, other)
    with pytest.raises(DataLossError, match=r"is not a cs\.Checkpoint file"):
        checkpoint.read(other)
    assert cs.errors.DataLossError is DataLossError


# -- CheckpointManager -----------------------------------------------------------------------


def names(paths: list[str]) -> list[str]:
    return [Path(p).name for p in paths]


def test_manager_keeps_max_to_keep_and_recovers_its_directory(tmp_path: Path) -> None:
    model = linear(0)
    manager = CheckpointManager(Checkpoint(model=model), tmp_path, max_to_keep=3)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    for _ in range(5):
        manager.save()
    assert names(manager.checkpoints) == ["ckpt-3", "ckpt-4", "ckpt-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-3", "ckpt-4",
                                                          "ckpt-5"]
    assert Path(manager.save(checkpoint_number=100) or "").name == "ckpt-100"
    assert names(manager.checkpoints) == ["ckpt-4", "ckpt-5", "ckpt-100"]
    # A new manager (a restarted job) finds them, and restores the latest.
    restarted = Checkpoint(model=linear(1))
    again = CheckpointManager(restarted, tmp_path, max_to_keep=3)
    assert names(again.checkpoints) == ["ckpt-4", "ckpt-5", "ckpt-100"]
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-100")
    assert restarted.save_counter == 6
    assert_same_state(restarted.model.state_dict(), model.state_dict())
    # A complete checkpoint the state file does not list (death between the two writes) is
    # adopted; a listed one that is gone is dropped.
    Checkpoint(model=model).write(tmp_path / "ckpt-101")
    (tmp_path / "ckpt-4").unlink()
    assert names(CheckpointManager(restarted, tmp_path).checkpoints) == ["ckpt-5", "ckpt-100",
                                                                         "ckpt-101"]


def test_max_to_keep_none_keeps_all_and_every_n_hours_keeps_some_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = linear(0)
    keep_all = CheckpointManager(Checkpoint(model=model), tmp_path / "all", max_to_keep=None)
    for _ in range(4):
        keep_all.save()
    assert names(keep_all.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]

    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    hourly = CheckpointManager(
        Checkpoint(model=model), tmp_path / "hourly", max_to_keep=1, keep_checkpoint_every_n_hours=1
    )
    for minutes in (10, 50, 70, 80, 130):  # saved at these minutes after the manager began
        now[0] = 1000.0 + 60 * minutes
        hourly.save()
    # ckpt-3 (minute 70) is the first one swept out an hour after the start: kept for good.
    assert names(hourly.checkpoints) == ["ckpt-5"]
    left = sorted(p.name for p in (tmp_path / "hourly").iterdir())
    assert left == ["checkpoint", "ckpt-3", "ckpt-5"]
    state = json.loads((tmp_path / "hourly" / "checkpoint").read_text())
    assert state["preserved"] == ["ckpt-3"]
    later = CheckpointManager(Checkpoint(model=model), tmp_path / "hourly", max_to_keep=1)
    assert names(later.checkpoints) == ["ckpt-5"]  # ckpt-3 stays out of the managed ones


def test_checkpoint_interval_saves_when_the_step_counter_advanced_enough(tmp_path: Path) -> None:
    step = torch.zeros((), dtype=torch.int64)
    manager = CheckpointManager(
        Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=3
    )
    written = []
    for _ in range(8):
        step += 1
        written.append(manager.save() is not None)
    assert written == [True, False, False, True, False, False, True, False]
    assert manager.save(check_interval=False) is not None  # the step moved since the last
    assert manager.save(check_interval=False) is None  # it did not
    assert manager.checkpoint_interval == 3


def test_restore_or_initialize_calls_init_fn_without_a_checkpoint(tmp_path: Path) -> None:
    calls: list[int] = []
    manager = CheckpointManager(
        Checkpoint(model=linear(0)), tmp_path, init_fn=lambda: calls.append(1)
    )
    assert manager.restore_or_initialize() is None and calls == [1]
    manager.save()
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1") and calls == [1]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive int"),
        ({"checkpoint_name": "a/b"}, ValueError, "without a separator"),
        ({"checkpoint_interval": 2}, ValueError, "needs one: pass step_counter="),
    ],
)
def test_manager_arguments_are_checked(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        CheckpointManager(Checkpoint(model=linear(0)), tmp_path, **kwargs)
    with pytest.raises(TypeError, match=r"takes a cs\.Checkpoint"):
        CheckpointManager(linear(0), tmp_path)  # type: ignore[arg-type]


def test_a_damaged_state_file_falls_back_to_the_files(tmp_path: Path) -> None:
    manager = CheckpointManager(Checkpoint(model=linear(0)), tmp_path)
    manager.save()
    manager.save()
    (tmp_path / "checkpoint").write_text("{ not json")
    with pytest.warns(UserWarning, match="Ignoring the checkpoint manager's state file"):
        again = CheckpointManager(Checkpoint(model=linear(0)), tmp_path)
    assert names(again.checkpoints) == ["ckpt-1", "ckpt-2"]


def test_a_damaged_latest_checkpoint_is_named_and_deleting_it_resumes_the_previous(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(Checkpoint(model=linear(0)), tmp_path)
    manager.save()
    latest = Path(manager.save() or "")
    latest.write_bytes(latest.read_bytes()[:100])
    with pytest.raises(DataLossError, match=re.escape(f"{str(latest)!r} is truncated")):
        CheckpointManager(Checkpoint(model=linear(1)), tmp_path).restore_or_initialize()
    latest.unlink()
    assert CheckpointManager(Checkpoint(model=linear(1)), tmp_path).restore_or_initialize() == (
        str(tmp_path / "ckpt-1")
    )


# -- RNGState ----------------------------------------------------------------------------------


def test_rng_state_restores_torch_numpy_and_python() -> None:
    state = RNGState()
    saved = state.state_dict()
    draws = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    state.load_state_dict(saved)
    again = (torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1])
    assert draws[2:] == again[2:]
    with pytest.raises(ValueError, match=r"\['numpy', 'python'\] are missing"):
        state.load_state_dict({"torch": saved["torch"], "cuda": []})


# -- Killed with SIGKILL and resumed ------------------------------------------------------------


def run_worker(out: Path, pipeline: str, replicas: int, kill_after: int, *extra: str) -> int:
    command = [sys.executable, str(WORKER), str(out), pipeline, str(replicas), str(kill_after)]
    result = subprocess.run(
        [*command, *extra], env=ENV, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode in (0, -signal.SIGKILL), result.stderr
    return result.returncode


def uninterrupted(pipeline: str, replicas: int) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: the same arithmetic
    try:
        strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
        return helper.train(strategy, pipeline, None, -1, False)
    finally:
        torch.set_num_threads(threads)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("pipeline", "before", "after"), [("global", 2, 2), ("function", 2, 3)]
)
def test_training_killed_after_a_step_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, pipeline: str, before: int, after: int
) -> None:
    """Killed after step 4 (the last save was after step 3): the resumed run redoes step 4 from
    the restored iterator position, optimizer, schedule and random state."""
    assert run_worker(tmp_path, pipeline, before, 4) == -signal.SIGKILL
    assert names(sorted(map(str, (tmp_path / "ckpts").glob("ckpt-*")))) == ["ckpt-1", "ckpt-2"]
    assert run_worker(tmp_path, pipeline, after, -1) == 0
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    expected = uninterrupted(pipeline, before)
    assert max_difference(resumed, expected) <= 1e-5
    if before == after:  # the same replicas: the same operations in the same order
        assert max_difference(resumed, expected) == 0.0


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint_latest(
    tmp_path: Path,
) -> None:
    assert run_worker(tmp_path, "global", 2, 5, "torn") == -signal.SIGKILL
    directory = tmp_path / "ckpts"
    torn = [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert len(torn) == 1 and torn[0].startswith(".ckpt-3."), torn  # the interrupted write
    manager = CheckpointManager(Checkpoint(), directory)
    assert Path(manager.latest_checkpoint or "").name == "ckpt-2"
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())  # cleaned up
    assert run_worker(tmp_path, "global", 2, -1) == 0
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    assert max_difference(resumed, uninterrupted("global", 2)) == 0.0
