"""The argument checks that ``Dataset``'s sources and transformations share.

Each names the public call and the argument, as every error of the package does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._base import DatasetBase
from .data_options import AUTOTUNE
from .options import as_int


def check_count(call: str, name: str, value: Any, minimum: int) -> int:
    """An int argument of at least ``minimum`` (1: a size; -1: a count where -1 means all).

    >>> check_count("Dataset.take", "count", 3, minimum=-1)
    3
    """
    number = as_int(name, value, call)
    if number < minimum:
        meaning = "a positive int" if minimum == 1 else ">= 0, or -1 for all"
        raise ValueError(f"{call}({name}) must be {meaning}. Received: {name}={number}")
    return number


def check_parallelism(call: str, value: Any) -> None:
    """``num_parallel_calls``: None, ``AUTOTUNE`` or a positive int (work runs in order)."""
    if value is not None and as_int("num_parallel_calls", value, call) != AUTOTUNE:
        check_count(call, "num_parallel_calls", value, minimum=1)


def seed_or_draw(call: str, seed: int | None) -> int:
    """``seed``, or one drawn from torch's global generator (``torch.manual_seed`` fixes it)."""
    if seed is None:
        return int(torch.randint(0, 2**62, ()).item())
    return as_int("seed", seed, call)


def check_datasets(call: str, argument: str, members: Sequence[Any], received: Any) -> list[Any]:
    """``members`` when it is a non-empty sequence of datasets, else ``TypeError``."""
    if not members or not all(isinstance(m, DatasetBase) for m in members):
        raise TypeError(
            f"{call}({argument}) needs a non-empty structure of Datasets. "
            f"Received: {argument}={received!r}"
        )
    return list(members)
