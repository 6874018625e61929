"""``CentralStorageStrategy`` for Lightning's ``Trainer``: R replicas in one process.

Lightning's training loop calls, per batch, ``strategy.training_step`` (inside the closure it
hands the optimizer), then the optimizer's ``zero_grad`` on the first batch of an
accumulation window, then ``strategy.backward`` on the step's loss, then clipping and
``optimizer.step``. Here:

* ``training_step`` cuts the global batch into the replicas' slices and runs the module's
  ``training_step`` on each inside the internal strategy's ``run``; each replica scales its
  loss by its slice's share of the batch (n / g, for a loss that is a mean over the batch)
  and by 1 / ``accumulate_grad_batches``, and runs its backward there. When ``run`` returns,
  the central variables' ``.grad`` hold the replicas' summed gradients: one device's on the
  whole batch. Those are set aside (the module's parameters and any other tensor made in the
  scope that requires grad), and ``.grad`` gets back what it held before, so that the
  ``zero_grad`` Lightning calls next (after the step, before the backward) clears only what
  one device's would.
* ``backward`` runs the backward hooks (``on_before_backward``, ``on_after_backward``) as
  one device's backward does, and adds the set-aside gradients into ``.grad`` in between.
* What the replicas return and log is combined as one device's step on the whole batch
  (``_batches.py``, ``_logs.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from itertools import compress, repeat
from typing import Any, Literal

import torch

from .._autograd import grad_of, requires_grad_of, set_grads, some
from .._devices import DeviceLike, storage_device
from .._losses import weighted
from ..strategies.central_storage import CentralStorageStrategy as _CentralStorage
from ..strategies.context import get_replica_context
from ..variables.folding import add_in_order
from ..variables.store import VariableStore, current_store
from . import _batches
from ._load import load
from ._logs import LogRecorder, LogSignature

pl = load()
from lightning.pytorch.strategies import Strategy as _LightningStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

_LOG_SIGNATURE = LogSignature(pl.LightningModule.log)


class CentralStorageStrategy(_LightningStrategy):  # type: ignore[misc]
    """A Lightning ``Strategy`` that trains one ``LightningModule`` on R replicas in one
    process: its parameters are stored once, on ``parameter_device``, as the central
    variables of an internal :class:`centralstore.CentralStorageStrategy`; every batch of the
    DataLoader (the global batch) is split over ``compute_devices`` by TensorFlow's rule; each
    replica runs ``training_step`` and its backward on its slice; the optimizer steps once, on
    the summed gradients. Validation, test and predict steps run per replica too, and what
    the steps log or return is combined as one device's on the whole batch.

    The losses ``training_step`` returns are taken to be means over the batch
    (``loss_reduction="mean"``: each replica's counts n / g of the batch's) or sums
    (``loss_reduction="sum"``). Automatic optimization only. Use it with one Lightning
    device (``devices=1``) of the parameter device's kind: the replicas are the compute
    devices, not Lightning's devices.

    >>> import lightning.pytorch as pl
    >>> import centralstore as cs
    >>> strategy = cs.lightning.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    >>> strategy.num_replicas_in_sync
    2
    >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False,
    ...                      enable_progress_bar=False, enable_checkpointing=False,
    ...                      enable_model_summary=False)
    >>> trainer.strategy is strategy
    True
    """

    strategy_name = "centralstore"

    def __init__(
        self,
        compute_devices: Sequence[DeviceLike] | None = None,
        parameter_device: DeviceLike | None = None,
        *,
        loss_reduction: Literal["mean", "sum"] = "mean",
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                'loss_reduction must be "mean" (training_step returns a mean over the batch) '
                f'or "sum" (a sum over the batch). Received: loss_reduction={loss_reduction!r}'
            )
        self._strategy = _CentralStorage(compute_devices, parameter_device)
        self._store: VariableStore | None = None  # its central variables: see _trained
        self._loss_reduction = loss_reduction
        self._root_device = storage_device(self._strategy.parameter_device)
        self._parallel_devices: list[torch.device] | None = None
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
        self.global_rank = 0
        self.local_rank = 0
        self.world_size = 1

    # -- what it is ---------------------------------------------------------------------------

    @property
    def cs_strategy(self) -> _CentralStorage:
        """The internal :class:`centralstore.CentralStorageStrategy`, whose central variables
        the module's parameters and buffers are (for ``scope()``, ``reduce``, ...).

        >>> import centralstore as cs
        >>> cs.lightning.CentralStorageStrategy(["cpu:0", "cpu:1"]).cs_strategy
        CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], parameter_device='cpu:0')
        """
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """R, the number of replicas: one per compute device."""
        return self._strategy.num_replicas_in_sync

    @property
    def compute_devices(self) -> tuple[str, ...]:
        """The canonical names of the compute devices, in replica order."""
        return self._strategy.compute_devices

    @property
    def parameter_device(self) -> str:
        """The canonical name of the device that stores the parameters."""
        return self._strategy.parameter_device

    @property
    def loss_reduction(self) -> str:
        """How ``training_step``'s loss reduces over the batch: ``"mean"`` or ``"sum"``."""
        return self._loss_reduction

    @property
    def root_device(self) -> torch.device:
        """Where the module lives and the batches arrive: the parameter device's storage."""
        return self._root_device

    @property
    def is_global_zero(self) -> bool:
        return True

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The Trainer's devices (one, or exactly the compute devices)."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # The Trainer sets its devices here (Trainer(devices=...)): with several, it would
        # expect one process or replica per device of its own. The replicas are the compute
        # devices; the Trainer runs one process on one device.
        if devices and len(devices) > 1:
            computing = sorted({str(storage_device(d)) for d in self.compute_devices})
            if sorted(str(torch.device(d)) for d in devices) != computing:
                raise ValueError(
                    f"Trainer(devices={len(devices)}) with centralstore.lightning."
                    "CentralStorageStrategy: this strategy runs one process on one Lightning "
                    "device; its replicas are its compute devices "
                    f"{list(self.compute_devices)}, not the Trainer's devices. Pass "
                    "Trainer(devices=1) and choose the replicas with compute_devices=[...]. "
                    f"Received: devices={[str(d) for d in devices]}"
                )
        self._parallel_devices = devices

    def __repr__(self) -> str:
        return (
            f"lightning.CentralStorageStrategy(compute_devices={list(self.compute_devices)}, "
            f"parameter_device={self.parameter_device!r})"
        )

    # -- setup --------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        accelerator = self.accelerator
        kind = self._root_device.type
        if accelerator is not None:
            expected = {"cpu": "CPUAccelerator", "cuda": "CUDAAccelerator", "mps": "MPSAccelerator"}
            name = type(accelerator).__name__
            if kind in expected and name != expected[kind]:
                raise ValueError(
                    f"Trainer(accelerator=...) gave {name}, but the parameters live on "
                    f"{self.parameter_device!r}: Lightning's device is the parameter device "
                    f"(the module and the batches go there). Pass "
                    f"Trainer(accelerator={'gpu' if kind == 'cuda' else kind!r}, devices=1)."
                )
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(
                "centralstore.lightning.CentralStorageStrategy supports automatic optimization "
                f"only, but {type(module).__name__}.automatic_optimization is False: with "
                "manual optimization training_step steps the optimizer itself, which inside "
                "the replicated step would happen once per replica. Let Lightning optimize "
                "(automatic_optimization = True)."
            )
        super().setup(trainer)

    def model_to_device(self) -> None:
        """Move the module to the parameter device and make its parameters and buffers the
        internal strategy's central variables (again, after the precision plugin converted
        it; a module built in its ``scope()`` keeps the aggregations it had)."""
        model = self.model
        assert model is not None
        model.to(self._root_device)
        with self._strategy.scope():
            holder = torch.nn.Module()
            holder.add_module("module", model)  # registers every parameter and buffer

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model`` runs in the internal strategy's ``scope()``: what it builds is
        created on the parameter device, as central variables."""
        with self._strategy.scope():
            yield

    # -- steps --------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step`` once per replica, on its slice of the batch, with
        its backward: the summed gradients wait for ``backward`` (module docstring)."""
        module = self.lightning_module
        trainer = module.trainer
        normalize = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        scaler = getattr(self.precision_plugin, "scaler", None)
        share_of = self._loss_reduction == "mean"
        plugin = self.precision_plugin

        def replica(part: Any, size: int, total: int, rest: tuple[Any, ...]) -> Any:
            with plugin.train_step_context(), self._replica_autocast():
                output = module.training_step(part, *rest, **kwargs)
            loss = _loss_of(output)
            if loss is not None and torch.is_grad_enabled() and loss.requires_grad:
                share = weighted(loss, size / total) if share_of else loss
                if normalize != 1:
                    share = share / normalize
                if scaler is not None:
                    share = scaler.scale(share)
                module.backward(share)
            return _batches.detached(output)

        parameters = self._trained()
        before = list(map(grad_of, parameters))
        if some(before):
            set_grads(parameters, repeat(None))
        try:
            outputs, sizes = self._replicated(replica, args)
        finally:
            summed = list(map(grad_of, parameters))
            set_grads(parameters, before)
        self._pending = None
        combined = self._combine_training(outputs, sizes)
        if _loss_of(combined) is not None:
            self._pending = (parameters, summed)
        return combined

    def _trained(self) -> list[torch.Tensor]:
        """Every central variable that can receive a gradient: the module's parameters and
        any other tensor made in the internal strategy's scope, read in C passes (walking
        the module's tree would cost tens of lines per submodule at every step)."""
        if self._store is None:  # taken once, here: the constructor enters no scope
            with self._strategy.scope():
                self._store = current_store()
        variables = self._store.live()
        return list(compress(variables, map(requires_grad_of, variables)))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``validation_step`` once per replica; outputs and logs combined."""
        return self._evaluate("validation_step", self.precision_plugin.val_step_context, args,
                              kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``test_step`` once per replica; outputs and logs combined."""
        return self._evaluate("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step`` once per replica; the predictions concatenated in
        replica order, which is the batch's order."""
        return self._evaluate("predict_step", self.precision_plugin.predict_step_context, args,
                              kwargs)

    def _evaluate(
        self, hook: str, context: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        step = getattr(self.lightning_module, hook)

        def replica(part: Any, size: int, total: int, rest: tuple[Any, ...]) -> Any:
            with context(), self._replica_autocast():
                return _batches.detached(step(part, *rest, **kwargs))

        outputs, sizes = self._replicated(replica, args)
        present = [n for n in sizes if n]
        return _batches.combine(outputs, present, self._root_device)

    def _replica_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision on the running replica's device, where it is not the plugin's:
        Lightning's autocast covers the parameter device's kind (its accelerator's), so GPU
        replicas with parameters on the CPU autocast their own device too."""
        plugin = self.precision_plugin
        device = getattr(plugin, "device", None)
        autocast = getattr(plugin, "autocast_context_manager", None)
        context = get_replica_context()
        if not isinstance(device, str) or autocast is None or context is None:
            return contextlib.nullcontext()
        replica = context.replica_id_in_sync_group
        kind = storage_device(self.compute_devices[replica]).type
        if kind == torch.device(device).type:
            return contextlib.nullcontext()
        return torch.autocast(kind, dtype=autocast().fast_dtype, cache_enabled=False)

    def _replicated(
        self, fn: Callable[[Any, int, int, tuple[Any, ...]], Any], args: tuple[Any, ...]
    ) -> tuple[list[Any], list[int]]:
        """``fn(slice, size, total, rest)`` on each replica with examples, inside ``run``,
        ``self.log`` recorded and then logged once; the outputs of those replicas, in order,
        and every replica's slice size."""
        if not args:
            raise TypeError("A Lightning step needs its batch as its first argument.")
        batch, rest = args[0], tuple(args[1:])
        module = self.lightning_module
        slices, sizes = _batches.split(batch, self.compute_devices)
        total = sum(sizes)
        recorder = LogRecorder(len(sizes), _LOG_SIGNATURE)

        results: list[Any] = [None] * len(sizes)

        def replica() -> None:
            context = get_replica_context()
            r = 0 if context is None else context.replica_id_in_sync_group
            if sizes[r]:  # else nothing to compute: a step over no example is undefined
                results[r] = fn(slices[r], sizes[r], total, rest)

        with recorder.installed(module):
            try:
                self._strategy.run(replica)
            except Exception as error:
                empty = [r for r, n in enumerate(sizes) if not n]
                if empty:
                    error.add_note(
                        f"(this batch of {total} rows left replicas {empty} of "
                        f"{len(sizes)} without examples, and those did not run the step: a "
                        "step that calls all_reduce, all_gather or merge_call needs examples "
                        "on every replica; drop the short last batch, DataLoader("
                        "drop_last=True), or choose a batch size that gives each replica some)"
                    )
                raise
        recorder.replay(module.log, sizes, self._root_device)
        return [c for c, n in zip(results, sizes) if n], sizes

    def _combine_training(self, outputs: list[Any], sizes: list[int]) -> Any:
        present = [n for n in sizes if n]
        if not outputs or all(o is None for o in outputs):
            return None
        losses = [_loss_of(o) for o in outputs]
        if any(loss is None for loss in losses):
            return _batches.combine(outputs, present, self._root_device)
        if self._loss_reduction == "mean":
            loss = _batches.weighted_mean(losses, present, self._root_device)
        else:
            loss = _batches.total(losses, self._root_device)
        if isinstance(outputs[0], torch.Tensor):
            return loss
        extras = [{k: v for k, v in o.items() if k != "loss"} for o in outputs]
        combined = _batches.combine(extras, present, self._root_device)
        return {"loss": loss, **combined}

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """The backward hooks of one device's backward, and, in between, the replicas'
        summed gradients added into ``.grad`` (their backward ran in ``training_step``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[no-any-return]
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        parameters, gradients = pending
        sums = list(map(grad_of, parameters))
        add_in_order(sums, gradients)  # in place where a .grad exists, as a backward adds
        set_grads(parameters, sums)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # -- one process: collectives are identities -------------------------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """The identity: one process (the replicas were combined already)."""
        return tensor

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """The identity: one process."""
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for: one process."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The identity: one process."""
        return obj

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Not registered by name: pass an instance, ``Trainer(strategy=...)``."""


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None
