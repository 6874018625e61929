"""torchmetrics metrics updated inside ``strategy.run``, aggregated by their ``dist_reduce_fx``.

A ``torchmetrics.Metric`` keeps its states as plain attributes (tensors, or lists for
``dist_reduce_fx="cat"``), not as buffers, so they are no central variables. Inside ``run``
each replica therefore updates a copy of its own: ``update`` and ``forward`` swap in the
replica's copy (fresh default states, on the device of the replica's inputs) and swap it out
again, under a lock, so that replicas on threads never share a state. At each sync point of
the strategy (the end of ``run``, ``merge_call``) the copies fold into the metric in replica
order, each state by its own ``dist_reduce_fx``, as torchmetrics merges the states of
several processes:

* ``"sum"`` adds, ``"max"`` and ``"min"`` take the extreme, ``"cat"`` appends (replica order
  is the batch's order, so the metric equals one device updated with the whole batch);
* ``"mean"`` averages the replicas' values of the step and merges that into the running
  value as ``Metric.merge_state`` does (exact when the slices are equal).

The update count grows by one per step, as on one device. A process's only replica
that computes where the metric's states live (one replica on the CPU or on the GPU that holds
them) has nothing to isolate: it updates the states themselves, as one device does, and the
first update after a sync point keeps a copy of them (and of the update count) that a failed
run puts back; the sync point folds nothing. A forward (``metric(preds,
target)``) returns its replica's slice's value; the step's value it caches, which Lightning
logs with ``on_step=True``, is the whole batch's when every replica made one forward in the
run. A run that fails leaves no trace in the metric: its copies are dropped. Custom
reductions (a function, or None) cannot be folded this way and raise. A
``MetricCollection`` updated first inside a replica forms its compute groups at the sync
point, from the folded states (``_FirstGroups``). Across worker processes, torchmetrics'
own synchronization in ``compute`` combines the workers' metrics.

The integration installs itself when a strategy's scope is entered after torchmetrics was
imported, and acts only inside a replica; ``install``/``uninstall`` do it by hand. It needs
``pip install 'centralstore[metrics]'``.

>>> import torch, torchmetrics, centralstore as cs
>>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     total = torchmetrics.SumMetric()
>>> _ = strategy.run(total.update, args=(cs.PerReplica([torch.tensor(1.0), torch.tensor(2.0)]),))
>>> total.compute()
tensor(3.)
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import torch

from . import _tree
from ._autograd import no_grad
from .strategies.context import get_replica_context, has_strategy
from .variables.folding import brought_to
from .variables.store import current_store

EXTRA = "pip install 'centralstore[metrics]'"
_applied: list[tuple[type, str, Any]] = []  # (torchmetrics class, attribute, its original)
_states: dict[int, _ReplicaStates] = {}  # id(metric) -> its replicas' copies
_groups: dict[int, _FirstGroups] = {}  # id(collection) -> its groups' forming, at a sync point


def activate() -> None:
    """Install the integration if torchmetrics is imported; centralstore calls it whenever a
    strategy's scope is entered or left."""
    if not _applied and "torchmetrics" in sys.modules:
        install()


