"""Keras 3 on PyTorch under a strategy: ``fit``, ``evaluate`` and ``predict`` distributed.

TensorFlow code that trains a Keras model under a strategy ports by setting
``KERAS_BACKEND=torch`` and renaming the strategy: a model whose variables were created
inside ``strategy.scope()`` trains with every global batch split over the replicas, the
replicas' gradients summed onto its central variables and the optimizer applied once per
step; its metrics aggregate over the replicas as one device's would on the whole batch.

This integration installs itself when a strategy's scope is entered after Keras was
imported (``activate``, found by centralstore through the entry point
``centralstore.integrations``), so user code imports nothing from here. ``install`` and
``uninstall`` do it by hand; the hook acts only for models whose variables belong to a
strategy, and ``uninstall`` restores Keras exactly. Keras is an optional dependency:
``pip install 'centralstore[keras]'``.

>>> import centralstore.keras
>>> centralstore.keras.install()
>>> centralstore.keras.installed()
True
"""

from __future__ import annotations

import sys

from . import _backend


def activate() -> None:
    """Install the hook if Keras is imported on its PyTorch backend; otherwise do nothing.

    centralstore calls it whenever a strategy's scope is entered or left.
    """
    if not installed() and _backend.loaded_on_torch():
        install()


def install() -> None:
    """Hook Keras' PyTorch backend (once): Keras models whose variables belong to a strategy
    train, evaluate and predict under it. Imports Keras, setting ``KERAS_BACKEND=torch`` if
    Keras is not imported yet and no backend was asked for.

    Raises ``ModuleNotFoundError`` (naming the extra ``centralstore[keras]``) when Keras is
    not installed, and ``RuntimeError`` when Keras runs on another backend.
    """
    _backend.load()
    from . import _hook

    _hook.install()


def uninstall() -> None:
    """Undo ``install``: Keras is as it was before (until the next scope entered activates
    the hook again)."""
    hook = sys.modules.get(f"{__name__}._hook")
    if hook is not None:
        hook.uninstall()


def installed() -> bool:
    """Whether the hook is installed."""
    hook = sys.modules.get(f"{__name__}._hook")
    return hook is not None and bool(hook.installed())


__all__ = ["activate", "install", "installed", "uninstall"]
