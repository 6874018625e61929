"""The replica paths that the parity matrix runs every test through (docs/design.md §5.9).

* ``direct``: replicas on logical CPU devices compute on the parameters themselves;
* ``views``: the same replicas see views of every parameter, as GPU replicas away from the
  parameter device do;
* ``threads``: ``direct``, with a step that starts with a rendezvous, so that replicas 1..R-1
  run on replica threads and hand a baton around.

A test that passes on one path and fails on another is a bug in the paths, not a skip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
from replicas import context, strategy_of

import centralstore as cs

if TYPE_CHECKING:
    import fakegpu

PATHS = ["direct", "views", "threads"]
each_path = pytest.mark.parametrize("path", PATHS)


def strategy_on(path: str, replicas: int = 2) -> cs.CentralStorageStrategy:
    return strategy_of(replicas, direct=path != "views")


def step_on(path: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, started by a rendezvous on the ``threads`` path."""
    if path != "threads":
        return fn

    def step(*args: Any, **kwargs: Any) -> Any:
        context().all_reduce("SUM", 0.0)
        return fn(*args, **kwargs)

    return step


def run_on(
    path: str, strategy: cs.Strategy, fn: Callable[..., Any], args: tuple[Any, ...] = ()
) -> Any:
    return strategy.run(step_on(path, fn), args=args)


@dataclass(frozen=True)
class FakePlacement:
    """Two fake GPUs and where a parity test puts its strategy's variables."""

    gpus: fakegpu.FakeGPUs | None  # None: real GPUs
    compute_devices: tuple[str, ...]
    parameter_device: str
