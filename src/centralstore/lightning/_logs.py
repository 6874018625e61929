"""``self.log`` inside a replicated step: recorded per replica, then logged once, combined.

Lightning accumulates what a step logs as one value per step (weighted by the batch size
for epoch means). If every replica called ``self.log`` itself, a step would log R values,
each weighted by the whole batch's size, and the step's value would be the last replica's.
So while the replicas run, ``self.log`` (and ``self.log_dict``, which calls it) only records
each replica's call; afterwards each name is logged once, with the value one device would
have logged for the whole batch, following the call's ``reduce_fx``:

* ``"mean"`` (the default): the value is taken to be a mean over the replica's slice (a loss,
  an accuracy), and the replicas' values are averaged weighted by their slice sizes;
* ``"sum"``: a sum over the slice (a count), summed over the replicas;
* ``"max"`` / ``"min"``: the largest / smallest of the replicas' values.

A ``batch_size=`` given by every replica's call is summed (the global batch's size). A
torchmetrics ``Metric`` logged as the value is the same object on every replica and is
logged once as it is.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..strategies.context import get_replica_context
from ._batches import total, weighted_mean

_MEAN = ("mean", "avg", torch.mean)
_SUM = ("sum", torch.sum)
_MAX = ("max", torch.max, torch.amax)
_MIN = ("min", torch.min, torch.amin)


class LogSignature:
    """The signature of a ``log`` method without ``self``, and the keywords its usual call,
    ``log(name, value, ...)``, may pass (worked out once: a recorder is made per step)."""

    def __init__(self, log: Callable[..., Any]) -> None:
        parameters = list(inspect.signature(log).parameters.values())[1:]
        self.signature = inspect.Signature(parameters)
        keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.options = frozenset(p.name for p in parameters if p.kind in keywords) - {
            "name", "value"
        }


class LogRecorder:
    """The ``self.log`` calls of each replica of one step."""

    def __init__(self, num_replicas: int, signature: LogSignature) -> None:
        self.calls: list[list[tuple[str, Any, dict[str, Any]]]] = [[] for _ in range(num_replicas)]
        self._lock = threading.Lock()
        self._signature = signature

    def log(self, *args: Any, **kwargs: Any) -> None:
        """Stands for ``LightningModule.log`` while the replicas run."""
        if len(args) == 2 and self._signature.options.issuperset(kwargs):
            (name, value), bound = args, kwargs  # what binding gives, without its ~60 lines
        else:
            bound = self._signature.signature.bind(*args, **kwargs).arguments
            name, value = bound.pop("name"), bound.pop("value")
        context = get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        with self._lock:
            self.calls[replica].append((name, value, dict(bound)))

    @contextmanager
    def installed(self, module: Any) -> Iterator[None]:
        """``module.log`` records into this recorder inside the block. (In the module's
        ``__dict__`` directly: ``nn.Module``'s ``__setattr__`` and ``__delattr__`` would run
        their Python at every step.)"""
        attributes = vars(module)
        had = "log" in attributes
        before = attributes.get("log")
        attributes["log"] = self.log
        try:
            yield
        finally:
            if had:
                attributes["log"] = before
            else:
                del attributes["log"]

    def replay(
        self, log: Callable[..., None], sizes: Sequence[int], device: torch.device
    ) -> None:
        """Log every recorded name once through ``log``, the replicas' values combined."""
        order: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
        for replica, calls in enumerate(self.calls):
            for name, value, kwargs in calls:
                order.setdefault(name, []).append((replica, value, kwargs))
        for name, entries in order.items():
            kwargs = dict(entries[0][2])
            values = [value for _, value, _ in entries]
            if not isinstance(values[0], (torch.Tensor, int, float)):
                log(name, values[0], **kwargs)  # a Metric: one object for all replicas
                continue
            weights = [sizes[replica] for replica, _, _ in entries]
            given = [e[2].get("batch_size") for e in entries]
            if all(b is not None for b in given):
                weights = [int(b) for b in given if b is not None]
                kwargs["batch_size"] = sum(weights)
            else:
                kwargs.pop("batch_size", None)
            log(name, _reduce(name, kwargs.get("reduce_fx", "mean"), values, weights, device),
                **kwargs)


def _reduce(
    name: str, reduce_fx: Any, values: list[Any], weights: list[int], device: torch.device
) -> Any:
    if len(values) == 1:
        return values[0]
    if reduce_fx in _MEAN:
        return weighted_mean(values, weights, device)
    if reduce_fx in _SUM:
        return total(values, device)
    if reduce_fx in _MAX or reduce_fx in _MIN:
        stacked = torch.stack([torch.as_tensor(v).detach().to(device) for v in values])
        return stacked.amax(0) if reduce_fx in _MAX else stacked.amin(0)
    raise ValueError(
        f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): centralstore.lightning combines "
        "the replicas' values by reduce_fx 'mean', 'sum', 'max' or 'min' only."
    )
