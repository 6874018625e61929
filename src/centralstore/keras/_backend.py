"""Keras 3 on PyTorch: the optional dependency of ``centralstore.keras``, loaded with checks.

Keras reads its backend once, when it is first imported: from the environment variable
``KERAS_BACKEND``, else from ``~/.keras/keras.json``, else TensorFlow. So ``load`` sets
``KERAS_BACKEND=torch`` when Keras has not been imported yet and no backend was asked for,
and refuses a Keras loaded on another backend: its variables would not be torch tensors, and
no strategy could hold them.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType

# The Keras minor versions the hook (``_hook.py``) was tested against; pyproject.toml's
# ``keras`` extra allows the same range.
TESTED = ((3, 8), (3, 15))
EXTRA = "pip install 'centralstore[keras]'"


def loaded_on_torch() -> bool:
    """Whether Keras is imported already, on the torch backend (then the hook can act)."""
    keras = sys.modules.get("keras")
    if keras is None:
        return False
    config = getattr(keras, "config", None)
    return config is not None and bool(config.backend() == "torch")


def load() -> ModuleType:
    """Keras, imported on the torch backend.

    Raises ``ModuleNotFoundError`` naming the extra when Keras is not installed, and
    ``RuntimeError`` when Keras is (or is about to be) loaded on another backend.
    """
    if "keras" not in sys.modules:
        requested = os.environ.get("KERAS_BACKEND")
        if requested is None:
            os.environ["KERAS_BACKEND"] = "torch"
        elif requested != "torch":
            raise RuntimeError(
                "centralstore.keras distributes Keras on its PyTorch backend, but the "
                f"environment asks for another one. Set KERAS_BACKEND=torch before Keras is "
                f"imported. Received: KERAS_BACKEND={requested!r}"
            )
    try:
        import keras
    except ModuleNotFoundError as error:
        if error.name != "keras":
            raise
        raise ModuleNotFoundError(
            "centralstore.keras needs Keras 3, an optional dependency of centralstore. "
            f"Install it with: {EXTRA}. Received: no module named 'keras'",
            name="keras",
        ) from None
    backend = keras.config.backend()
    if backend != "torch":
        raise RuntimeError(
            "Keras was imported on a backend other than PyTorch, so its variables are not "
            "torch tensors and a centralstore strategy cannot hold them. Set "
            "KERAS_BACKEND=torch before the first `import keras` (Keras reads it once). "
            f"Received: keras.config.backend()={backend!r}"
        )
    _check_version(keras.__version__)
    return sys.modules["keras"]


def _check_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and not TESTED[0] <= parts <= TESTED[1]:
        low, high = (f"{major}.{minor}" for major, minor in TESTED)
        warnings.warn(
            f"centralstore.keras hooks Keras' PyTorch trainer and was tested with Keras "
            f"{low} to {high}; it may not work with this one. Received: "
            f"keras.__version__={version!r}",
            RuntimeWarning,
            stacklevel=3,
        )
