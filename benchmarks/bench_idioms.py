"""The idioms people bring to a training step, through centralstore and in plain PyTorch.

``bench_models.py`` times real models with a bare step (AdamW, a loss, backward). Users'
steps carry more: hooks on gradients, frozen layers, a fused optimizer, clipping, a moving
average of the weights, activation checkpointing, autocast, parametrized weights, recurrent
layers with flat weights, sparse gradients, channels-last convolutions. Each of these meets
a different part of centralstore (held hooks, the set-aside ``.grad`` of some variables
only, the optimizer step's sync point, a backward that runs the forward again, gradients
that arrive sparse, running statistics in the replicas' shared rows). This script times one
small network per idiom, so that an idiom that costs more than the run's fixed cost shows:

  none               an MLP 64-256-256-256-10, AdamW: the reference row
  gradient hooks     the same, each parameter's gradient clamped by a ``register_hook``
  frozen half        the same, its first two layers ``requires_grad_(False)``
  fused AdamW        the same with ``AdamW(fused=True)``
  clipping           the same, ``clip_grad_norm_(..., 1.0)`` after the replicas' backward
  EMA                the same, an ``AveragedModel`` (EMA 0.999) updated after every step
  checkpointing      four residual blocks, each through ``torch.utils.checkpoint``
  autocast           the MLP's forward under ``torch.autocast("cpu", torch.bfloat16)``
  weight norm        the MLP's hidden layers under ``parametrizations.weight_norm``
  LSTM               an embedding, a two-layer ``nn.LSTM`` and a linear head on 16 tokens
  sparse embedding   an ``EmbeddingBag(20000, 64, sparse=True)`` and a head, plain SGD
  channels last      two convolutions with ``BatchNorm2d``, in ``torch.channels_last``
  metric             the MLP, a torchmetrics ``MeanMetric`` of the loss updated after each
                     backward (Lightning's ``self.train_loss(loss)``): inside a replica it
                     updates the replica's copy, which the sync point folds in (needs
                     torchmetrics, a test extra; left out without it)

at P examples per replica (8 by default). Configurations, as in ``bench_models.py``: ``plain``
(one device, a batch of P), ``plain again`` (a second instance: the run's noise), ``cs R=1``
(``CentralStorageStrategy`` on ``cpu:0``), ``halves`` (one device, two passes of P that
accumulate gradients), ``apart`` (the halves, the first pass's gradients taken off before
the second and added after it: what two replicas that each find only their own gradients in
``.grad`` must do at least, in plain PyTorch) and ``cs R=2`` (``cpu:0`` and ``cpu:1``; its
second line against ``apart``: about centralstore's own bookkeeping). They take turns step
by step in drawn orders and are built anew every round (``bench_train.take_turns``). Each
ratio is the median over the rounds of the round's medians, with the rounds' quartiles, and
``+us`` the median over the rounds of the difference of the round's medians: what a run
adds to the step in microseconds. The ``none`` row's ``+us`` is the run's fixed cost on
this network; an idiom whose ``+us`` lies well above it, beyond the rounds' spread, costs
centralstore something of its own. One intra-op thread, the process's CPU time, glibc's heap fixed
(``cs.keep_host_memory()``), as in ``bench_models.py``. The targets of docs/design.md §7
(R = 1 <= 1.02, R = 2 <= 1.03) are printed beside the ratios; these steps are short (0.2
to 4 ms), where a run's fixed cost weighs most.

``--gpu-bytes`` times nothing: it counts, on the test suite's fake GPUs (``tests/fakegpu``),
the bytes each idiom's training step copies to two GPU replicas whose variables are in host
memory, and back, against what the model must take there at least (each replica's copy of
its parameters) and bring back (each replica's gradients of the trained ones). A variable
sent though no replica reads it shows as more: an EMA copy of the model in the scope read
2.000 of the model's bytes until the fiftieth session. ``copies`` and ``back`` count the
copies that carry those bytes each way (each costs a transfer's start, and one to the host a
wait for its GPU). (The autocast idiom is left out: its ``autocast("cpu")`` does not apply to
GPU replicas.)

``--compiled`` compiles each configuration's forward and loss (``torch.compile``, static
shapes, a code object per configuration: ``bench_models.compiled``) and keeps its instances
for the whole run instead of building them anew every round (a new one would compile
again). Whether the compiled idioms make more graphs through centralstore than plainly is
a test, not a timing: ``tests/equivalence/test_parity.py`` counts them on every path.

    python benchmarks/bench_idioms.py [--rounds 10] [--steps 10] [--per-replica 8]
        [--idioms none clipping ...] [--compiled]
    python benchmarks/bench_idioms.py --gpu-bytes [--idioms none EMA ...]
"""

