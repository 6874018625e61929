"""Tests of centralstore.lightning; helpers are in lightning_models.py (importable as
``lightning_models``: ``tests/lightning`` cannot be a package, it would shadow Lightning)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # Lightning's advice about DataLoader workers and logging intervals, not ours.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*number of training batches.*smaller than the logging.*")
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", ".*but have no `val_dataloader`.*")
