"""Lightning, imported once for the integration, with an error naming the extra if absent."""

from __future__ import annotations

from typing import Any


def load() -> Any:
    """``lightning.pytorch``; ``ModuleNotFoundError`` naming ``centralstore[lightning]`` when
    Lightning 2 is not installed.

    >>> load().__name__
    'lightning.pytorch'
    """
    try:
        import lightning.pytorch as pl
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "centralstore.lightning needs Lightning 2 (the `lightning` package, "
            "`lightning.pytorch`), which is not installed. Install it with: "
            "pip install 'centralstore[lightning]'"
        ) from error
    return pl