from __future__ import annotations

import argparse
import functools
import operator
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from bench_models import compiled
from bench_train import median_of_all, quartiles, round_ratios, take_turns
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

try:  # imported before any scope is entered, as a program does: the scope installs the
    # integration that makes a metric's updates inside a replica fold at the sync point
    import torchmetrics
except ModuleNotFoundError:  # (the metric idiom is left out)
    torchmetrics = None

import centralstore as cs
from centralstore.cli import at_least

CONFIGS = ("plain", "plain again", "cs R=1", "halves", "apart", "cs R=2")
RATIOS = {  # the ratio's row, its baseline, its target
    "plain again": ("plain", None),
    "cs R=1": ("plain", 1.02),
    "apart": ("halves", None),
    "cs R=2": ("halves", 1.03),
}
BOOKKEEPING = {"cs R=2": "apart"}  # a second line: against the floor of the semantics
_grad = operator.attrgetter("grad")


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _hooked() -> nn.Module:
    model = _mlp()
    for parameter in model.parameters():
        parameter.register_hook(lambda grad: grad.clamp(-1.0, 1.0))
    return model


def _frozen() -> nn.Module:
    model = _mlp()
    for parameter in list(model.parameters())[:4]:
        parameter.requires_grad_(False)
    return model


def _weight_norm() -> nn.Module:
    model = _mlp()
    for index in (0, 2, 4):
        weight_norm(model[index])
    return model


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(500, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embedding(tokens))[0][:, -1])


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20000, 64, sparse=True)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def _channels_last() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    ).to(memory_format=torch.channels_last)


def _features(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 64, generator=generator)


def _tokens(vocabulary: int, length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    def make(n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocabulary, (n, length), generator=generator)

    return make


def _images(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=generator).to(memory_format=torch.channels_last)


def _adamw(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-3)


@dataclass(frozen=True)
class Idiom:
    """A network, its inputs, its optimizer and what its step does besides."""

    build: Callable[[], nn.Module] = _mlp
    inputs: Callable[[int, torch.Generator], torch.Tensor] = _features
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = _adamw
    clip: bool = False  # clip_grad_norm_ after the backward passes
    ema: bool = False  # an AveragedModel updated after the optimizer step
    autocast: bool = False  # the forward under autocast to bfloat16
    metric: bool = False  # a torchmetrics MeanMetric of the loss, updated after each backward


IDIOMS = {
    "none": Idiom(),
    "gradient hooks": Idiom(build=_hooked),
    "frozen half": Idiom(build=_frozen),
    "fused AdamW": Idiom(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
    "clipping": Idiom(clip=True),
    "EMA": Idiom(ema=True),
    "checkpointing": Idiom(build=_Checkpointed),
    "autocast": Idiom(autocast=True),
    "weight norm": Idiom(build=_weight_norm),
    "LSTM": Idiom(build=_Recurrent, inputs=_tokens(500, 16)),
    "sparse embedding": Idiom(
        build=_Sparse, inputs=_tokens(20000, 8),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
    ),
    "channels last": Idiom(build=_channels_last, inputs=_images),
    "metric": Idiom(metric=True),
}


def mean_metric() -> Any:
    """The metric idiom's: a torchmetrics ``MeanMetric`` (of the loss)."""
    assert torchmetrics is not None
    return torchmetrics.MeanMetric()


def available(name: str) -> bool:
    """Whether idiom ``name`` can run here (the metric's needs torchmetrics)."""
    return torchmetrics is not None or not IDIOMS[name].metric


def make_step(
    name: str, config: str, per_replica: int, compile_: bool = False
) -> Callable[[], None]:
    """One optimizer step of ``config`` with idiom ``name``, ready to time (``compile_``: its
    forward and loss ``torch.compile``d, as ``bench_models.py`` compiles them)."""
    idiom = IDIOMS[name]
    replicas = 2 if config in ("halves", "apart", "cs R=2") else 1
    global_batch = per_replica * replicas
    generator = torch.Generator().manual_seed(0)
    x = idiom.inputs(global_batch, generator)
    y = torch.randint(0, 10, (global_batch,), generator=generator)
    slices = [
        (x[i * per_replica:(i + 1) * per_replica], y[i * per_replica:(i + 1) * per_replica])
        for i in range(replicas)
    ]
    torch.manual_seed(0)
    strategy = None
    scope: AbstractContextManager[Any] = nullcontext()
    if config.startswith("cs"):
        strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
        scope = strategy.scope()
    with scope:
        model = idiom.build()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = idiom.optimizer(trainable)
        average = (
            AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)) if idiom.ema else None
        )
        metric = mean_metric() if idiom.metric else None
    precision: Callable[[], AbstractContextManager[Any]] = (
        functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        if idiom.autocast else nullcontext
    )

    def loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        with precision():
            logits = model(xs)
        return F.cross_entropy(logits.float(), ys, reduction="sum") / global_batch

    forward_and_loss = compiled(loss, config) if compile_ else loss

    def backward(xs: torch.Tensor, ys: torch.Tensor) -> None:
        value = forward_and_loss(xs, ys)
        value.backward()
        if metric is not None:
            metric.update(value.detach())

    def one_by_one() -> None:
        for xs, ys in slices:
            backward(xs, ys)

    def apart() -> None:  # the first pass's gradients taken off, added after the second
        backward(*slices[0])
        first = list(map(_grad, trainable))
        for parameter in trainable:
            parameter.grad = None
        backward(*slices[1])
        second = list(map(_grad, trainable))
        with torch.no_grad():
            if not any(grad.is_sparse for grad in first):  # (every one present: dense)
                torch._foreach_add_(second, first)
                return
            for parameter, grad, last in zip(trainable, first, second, strict=True):
                parameter.grad = last + grad if grad.is_sparse else last.add_(grad)

    passes: Callable[[], Any] = apart if config == "apart" else one_by_one
    if strategy is not None:
        arguments = slices[0] if replicas == 1 else (
            cs.PerReplica([xs for xs, _ in slices]), cs.PerReplica([ys for _, ys in slices])
        )
        passes = functools.partial(strategy.run, backward, args=arguments)

    def step() -> None:
        optimizer.zero_grad()
        passes()
        if idiom.clip:
            nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        if average is not None:
            average.update_parameters(model)

    return step


