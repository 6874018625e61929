"""``transformers.Trainer`` with its data parallelism done by a centralstore strategy.

The Trainer's own multi-GPU path in one process is ``nn.DataParallel``: it derives
``args.n_gpu`` from the visible GPUs, multiplies the batch size by it, wraps the model in
``_wrap_model`` and averages the replicas' losses with ``loss.mean()``. Here ``n_gpu`` is at
most 1, so none of that happens, and the strategy's replicas take its place:

* ``training_step`` cuts each global batch (R x ``per_device_train_batch_size`` rows) into the
  replicas' slices and runs ``compute_loss`` and the backward of each slice inside
  ``strategy.run``, its loss weighted as ``_batches.Shares`` explains; the gradients are
  summed onto the central parameters when ``run`` returns, and the Trainer clips them and
  steps its optimizer once, as on one device.
* ``prediction_step`` does the same without gradients, and joins the replicas' logits in
  batch order; ``evaluate`` and ``predict`` batches hold R x ``per_device_eval_batch_size``
  rows.
* Neither the Trainer (``_move_model_to_device``) nor accelerate (``device_placement``) moves
  the model: its parameters stay where the strategy stores them. Batches stay on the host
  until each slice is moved to its replica's device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from .._autograd import no_grad
from .._losses import weighted
from ..strategies.base import Strategy
from ..strategies.context import get_replica_context
from ..strategies.multi_worker import MultiWorkerCentralStorageStrategy
from ._backend import load
from ._batches import ItemCount, Shares, concat, split, to_device

load()
from transformers import Trainer as _Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402
from transformers.trainer_pt_utils import nested_detach  # noqa: E402
from transformers.training_args import ParallelMode  # noqa: E402

_HOST = torch.device("cpu")


class Trainer(_Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` whose model trains on the replicas of ``strategy``.

    Takes ``transformers.Trainer``'s arguments plus ``strategy``. The model's parameters
    must be central variables of the strategy: build the model inside ``strategy.scope()``,
    or pass ``model_init``, which is called inside it. ``per_device_train_batch_size`` and
    ``per_device_eval_batch_size`` are per replica; each global batch holds R times as many
    rows and trains as it would on one device: R replicas reach the weights, logged losses,
    metrics and predictions of ``transformers.Trainer`` on one device with R times the batch
    size (see docs/huggingface.md for what differs).

    >>> import tempfile, torch, centralstore as cs, centralstore.transformers
    >>> from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     model = GPT2LMHeadModel(GPT2Config(
    ...         vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2,
    ...         bos_token_id=0, eos_token_id=0))
    >>> data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 8))]
    >>> args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=2,
    ...     max_steps=2, report_to=[], save_strategy="no", dataloader_pin_memory=False)
    >>> trainer = cs.transformers.Trainer(model=model, args=args, train_dataset=data,
    ...     strategy=strategy)
    >>> len(next(iter(trainer.get_train_dataloader()))["input_ids"])  # 2 per replica
    4
    >>> trainer.args.n_gpu <= 1  # never nn.DataParallel
    True

    ``trainer.train()``, ``trainer.evaluate()``, ``trainer.predict(data)`` and
    ``trainer.save_model(path)`` then work as they do on one device.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Any = None,
        *positional: Any,
        strategy: Strategy,
        **kwargs: Any,
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(
                "centralstore.transformers.Trainer needs strategy=, a centralstore strategy "
                "such as cs.CentralStorageStrategy([...]). Received: "
                f"strategy={strategy!r}"
            )
        if isinstance(strategy, MultiWorkerCentralStorageStrategy):
            raise ValueError(
                "centralstore.transformers.Trainer runs in one process; "
                "MultiWorkerCentralStorageStrategy is not supported. Use "
                "cs.CentralStorageStrategy, or transformers.Trainer itself under torchrun. "
                f"Received: strategy={strategy!r}"
            )
        self.strategy = strategy
        self._eval_batch_scaled = False
        self._model_checked = False
        self._divides: bool | None = None  # whether the losses divide by the count handed
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        args = _one_process_arguments(args)
        if model is not None:
            _check_central(model, strategy)
        super().__init__(model, args, *positional, **kwargs)
        self._check_supported()
        self._train_batch_size = self.args.per_device_train_batch_size * self._replicas

    @property
    def _replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    def _check_supported(self) -> None:
        unsupported = {
            "DeepSpeed": self.is_deepspeed_enabled,
            "FSDP": self.is_fsdp_enabled or bool(self.args.fsdp),
            "auto_find_batch_size": bool(self.args.auto_find_batch_size),
            "parallelism_config": getattr(self.accelerator, "parallelism_config", None)
            is not None,
            "model parallelism (hf_device_map)": self.is_model_parallel,
        }
        used = [name for name, on in unsupported.items() if on]
        if used:
            raise ValueError(
                "centralstore.transformers.Trainer distributes the model over the strategy's "
                "replicas and cannot combine that with "
                + ", ".join(used)
                + ". Turn it off, or use transformers.Trainer without a strategy."
            )

    # ---- where the model lives -----------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # accelerate would move the model, the optimizer state and every batch to
        # args.device; the strategy places them instead.
        arguments: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        arguments["device_placement"] = False
        return arguments

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The parameters are central variables: they stay on the strategy's parameter device.
        return None

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        # Never nn.DataParallel: the strategy's replicas are the data parallelism.
        return model

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init``, called inside the strategy's scope, so that the model's parameters
        are central variables."""
        with self.strategy.scope():
            model: nn.Module = super().call_model_init(trial)
        _check_central(model, self.strategy)
        return model

    # ---- entry points --------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train`` on the strategy's replicas."""
        # The model may have changed since __init__ (a head replaced, model_init called
        # again by train()): the first step checks it again.
        self._model_checked = False
        self._divides = None
        return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``transformers.Trainer.evaluate`` with batches of R x ``per_device_eval_batch_size``
        rows, each split over the replicas."""
        _check_central(self.model, self.strategy)
        with self._global_eval_batch():
            metrics: dict[str, float] = super().evaluate(*args, **kwargs)
        return metrics

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.predict`` with batches of R x ``per_device_eval_batch_size``
        rows, each split over the replicas; the predictions come in the dataset's order."""
        _check_central(self.model, self.strategy)
        with self._global_eval_batch():
            return super().predict(*args, **kwargs)

    @contextlib.contextmanager
    def _global_eval_batch(self) -> Iterator[None]:
        # The Trainer reads args.eval_batch_size for the loader, for the weight of each
        # batch's loss in eval_loss (gather_for_metrics trims the last one by it) and for
        # the speed metrics: all of them mean the global batch, as they do for DataParallel.
        if self._eval_batch_scaled:
            yield
            return
        per_replica = self.args.per_device_eval_batch_size
        self.args.per_device_eval_batch_size = per_replica * self._replicas
        self._eval_batch_scaled = True
        try:
            yield
        finally:
            self.args.per_device_eval_batch_size = per_replica
            self._eval_batch_scaled = False

    # ---- training ------------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """One global batch: forward, loss and backward on each replica's slice inside
        ``strategy.run``; returns the batch's loss (detached) on ``args.device``."""
        if not self._model_checked:
            _check_central(model, self.strategy)
            self._model_checked = True
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        slices = split(inputs, self._replicas)
        shares = Shares.plan(slices, num_items_in_batch, self._count_items)
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_ga = bool(self.loss_is_scaled_for_ga)
        else:
            scaled_for_ga = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        accumulation = self.current_gradient_accumulation_steps
        losses: list[torch.Tensor | None] = [None] * self._replicas
        computing, tracked = self._counting(model, num_items_in_batch)

        def replica(batch: Any) -> None:
            mine = _this_replica(shares, batch)
            if mine is None:
                return
            index, device, batch = mine
            count = _handed_count(num_items_in_batch, device, tracked)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(computing, batch, num_items_in_batch=count)
            weight = self._weight(count, shares, index)
            if weight == 0.0:
                losses[index] = torch.zeros_like(loss.detach())
                return
            share = weighted(loss, weight)
            if not scaled_for_ga:
                share = share / accumulation
            self.accelerator.backward(share)
            losses[index] = share.detach()

        self.strategy.run(replica, args=(self._per_replica(slices),))
        return _sum(losses, self.args.device)

    def _counting(self, model: nn.Module, count: Any) -> tuple[nn.Module, bool]:
        """The module that computes this step's losses, and whether they receive the count
        (``num_items_in_batch``) as an ``ItemCount``, which tells whether they divide by it.
        A model compiled whole cannot take that tensor subclass: its losses run uncompiled
        until one step has shown it (``_divides``), then compiled, with the count as one
        device hands it. One replica's loss weighs 1 either way: it takes the count as one
        device hands it."""
        if self._replicas == 1:
            return model, False
        if not isinstance(model, OptimizedModule):
            return model, True
        if self._divides is None and _is_count(count):
            return model._orig_mod, True
        return model, False

    def _weight(self, count: Any, shares: Shares, index: int) -> float:
        """Replica ``index``'s loss weight: 1 if its loss divides by the global count it was
        handed, else its share of the batch (``_batches.Shares``). What an ``ItemCount``
        shows is kept in ``_divides``, for the steps of a model compiled whole."""
        if isinstance(count, ItemCount):
            self._divides = count.used
            return 1.0 if count.used else shares.fallback[index]
        if count is None or (self._divides is False and _is_count(count)):
            return shares.fallback[index]
        return 1.0  # shown by an earlier step, or an integer count, which cannot tell

    def _count_items(self, batch: Any) -> Any:
        """A batch's items (labels other than -100) as the Trainer counts them, or None."""
        return self._get_num_items_in_batch([batch], _HOST)

    def _per_replica(self, slices: Sequence[Any]) -> Any:
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: slices[context.replica_id_in_sync_group]
        )

    # ---- evaluation and prediction -------------------------------------------------------

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """``transformers.Trainer.prediction_step`` on the replicas' slices: the batch's loss
        as one device computes it, and the logits joined in batch order."""
        has_labels = len(self.label_names) > 0 and all(
            inputs.get(k) is not None for k in self.label_names
        )
        return_loss = inputs.get("return_loss")
        if return_loss is None:
            return_loss = self.can_return_loss
        loss_without_labels = len(self.label_names) == 0 and return_loss
        with_loss = has_labels or loss_without_labels
        if ignore_keys is None:
            if hasattr(self.model, "config"):
                ignore_keys = getattr(self.model.config, "keys_to_ignore_at_inference", ["cache"])
            else:
                ignore_keys = []
        skipped = [*ignore_keys, "loss"] if with_loss else list(ignore_keys)

        labels: Any = None
        if with_loss:
            labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
            labels = self._prepare_input(labels[0] if len(labels) == 1 else labels)

        num_items_in_batch = self._count_items(inputs) if with_loss else None
        slices = split(inputs, self._replicas)
        shares = Shares.plan(slices, num_items_in_batch, self._count_items)
        losses: list[torch.Tensor | None] = [None] * self._replicas
        outputs: list[Any] = [None] * self._replicas
        computing, tracked = self._counting(model, num_items_in_batch)

        def replica(batch: Any) -> None:
            mine = _this_replica(shares, batch)
            if mine is None:
                return
            index, device, batch = mine
            with no_grad(), self.compute_loss_context_manager():
                if with_loss:
                    count = _handed_count(num_items_in_batch, device, tracked)
                    loss, output = self.compute_loss(
                        computing, batch, return_outputs=True, num_items_in_batch=count
                    )
                    weight = self._weight(count, shares, index)
                    loss = loss.detach().mean()
                    losses[index] = torch.zeros_like(loss) if weight == 0.0 else loss * weight
                else:
                    output = computing(**batch)
            if isinstance(output, dict):
                logits = tuple(v for k, v in output.items() if k not in skipped)
            else:
                logits = output[1:] if with_loss else output
            outputs[index] = nested_detach(logits)

        self.strategy.run(replica, args=(self._per_replica(slices),))
        loss = _sum(losses, self.args.device) if with_loss else None
        if prediction_loss_only:
            return (loss, None, None)
        joined = concat([o for o in outputs if o is not None], self.args.device)
        if isinstance(joined, (tuple, list)) and len(joined) == 1:
            joined = joined[0]
        return (loss, joined, labels)


