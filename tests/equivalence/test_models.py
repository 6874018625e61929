"""R replicas on logical CPU devices train exactly like one device on the same global batch."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import centralstore as cs


def split(batch: torch.Tensor, replicas: int) -> list[torch.Tensor]:
    """TensorFlow's split rule: consecutive slices of ceil(g / R)."""
    size, total = -(-batch.shape[0] // replicas), len(batch)
    return [batch[min(i * size, total) : min((i + 1) * size, total)] for i in range(replicas)]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 5)
        self.lstm = nn.LSTM(5, 7, batch_first=True)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.abs() * 10).long().clamp(max=19)
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 8)
        # No attention biases: the key bias has a gradient of exactly zero in theory, and
        # Adam turns its float rounding noise into full-size steps on one device and on R.
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=True, bias=False
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x.unsqueeze(-1))
        h, _ = self.mha(h, h, h)
        return self.head(self.encoder(h).mean(1))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "linear": MLP, "conv": ConvNet, "lstm": Recurrent, "attention": Attention,
}
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def data(model: str, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    features = 64 if model == "conv" else 6
    return [
        (torch.randn(batch, features, generator=generator),
         torch.randint(0, 3, (batch,), generator=generator))
        for _ in range(steps)
    ]


def train_one_device(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def train_replicated(strategy: cs.CentralStorageStrategy, make_model: Callable[[], nn.Module],
                     make_optimizer: Callable, state: dict, batches: list) -> nn.Module:
    with strategy.scope():
        model = make_model()
        model.load_state_dict(state)
        optimizer = make_optimizer(list(model.parameters()))
    replicas = strategy.num_replicas_in_sync

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = cs.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        return loss

    for x, y in batches:
        global_batch = len(x)
        optimizer.zero_grad()
        xs, ys = cs.PerReplica(split(x, replicas)), cs.PerReplica(split(y, replicas))
        strategy.run(step, args=(xs, ys))
        optimizer.step()
    return model


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("batch", [8, 7])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_replicas_match_one_device(
    replicas: int, batch: int, model_name: str, optimizer_name: str
) -> None:
    torch.manual_seed(0)
    oracle = MODELS[model_name]()
    state = copy.deepcopy(oracle.state_dict())
    batches = data(model_name, batch, steps=3)
    train_one_device(oracle, OPTIMIZERS[optimizer_name](list(oracle.parameters())), batches)

    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    model = train_replicated(
        strategy, MODELS[model_name], OPTIMIZERS[optimizer_name], state, batches
    )
    for (name, expected), actual in zip(oracle.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_tensorflow_reference_values() -> None:
    """Measured on TensorFlow 2.21: y = 3x + 2, SGD 0.1, global batch 8, 4 steps."""
    x = torch.linspace(-1, 1, 32)
    y = 3 * x + 2
    for replicas in (1, 2, 3, 4):
        strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
        with strategy.scope():
            w = torch.zeros((), requires_grad=True)
            b = torch.zeros((), requires_grad=True)
            optimizer = torch.optim.SGD([w, b], lr=0.1)

        def step(
            xs: torch.Tensor, ys: torch.Tensor, w: torch.Tensor, b: torch.Tensor
        ) -> torch.Tensor:
            loss = cs.compute_average_loss((w * xs + b - ys) ** 2, global_batch_size=8)
            loss.backward()
            return loss.detach()

        losses = []
        for i in range(4):
            xs, ys = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
            if replicas > 1:
                xs, ys = cs.PerReplica(split(xs, replicas)), cs.PerReplica(split(ys, replicas))
            optimizer.zero_grad()
            out = strategy.run(step, args=(xs, ys, w, b))
            optimizer.step()
            losses.append(float(strategy.reduce("SUM", out) if replicas > 1 else out))
        assert w.item() == pytest.approx(0.7074499726295471, abs=1e-6)
        assert b.item() == pytest.approx(1.4100775718688965, abs=1e-6)
        assert losses == pytest.approx([0.30072838, 1.89568210, 6.82725811, 12.36517334], abs=1e-5)
