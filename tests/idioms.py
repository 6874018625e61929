"""Everyday training idioms, each a model, an optimizer and a step, that the parity tests
train on every replica path and on fake GPUs against one device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune
from torch import nn

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randn(6, 2, generator=torch.Generator().manual_seed(1))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def step_optimizer(
    spec: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The pattern's optimizer step: ``optimizer.step()``, or its own ``optimizer_step``."""
    spec.get("optimizer_step", lambda m, o: o.step())(model, optimizer)


def mse_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        loss = ((model(xs) - ys) ** 2).sum() / len(X)
        loss.backward()
        return loss.detach()

    return step


PATTERNS: dict[str, dict[str, Any]] = {
    "sgd momentum": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    ),
    "fused adamw": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
        optimizer_of=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True),
    ),
    "foreach adam": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        optimizer_of=lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=True),
    ),
    "frozen backbone fine-tuning": dict(
        make=lambda: _frozen(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))),
        optimizer_of=lambda m: torch.optim.SGD(
            [p for p in m.parameters() if p.requires_grad], lr=0.1
        ),
    ),
    "gradient accumulation over runs": dict(
        make=lambda: nn.Linear(4, 2),
        optimizer_of=_sgd,
        runs_per_step=3,
    ),
    "gradient accumulation inside the step": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        step_of=lambda m: _micro_batches(m),
    ),
    "clipping after run": dict(
        make=lambda: nn.Linear(4, 2),
        optimizer_of=lambda m: _ClippingSGD(m.parameters(), lr=0.5),
    ),
    "lr scheduler": dict(
        make=lambda: nn.Linear(4, 2),
        optimizer_of=lambda m: _scheduled(torch.optim.SGD(m.parameters(), lr=0.3)),
        after_step=lambda m, o: o._test_scheduler.step(),  # type: ignore[attr-defined]
    ),
    "weight clipping after step (WGAN)": dict(
        make=lambda: nn.Linear(4, 2),
        optimizer_of=lambda m: torch.optim.RMSprop(m.parameters(), lr=0.05),
        after_step=lambda m, o: [p.data.clamp_(-0.05, 0.05) for p in m.parameters()],
    ),
    "tied weights": dict(
        make=lambda: _Tied(),
        optimizer_of=_sgd,
    ),
    "lstm": dict(
        make=lambda: _Recurrent(),
        optimizer_of=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    ),
    "gradient checkpointing": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=_sgd,
        step_of=lambda m: _checkpointed(m),
    ),
    "spectral norm (its power iteration writes buffers in forward)": dict(
        make=lambda: nn.Sequential(
            nn.utils.parametrizations.spectral_norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 2)
        ),
        optimizer_of=_sgd,
    ),
    "spectral norm, the older forward pre-hook": dict(
        make=lambda: nn.Sequential(
            nn.utils.spectral_norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 2)
        ),
        optimizer_of=_sgd,
    ),
    "weight norm": dict(
        make=lambda: nn.Sequential(
            nn.utils.parametrizations.weight_norm(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 2)
        ),
        optimizer_of=_sgd,
    ),
    "multi-head attention": dict(
        make=lambda: _Attention(),
        optimizer_of=_sgd,
    ),
    "a buffer that forward updates in place (an EMA of activations)": dict(
        make=lambda: _EmaBuffer(),
        optimizer_of=_sgd,
    ),
    "gru, two layers, bidirectional": dict(
        make=lambda: _Gru(),
        optimizer_of=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    ),
    "pruning (torch.nn.utils.prune: a mask buffer and a pre-hook)": dict(
        make=lambda: _pruned(),
        optimizer_of=_sgd,
    ),
    "ParameterList and ParameterDict, AdamW with amsgrad": dict(
        make=lambda: _ParamList(),
        optimizer_of=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True),
    ),
    "orthogonal parametrization": dict(
        make=lambda: nn.Sequential(
            nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2)
        ),
        optimizer_of=_sgd,
    ),
    "low-rank adapters (a parametrization on a frozen weight)": dict(
        make=lambda: _lora(),
        optimizer_of=lambda m: torch.optim.AdamW(_trained(m), lr=0.01),
    ),
    "low-rank adapters, the weight cached for two calls (parametrize.cached)": dict(
        make=lambda: _lora(),
        optimizer_of=lambda m: torch.optim.SGD(_trained(m), lr=0.1),
        step_of=lambda m: _cached_twice(m),
    ),
    "instance norm with running statistics": dict(
        make=lambda: _Inst(),
        optimizer_of=_sgd,
    ),
    "gradient penalty (WGAN-GP: an input gradient with create_graph)": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=_sgd,
        step_of=lambda m: _gradient_penalty(m),
    ),
    "module hooks that change values (a forward pre-hook, a forward hook)": dict(
        make=lambda: _hooked(),
        optimizer_of=_sgd,
    ),
    "gradient reversal (a full backward hook and a torch.autograd.Function)": dict(
        make=lambda: _reversed(),
        optimizer_of=_sgd,
    ),
    "two backward passes, retain_graph": dict(
        make=lambda: nn.Linear(4, 2),
        optimizer_of=_sgd,
        step_of=lambda m: _twice(m),
    ),
    "gradients scaled inside the step, after backward (.grad read and written)": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=_sgd,
        step_of=lambda m: _scaled_inside(m),
    ),
    "gradients discarded inside the step (zero_grad between two backward passes)": dict(
        make=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        optimizer_of=_sgd,
        step_of=lambda m: _zeroed_inside(m),
    ),
    "mixed precision's GradScaler, its scale on the parameter device; step 2 overflows": dict(
        make=lambda: _Scaled(),
        optimizer_of=_sgd,
        step_of=lambda m: _scaled_step(m),
        optimizer_step=lambda m, o: m.step_scaler(o),
    ),
    "mixture of experts, an expert without rows skipped (two runs a step, Adam)": dict(
        make=lambda: _Experts(),
        optimizer_of=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        runs_per_step=2,
    ),
    "sparse embeddings, one also read densely (SparseAdam beside Adam, two runs a step)": dict(
        make=lambda: _Recommender(),
        optimizer_of=lambda m: SparseAndDense(
            [*m.users.parameters(), *m.items.parameters()],
            [*m.mixed.parameters(), *m.head.parameters()],
        ),
        runs_per_step=2,
    ),
}