def _one_process_arguments(args: Any) -> Any:
    """A copy of ``args`` whose ``n_gpu`` is at most 1: no DataParallel, no batch size
    multiplied by the GPUs, no ``loss.mean()`` over them. Raises under a distributed launch."""
    args._setup_devices  # noqa: B018  (device and distributed setup, as the Trainer does)
    if args.parallel_mode == ParallelMode.DISTRIBUTED or args.world_size > 1:
        raise ValueError(
            "centralstore.transformers.Trainer runs in one process, but these "
            "TrainingArguments are set up for a distributed launch (torchrun, accelerate "
            "launch). Start the script with plain python. Received: "
            f"parallel_mode={args.parallel_mode}, world_size={args.world_size}"
        )
    args = copy.copy(args)
    args._n_gpu = min(int(args._n_gpu), 1)
    return args


def _check_central(model: nn.Module, strategy: Strategy) -> None:
    variable_created_in_scope: Callable[[Any], bool] = strategy.extended.variable_created_in_scope
    foreign = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if not variable_created_in_scope(tensor)
    ]
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        shown = ", ".join(foreign[:3]) + more
        raise ValueError(
            "The model's parameters and buffers must be central variables of the strategy, "
            "but some were created outside its scope. Build the model inside "
            "`with strategy.scope():` (or pass model_init=, which the Trainer calls inside "
            "it), and add any module to it there too. "
            f"Outside the scope: {shown}. Received: strategy={strategy!r}"
        )


def _this_replica(shares: Shares, batch: Any) -> tuple[int, torch.device, Any] | None:
    """Inside ``run``: this replica's index, device and slice (on that device), or None when
    its slice has no rows (it computes nothing)."""
    context = get_replica_context()
    assert context is not None
    index = int(context.replica_id_in_sync_group)
    if shares.rows[index] == 0:
        return None
    return index, context.device, to_device(batch, context.device)


def _is_count(count: Any) -> bool:
    return isinstance(count, torch.Tensor) and count.dim() == 0


def _handed_count(count: Any, device: torch.device, tracked: bool) -> Any:
    """The global ``num_items_in_batch`` as one replica's loss receives it (``tracked``: as
    an ``ItemCount``)."""
    if _is_count(count):
        place = _HOST if device.type == "cpu" else device
        return ItemCount.of(count, place) if tracked else count.to(place)
    return count


def _sum(values: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    present = [v.to(device) for v in values if v is not None]
    return functools.reduce(operator.add, present)
