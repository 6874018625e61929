"""Runs' plans (``variables/runs.py``): which variables the replicas can see."""

from __future__ import annotations

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
