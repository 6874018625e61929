"""Runs' plans (``variables/runs.py``): which variables the replicas can see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import strategy_of
from torch import nn

import centralstore as cs


class Graph(nn.Module):
    """A graph convolution over a fixed sparse adjacency, held as a buffer or an attribute."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        adjacency = torch.eye(6).roll(1, 0).add(torch.eye(6)).to_sparse()
        if as_buffer:
            self.register_buffer("adjacency", adjacency)
        else:
            self.adjacency = adjacency
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adjacency, self.linear(x))


def trained(strategy: cs.Strategy, as_buffer: bool, path: str = "direct") -> list[torch.Tensor]:
    """Two SGD steps over two graphs' features (six nodes, three features each), one graph
    per replica at R = 2, both in the one replica at R = 1."""
    with strategy.scope():
        model = Graph(as_buffer)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replicas = strategy.num_replicas_in_sync
    x = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1))

    def step(xs: torch.Tensor) -> None:
        loss = sum(model(graph).pow(2).sum() for graph in xs) / 2
        loss.backward()  # type: ignore[union-attr]

    for _ in range(2):
        optimizer.zero_grad()
        run_on(path, strategy, step, args=(cs.PerReplica(list(x.chunk(2))) if replicas > 1 else x,))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@each_path
def test_several_replicas_refuse_a_sparse_buffer_and_name_it(path: str) -> None:
    strategy = strategy_on(path)
    with strategy.scope():
        model = Graph(as_buffer=True)
    called = []
    with pytest.raises(ValueError, match=r"buffer 'adjacency' of Graph is a torch.sparse_coo"):
        run_on(path, strategy, lambda: called.append(model))
    assert not called


def test_one_replica_uses_a_sparse_buffer_as_one_device_does() -> None:
    for got, want in zip(
        trained(strategy_of(1), as_buffer=True), trained(cs.get_strategy(), as_buffer=True),
        strict=True,
    ):
        assert torch.equal(got, want)


