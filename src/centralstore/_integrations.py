"""Optional integrations with other libraries, found by entry point.

An integration (``centralstore.keras``, ``centralstore.metrics``) is a function of no
argument that a package declares in the entry-point group ``centralstore.integrations``.
Each is called whenever a strategy's scope is entered or left, and installs what it needs
once the library it serves has been imported (it returns at once otherwise). So the core
imports none of them, and a user's code needs no import beyond ``centralstore`` and the
library itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib import metadata

GROUP = "centralstore.integrations"
_hooks: list[Callable[[], None]] = []
_loaded: list[bool] = []


def activate() -> None:
    """Call every integration (loaded on the first call)."""
    if not _loaded:
        _loaded.append(True)
        for entry in metadata.entry_points(group=GROUP):
            try:
                _hooks.append(entry.load())
            except Exception as error:  # a broken integration must not break scope()
                warnings.warn(
                    f"centralstore could not load its integration {entry.name!r} "
                    f"({entry.value}): {error!r}. Strategies work without it.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    for hook in _hooks:
        hook()