_clock = time.process_time


def _time(step: Callable[[], None]) -> float:
    start = _clock()
    step()
    return (_clock() - start) * 1e3


def measure(
    name: str, per_replica: int, rounds: int, steps: int, compile_: bool = False
) -> dict[str, list[list[float]]]:
    """config -> each round's step times (ms). Compiled configurations are built once (a
    new instance would compile again), eager ones anew every round."""
    return take_turns(
        lambda config: make_step(name, config, per_replica, compile_), CONFIGS, rounds, steps,
        _time, rebuild=not compile_,
    )


def added_us(times: list[list[float]], baseline: list[list[float]]) -> float:
    """The median over the rounds of the difference of the round's medians, in us."""
    return statistics.median(
        (statistics.median(t) - statistics.median(b)) * 1e3
        for t, b in zip(times, baseline, strict=True)
    )


GPU_STEPS = 4  # --gpu-bytes: steps before the one counted (the first optimizer step's sync
# point is where a run learns which variables no optimizer holds and no run trains)


def gpu_bytes(name: str, per_replica: int) -> dict[str, float]:
    """``--gpu-bytes`` for idiom ``name``: one training step's bytes to and from two fake
    GPUs with the variables in host memory, after ``GPU_STEPS``, and the model's bytes."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    import fakegpu

    idiom = IDIOMS[name]
    devices = ["cuda:0", "cuda:1"]
    generator = torch.Generator().manual_seed(0)
    x = idiom.inputs(2 * per_replica, generator)
    y = torch.randint(0, 10, (2 * per_replica,), generator=generator)
    with fakegpu.devices(len(devices)) as gpus:
        strategy = cs.CentralStorageStrategy(devices, parameter_device="cpu")
        torch.manual_seed(0)
        with strategy.scope():
            model = idiom.build()
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = idiom.optimizer(trainable)
            average = (
                AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)) if idiom.ema
                else None
            )
            metric = mean_metric() if idiom.metric else None
        arguments = tuple(
            cs.PerReplica([part.to(device) for part, device in zip(
                whole.tensor_split(len(devices)), devices, strict=True
            )])
            for whole in (x, y)
        )

        def backward(xs: torch.Tensor, ys: torch.Tensor) -> None:
            logits = model(xs)
            value = F.cross_entropy(logits.float(), ys, reduction="sum") / len(x)
            value.backward()
            if metric is not None:
                metric.update(value.detach())

        def step() -> None:
            optimizer.zero_grad()
            strategy.run(backward, args=arguments)
            if idiom.clip:
                nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            if average is not None:
                average.update_parameters(model)

        for _ in range(GPU_STEPS):
            step()
        before, calls = gpus.moved.copy(), gpus.calls.copy()
        step()
        moved = gpus.moved - before
        made = Counter(what for (what, _) in (gpus.calls - calls).elements())
    return {
        "to GPUs": moved["copy to device"], "to host": moved["copy to host"],
        "copies to GPUs": made["copy to device"], "copies to host": made["copy to host"],
        "parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trained": sum(p.numel() * p.element_size() for p in trainable),
        "replicas": len(devices),
    }


def gpu_bytes_table(names: list[str], per_replica: int) -> None:
    """``--gpu-bytes``: the table of what each idiom's step copies to and from the GPUs."""
    print(f"bytes one training step copies to two fake GPU replicas whose variables are in "
          f"host memory, and back, after {GPU_STEPS} steps; {per_replica} examples per "
          "replica\n")
    print(f"{'idiom':<17} {'parameters':>11} {'to GPUs':>10} {'/ R x parameters':>17} "
          f"{'to host':>10} {'/ R x trained':>14} {'copies':>8} {'back':>5}")
    for name in names:
        if not available(name):
            print(f"{name:<17} {'(needs torchmetrics: pip install torchmetrics)':>64}")
            continue
        if IDIOMS[name].autocast:
            print(f"{name:<17} {'(autocast to bfloat16 on the CPU: not a GPU replica idiom)':>64}")
            continue
        row = gpu_bytes(name, per_replica)
        replicas = row["replicas"]
        print(f"{name:<17} {row['parameters']:>11,.0f} {row['to GPUs']:>10,.0f} "
              f"{row['to GPUs'] / (replicas * row['parameters']):>16.3f}x "
              f"{row['to host']:>10,.0f} {row['to host'] / (replicas * row['trained']):>13.3f}x "
              f"{row['copies to GPUs']:>8.0f} {row['copies to host']:>5.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=10)
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps per round")
    parser.add_argument("--per-replica", type=at_least(1), default=8,
                        help="examples per replica")
    parser.add_argument("--idioms", nargs="+", choices=list(IDIOMS), default=list(IDIOMS))
    parser.add_argument("--compiled", action="store_true",
                        help="each step's forward and loss torch.compile'd")
    parser.add_argument("--gpu-bytes", action="store_true",
                        help="instead of timing, the bytes a step copies to and from two "
                             "fake GPUs (tests/fakegpu)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.gpu_bytes:
        gpu_bytes_table(options.idioms, options.per_replica)
        return
    fixed = cs.keep_host_memory()
    print(f"torch {torch.__version__}, 1 intra-op thread, {options.steps} steps x "
          f"{options.rounds} rounds, turns step by step, medians of cpu time, mmap threshold "
          f"{'fixed' if fixed else 'dynamic'}, {options.per_replica} examples per replica\n")
    print(f"{'idiom':<17} {'config':<12} {'ms/step':>8} {'ratio':>7} {'quartiles':>15} "
          f"{'against':<8} {'+us':>6} {'target':>6}")
    for name in options.idioms:
        if not available(name):
            print(f"{name:<17} (needs torchmetrics: pip install torchmetrics)", flush=True)
            continue
        times = measure(
            name, options.per_replica, options.rounds, options.steps, options.compiled
        )
        for config in CONFIGS:
            row = f"{name:<17} {config:<12} {median_of_all(times[config]):8.2f}"
            if config in RATIOS:
                against, target = RATIOS[config]
                q1, median, q3 = quartiles(round_ratios(times[config], times[against]))
                added = added_us(times[config], times[against])
                goal = f"<={target:.2f}" if target else ""
                row += (f" {median:7.3f} {f'[{q1:.3f}, {q3:.3f}]':>15} {against:<8} "
                        f"{added:6.0f} {goal:>6}")
            print(row, flush=True)
            floor = BOOKKEEPING.get(config)
            if floor is not None:
                q1, median, q3 = quartiles(round_ratios(times[config], times[floor]))
                added = added_us(times[config], times[floor])
                print(f"{'':<17} {'':<12} {'':>8} {median:7.3f} "
                      f"{f'[{q1:.3f}, {q3:.3f}]':>15} {floor:<8} {added:6.0f}", flush=True)


if __name__ == "__main__":
    main()