def install() -> None:
    """Make every torchmetrics ``Metric`` created from now on aggregate over replicas when
    updated inside ``strategy.run`` (once). ``ModuleNotFoundError`` naming the extra when
    torchmetrics is missing."""
    if _applied:
        return
    try:
        from torchmetrics import Metric, MetricCollection
    except ModuleNotFoundError as error:
        if error.name != "torchmetrics":
            raise
        raise ModuleNotFoundError(
            "centralstore.metrics needs torchmetrics, an optional dependency of centralstore. "
            f"Install it with: {EXTRA}. Received: no module named 'torchmetrics'",
            name="torchmetrics",
        ) from None
    original_wrap, original_forward = Metric._wrap_update, Metric.forward
    original_collection_update = MetricCollection.update

    def _wrap_update(self: Any, update: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = original_wrap(self, update)

        @functools.wraps(update)
        def replica_aware(*args: Any, **kwargs: Any) -> Any:
            if _in_replica():
                return _kept_for(_states, self, _ReplicaStates).isolated(wrapped, args, kwargs)
            return wrapped(*args, **kwargs)

        return replica_aware

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_replica():
            return _kept_for(_states, self, _ReplicaStates).isolated(
                functools.partial(original_forward, self), args, kwargs, forward=True
            )
        return original_forward(self, *args, **kwargs)

    def update(self: Any, *args: Any, **kwargs: Any) -> None:
        if not self._groups_checked and self._enable_compute_groups and _in_replica():
            _kept_for(_groups, self, _FirstGroups).update(args, kwargs)
        else:
            original_collection_update(self, *args, **kwargs)

    for cls, name, replacement in (
        (Metric, "_wrap_update", _wrap_update), (Metric, "forward", forward),
        (MetricCollection, "update", update),
    ):
        _applied.append((cls, name, vars(cls)[name]))
        setattr(cls, name, replacement)


def uninstall() -> None:
    """Restore torchmetrics' ``Metric`` and ``MetricCollection``. Metrics created while it
    was installed keep their replica-aware ``update``."""
    while _applied:
        cls, name, original = _applied.pop()
        setattr(cls, name, original)


def installed() -> bool:
    """Whether the integration is installed."""
    return bool(_applied)


def _in_replica() -> bool:
    return has_strategy() and get_replica_context() is not None


_Kept = TypeVar("_Kept")


def _find_kept(table: dict[int, _Kept], owner: Any, make: Callable[[Any], _Kept]) -> _Kept:
    """``table``'s entry for ``owner`` (by id): ``make(owner)`` at its first use, dropped
    when ``owner`` dies (metrics and collections are modules: no weak dictionary keys)."""
    key = id(owner)
    kept = table.get(key)
    if kept is None:
        kept = table[key] = make(owner)
        weakref.finalize(owner, table.pop, key, None)
    return kept


# torch.compile leaves the tables to Python: traced, the first use's ``weakref.finalize``
# read the registry of every finalizer while the collector could change it ("dictionary
# changed size during iteration", once in a full suite). (torch's lazy ``disable``, as
# ``views._on_views``: it imports torch._dynamo only when a compilation calls it.)
_kept_for: Callable[[dict[int, Any], Any, Callable[[Any], Any]], Any] = (
    torch._disable_dynamo(_find_kept)  # type: ignore[attr-defined]
)


class _FirstGroups:
    """A ``MetricCollection``'s compute groups, formed at the sync point after its first
    update inside a replica (the store's fold hook).

    torchmetrics forms them right after the first update, by comparing the metrics' states:
    those equal share one state from then on, and only the first of each group is updated.
    Inside a replica the states it would compare are the metric's own, which its update left
    as they were (the update went to the replica's copy), so every metric of the same state
    names would look alike and share states that differ. So the first update inside a
    replica updates every metric, as torchmetrics' does, and the sync point folds the
    metrics' copies first, then forms the groups from the folded states: from the whole
    batch, as one device would."""

    def __init__(self, collection: Any) -> None:
        self._collection = weakref.ref(collection)

    def update(self, args: Any, kwargs: Any) -> None:
        collection: Any = self._collection()  # alive: it is the one being updated
        for metric in collection.values(copy_state=False):
            metric.update(*args, **metric._filter_kwargs(**kwargs))
        current_store().fold_later(self)

    def fold(self, discard: bool) -> None:
        collection = self._collection()
        if collection is None:
            return
        for metric in collection.values(copy_state=False):
            states = _states.get(id(metric))
            if states is not None:  # (its own hook then finds nothing left to fold)
                states.fold(discard)
        if discard or collection._groups_checked:
            return
        collection._merge_compute_groups()
        collection._state_is_copy = False
        collection._compute_groups_create_state_ref()
        collection._groups_checked = True


class _Copy:
    """One replica's copy of a metric's states since the last sync point, made on
    ``device`` when that is not the metric's (else None: the metric's own states too)."""

    __slots__ = ("count", "device", "states")

    def __init__(self, states: dict[str, Any], count: int, device: torch.device | None) -> None:
        self.states = states
        self.count = count
        self.device = device


class _ReplicaStates:
    """The replicas' copies of one metric's states, and their fold at a sync point (the
    store's fold hook).

    A forward's value is its replica's slice's, as each replica's output is; the metric's
    ``_forward_cache``, the step's value that Lightning logs with ``on_step=True``, is the
    whole batch's when every replica made one forward in the run and nothing else: the sync
    point of several replicas computes it from their copies (each holds just its slice
    then), as one device's forward computes it from the batch alone. Otherwise (several
    forwards in a run) it stays the last replica's."""

    def __init__(self, metric: Any) -> None:
        self._metric = weakref.ref(metric)
        self._lock = threading.RLock()
        self._depth = 0  # > 0 while a replica's copy is swapped in (forward calls update)
        self._copies: dict[int, _Copy] = {}
        self._forwards: set[int] = set()  # the replicas whose copy a forward updated
        self._before: _Before | None = None  # the states before this interval's own updates

    def isolated(
        self, fn: Callable[..., Any], args: Any, kwargs: Any, forward: bool = False
    ) -> Any:
        """``fn(*args, **kwargs)`` on the calling replica's copy of the states (``forward``:
        ``fn`` is the metric's forward), or on the states themselves for a process's only
        replica computing where they live (``_alone``)."""
        with self._lock:
            if self._depth:
                return fn(*args, **kwargs)
            metric: Any = self._metric()  # alive: it is the one being updated
            _check_reductions(metric)
            if _alone(metric, args, kwargs):
                if self._before is None:  # the interval's first update: what a failure restores
                    self._before = _Before(metric)
                    current_store().fold_later(self)
                self._depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1
            replica = get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
            if forward:
                self._forwards.add(replica)
            copy = self._copies.get(replica) or _fresh(metric, args, kwargs)
            attributes = vars(metric)
            computed = attributes["_computed"]
            own = _copy_of(metric)
            _swap(metric, copy)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._copies[replica] = _copy_of(metric, copy.device)
                _swap(metric, own)
                attributes["_computed"] = computed
                current_store().fold_later(self)

    def fold(self, discard: bool) -> None:
        with self._lock:
            copies, self._copies = self._copies, {}
            forwards, self._forwards = self._forwards, set()
            before, self._before = self._before, None
        metric = self._metric()
        if discard and before is not None and metric is not None:
            before.restore(metric)
        if discard or metric is None or not copies:
            return
        ordered = [copies[replica] for replica in sorted(copies)]
        if any(map(_away, ordered)):
            _bring(metric, ordered)
        batch = None  # (one replica's forward has cached the batch's value already)
        if len(ordered) > 1 and forwards.issuperset(copies) and all(
            c.count == 1 for c in ordered
        ):
            batch = _batch_value(metric, ordered)
        with no_grad():
            for name in metric._defaults:
                _fold_state(metric, name, [c.states[name] for c in ordered])
        attributes = vars(metric)
        attributes["_update_count"] += max(c.count for c in ordered)
        attributes["_computed"] = None
        if batch is not None:
            attributes["_forward_cache"] = batch


def _batch_value(metric: Any, ordered: list[_Copy]) -> Any:
    """The metric's value over the copies ``ordered`` alone (this run's slices, in replica
    order), computed as its forward computes a batch's, and never synchronized across
    processes, even with ``dist_sync_on_step``: a sync point's collective here could wait
    for a worker whose run failed, which folds nothing."""
    attributes = vars(metric)
    own, computed = _copy_of(metric), attributes["_computed"]
    kept = {name: attributes[name] for name in ("_to_sync", "_should_unsync")}
    _swap(metric, _fresh(metric, (), {}))
    try:
        with no_grad():
            for name in metric._defaults:
                _fold_state(metric, name, [c.states[name] for c in ordered])
        attributes["_update_count"] = 1
        attributes["_computed"] = None
        attributes["_to_sync"] = False
        attributes["_should_unsync"] = False
        return metric.compute()
    finally:
        _swap(metric, own)
        attributes.update(kept)
        attributes["_computed"] = computed


# A metric's states, its update count and its computed value are plain attributes of the
# instance (``add_state`` makes no buffer of them): they are read and written in its
# ``__dict__``, past ``nn.Module.__setattr__``'s checks for parameters, buffers and modules,
# which cost more than the rest of a swap.


_away = attrgetter("device")  # (a copy's device, None at home: any() reads it in C)


def _copy_of(metric: Any, device: torch.device | None = None) -> _Copy:
    """The metric's states and update count as they are now (``device``: those of a
    replica's copy made there)."""
    attributes = vars(metric)
    return _Copy({n: attributes[n] for n in metric._defaults}, attributes["_update_count"], device)


def _swap(metric: Any, copy: _Copy) -> None:
    attributes = vars(metric)
    attributes.update(copy.states)
    attributes["_update_count"] = copy.count


def _input_device(args: Any, kwargs: Any) -> torch.device | None:
    """The device of the replica's first input tensor, if it gives one."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)  # (the usual case)
    if first is None:
        tensors = (t for t in _tree.leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        first = next(tensors, None)
    return None if first is None else first.device


def _alone(metric: Any, args: Any, kwargs: Any) -> bool:
    """Whether the replica calling is its process's only one and its inputs are where the
    metric and its states are (or it gives none): it can update the states as one device
    does. (Elsewhere its copies live where the inputs do, and fold into the metric's device:
    a "cat" state's items too.)"""
    if current_store().placement.local_replicas != 1:
        return False
    device = _input_device(args, kwargs)
    if device is None:
        return True
    if device != metric.device:
        return False
    attributes = vars(metric)
    states = (attributes[name] for name in metric._defaults)
    return all(state.device == device for state in states if isinstance(state, torch.Tensor))


class _Before:
    """A metric's states, update count and computed value before the updates that a process's
    only replica made to them since the last sync point: what a failed run puts back (in
    place, where a metric of a compute group shares a state with others)."""

    __slots__ = ("computed", "count", "states")

    def __init__(self, metric: Any) -> None:
        attributes = vars(metric)
        self.states: dict[str, tuple[Any, Any]] = {}  # name -> (the state, its value)
        with no_grad():
            for name in metric._defaults:
                state = attributes[name]
                value = state.clone() if isinstance(state, torch.Tensor) else list(state)
                self.states[name] = (state, value)
        self.count = attributes["_update_count"]
        self.computed = attributes["_computed"]

    def restore(self, metric: Any) -> None:
        attributes = vars(metric)
        with no_grad():
            for name, (state, value) in self.states.items():
                if isinstance(state, list):
                    state[:] = value
                else:
                    state.copy_(value)
                attributes[name] = state
        attributes["_update_count"] = self.count
        attributes["_computed"] = self.computed


def _fresh(metric: Any, args: Any, kwargs: Any) -> _Copy:
    """Default states on the device of the replica's first input tensor (else the metric's):
    on another device than the metric's (a GPU replica's, of a metric on the host) the
    defaults go in one copy per dtype (``folding.brought_to``)."""
    device = _input_device(args, kwargs)
    home = metric.device  # (where its defaults are: torchmetrics moves them with it)
    if device is None or device == home:
        states: dict[str, Any] = {
            name: default.clone() if isinstance(default, torch.Tensor) else []
            for name, default in metric._defaults.items()
        }
        return _Copy(states, 0, None)
    defaults = metric._defaults
    names = [name for name, default in defaults.items() if isinstance(default, torch.Tensor)]
    tensors = [defaults[name] for name in names]
    if _strided(tensors):
        moved = brought_to(device, tensors)
        fresh = [t.clone() if t is default else t for t, default in zip(moved, tensors)]
    else:
        fresh = [tensor.to(device, copy=True) for tensor in tensors]
    made = iter(fresh)
    states = {
        name: next(made) if isinstance(default, torch.Tensor) else []
        for name, default in defaults.items()
    }
    return _Copy(states, 0, device)


def _bring(metric: Any, ordered: list[_Copy]) -> None:
    """The copies' tensor states, from their replicas' devices to where the metric's are,
    in one copy per dtype and replica (``folding.brought_to``), where ``_fold_state`` would
    move each alone: from a GPU to the host, a wait for the GPU each."""
    attributes = vars(metric)
    names = [name for name in metric._defaults if isinstance(attributes[name], torch.Tensor)]
    targets = {attributes[name].device for name in names}
    if len(targets) != 1:
        return
    target = targets.pop()
    for copy in ordered:
        values = [copy.states[name] for name in names]
        if all(isinstance(value, torch.Tensor) for value in values) and _strided(values):
            copy.states.update(zip(names, brought_to(target, values)))


def _strided(tensors: list[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` is dense (``brought_to`` joins their elements)."""
    return all(tensor.layout is torch.strided for tensor in tensors)


# Filled at the first use: a ``functools.cache`` would do, but torch.compile warns about one
# when it traces a replica's update.
_KNOWN: dict[Callable[..., Any], str] = {}


def _known_reductions() -> dict[Callable[..., Any], str]:
    """torchmetrics' functions of the reductions that fold, with their names."""
    if not _KNOWN:
        from torchmetrics.utilities import (
            dim_zero_cat,
            dim_zero_max,
            dim_zero_mean,
            dim_zero_min,
            dim_zero_sum,
        )

        _KNOWN.update({
            dim_zero_sum: "sum", dim_zero_mean: "mean", dim_zero_max: "max",
            dim_zero_min: "min", dim_zero_cat: "cat",
        })
    return _KNOWN


def _reduction(metric: Any, name: str) -> str | None:
    return _known_reductions().get(metric._reductions[name])


def _check_reductions(metric: Any) -> None:
    known = _known_reductions()
    if all(map(known.__contains__, metric._reductions.values())):
        return
    for name, fx in metric._reductions.items():
        if fx not in known:
            raise ValueError(
                f"The state {name!r} of {type(metric).__name__} reduces by a custom "
                "dist_reduce_fx, which cannot fold the replicas' copies inside "
                "strategy.run: only 'sum', 'mean', 'max', 'min' and 'cat' can. Update this "
                "metric in cross-replica context instead: return the predictions from the step "
                "function and update it with strategy.gather(predictions, axis=0). Received: "
                f"dist_reduce_fx={fx!r}"
            )


def _fold_state(metric: Any, name: str, parts: list[Any]) -> None:
    """Fold the replicas' copies ``parts`` of state ``name`` into ``metric``, in order."""
    central = getattr(metric, name)
    kind = _reduction(metric, name)
    if isinstance(central, list):  # "cat" of lists: extended in place, in replica order
        for part in parts:
            central.extend(item.to(metric.device) for item in part)
        return
    device = central.device
    parts = [part if part.device == device else part.to(device) for part in parts]
    if kind == "sum":
        total = functools.reduce(torch.add, parts)
        if total.shape == central.shape and total.dtype == central.dtype:
            central.add_(total)  # what ``central + total`` gives, without the copy back
            return
        merged = central + total
    elif kind == "max":
        merged = functools.reduce(torch.maximum, parts, central)
    elif kind == "min":
        merged = functools.reduce(torch.minimum, parts, central)
    elif kind == "cat":
        merged = torch.cat([central, *parts])
    else:  # "mean": this step's mean over replicas, merged as Metric.merge_state does
        steps = metric._update_count + 1
        step = torch.stack(parts).float().mean(0)
        merged = ((steps - 1) * central + step).float() / steps
    if merged.shape == central.shape and merged.dtype == central.dtype:
        central.copy_(merged)  # in place: metrics of a compute group share this tensor
    else:
        setattr(metric, name, merged)
