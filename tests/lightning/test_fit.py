"""Trainer.fit with centralstore.lightning.CentralStorageStrategy equals one device.

The same LightningModule trains once with Lightning's own single-device strategy and once on
R logical CPU devices; the weights, the logged metrics and the step outputs must agree. The
global batch of 5 splits 3/2 at R = 2 and 2/2/1 at R = 3; the last batch (1 row of 21) splits
1/0 and 1/0/0, so replicas with empty slices occur too. Last, the same on two fake GPUs.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from lightning_models import MLP, fit, max_difference, metrics

TOLERANCE = 1e-5  # float64 runs agree to ~1e-15; this is the bound the tests require


@pytest.mark.parametrize(
    ("replicas", "views"), [(1, False), (1, True), (2, False), (3, False), (2, True)]
)
def test_fit_equals_one_device(replicas: int, views: bool) -> None:
    # views: the replicas see views of the parameters, as GPU replicas do
    one, one_run = fit(0)
    many, many_run = fit(replicas, views=views)
    assert max_difference(one, many) < TOLERANCE
    if replicas == 1:  # the replica computes on the parameters, as one device: bit for bit
        assert max_difference(one, many) == 0.0
        assert [float(o["loss"]) for o in many.step_outputs] == [
            float(o["loss"]) for o in one.step_outputs
        ]
    assert metrics(many_run).keys() == metrics(one_run).keys() >= {
        "train_loss_step", "train_loss_epoch", "val_loss"
    }
    for key, value in metrics(one_run).items():
        assert metrics(many_run)[key] == pytest.approx(value, abs=TOLERANCE), key
    # the loss handed to on_train_batch_end is one device's on the whole batch
    assert len(many.step_outputs) == len(one.step_outputs) == 10
    for a, b in zip(one.step_outputs, many.step_outputs):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), abs=TOLERANCE)
    # gradients seen before each optimizer step are the summed ones, hooks run once per step
    assert many.grad_norms == pytest.approx(one.grad_norms, abs=TOLERANCE)
    assert many.backward_hooks == one.backward_hooks == 10


def test_parameters_are_central_variables() -> None:
    model, run = fit(2, max_epochs=1, val=False)
    strategy = run.strategy.cs_strategy
    assert all(strategy.extended.variable_created_in_scope(p) for p in model.parameters())
    assert run.strategy.num_replicas_in_sync == 2
    assert run.strategy.root_device == torch.device("cpu")


def test_logs_and_outputs_combined_like_one_device() -> None:
    torch.manual_seed(0)
    one, one_run = fit(0, MLP(extra_logs=True))
    torch.manual_seed(0)
    many, many_run = fit(3, MLP(extra_logs=True))
    assert max_difference(one, many) < TOLERANCE
    expected, got = metrics(one_run), metrics(many_run)
    assert got.keys() == expected.keys() >= {
        "train_max_error_epoch", "train_sum_error_epoch", "train_mean_y_epoch",
        "train_sized_epoch",
    }
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=TOLERANCE), key
    for a, b in zip(one.step_outputs, many.step_outputs, strict=True):
        assert torch.allclose(a["predictions"], b["predictions"], atol=TOLERANCE)  # in order
        assert b["count"] == a["count"]  # an int: a count, summed


def test_loss_reduction_sum() -> None:
    class Summed(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = ((self(x) - y) ** 2).sum()
            self.log("train_loss", loss, reduce_fx="sum")
            return loss

    import centralstore as cs

    torch.manual_seed(0)
    one, one_run = fit(0, Summed(lr=0.01), val=False)
    torch.manual_seed(0)
    model = Summed(lr=0.01)
    strategy = cs.lightning.CentralStorageStrategy(["cpu:0", "cpu:1"], loss_reduction="sum")
    import lightning.pytorch as pl
    from lightning_models import loader

    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2,
                     logger=False, enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False)
    run.fit(model, loader(shuffle=True))
    assert max_difference(one, model) < TOLERANCE
    assert metrics(run)["train_loss"] == pytest.approx(metrics(one_run)["train_loss"], abs=1e-9)


@pytest.mark.parametrize(
    "options",
    [
        {"accumulate_grad_batches": 3},
        {"gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ],
    ids=["accumulate", "clip-norm", "clip-value", "accumulate-clip"],
)
def test_accumulation_and_clipping_equal_one_device(options: dict[str, object]) -> None:
    one, one_run = fit(0, val=False, **options)
    many, many_run = fit(3, val=False, **options)
    assert max_difference(one, many) < TOLERANCE
    assert many.grad_norms == pytest.approx(one.grad_norms, abs=TOLERANCE)
    assert metrics(many_run)["train_loss_epoch"] == pytest.approx(
        metrics(one_run)["train_loss_epoch"], abs=TOLERANCE
    )
    assert many_run.global_step == one_run.global_step


def test_model_built_in_configure_model_lives_in_scope() -> None:
    class Late(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.head: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.head is None:
                self.head = torch.nn.Linear(1, 1).double()

        def forward(self, x):  # type: ignore[no-untyped-def]
            assert self.head is not None
            return self.head(self.net(x))

    torch.manual_seed(0)
    one, _ = fit(0, Late(), val=False, max_epochs=1)
    torch.manual_seed(0)
    many, run = fit(2, Late(), val=False, max_epochs=1)
    assert max_difference(one, many) < TOLERANCE
    assert many.head is not None
    assert run.strategy.cs_strategy.extended.variable_created_in_scope(many.head.weight)


def test_replicas_on_threads_after_a_rendezvous() -> None:
    """A training_step that meets the other replicas (an all_reduce) makes them run on
    replica threads; logging, backward and the result stay as on one device."""
    import centralstore as cs

    class Meets(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            replicas = cs.get_replica_context().all_reduce("SUM", torch.ones(()))
            self.log("replicas", replicas, reduce_fx="max")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    one, one_run = fit(0, Meets(), val=False, rows=20)
    torch.manual_seed(0)
    many, many_run = fit(3, Meets(), val=False, rows=20)  # 2/2/1: no replica without rows
    assert max_difference(one, many) < TOLERANCE
    assert metrics(many_run)["train_loss_epoch"] == pytest.approx(
        metrics(one_run)["train_loss_epoch"], abs=TOLERANCE
    )
    assert metrics(one_run)["replicas"] == 1.0
    assert metrics(many_run)["replicas"] == 3.0


def test_collectives_need_examples_on_every_replica() -> None:
    import centralstore as cs

    class Meets(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            cs.get_replica_context().all_reduce("SUM", torch.ones(()))
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="without calling all_reduce") as info:
        fit(3, Meets(), val=False, rows=21)  # the last batch of 1 row: 1/0/0
    assert any("drop_last=True" in note for note in info.value.__notes__)


def test_model_built_in_the_strategys_scope() -> None:
    """A module built in ``strategy.cs_strategy.scope()`` trains the same; ``self.log`` may
    take its options positionally."""
    import centralstore as cs

    class Positional(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, True, None, True, True)  # prog_bar, logger, steps
            return loss

    torch.manual_seed(0)
    one, one_run = fit(0, Positional(), val=False)
    chosen = cs.lightning.CentralStorageStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with chosen.cs_strategy.scope():
        model = Positional()
    assert chosen.cs_strategy.extended.variable_created_in_scope(model.net[0].weight)
    import lightning.pytorch as pl
    from lightning_models import loader

    run = pl.Trainer(strategy=chosen, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False)
    run.fit(model, loader(shuffle=True))
    assert max_difference(one, model) < TOLERANCE
    assert metrics(run)["train_loss_epoch"] == pytest.approx(
        metrics(one_run)["train_loss_epoch"], abs=TOLERANCE
    )


class _WithOffset(MLP):
    """An MLP plus an offset that is not a module parameter: a tensor made in
    ``configure_model`` (inside the strategy's scope, so a central variable) and handed to
    the optimizer beside the parameters."""

    def configure_model(self) -> None:
        if not hasattr(self, "offsets"):
            self.offsets = [torch.zeros(1, dtype=torch.float64, requires_grad=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.offsets[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([*self.parameters(), *self.offsets], lr=self.lr, momentum=0.9)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_trained_tensor_outside_the_module_keeps_its_gradient(replicas: int) -> None:
    # Lightning zeroes the optimizer's gradients between training_step and backward: the
    # offset's gradient from the replicas must survive that, as one device's does.
    torch.manual_seed(0)
    one, _ = fit(0, _WithOffset(), val=False)
    torch.manual_seed(0)
    many, _ = fit(replicas, _WithOffset(), val=False)
    assert float(one.offsets[0].detach().abs()) > 1e-3  # it trained
    assert float((one.offsets[0] - many.offsets[0]).detach().abs()) < TOLERANCE
    assert max_difference(one, many) < TOLERANCE


def test_the_strategy_can_be_made_inside_another_strategys_scope() -> None:
    # Its constructor enters no scope (its internal strategy's scope is entered at the first
    # training step, to read its central variables).
    import lightning.pytorch as pl
    from lightning_models import loader

    import centralstore as cs

    with cs.CentralStorageStrategy(["cpu:0", "cpu:1"]).scope():
        made = cs.lightning.CentralStorageStrategy(["cpu:0", "cpu:1"])
    run = pl.Trainer(
        strategy=made, accelerator="cpu", devices=1, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = MLP()
    run.fit(model, loader())
    one, _ = fit(0, val=False, max_epochs=1, shuffle=False)
    assert max_difference(one, model) < TOLERANCE


@pytest.mark.parametrize("views", [False, True])
def test_a_compiled_submodule_trains_like_one_device(views: bool) -> None:
    # Lightning refuses a compiled LightningModule for other strategies than its own three;
    # its submodules may be compiled (torch.compile first runs inside the replicas). views:
    # the replicas see views of the parameters, as GPU replicas do.
    one, _ = fit(0)
    torch.manual_seed(0)
    model = MLP()
    model.net = torch.compile(model.net, backend="aot_eager")
    many, _ = fit(2, model, views=views)
    many.net = many.net._orig_mod  # the state dict's own names
    assert max_difference(one, many) < TOLERANCE


def test_fit_on_two_gpus_equals_one_device(fake_gpu_placement: Any) -> None:
    """Trainer.fit on two fake GPUs (``fake_gpu_placement``: the parameters in host memory,
    Lightning's accelerator the CPU; or on ``cuda:0``, the accelerator the GPU) trains as
    one device, as on logical CPU devices; no stream hazard."""
    import lightning.pytorch as pl
    from lightning_models import loader

    import centralstore as cs

    one, _ = fit(0)
    placement = fake_gpu_placement
    torch.manual_seed(0)
    model = MLP()
    strategy = cs.lightning.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    )
    accelerator = "gpu" if placement.parameter_device.startswith("cuda") else "cpu"
    run = pl.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, max_epochs=2, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    run.fit(model, loader(21, 5, shuffle=True), loader(21, 5))
    assert max_difference(one, model) < TOLERANCE  # (Lightning moves the module to the CPU)
    if placement.gpus is not None:  # the replicas computed on the fake GPUs
        assert {stream.device for what, stream in placement.gpus.calls if what == "kernel"} == {
            torch.device("cuda:0"), torch.device("cuda:1")
        }
