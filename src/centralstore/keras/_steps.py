"""The step functions of ``fit``, ``evaluate`` and ``predict``, distributed by a strategy.

Keras' PyTorch trainer calls ``model.train_function(data)`` once per step with one global
batch. Here that function cuts the batch into the replicas' slices (``_batches.py``) and runs
each slice's forward and loss inside ``strategy.run``. The replicas' gradients are summed onto
the central variables when ``run`` returns, and the optimizer applies them once. Metric
variables are synchronized on read with SUM (their declared aggregation): each replica
updates its own copy, and the metrics, the loss tracker included, read as one device's
would on the whole batch. A model's own ``train_step`` runs per replica instead
(``CustomTrainStep``), and a model's own ``test_step`` and ``predict_step`` too. A replica
whose slice is empty (a short last batch) computes nothing: a loss over no example is undefined.

Keras keeps its global state (dtype policy, device scope, name scopes) per thread. Replicas
run on the calling thread unless one reaches a rendezvous (an ``all_reduce`` in a layer); then
the others run on replica threads, which receive the calling thread's Keras state here, as the
strategy hands them grad mode and autocast.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any, final

import torch

from .._autograd import no_grad
from .._losses import weighted
from ..strategies.base import Strategy
from ..strategies.context import get_replica_context
from ._backend import load
from ._batches import rows, split

keras = load()
from keras.src.backend.common import global_state  # noqa: E402
from keras.src.backend.torch import trainer as _trainer  # noqa: E402
from keras.src.trainers.data_adapters.data_adapter_utils import (  # noqa: E402
    unpack_x_y_sample_weight,
)


class _KerasState:
    """The calling thread's Keras global state, re-established on replica threads."""

    def __init__(self) -> None:
        self._thread = threading.current_thread()
        self._values = [
            (name, dict(vars(getattr(global_state, name))))
            for name in ("GLOBAL_STATE_TRACKER", "GLOBAL_SETTINGS_TRACKER")
        ]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        if threading.current_thread() is self._thread:
            yield
            return
        saved = []
        for name, values in self._values:
            own = vars(getattr(global_state, name))  # this thread's
            saved.append((own, dict(own)))
            own.update({k: list(v) if isinstance(v, list) else v for k, v in values.items()})
        try:
            yield
        finally:
            for own, before in saved:
                own.clear()
                own.update(before)


