"""examples/keras_fit.py, TensorFlow's "Distributed training with Keras" tutorial ported, runs
to completion and does what it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "keras_fit.py"


def test_keras_fit_example(tmp_path: Path) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "torch"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False, env=environment,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if torch.cuda.device_count() == 0:
        assert "Number of devices: 2" in lines
    assert "Learning rate for epoch 1 is 1e-02" in lines
    assert "Learning rate for epoch 4 is 1e-03" in lines
    evaluation = next(line for line in lines if line.startswith("Eval loss:"))
    assert float(evaluation.rsplit(maxsplit=1)[1]) > 0.9
    difference = next(line for line in lines if line.startswith("Largest difference"))
    assert float(difference.rsplit(maxsplit=1)[1]) < 1e-6  # float32 rounding at most
    checkpoints = sorted(p.name for p in (tmp_path / "training_checkpoints").iterdir())
    assert checkpoints == [f"ckpt_{epoch}.weights.h5" for epoch in (1, 2, 3, 4)]
    assert (tmp_path / "saved_model" / "digits.keras").is_file()
    assert len((tmp_path / "logs.csv").read_text().splitlines()) == 5  # a header, 4 epochs
