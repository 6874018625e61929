"""The step functions of ``fit``, ``evaluate`` and ``predict``, distributed by a strategy.

Keras' PyTorch trainer calls ``model.train_function(data)`` once per step with one global
batch. Here that function cuts the batch into the replicas' slices (``_batches.py``) and runs
each slice's forward and loss inside ``strategy.run``. The replicas' gradients are summed onto
the central variables when ``run`` returns, and the optimizer applies them once. Metric
variables aggregate by SUM (their declared aggregation), so the metrics, the loss tracker
included, accumulate as one device would on the whole batch. A replica whose slice is empty
(a short last batch) computes nothing: a loss over no example is undefined.

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

from ..strategies.base import Strategy
from ._backend import load
from ._batches import rows, split

keras = load()
from keras.src.backend.common import global_state  # noqa: E402
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
        """The step's global batch as a PerReplica of slices, and its number of examples."""
        batch = data[0]
        slices = split(batch, self.strategy.num_replicas_in_sync)
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

        def replica(batch: Any) -> None:
            x, y, sample_weight = unpack_x_y_sample_weight(batch)
            count = rows(x)
            if count == 0:
                return
            with state.applied():
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                model._loss_tracker.update_state(loss, sample_weight=count)
                if trainable:
                    share = loss * (count / size)  # the replicas' shares add up to the batch's
                    if model.optimizer is not None:
                        share = model.optimizer.scale_loss(share)
                    share.backward()
                model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        model.zero_grad()
        self.strategy.run(replica, args=(per_replica,))
        if trainable:
            gradients = [variable.value.grad for variable in trainable]
            with torch.no_grad():
                model.optimizer.apply(gradients, trainable)
        return model.get_metrics_result()


@final
class TestStep(Step):
    """``model.test_function``: ``model.test_step`` on each replica's slice."""

    __test__ = False  # not a pytest test class

    def __call__(self, data: list[Any]) -> Any:
        model = self.model
        per_replica, _ = self.replicated(data)
        state = _KerasState()

        def replica(batch: Any) -> None:
            if rows(batch) == 0:
                return
            with state.applied(), torch.no_grad():
                model.test_step(batch)

        self.strategy.run(replica, args=(per_replica,))
        return model.get_metrics_result()


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
            with state.applied(), torch.no_grad():
                return model.predict_step(batch)

        outputs = self.strategy.run(replica, args=(per_replica,))
        return self.strategy.gather(outputs, axis=0)
