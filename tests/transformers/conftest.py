"""Hugging Face transformers for these tests, offline; helpers are in hf_models.py (importable
as ``hf_models``: ``tests/transformers`` cannot be a package, it would shadow transformers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # every model is built from a config, never downloaded
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

transformers.logging.set_verbosity_error()