@each_path
def test_several_replicas_read_a_sparse_tensor_held_as_a_plain_attribute(path: str) -> None:
    """The error's advice works: every replica reads the one tensor, and training matches one
    device up to the order of the sum."""
    for got, want in zip(
        trained(strategy_on(path), as_buffer=False, path=path),
        trained(strategy_of(1), as_buffer=False),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


def _ema_training(
    strategy: cs.Strategy, runs: int, teacher_from: int | None = None, path: str = "direct",
    after_run: Callable[[], None] = lambda: None,
) -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """A model and an EMA copy of it (``AveragedModel``), both built in ``strategy``'s scope;
    SGD over the model, the EMA updated after each step, ``runs`` runs of two slices (on the
    ``threads`` path, each step starts with a rendezvous: ``paths.step_on``), ``after_run``
    called after each. From run ``teacher_from`` on, the replicas also read the EMA (a mean
    teacher: its outputs under ``no_grad`` as targets). Returns the model, the EMA and each
    run's loss."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

    torch.manual_seed(0)
    initial = build().state_dict()  # drawn on the host (a GPU draws otherwise)
    with strategy.scope():
        model = build()
        model.load_state_dict(initial)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    device = strategy.extended.worker_devices[0]
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))

    def step(xs: torch.Tensor, teach: bool) -> torch.Tensor:
        xs = xs.to(next(model.parameters()).device)
        target = torch.zeros(len(xs), 2, device=xs.device)
        if teach:
            with torch.no_grad():
                target = ema(xs)
        loss = cs.compute_average_loss((model(xs) - target).pow(2).sum(1), global_batch_size=8)
        loss.backward()
        return loss.detach()

    replicas = strategy.num_replicas_in_sync
    args = cs.PerReplica(list(x.chunk(replicas))) if replicas > 1 else x.to(device)
    losses = []
    for k in range(runs):
        optimizer.zero_grad()
        teach = teacher_from is not None and k >= teacher_from
        loss = run_on(path, strategy, step, (args, teach))
        losses.append(strategy.reduce("SUM", loss, axis=None))
        optimizer.step()
        ema.update_parameters(model)
        after_run()
    return model, ema, losses


def _idle_keys(strategy: cs.CentralStorageStrategy) -> frozenset[int]:
    plan = strategy._store._plan
    assert plan is not None
    return plan.idle


@pytest.mark.parametrize("path", ["views", "threads"])
def test_an_ema_that_no_replica_reads_gets_no_views_once_an_optimizer_stepped(path: str) -> None:
    """Replicas that see views (as GPU replicas away from the variables do) fill every module
    slot at first; the sync point after the first optimizer step finds the EMA's parameters
    trainable, held by no optimizer and given no gradient: they are idle, their views are
    dropped, and no later run fills their slots (a GPU replica is not sent their values).
    Also when each step starts with a rendezvous (replicas on threads after it). The
    training and the EMA are one device's."""
    strategy = strategy_of(2, direct=False)
    model, ema, losses = _ema_training(strategy, 4, path=path)
    ema_keys = {id(p) for p in ema.parameters()}
    assert _idle_keys(strategy) == ema_keys
    for views in strategy._store.replicas:
        assert not ema_keys & views.views.keys()
        assert {id(p) for p in model.parameters()} <= views.views.keys()
    plan = strategy._store._plan
    assert plan is not None and len(plan.view_slots) == len(plan.slots) - len(ema_keys)
    one_model, one_ema, one_losses = _ema_training(cs.OneDeviceStrategy("cpu"), 4)
    torch.testing.assert_close(losses, one_losses)
    for got, want in zip([*model.parameters(), *ema.parameters()],
                         [*one_model.parameters(), *one_ema.parameters()], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("views", [False, True], ids=["direct", "views"])
@pytest.mark.parametrize("path", ["direct", "threads"])
def test_an_idle_variable_that_a_replica_reads_is_seen_and_back_in_the_slots(
    path: str, views: bool
) -> None:
    """A mean teacher: from the fourth run the replicas read the EMA, idle since the second
    where they see views. That run reads it through the variables' class, with its current
    values; its sync point puts it back in the slots. Every run matches one device, also
    with a rendezvous starting each step. (Replicas that compute where the variables live
    fill no slot of a parameter and learn nothing.)"""
    strategy = strategy_of(2, direct=not views)
    idle: list[int] = []
    model, ema, losses = _ema_training(
        strategy, 6, teacher_from=3, path=path,
        after_run=lambda: idle.append(len(_idle_keys(strategy))),
    )
    ema_variables = len(list(ema.parameters()))
    assert idle == ([0, ema_variables, ema_variables, 0, 0, 0] if views else [0] * 6), idle
    one_model, one_ema, one_losses = _ema_training(cs.OneDeviceStrategy("cpu"), 6, teacher_from=3)
    torch.testing.assert_close(losses, one_losses)
    for got, want in zip([*model.parameters(), *ema.parameters()],
                         [*one_model.parameters(), *one_ema.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def test_a_model_that_no_optimizer_steps_is_never_idle() -> None:
    """Without an optimizer step (a hand-written update) nothing tells an idle variable from
    a trained one: every slot stays filled."""
    strategy = strategy_of(2, direct=False)
    with strategy.scope():
        model = nn.Linear(3, 1)
        unused = nn.Linear(3, 1)
    x = cs.PerReplica(list(torch.randn(4, 3).chunk(2)))
    for _ in range(3):
        strategy.run(lambda xs: model(xs).sum().backward(), args=(x,))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad  # type: ignore[operator]
                p.grad = None
    assert _idle_keys(strategy) == frozenset()
    assert all(id(unused.weight) in views.views for views in strategy._store.replicas)


def test_gpu_replicas_are_not_sent_an_ema_that_none_reads(
    fake_gpu_placement: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs away from the variables a replica gets a copy of each trained variable at
    every run (after the first, which makes them): the EMA's too until the sync point after
    the first optimizer step, then the model's only; and to every replica the EMA's step
    counter, a buffer that changed. Every run matches one device."""
    from centralstore.variables.views import ReplicaViews

    sent: list[int] = []
    refresh = ReplicaViews.refresh

    def counted(
        self: ReplicaViews, tensors: list[torch.Tensor], centrals: list[torch.Tensor]
    ) -> None:
        sent.append(sum(c.numel() * c.element_size() for c in centrals))
        refresh(self, tensors, centrals)

    monkeypatch.setattr(ReplicaViews, "refresh", counted)
    placement = fake_gpu_placement
    strategy = cs.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    )
    runs: list[int] = []
    run = strategy.run

    def counting(*args: Any, **kwargs: Any) -> Any:
        before = sum(sent)
        out = run(*args, **kwargs)
        runs.append(sum(sent) - before)
        return out

    monkeypatch.setattr(strategy, "run", counting)
    model, ema, losses = _ema_training(strategy, 4)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    counter = sum(b.numel() * b.element_size() for b in ema.buffers())
    away = sum(device != placement.parameter_device for device in placement.compute_devices)
    counters = counter * len(placement.compute_devices)  # (a buffer: every replica's copy)
    model_only = away * size + counters
    assert runs == [0, away * 2 * size + counters, model_only, model_only], (runs, size, counter)
    one_model, one_ema, one_losses = _ema_training(cs.OneDeviceStrategy("cpu"), 4)
    torch.testing.assert_close([float(x) for x in losses], [float(x) for x in one_losses])
    for got, want in zip([*model.parameters(), *ema.parameters()],
                         [*one_model.parameters(), *one_ema.parameters()], strict=True):
        torch.testing.assert_close(got.cpu(), want)
