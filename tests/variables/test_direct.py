"""Replicas computing on the parameters themselves (variables/direct.py): each one finds only
its own gradients in ``.grad``, the sync point sums them in replica order after the gradients
already there, and a failed run puts those back."""

from __future__ import annotations

import pytest
import torch
from replicas import context, local, replica_id, strategy_of
from torch import nn

import centralstore as cs


def linear(strategy: cs.Strategy) -> nn.Linear:
    torch.manual_seed(0)
    with strategy.scope():
        return nn.Linear(3, 2)


def replica_gradients(model: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """What one device computes for ``x`` alone."""
    model.zero_grad()
    model(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("replicas", [2, 3])
def test_each_replica_finds_only_its_own_gradients_and_run_leaves_their_sum(
    replicas: int,
) -> None:
    strategy = strategy_of(replicas)
    model = linear(strategy)
    x = torch.randn(3 * replicas, 3)
    slices = list(x.chunk(replicas))

    def step(xs: torch.Tensor) -> list[torch.Tensor]:
        model(xs).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    seen = local(strategy, strategy.run(step, args=(cs.PerReplica(slices),)))
    oracle = linear(cs.OneDeviceStrategy("cpu"))
    expected = [replica_gradients(oracle, xs) for xs in slices]
    for got, want in zip(seen, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    for i, param in enumerate(model.parameters()):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, sum(want[i] for want in expected))


def test_gradients_already_in_grad_come_first_and_match_views_bit_for_bit() -> None:
    x = torch.randn(8, 3)

    def train(direct: bool) -> list[torch.Tensor]:
        strategy = strategy_of(3, direct=direct)
        model = linear(strategy)
        for part in x.chunk(2):  # two runs without zero_grad: the second adds to the first
            strategy.run(
                lambda xs: model(xs).pow(2).sum().backward(),
                args=(cs.PerReplica(list(part.tensor_split(3))),),
            )
        return [p.grad for p in model.parameters() if p.grad is not None]

    for direct, views in zip(train(True), train(False), strict=True):
        assert torch.equal(direct, views)


def test_a_failed_run_puts_the_gradients_already_there_back_untouched() -> None:
    strategy = strategy_of(3)
    model = linear(strategy)
    model(torch.randn(2, 3)).sum().backward()
    before = [p.grad for p in model.parameters()]
    values = [g.clone() for g in before if g is not None]

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        if replica_id() == 2:
            raise KeyError("boom")

    with pytest.raises(KeyError):
        strategy.run(step, args=(cs.PerReplica(list(torch.randn(6, 3).chunk(3))),))
    after = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(after, before, strict=True))
    for grad, value in zip(after, values, strict=True):
        assert grad is not None and torch.equal(grad, value)


def test_after_a_rendezvous_replica_0_still_finds_the_gradients_it_made_before_it() -> None:
    strategy = strategy_of(2)
    model = linear(strategy)
    x = torch.randn(4, 3)

    def step(xs: torch.Tensor) -> torch.Tensor:
        model(xs).pow(2).sum().backward()
        context().all_reduce("sum", xs.sum())  # replica 0 was alone so far: threads start
        weight = model.weight.grad
        assert weight is not None
        return weight.clone()

    seen = local(strategy, strategy.run(step, args=(cs.PerReplica(list(x.chunk(2))),)))
    oracle = linear(cs.OneDeviceStrategy("cpu"))
    expected = [replica_gradients(oracle, xs)[0] for xs in x.chunk(2)]
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.weight.grad, expected[0] + expected[1])


def test_clipping_inside_the_step_clips_each_replica_on_its_own() -> None:
    x = torch.randn(8, 3) * 10

    def clipped(strategy: cs.Strategy, parts: list[torch.Tensor]) -> torch.Tensor:
        model = linear(strategy)

        def step(xs: torch.Tensor) -> None:
            model(xs).pow(2).sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        for part in parts:
            strategy.run(step, args=(part,))
        assert model.weight.grad is not None
        return model.weight.grad

    together = clipped(strategy_of(2), [cs.PerReplica(list(x.chunk(2)))])
    one_by_one = clipped(cs.OneDeviceStrategy("cpu"), list(x.chunk(2)))
    torch.testing.assert_close(together, one_by_one)


def test_sparse_gradients_are_summed() -> None:
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])

    def gradient(strategy: cs.Strategy, args: object) -> torch.Tensor:
        torch.manual_seed(0)
        with strategy.scope():
            embed = nn.Embedding(4, 2, sparse=True)
        for _ in range(2):  # the second run adds to the first's gradient
            strategy.run(lambda xs: embed(xs).sum().backward(), args=(args,))
        assert embed.weight.grad is not None and embed.weight.grad.is_sparse
        return embed.weight.grad.to_dense()

    torch.testing.assert_close(
        gradient(strategy_of(2), cs.PerReplica(list(ids.chunk(2)))),
        gradient(cs.OneDeviceStrategy("cpu"), ids),
    )


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_run_with_gradients_in_grad_compares_no_tensor_with_eq(
    replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting gradients aside and taking them off goes by identity: ``tensor == None`` costs
    about 20 us per tensor (torch raises a TypeError inside and turns it into NotImplemented),
    which made a run with filled ``.grad`` cost more per tensor than one beginning empty."""
    strategy = strategy_of(replicas)
    model = linear(strategy)
    x = cs.PerReplica(list(torch.randn(2 * replicas, 3).chunk(replicas)))
    args = (x,) if replicas > 1 else (x.values[0],)

    def step(xs: torch.Tensor) -> None:
        model(xs).pow(2).sum().backward()

    strategy.run(step, args=args)  # .grad filled for the next run
    compared: list[object] = []
    original = torch.Tensor.__eq__

    def counting(self: torch.Tensor, other: object) -> object:
        compared.append(other)
        return original(self, other)

    monkeypatch.setattr(torch.Tensor, "__eq__", counting)
    strategy.run(step, args=args)
    monkeypatch.undo()
    assert compared == []


def test_a_run_on_parameters_only_takes_no_views_and_one_with_a_buffer_does() -> None:
    from centralstore.variables.runs import DirectRun, ReplicasRun

    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(3, 2)
    modes: list[type] = []
    strategy.run(lambda: modes.append(type(strategy._store.run)))
    assert modes == [DirectRun, DirectRun]
    with strategy.scope():
        norm = nn.BatchNorm1d(2)  # a buffer: the replicas must not share its writes
    modes.clear()
    strategy.run(lambda: modes.append(type(strategy._store.run)))
    assert modes == [ReplicasRun, ReplicasRun]
    del model, norm
