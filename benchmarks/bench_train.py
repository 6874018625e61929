"""Milliseconds per training step: plain PyTorch against centralstore on logical CPU devices.

Compares, in one run and interleaved step by step (this machine is shared and noisy):
  plain        a plain PyTorch loop on the full batch
  halves       the same loop doing two half-batch passes that accumulate gradients
               (the floor for R = 2: the same arithmetic as two replicas)
  cs R=1       CentralStorageStrategy on one device
  cs R=2       CentralStorageStrategy on cpu:0 and cpu:1
on an MLP, a CNN with BatchNorm and a small transformer (framework cost decides its time),
and on the transformer again with its forward and loss ``torch.compile``d in every
configuration ("transformer-compiled": the counterpart of a ``@tf.function`` step).
``plain again`` is a second instance of plain: its ratio states the run's noise.
The configurations take turns step by step, each step timed alone, in an order drawn afresh
for every step (``take_turns``); every round builds the eager configurations anew and warms
them, and a ratio is the median over the rounds of each round's ratio of medians; ms/step is
the median of all steps. Every step follows another configuration's (whose model and
activations left the caches cold), so each pays for the switch alike. (An earlier version
timed blocks of 20 steps per configuration and took the median of the blocks' means: the
machine's changes of speed between blocks, and one slow step in a block, moved the small
transformer's R=2 / halves from 0.90 to 1.17 over three runs of the same code, where the
medians of the steps read 0.93 to 1.03. The next kept one instance per configuration for the
whole run, in an order reversed every round, which ``bench_models.py`` found biased by the
instance.) The compiled transformer's configurations are built once.
Peak memory is measured per configuration in a fresh subprocess: the highest resident set
size sampled every millisecond during 5 training steps, above what the process held after
building the model and its optimizer (large tensors are mapped and unmapped as they live and
die, so the RSS follows the live tensors).

The timings run with glibc's mmap threshold fixed, by ``cs.keep_host_memory()``
(``--default-malloc`` leaves it dynamic).
By default glibc serves a large block from a fresh ``mmap``, page faults included, until a
block that large has been freed, and then from its heap; so which configurations ran before
decided whether the CNN's 25 MB activations cost page faults: its plain step took 68 ms
alone and 83 to 102 ms in a process that also ran the others. A fixed threshold gives every
configuration the same allocator.

    python benchmarks/bench_train.py [--steps 10] [--rounds 10] [--models mlp cnn ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

import centralstore as cs
from centralstore.cli import at_least

BATCH = 512


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


class Transformer(nn.Module):
    """An op-heavy small model: 2 encoder layers (d=64, 4 heads, feed-forward 128, no
    dropout) over sequences of 16, mean-pooled into 10 classes. Framework cost, not matrix
    products, decides its step time."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


# name -> (model, global batch, one example's shape, optimizer)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, tuple[int, ...], type]] = {
    "mlp": (mlp, BATCH, (784,), torch.optim.SGD),
    "cnn": (cnn, BATCH, (784,), torch.optim.SGD),
    "transformer": (Transformer, 32, (16, 64), torch.optim.Adam),
    "transformer-compiled": (Transformer, 32, (16, 64), torch.optim.Adam),
}


def make_optimizer(
    kind: type, model: nn.Module, foreach: bool | None = None, fused: bool | None = None
) -> torch.optim.Optimizer:
    """The models' optimizer of ``kind``, in its default implementation or, with
    ``foreach=True`` or ``fused=True``, in that one."""
    if kind is torch.optim.SGD:
        return torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9, foreach=foreach, fused=fused
        )
    return torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach, fused=fused)