class Step(abc.ABC):
    """One of the model's step functions, distributed by ``strategy``: called by Keras'
    trainer with a list holding one global batch."""

    def __init__(self, model: Any, strategy: Strategy) -> None:
        self.model = model
        self.strategy = strategy

    def replicated(self, data: list[Any]) -> tuple[Any, int]:
        """The step's global batch as a PerReplica of slices, and its number of examples.
        One replica in sync takes the batch as it is: its one slice would be the whole."""
        batch = data[0]
        replicas = self.strategy.num_replicas_in_sync
        if replicas == 1:
            return batch, rows(batch)
        slices = split(batch, replicas)
        per_replica = self.strategy.experimental_distribute_values_from_function(
            lambda context: slices[context.replica_id_in_sync_group]
        )
        return per_replica, rows(batch)

    @abc.abstractmethod
    def __call__(self, data: list[Any]) -> Any:
        """The step on ``data[0]``: the logs (train, test) or the outputs (predict)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model.name!r}, strategy={self.strategy!r})"


@final
class TrainStep(Step):
    """``model.train_function``: forward, loss and backward per replica, then one update."""

    def __call__(self, data: list[Any]) -> Any:
        model = self.model
        per_replica, size = self.replicated(data)
        state = _KerasState()
        trainable = model.trainable_weights[:]
        if not trainable:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        own_metrics = _own_compute_metrics(model)

        def replica(batch: Any) -> None:
            x, y, sample_weight = unpack_x_y_sample_weight(batch)
            count = rows(x)
            if count == 0:
                return
            with state.applied():
                y_pred, loss = _forward(model, x, y, sample_weight, count, training=True)
                if trainable:
                    # the replicas' shares add up to the batch's
                    share: Any = weighted(loss, count / size)
                    if model.optimizer is not None:
                        share = model.optimizer.scale_loss(share)
                    share.backward()
                _update_metrics(model, own_metrics, x, y, y_pred, sample_weight)

        model.zero_grad()
        self.strategy.run(replica, args=(per_replica,))
        if trainable:
            gradients = [variable.value.grad for variable in trainable]
            with no_grad():
                model.optimizer.apply(gradients, trainable)
        return model.get_metrics_result()


def _own_compute_metrics(model: Any) -> bool:
    """Whether the model overrides ``compute_metrics`` (which then runs as written)."""
    return type(model).compute_metrics is not _trainer.TorchTrainer.compute_metrics


def _forward(
    model: Any, x: Any, y: Any, sample_weight: Any, count: int, training: bool
) -> tuple[Any, Any]:
    """Keras' own train and test steps on one replica's slice of ``count`` examples, up to
    the loss: the predictions and the loss, which the loss tracker has counted."""
    y_pred = model(x, training=training) if model._call_has_training_arg else model(x)
    loss = model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )
    model._loss_tracker.update_state(loss, sample_weight=count)
    return y_pred, loss


def _update_metrics(
    model: Any, own_metrics: bool, x: Any, y: Any, y_pred: Any, sample_weight: Any
) -> None:
    """A replica's part of Keras' ``compute_metrics``: the compiled metrics' updates. Keras'
    own also reads every metric, which the step does once, after the replicas (inside them
    each read would go through the replica's views of the metric variables, and be thrown
    away). An override (``own_metrics``) runs as written."""
    if own_metrics:
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    elif model._compile_metrics is not None:
        model._compile_metrics.update_state(y, y_pred, sample_weight)


def _replica_id() -> int:
    context = get_replica_context()
    assert context is not None
    return context.replica_id_in_sync_group


class _Updates:
    """The optimizer updates that a custom ``train_step`` asks for on each replica
    (``optimizer.apply`` inside it, ``_hook.py``), applied once after the replicas finished:
    to the sum, in replica order, of the replicas' gradients, each weighted by its slice's
    share of the global batch (so that, for a loss that is the mean over the slice, the sum
    is the gradient of the batch's loss on one device, uneven slices included)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.share = 1.0  # the running replica's slice's share of the batch
        self.calls: list[tuple[Any, list[torch.Tensor | None], Any]] = []
        self._index = 0  # which call of the running replica's step this is

    def start(self, count: int) -> None:
        self.share = count / self.size
        self._index = 0

    def add(self, optimizer: Any, grads: Any, variables: Any) -> None:
        weighted = [
            None if g is None else g.detach() * self.share for g in list(grads)
        ]
        if self._index == len(self.calls):
            self.calls.append((optimizer, weighted, variables))
        else:
            known, total, held = self.calls[self._index]
            if known is not optimizer or len(total) != len(weighted):
                raise ValueError(
                    "Under a strategy, the replicas of a custom train_step must call the "
                    "same optimizers, in the same order, on the same variables, so that their "
                    "gradients can be summed and applied once. Received: a replica that "
                    f"called {type(optimizer).__name__}.apply with {len(weighted)} gradients "
                    f"where replica 0 called {type(known).__name__}.apply with {len(total)}"
                )
            summed = [
                b if a is None else a if b is None else a + b
                for a, b in zip(total, weighted, strict=True)
            ]
            self.calls[self._index] = (known, summed, held)
        self._index += 1

    def apply(self, original: Any) -> None:
        with no_grad():
            for optimizer, total, variables in self.calls:
                original(optimizer, total, variables)


_active: list[_Updates] = []  # the custom train step's updates while its run lasts


def collecting() -> _Updates | None:
    """The updates that ``optimizer.apply`` inside a replica of a custom ``train_step``
    records instead of applying (None outside such a step)."""
    return _active[-1] if _active else None


def _merge_logs(model: Any, logs: list[Any]) -> Any:
    """The logs of a custom step: what replica code returned, each value that names a
    metric of the model read again now, in cross-replica context, where it is the
    replicas' reduction (TensorFlow's Keras reads them the same way: metrics are
    sync-on-read), and every other value averaged over the replicas that ran (TensorFlow's
    Keras reduces them by "auto", the mean)."""
    returned = [entry for entry in logs if entry is not None]
    if not returned:
        return model.get_metrics_result()
    first = returned[0]
    if not isinstance(first, dict):
        return first
    reduced = model.get_metrics_result()
    named = {m.name: m for m in model.metrics}
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if key in reduced:
            merged[key] = reduced[key]
        elif key in named:
            merged[key] = named[key].result()
        elif isinstance(value, torch.Tensor):
            merged[key] = torch.stack([
                torch.as_tensor(entry[key]).to(value.device, torch.float32)
                for entry in returned
            ]).mean(0)
        elif isinstance(value, (int, float)):
            merged[key] = sum(float(entry[key]) for entry in returned) / len(returned)
        else:
            merged[key] = value
    return merged


@final
class CustomTrainStep(Step):
    """``model.train_function`` of a model that overrides ``train_step``: the model's own
    ``train_step`` on each replica's slice, as TensorFlow runs it per replica. Its
    ``optimizer.apply`` (or ``apply_gradients``) is applied once, after the replicas, to
    their share-weighted summed gradients (``_Updates``); its metrics are ON_READ variables,
    so they count every replica's examples once."""

    def __init__(self, model: Any, strategy: Strategy, original: Any) -> None:
        super().__init__(model, strategy)
        self._original = original  # the optimizers' own apply

    def __call__(self, data: list[Any]) -> Any:
        model = self.model
        per_replica, size = self.replicated(data)
        state = _KerasState()
        updates = _Updates(size)
        logs: list[Any] = [None] * self.strategy.num_replicas_in_sync

        def replica(batch: Any) -> None:
            x, _, _ = unpack_x_y_sample_weight(batch)
            count = rows(x)
            if count == 0:
                return
            updates.start(count)
            with state.applied():
                logs[_replica_id()] = model.train_step(batch)

        model.zero_grad()
        _active.append(updates)
        try:
            self.strategy.run(replica, args=(per_replica,))
        finally:
            _active.remove(updates)
        updates.apply(self._original)
        return _merge_logs(model, logs)


@final
class TestStep(Step):
    """``model.test_function``: forward, loss and the metrics' updates per replica, as Keras'
    ``test_step`` does, and the metrics read once after the replicas. A model's own
    ``test_step`` runs per replica instead, and its logs are merged as a custom train
    step's."""

    __test__ = False  # not a pytest test class

    def __call__(self, data: list[Any]) -> Any:
        model = self.model
        per_replica, _ = self.replicated(data)
        state = _KerasState()
        if type(model).test_step is not _trainer.TorchTrainer.test_step:
            return self._custom(per_replica, state)
        own_metrics = _own_compute_metrics(model)

        def replica(batch: Any) -> None:
            x, y, sample_weight = unpack_x_y_sample_weight(batch)
            count = rows(x)
            if count == 0:
                return
            with state.applied(), no_grad():
                y_pred, _ = _forward(model, x, y, sample_weight, count, training=False)
                _update_metrics(model, own_metrics, x, y, y_pred, sample_weight)

        self.strategy.run(replica, args=(per_replica,))
        return model.get_metrics_result()

    def _custom(self, per_replica: Any, state: _KerasState) -> Any:
        model = self.model
        logs: list[Any] = [None] * self.strategy.num_replicas_in_sync

        def replica(batch: Any) -> None:
            if rows(batch) == 0:
                return
            with state.applied(), no_grad():
                logs[_replica_id()] = model.test_step(batch)

        self.strategy.run(replica, args=(per_replica,))
        return _merge_logs(model, logs)


@final
class PredictStep(Step):
    """``model.predict_function``: ``model.predict_step`` on each replica's slice, the
    outputs gathered in replica order, which is the batch's order."""

    def __call__(self, data: list[Any]) -> Any:
        model = self.model
        per_replica, _ = self.replicated(data)
        state = _KerasState()

        def replica(batch: Any) -> Any:
            # An empty slice runs too: its output, with no row, still has the output's shape.
            with state.applied(), no_grad():
                return model.predict_step(batch)

        outputs = self.strategy.run(replica, args=(per_replica,))
        return self.strategy.gather(outputs, axis=0)
