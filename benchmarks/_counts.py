"""Command-line counts for the benchmark scripts: ``--rounds 0`` is refused by argparse with
the option's name, instead of failing later on an empty median."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``minimum``.

    >>> at_least(1)("3")
    3
    """

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return count
