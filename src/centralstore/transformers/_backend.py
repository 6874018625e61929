"""Hugging Face ``transformers`` and ``accelerate``: the optional dependencies of
``centralstore.transformers``, loaded with checks."""

from __future__ import annotations

import warnings
from types import ModuleType

# The transformers minor versions the Trainer subclass (``_trainer.py``) was tested with: it
# overrides Trainer methods whose private signatures change between releases.
TESTED = ((5, 24), (5, 24))
EXTRA = "pip install 'centralstore[transformers]'"


def load() -> ModuleType:
    """``transformers``, imported, with ``accelerate`` (which its Trainer needs).

    Raises ``ModuleNotFoundError`` (an ``ImportError``) naming the extra
    ``centralstore[transformers]`` when either is not installed.
    """
    for name in ("transformers", "accelerate"):
        try:
            module = __import__(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            raise ModuleNotFoundError(
                "centralstore.transformers needs Hugging Face transformers and accelerate, "
                f"optional dependencies of centralstore. Install them with: {EXTRA}. "
                f"Received: no module named {name!r}",
                name=name,
            ) from None
        if name == "transformers":
            transformers = module
    _check_version(str(transformers.__version__))
    return transformers


def _check_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and not TESTED[0] <= parts <= TESTED[1]:
        low, high = (f"{major}.{minor}" for major, minor in TESTED)
        tested = low if low == high else f"{low} to {high}"
        warnings.warn(
            f"centralstore.transformers overrides methods of transformers.Trainer and was "
            f"tested with transformers {tested}; it may not work with this one. Received: "
            f"transformers.__version__={version!r}",
            RuntimeWarning,
            stacklevel=3,
        )
