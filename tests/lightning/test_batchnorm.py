"""BatchNorm under the strategy: each replica normalizes its own slice (as in the core
strategy, so R replicas differ from one device), the running statistics are averaged over the
replicas and ``num_batches_tracked`` counts steps. The Trainer's run equals a hand-written
``strategy.run`` loop of the core at the same R, and one replica equals one device."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import torch
from lightning_models import MLP, fit, loader, max_difference, trainer

import centralstore as cs

TOLERANCE = 1e-5


def core_loop(replicas: int, rows: int, batch_size: int, epochs: int) -> torch.nn.Module:
    """The reference: the same model trained by the core strategy's own loop."""
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(batchnorm=True)
    optimizer = model.configure_optimizers()
    batches = loader(rows, batch_size)
    distributed = strategy.experimental_distribute_dataset(batches)
    for _ in range(epochs):
        for (x_global, _), (x, y) in zip(batches, distributed):
            size = len(x_global)

            def step(x: torch.Tensor, y: torch.Tensor, size: int = size) -> None:
                per_example = ((model(x) - y) ** 2).mean(dim=1)
                cs.compute_average_loss(per_example, global_batch_size=size).backward()

            optimizer.zero_grad()
            strategy.run(step, args=(x, y))
            optimizer.step()
    return model


@pytest.mark.parametrize(("replicas", "batch_size"), [(2, 5), (3, 6)])
def test_batchnorm_equals_the_core_strategy(replicas: int, batch_size: int) -> None:
    rows = 4 * batch_size
    reference = core_loop(replicas, rows, batch_size, epochs=2)
    torch.manual_seed(0)
    model = MLP(batchnorm=True)
    run = trainer(replicas, max_epochs=2)
    run.fit(model, loader(rows, batch_size))
    assert max_difference(reference, model) < TOLERANCE
    bn = model.net[1]
    assert int(bn.num_batches_tracked) == 8  # one per step, not per replica
    # and it does differ from one device, which normalizes over the whole batch
    torch.manual_seed(0)
    one = MLP(batchnorm=True)
    trainer(0, max_epochs=2).fit(one, loader(rows, batch_size))
    assert max_difference(one, model) > 1e-4


def test_one_replica_equals_one_device() -> None:
    torch.manual_seed(0)
    one, _ = fit(0, MLP(batchnorm=True), rows=20)
    torch.manual_seed(0)
    model = MLP(batchnorm=True)
    import lightning.pytorch as pl

    run = pl.Trainer(strategy=cs.lightning.CentralStorageStrategy(["cpu:0"]),
                     accelerator="cpu", devices=1, max_epochs=2, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False, num_sanity_val_steps=0)
    run.fit(model, loader(20, 5, shuffle=True), loader(20, 5))
    assert max_difference(one, model) < TOLERANCE