def compiled_if(
    model_name: str, config: str, fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``fn`` compiled for the "-compiled" models, with static shapes and a code object of
    its own: dynamo keeps its compiled graphs per code object, and the configurations' step
    functions share theirs (plain and halves one, cs R=1 and R=2 another), so each call
    would first check the guards of another configuration's graph (and dynamo would make
    the batch dimension dynamic on seeing a second batch size), as one process training one
    configuration never does."""
    if not model_name.endswith("-compiled"):
        return fn
    fn.__code__ = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{config.replace(' ', '_')}")
    return torch.compile(fn, dynamic=False)


def make_step(config: str, model_name: str) -> Callable[[], None]:
    """One training step of ``config`` on ``model_name``, ready to time."""
    torch.manual_seed(0)
    build, batch, shape, optimizer_kind = MODELS[model_name]
    half = batch // 2
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    loss_fn = nn.functional.cross_entropy
    if config in ("plain", "plain again", "halves"):
        model = build()
        optimizer = make_optimizer(optimizer_kind, model)
        parts = [(x, y)] if config != "halves" else [(x[:half], y[:half]), (x[half:], y[half:])]
        plain_loss = compiled_if(
            model_name, config, lambda xs, ys: loss_fn(model(xs), ys, reduction="sum") / batch
        )

        def plain_step() -> None:
            optimizer.zero_grad()
            for xs, ys in parts:
                plain_loss(xs, ys).backward()
            optimizer.step()

        return plain_step
    replicas = int(config[-1])
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = build()
        optimizer = make_optimizer(optimizer_kind, model)
    if replicas == 1:
        args: tuple[object, ...] = (x, y)
    else:
        args = (cs.PerReplica([x[:half], x[half:]]), cs.PerReplica([y[:half], y[half:]]))

    def replica_loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        per_example = loss_fn(model(xs), ys, reduction="none")
        return cs.compute_average_loss(per_example, global_batch_size=batch)

    loss = compiled_if(model_name, config, replica_loss)

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        loss(xs, ys).backward()

    def cs_step() -> None:
        optimizer.zero_grad()
        strategy.run(replica_step, args=args)
        optimizer.step()

    return cs_step


CONFIGS = ("plain", "plain again", "halves", "cs R=1", "cs R=2")



def time_steps(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def time_step(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


WARM = 5  # steps of a rebuilt configuration before it is timed


def take_turns(
    make: Callable[[str], Callable[[], None]],
    configs: Sequence[str],
    rounds: int,
    steps: int,
    timer: Callable[[Callable[[], None]], float],
    made: dict[str, Callable[[], None]] | None = None,
    rebuild: bool = True,
    block: int = 1,
) -> dict[str, list[list[float]]]:
    """Each configuration's step times, round by round: in every round the configurations
    take turns step by step, in an order drawn afresh for every step, and every round but
    the first (which times ``made``, when given) builds them anew with ``make``, in a drawn
    order, and warms each for a few steps. An instance's luck (where its tensors lie) would
    otherwise stay with its configuration for the whole run: kept, with a fixed order
    reversed every round, it read identical code at 0.976 to 1.039 of itself
    (``bench_models.py``). ``rebuild`` False keeps the first instances (compiled ones, which
    a new instance would compile again).

    ``block`` > 1: a turn is that many consecutive steps of one configuration, the first
    untimed (it follows another configuration's step) and the others timed, as a training
    loop runs them; a round still times ``steps`` steps of each (``steps`` rounded up to
    whole turns). Taking turns step by step times every step right after another
    configuration's, on caches that step has filled."""
    if block < 1:
        raise ValueError(f"block must be at least 1 step per turn, got {block}")
    timed = max(block - 1, 1)  # timed steps per turn
    turns = -(-steps // timed)
    rng = random.Random(0)

    def build() -> dict[str, Callable[[], None]]:
        order = list(configs)
        rng.shuffle(order)
        built = {config: make(config) for config in order}
        for step in built.values():
            time_steps(step, WARM)
        return built

    current = build() if made is None else made
    times: dict[str, list[list[float]]] = {config: [] for config in configs}
    for round_ in range(rounds):
        if round_ and rebuild:
            current = build()
        gc.collect()
        this_round: dict[str, list[float]] = {config: [] for config in configs}
        for _ in range(turns):
            order = list(configs)
            rng.shuffle(order)
            for config in order:
                step = current[config]
                if block > 1:
                    step()
                for _ in range(timed):
                    this_round[config].append(timer(step))
        for config, samples in this_round.items():
            times[config].append(samples)
    return times


def round_ratios(times: list[list[float]], baseline: list[list[float]]) -> list[float]:
    """Each round's median over its baseline's (a round's configurations share the machine's
    state and the round's instances)."""
    return [
        statistics.median(t) / statistics.median(b) for t, b in zip(times, baseline, strict=True)
    ]


def ratio(times: list[list[float]], baseline: list[list[float]]) -> float:
    """The median over the rounds of ``round_ratios``."""
    return statistics.median(round_ratios(times, baseline))


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The first quartile, the median and the third quartile of ``values`` (one value is all
    three: a run of one round)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def median_of_all(times: list[list[float]]) -> float:
    return statistics.median(t for samples in times for t in samples)


def peak_rss_mb(config: str, model_name: str, steps: int) -> float:
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import bench_train as b;"
        f"print(b.measure_peak(b.make_step({config!r}, {model_name!r}), {steps}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_peak(step: Callable[[], None], steps: int) -> float:
    """MB of resident memory above the level before training, sampled while ``steps`` run."""
    baseline, peak, done = _rss_mb(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for _ in range(steps):
        step()
    done.set()
    sampler.join()
    return peak[0] - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--rounds", type=at_least(1), default=10)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's mmap threshold dynamic (see above)")
    options = parser.parse_args()
    fixed = not options.default_malloc and cs.keep_host_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"batch {BATCH} (transformers: 32), {options.steps} steps x {options.rounds} rounds, "
          f"medians, mmap threshold {'fixed' if fixed else 'dynamic'}\n")
    header = f"{'config':<11} {'ms/step':>8} {'/plain':>7} {'/halves':>8} {'+peak MB':>8}"
    print(f"{'model':<20} {header}")
    for model_name in options.models:
        times = take_turns(
            functools.partial(make_step, model_name=model_name), CONFIGS, options.rounds,
            options.steps, time_step, rebuild=not model_name.endswith("-compiled"),
        )
        for config in CONFIGS:
            memory = (
                "" if options.no_memory or config == "plain again"
                else f"{peak_rss_mb(config, model_name, 5):8.0f}"
            )
            print(f"{model_name:<20} {config:<11} {median_of_all(times[config]):8.2f} "
                  f"{ratio(times[config], times['plain']):7.3f} "
                  f"{ratio(times[config], times['halves']):8.3f} {memory}", flush=True)


if __name__ == "__main__":
    main()