# The patterns with a buffer written from each replica's own batch (a MEAN over the
# replicas of their slices' statistics), which is one device's only where the slices are even.
BATCH_STATISTICS = frozenset({
    "a buffer that forward updates in place (an EMA of activations)",
    "instance norm with running statistics",
})


def _frozen(model: nn.Sequential) -> nn.Sequential:
    model[0].requires_grad_(False)
    return model


class _ClippingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        torch.nn.utils.clip_grad_norm_(
            [p for group in self.param_groups for p in group["params"]], 0.05
        )
        return super().step(closure)


def _scheduled(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    optimizer._test_scheduler = torch.optim.lr_scheduler.StepLR(  # type: ignore[attr-defined]
        optimizer, step_size=1, gamma=0.5
    )
    return optimizer


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4, bias=False)
        self.decode = nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.decode(torch.tanh(self.encode(x)))))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2, 3, batch_first=True)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.view(len(x), 2, 2))
        return self.head(out[:, -1])


class _EmaBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * out.mean(0))
        return out


class _Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(2, 3, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.view(len(x), 2, 2))
        return self.head(out[:, -1])


def _pruned() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
    return model


class _ParamList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(4, 4) / 2) for _ in range(2)])
        self.out = nn.ParameterDict({"w": nn.Parameter(torch.randn(4, 2) / 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x @ self.out["w"]


class _LoRA(nn.Module):
    """``w + a @ b``: a weight's low-rank update, trained while the weight stays frozen."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(n, 2) / 4)
        self.b = nn.Parameter(torch.randn(2, n) / 4)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.a @ self.b


def _lora() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    parametrize.register_parametrization(model[0], "weight", _LoRA(4))
    return model


def _trained(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _cached_twice(model: nn.Module) -> Callable[..., Any]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        with parametrize.cached():
            out = model(xs) + model(xs * 0.5)
        (((out - ys) ** 2).sum() / len(X)).backward()

    return step


class _Scaled(nn.Sequential):
    """A model and its ``torch.amp.GradScaler``, whose scale is made on the parameter device
    (the variables' in a scope): made by the first ``scale(loss)`` on replica 0's device, it
    would be copied to the gradients' device without waiting (docs/porting.md)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        self.scaler.scale(torch.zeros((), device=self[0].weight.device))
        self.steps = 0

    def step_scaler(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)  # skipped when a gradient is not finite
        self.scaler.update()
        self.steps += 1


def _scaled_step(model: _Scaled) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        loss = ((model(xs) - ys) ** 2).sum() / len(X)
        if model.steps == 1 and bool((xs == X[0].to(xs.device)).all(1).any()):
            loss = loss * float("inf")  # the slice holding X's first row overflows
        model.scaler.scale(loss).backward()
        return loss.detach()

    return step


class _Experts(nn.Module):
    """Experts routed by the signs of each row's first two inputs, each called on its rows
    only, as a loop over experts skips one that got none. On X's rows the choices are 0, 3, 2,
    3, 3, 2: expert 0 has a gradient from the first replica's slice alone, expert 1 never."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 2) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        weight = self.gate(x).softmax(-1).gather(1, choice[:, None])
        out = x.new_zeros(len(x), 2)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, weight[rows] * expert(x[rows]))
        return out


class _Inst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(4, 8)
        self.norm = nn.InstanceNorm1d(2, track_running_stats=True, affine=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lift(x).view(len(x), 2, 4)).view(len(x), 8)
        return self.head(h)


def _gradient_penalty(model: nn.Module) -> Callable[..., Any]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        xs = xs.clone().requires_grad_(True)
        out = model(xs)
        (slope,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
        penalty = ((slope.norm(dim=1) - 1) ** 2).sum()
        ((((out - ys) ** 2).sum() + penalty) / len(X)).backward()

    return step


def _hooked() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[1].register_forward_hook(lambda module, args, out: out * 2)
    model[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    return model


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -2.0 * grad


class _Reversed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reverse.apply(x)  # type: ignore[no-any-return]


def _reversed() -> nn.Module:
    """Gradient-reversal layers as domain adaptation code makes them."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _Reversed(), nn.Linear(8, 2))
    model[1].register_full_backward_hook(
        lambda module, grad_in, grad_out: tuple(-0.5 * g for g in grad_in)
    )
    return model


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(len(x), 2, 2))
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head(mixed.mean(1))


def _checkpointed(model: nn.Module) -> Callable[..., Any]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        out = torch.utils.checkpoint.checkpoint(model, xs, use_reentrant=False)
        (((out - ys) ** 2).sum() / len(X)).backward()

    return step


def _micro_batches(model: nn.Module) -> Callable[..., Any]:
    """One backward per micro-batch of the replica's slice, inside one run."""

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        for x, y in zip(xs.tensor_split(3), ys.tensor_split(3), strict=True):
            (((model(x) - y) ** 2).sum() / len(X)).backward()

    return step


def _scaled_inside(model: nn.Module) -> Callable[..., Any]:
    """A replica's gradients halved in place after its backward, inside the step: one
    device's halved, summed."""

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        (((model(xs) - ys) ** 2).sum() / len(X)).backward()
        for parameter in model.parameters():
            parameter.grad.mul_(0.5)

    return step


def _zeroed_inside(model: nn.Module) -> Callable[..., Any]:
    """A first backward whose gradients the step discards (``zero_grad``) before its
    second: only the second's count."""

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        (model(xs).abs().sum() / len(X)).backward()
        model.zero_grad()
        (((model(xs) - ys) ** 2).sum() / len(X)).backward()

    return step


def _twice(model: nn.Module) -> Callable[..., Any]:
    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        out = model(xs)
        (((out - ys) ** 2).sum() / len(X)).backward(retain_graph=True)
        (out.abs().sum() / len(X)).backward()

    return step


class _Recommender(nn.Module):
    """A recommender's shape: ids looked up in sparse-gradient tables (``sparse=True``:
    each gradient a sparse tensor of the rows used), then a dense layer. The ids come from
    the inputs, so replicas use different rows, and some rows twice. The ``mixed`` table is
    also read densely for the rows whose third input passes 1.7 (one row, on the last
    replica or worker): there its gradient is dense, and the sum over the slices too, as
    sparse plus dense is on one device."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(10, 3, sparse=True)
        self.items = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
        self.mixed = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 3).long() % 10
        looked_up = self.users(ids[:, 0]) + self.mixed(ids[:, 3])
        dense_rows = x[:, 2:3] > 1.7
        if bool(dense_rows.any()):
            looked_up = looked_up + dense_rows * self.mixed.weight.sum() * 0.1
        return self.head(torch.cat([looked_up, self.items(ids[:, 1:3])], 1))


class SparseAndDense:
    """SparseAdam for the tables whose gradients are sparse and Adam for the rest, stepped
    and zeroed together, as recommender training loops pair them."""

    def __init__(self, tables: list[torch.Tensor], rest: list[torch.Tensor]) -> None:
        self.sparse = torch.optim.SparseAdam(tables, lr=0.05)
        self.dense = torch.optim.Adam(rest, lr=0.05)

    def step(self) -> None:
        self.sparse.step()
        self.dense.step()

    def zero_grad(self) -> None:
        self.sparse.zero_grad()
        self.dense.zero_grad()
