"""Keras on PyTorch for these tests, with the hook installed; helpers are in keras_models.py
(importable as ``keras_models``: ``tests/keras`` cannot be a package, it would shadow Keras)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is first imported
sys.path.insert(0, str(Path(__file__).parent))

import keras

import centralstore.keras

centralstore.keras.install()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    keras.utils.set_random_seed(0)
