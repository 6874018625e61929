"""Multi-worker cost on gloo over loopback: against DDP, step time, bytes per step, all-reduce.

Four tables:
  vs DDP      MultiWorkerCentralStorageStrategy against torch.nn.parallel.DistributedDataParallel in
              the same two worker processes, on the MLP 784-1024-1024-10 (global batch 512, SGD), on
              bench_train.py's small transformer (global batch 32, Adam), on a recommender whose two
              100,000 x 32 tables have sparse gradients (global batch 512, SGD, which steps sparse
              gradients as they are; DDP sends their entries only) and on a CNN of twenty
              convolutions with batch norm (global batch 32 of 16 x 16 images, SGD; its running
              statistics are combined across the workers by their aggregation, where DDP broadcasts
              worker 0's before each forward); with ``--models wide``, not by default, on an
              MLP 784-4096-4096-10 (global batch 64, SGD), whose 80 MB of gradients a step are
              past glibc's thresholds (a buffer made afresh at every step has its pages faulted
              in): W = 2 workers of R = 1 and of R = 2 local replicas
              (DDP always runs one model per process on the worker's half of the batch), and a
              second DDP model in the same processes ("DDP again": its ratio to DDP states the run's
              noise); at R = 2 also DDP making the two replicas' passes over their slices one after
              the other, under ``no_sync`` but the last ("DDP slices": the floor that the smaller
              batches set, with or without this strategy). They take turns step by step in an
              order drawn for every step (the same on every worker), so all see the same load on
              a shared machine; each round times
              ``--steps`` steps of each; the table gives the median over ``--rounds`` rounds of the
              mean step, and the median over the rounds of each round's ratio; then the same ratios
              of the process's CPU time per step (every thread, gloo's included), which a shared
              machine's load moves less: on 2 cores, CPU that a step spends beyond DDP's costs wall
              time only when the cores are busy, so the wall ratio moves with the machine's load and
              the CPU ratio says what is left.
  accumulation
              the MLP and the transformer (of ``--models``) at W = 2 x R = 1 (R: the
              ``--accumulation-replicas``), each step
              accumulating 4 global batches before the optimizer step: this strategy with a
              ``run`` per micro-batch (each run's sync point exchanges) and with one ``run``
              whose step function loops over the micro-batches (docs/porting.md: one
              exchange a step), against DDP under ``no_sync`` for all but the last
              micro-batch and DDP exchanging each; in drawn turns as above (each way of this
              strategy in processes of its own), ratios to DDP under ``no_sync``.
  steps       the MLP with W = 1 and W = 2 worker processes (R local replicas each, the host's
              cores split between them), against a plain PyTorch loop; milliseconds per step
              (median), and what each worker gives to collectives per step (payload; a ring
              all-reduce puts about 2 (W-1)/W times that on the wire).
  all-reduce  torch.distributed.all_reduce (SUM) of one flat float32 gradient buffer of
              1 to 100 MB between 2 gloo processes: milliseconds (median) and bus bandwidth.
  --idioms    instead of the tables above: each idiom of ``bench_idioms.py`` (hooks, a frozen
              half, a fused optimizer, clipping, an EMA copy of the model, checkpointing,
              autocast, weight norm, an LSTM, sparse gradients, channels last) at W = 2 x R = 1
              against DDP in the same two processes (the idiom's network in DDP, its EMA copy
              beside it), global batch 32, in drawn turns; with what a step of this strategy
              sends, against the bytes of the gradients of what it trains: a variable sent
              that no step trains (the EMA copy's) shows as more. A second DDP instance
              ("DDP again") states the run's noise.
  --gpu       instead of the tables above: two gloo workers whose replica is a GPU (each
              worker's ``cuda:LOCAL_RANK``, modulo the GPUs there are) with the variables in
              host memory, on the MLP 784-1024-1024-10 (7 MB of gradients: one pinned
              bucket, copied with the last gradient) and a wide MLP 784-4096-4096-10 (80 MB:
              five pinned buckets, copied as they fill); the step with the buckets leaving
              during backward against the same step with every bucket held for the sync
              point, in drawn turns. ``--fake-gpus``: the same on the test suite's fake
              GPUs, to try the script without one (their kernels run on the host, so the
              ratio says nothing of a GPU's).

    python benchmarks/bench_multiworker.py [--steps 10] [--rounds 7] [--sizes-mb 1 4 16 64 100]
                                           [--models mlp transformer recommender bn wide]
                                           [--accumulation-replicas 1]
    python benchmarks/bench_multiworker.py --idioms [none EMA ...] [--steps 10] [--rounds 7]
    python benchmarks/bench_multiworker.py --gpu [--fake-gpus] [--steps 10] [--rounds 7]

Each configuration runs in fresh processes started like torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); the numbers come back as JSON on worker 0's stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from bench_train import Transformer
from torch import nn

import centralstore as cs
from centralstore.cli import at_least
from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

BATCH = 512
MB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, args: list[str], threads: int) -> dict[str, float]:
    """Run this script's worker side in ``world`` processes; worker 0's JSON result."""
    port = str(_free_port())
    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "OMP_NUM_THREADS": str(threads)}
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", *args],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)},
            stdout=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"a worker failed: exit codes {[p.returncode for p in processes]}")
    result: dict[str, float] = json.loads(outputs[0].strip().splitlines()[-1])
    return result


# -- worker side ----------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def _worker_steps(config: str, steps: int, local: int) -> dict[str, float]:
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    if config == "plain":
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / BATCH
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()

        traffic: MultiWorkerCentralStorageStrategy | None = None
    else:
        devices = [f"cpu:{i}" for i in range(local)]
        strategy = MultiWorkerCentralStorageStrategy(devices, timeout=120)
        with strategy.scope():
            model = _mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

        def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
            per_example = nn.functional.cross_entropy(model(xs), ys, reduction="none")
            loss = cs.compute_average_loss(per_example, global_batch_size=BATCH)
            loss.backward()  # type: ignore[no-untyped-call]

        def step() -> None:
            optimizer.zero_grad()
            strategy.run(replica_step, args=batch)
            optimizer.step()

        traffic = strategy
    for _ in range(3):
        step()
    before = traffic.traffic if traffic is not None else None
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result = {"ms": 1000 * statistics.median(times)}
    if traffic is not None and before is not None:
        after = traffic.traffic
        result["bytes"] = (after["bytes"] - before["bytes"]) / steps
        result["collectives"] = (after["collectives"] - before["collectives"]) / steps
        dist.destroy_process_group()
    return result


class _Recommender(nn.Module):
    """Users' and items' tables of 100,000 x 32 with sparse gradients (12.8 MB each, dense)
    and a small MLP over the pair: each step touches a few hundred rows of each table."""

    ROWS = 100_000

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(self.ROWS, 32, sparse=True)
        self.items = nn.Embedding(self.ROWS, 32, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.mlp(
            torch.cat([self.users(ids[:, 0]), self.items(ids[:, 1])], dim=1)
        )
        return scores


def _batch_norm_cnn() -> nn.Module:
    """Twenty 3x3 convolutions of 16 channels, each followed by batch norm (whose running
    statistics every run writes) and a ReLU, on 16 x 16 images."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    for _ in range(19):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _inputs(shape: tuple[int, ...], batch: int) -> torch.Tensor:
    """The global batch: ids for the recommender (shape ``(2,)``), else normal floats."""
    if shape == (2,):
        return torch.randint(0, _Recommender.ROWS, (batch, 2))
    return torch.randn(batch, *shape)


def _wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 10))


# name -> (model, global batch, one example's shape, optimizer)
_DDP_MODELS: dict[str, tuple[Any, int, tuple[int, ...], Any]] = {
    "mlp": (_mlp, BATCH, (784,), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
    "transformer": (Transformer, 32, (16, 64), lambda p: torch.optim.Adam(p, lr=1e-3)),
    "recommender": (_Recommender, 512, (2,), lambda p: torch.optim.SGD(p, lr=0.1)),
    "bn": (_batch_norm_cnn, 32, (3, 16, 16), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
    "wide": (
        _wide_mlp, 64, (784,), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)
    ),
}
DEFAULT_MODELS = ["mlp", "transformer", "recommender", "bn"]  # "wide" on request: 80 MB


def _in_turns(
    steps_of: dict[str, Callable[[], None]], steps: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run the steps in turns, step by step in an order drawn for every step (the same seed
    on every worker, so they step in the same order and all see one load), after two
    untimed turns: per step name, each round's mean wall-clock ms, and its mean ms of the
    process's CPU time (every thread, gloo's included)."""
    for _ in range(2):
        for step in steps_of.values():
            step()
    draw = random.Random(0)
    means: dict[str, list[float]] = {name: [] for name in steps_of}
    cpu: dict[str, list[float]] = {name: [] for name in steps_of}
    for _ in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in steps_of}
        cpu_times: dict[str, list[float]] = {name: [] for name in steps_of}
        for _ in range(steps):
            order = list(steps_of)
            draw.shuffle(order)
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                steps_of[name]()
                times[name].append(1000 * (time.perf_counter() - start))
                cpu_times[name].append(1000 * (time.process_time() - start_cpu))
        for name, values in times.items():
            means[name].append(statistics.fmean(values))
            cpu[name].append(statistics.fmean(cpu_times[name]))
    return means, cpu


def _median_ratio(rounds_a: list[float], rounds_b: list[float]) -> float:
    """The median over the rounds of each round's ratio."""
    return statistics.median(a / b for a, b in zip(rounds_a, rounds_b, strict=True))


def _cs_step(
    strategy: MultiWorkerCentralStorageStrategy, model: nn.Module,
    optimizer: torch.optim.Optimizer, inputs: Any, batch: int, gpu: bool = False,
) -> Callable[[], None]:
    """One training step of ``model`` in ``strategy`` on ``inputs`` (a global batch of
    ``batch``); with ``gpu``, ending when the GPU has finished."""

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(xs), ys, reduction="none")
        cs.compute_average_loss(per_example, global_batch_size=batch).backward()  # type: ignore[no-untyped-call]

    def step() -> None:
        optimizer.zero_grad()
        strategy.run(replica_step, args=inputs)
        optimizer.step()
        if gpu:
            torch.cuda.synchronize()

    return step


def _worker_ddp(model_name: str, local: int, steps: int, rounds: int) -> dict[str, float]:
    """This strategy and DDP in the same processes, alternating: ms per step of each."""
    build, batch, shape, make_optimizer = _DDP_MODELS[model_name]
    torch.manual_seed(0)
    x, y = _inputs(shape, batch), torch.randint(0, 10, (batch,))
    strategy = MultiWorkerCentralStorageStrategy(
        [f"cpu:{i}" for i in range(local)], timeout=120
    )
    rank, world = strategy.worker_index, strategy.num_workers
    torch.manual_seed(1)
    with strategy.scope():
        model = build()
        optimizer = make_optimizer(model.parameters())
    inputs = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    cs_step = _cs_step(strategy, model, optimizer, inputs, batch)
    share = batch // world
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def ddp_step_of(slices: int = 1) -> Callable[[], None]:
        """DDP's step on the worker's share, or in ``slices`` passes over it (the local
        replicas' slices, one after another, under ``no_sync`` but the last)."""
        torch.manual_seed(1)
        ddp = nn.parallel.DistributedDataParallel(build())
        ddp_optimizer = make_optimizer(ddp.parameters())
        parts = list(zip(xs.tensor_split(slices), ys.tensor_split(slices), strict=True))

        def ddp_step() -> None:
            ddp_optimizer.zero_grad()
            for k, (x_part, y_part) in enumerate(parts):
                with ddp.no_sync() if k < slices - 1 else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(ddp(x_part), y_part) / slices
                    loss.backward()  # type: ignore[no-untyped-call]
            ddp_optimizer.step()

        return ddp_step

    # "again": a second DDP model in the same processes; its ratio to DDP is the run's noise.
    # "slices": with several local replicas, DDP doing their passes one after another: the
    # floor that the smaller batches set, with or without this strategy.
    steps_of = {"cs": cs_step, "ddp": ddp_step_of(), "again": ddp_step_of()}
    if local > 1:
        steps_of["slices"] = ddp_step_of(local)
    means, cpu = _in_turns(steps_of, steps, rounds)
    result = {name: statistics.median(values) for name, values in means.items()}
    for name in ("cs", "again"):
        result[f"{name} / ddp"] = _median_ratio(means[name], means["ddp"])
        result[f"{name} / ddp cpu"] = _median_ratio(cpu[name], cpu["ddp"])
    if local > 1:
        result["cs / slices"] = _median_ratio(means["cs"], means["slices"])
        result["slices / ddp"] = _median_ratio(means["slices"], means["ddp"])
    return result


MICRO_BATCHES = 4


def _worker_accumulate(
    model_name: str, looping: bool, steps: int, rounds: int, local: int = 1
) -> dict[str, float]:
    """Steps that accumulate ``MICRO_BATCHES`` global batches, in turns: this strategy with a
    ``run`` per micro-batch (each exchanges) or, ``looping``, with one ``run`` whose step
    loops over the micro-batches (one exchange), DDP under ``no_sync`` for all but the last
    micro-batch and DDP exchanging every one. ms per step (median over the rounds of each
    round's mean). The two ways of this strategy run in processes of their own: a run that
    calls backward several times leaves no bucket to start early, and its strategy learns
    to stop trying, which the other way would pay."""
    build, batch, shape, make_optimizer = _DDP_MODELS[model_name]
    torch.manual_seed(0)
    micro = [(_inputs(shape, batch), torch.randint(0, 10, (batch,)))
             for _ in range(MICRO_BATCHES)]
    strategy = MultiWorkerCentralStorageStrategy(
        [f"cpu:{i}" for i in range(local)], timeout=120
    )
    rank, world = strategy.worker_index, strategy.num_workers
    torch.manual_seed(1)
    with strategy.scope():
        model = build()
        optimizer = make_optimizer(model.parameters())
    each = [next(iter(strategy.experimental_distribute_dataset([mb]))) for mb in micro]
    share = batch // world
    # one global batch whose worker slices are the worker's slices of every micro-batch
    joined = tuple(
        torch.cat([torch.cat([mb[k][w * share : (w + 1) * share] for mb in micro])
                   for w in range(world)])
        for k in (0, 1)
    )
    whole = next(iter(strategy.experimental_distribute_dataset([joined])))

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(xs), ys, reduction="none")
        loss = cs.compute_average_loss(per_example, global_batch_size=batch * MICRO_BATCHES)
        loss.backward()  # type: ignore[no-untyped-call]

    def looping_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        for x_part, y_part in zip(xs.tensor_split(MICRO_BATCHES), ys.tensor_split(MICRO_BATCHES),
                                  strict=True):
            replica_step(x_part, y_part)

    def cs_step() -> None:
        optimizer.zero_grad()
        if looping:
            strategy.run(looping_step, args=whole)
        else:
            for inputs in each:
                strategy.run(replica_step, args=inputs)
        optimizer.step()

    mine = [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])
            for x, y in micro]
    torch.manual_seed(1)
    ddp = nn.parallel.DistributedDataParallel(build())
    ddp_optimizer = make_optimizer(ddp.parameters())

    def ddp_step(no_sync: bool) -> None:
        ddp_optimizer.zero_grad()
        for i, (x, y) in enumerate(mine):
            last = i == len(mine) - 1
            with ddp.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(ddp(x), y) / MICRO_BATCHES
                loss.backward()  # type: ignore[no-untyped-call]
        ddp_optimizer.step()

    steps_of: dict[str, Callable[[], None]] = {
        "cs": cs_step, "ddp no_sync": lambda: ddp_step(True), "ddp each": lambda: ddp_step(False),
    }
    means, _ = _in_turns(steps_of, steps, rounds)
    result = {name: statistics.median(values) for name, values in means.items()}
    for name in ("cs", "ddp each"):
        result[f"{name} / no_sync"] = _median_ratio(means[name], means["ddp no_sync"])
    return result


def _worker_allreduce(sizes_mb: list[float], reps: int) -> dict[str, float]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rows = {}
    for size in sizes_mb:
        flat = torch.ones(int(size * MB) // 4)
        dist.all_reduce(flat)  # warm-up: connections and buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - start)
        rows[str(size)] = 1000 * statistics.median(times)
    dist.destroy_process_group()
    return rows


_GPU_MODELS = {"mlp": _mlp, "wide mlp": _wide_mlp}


def _worker_gpu(steps: int, rounds: int, fake: bool) -> dict[str, float]:
    """``--gpu``: per model, ms per step with the buckets leaving during backward and held
    for the sync point, and the median ratio of the two."""
    if fake:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        import fakegpu

        gpus: Any = fakegpu.FakeGPUs(1)
    else:
        gpus = contextlib.nullcontext()
    result: dict[str, float] = {}
    with gpus:
        device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
        torch.manual_seed(0)
        x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
        for name, build in _GPU_MODELS.items():
            steps_of = {}
            for way in ("early", "held"):
                strategy = MultiWorkerCentralStorageStrategy(
                    [device], parameter_device="cpu", timeout=120
                )
                if way == "held":
                    strategy._collectives._arm = lambda store: None  # type: ignore[method-assign]
                torch.manual_seed(1)
                with strategy.scope():
                    model = build()
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                inputs = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
                steps_of[way] = _cs_step(strategy, model, optimizer, inputs, BATCH, gpu=True)
            means, _ = _in_turns(steps_of, steps, rounds)
            for way, values in means.items():
                result[f"{name} {way}"] = statistics.median(values)
            result[f"{name} early / held"] = _median_ratio(means["early"], means["held"])
    return result


IDIOM_BATCH = 32


def _idiom_steps(
    name: str,
) -> tuple[MultiWorkerCentralStorageStrategy, list[nn.Parameter], Callable[[], None],
           Callable[[], Callable[[], None]]]:
    """``bench_idioms.IDIOMS[name]`` trained with a strategy of its own (W workers x 1
    replica) and with DDP (the idiom's network wrapped, its EMA copy beside it, as a DDP
    program keeps one): the strategy, what it trains, its step, and what makes a DDP
    instance's step."""
    import torch.nn.functional as F
    from bench_idioms import IDIOMS, mean_metric
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    idiom = IDIOMS[name]
    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=120)
    rank, world = strategy.worker_index, strategy.num_workers
    generator = torch.Generator().manual_seed(0)
    x = idiom.inputs(IDIOM_BATCH, generator)
    y = torch.randint(0, 10, (IDIOM_BATCH,), generator=generator)
    precision: Callable[[], Any] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if idiom.autocast
        else contextlib.nullcontext
    )

    def trainer(model: nn.Module, averaged: nn.Module) -> tuple[list[nn.Parameter], Any, Any]:
        trained = [p for p in model.parameters() if p.requires_grad]
        ema = (
            AveragedModel(averaged, multi_avg_fn=get_ema_multi_avg_fn(0.999)) if idiom.ema
            else None
        )
        return trained, idiom.optimizer(trained), ema

    def finish(trained: list[nn.Parameter], optimizer: Any, ema: Any, model: nn.Module) -> None:
        if idiom.clip:
            nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        if ema is not None:
            ema.update_parameters(model)

    torch.manual_seed(1)
    with strategy.scope():
        model = idiom.build()
        trained, optimizer, ema = trainer(model, model)
        metric = mean_metric() if idiom.metric else None
    inputs = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        with precision():
            logits = model(xs)
        loss = F.cross_entropy(logits.float(), ys, reduction="sum") / IDIOM_BATCH
        loss.backward()  # type: ignore[no-untyped-call]
        if metric is not None:
            metric.update(loss.detach())

    def cs_step() -> None:
        optimizer.zero_grad()
        strategy.run(replica_step, args=inputs)
        finish(trained, optimizer, ema, model)

    share = IDIOM_BATCH // world
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]

    def ddp_step_of() -> Callable[[], None]:
        torch.manual_seed(1)
        ddp = nn.parallel.DistributedDataParallel(idiom.build())
        ddp_trained, ddp_optimizer, ddp_ema = trainer(ddp, ddp.module)
        ddp_metric = mean_metric() if idiom.metric else None

        def ddp_step() -> None:
            ddp_optimizer.zero_grad()
            with precision():
                logits = ddp(xs)
            # DDP averages over the workers: each worker's sum over the global batch, times W
            loss = F.cross_entropy(logits.float(), ys, reduction="sum") * world / IDIOM_BATCH
            loss.backward()  # type: ignore[no-untyped-call]
            if ddp_metric is not None:
                ddp_metric.update(loss.detach())
            finish(ddp_trained, ddp_optimizer, ddp_ema, ddp.module)

        return ddp_step

    return strategy, trained, cs_step, ddp_step_of


def _worker_idioms(names: list[str], steps: int, rounds: int) -> dict[str, float]:
    """Each idiom of ``names`` with this strategy and with DDP (``_idiom_steps``; a second
    DDP instance, "again", states the noise), in the same processes, taking turns: ms per
    step (wall and CPU), and the bytes and collectives a step of this strategy sends."""
    result: dict[str, float] = {}
    for name in names:
        strategy, trained, cs_step, ddp_step_of = _idiom_steps(name)
        for _ in range(3):
            cs_step()
        before = strategy.traffic
        for _ in range(steps):
            cs_step()
        after = strategy.traffic
        means, cpu = _in_turns(
            {"cs": cs_step, "ddp": ddp_step_of(), "again": ddp_step_of()}, steps, rounds
        )
        result[f"{name} sent"] = (after["bytes"] - before["bytes"]) / steps
        result[f"{name} collectives"] = (after["collectives"] - before["collectives"]) / steps
        result[f"{name} gradients"] = sum(p.numel() * p.element_size() for p in trained)
        result[f"{name} cs"] = statistics.median(means["cs"])
        result[f"{name} ddp"] = statistics.median(means["ddp"])
        result[f"{name} cs / ddp"] = _median_ratio(means["cs"], means["ddp"])
        result[f"{name} cs / ddp cpu"] = _median_ratio(cpu["cs"], cpu["ddp"])
        result[f"{name} again / ddp"] = _median_ratio(means["again"], means["ddp"])
        del strategy, trained, cs_step, ddp_step_of
        gc.collect()  # the idiom's variables gone before the next strategy's first run
    return result


def _worker(argv: list[str]) -> None:
    if argv[0] == "idioms":
        result = _worker_idioms(argv[3:], int(argv[1]), int(argv[2]))
    elif argv[0] == "gpu":
        result = _worker_gpu(int(argv[1]), int(argv[2]), argv[3] == "fake")
    elif argv[0] == "steps":
        result = _worker_steps(argv[1], int(argv[2]), int(argv[3]))
    elif argv[0] == "ddp":
        result = _worker_ddp(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    elif argv[0] == "accumulate":
        result = _worker_accumulate(
            argv[1], argv[2] == "loop", int(argv[3]), int(argv[4]), int(argv[5])
        )
    else:
        result = _worker_allreduce([float(s) for s in argv[2:]], int(argv[1]))
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result))
    # Skip the interpreter's teardown: freeing DDP's reducer there joins gloo threads that
    # can wait forever (torch 2.13), after the numbers are out.
    sys.stdout.flush()
    os._exit(0)


# -- driver ---------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--rounds", type=at_least(1), default=7)
    parser.add_argument("--reps", type=at_least(1), default=5)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 100])
    parser.add_argument("--models", nargs="+", choices=list(_DDP_MODELS), default=DEFAULT_MODELS,
                        help="the models of the table against DDP")
    parser.add_argument("--accumulation-replicas", type=at_least(1), default=1,
                        help="local replicas of this strategy in the accumulation table (DDP "
                             "makes one pass per micro-batch whatever it is)")
    parser.add_argument("--idioms", nargs="*", metavar="IDIOM",
                        help="only the table of bench_idioms.py's idioms against DDP (all "
                             "without names)")
    parser.add_argument("--gpu", action="store_true",
                        help="only the table of GPU replicas with the variables in host memory")
    parser.add_argument("--fake-gpus", action="store_true",
                        help="with --gpu: on the test suite's fake GPUs")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    threads = max(cores // 2, 1)
    if args.gpu:
        gpu_table(args.steps, args.rounds, args.fake_gpus, threads)
        return
    if args.idioms is not None:
        idioms_table(args.idioms, args.steps, args.rounds, threads)
        return
    print(f"against DistributedDataParallel in the same 2 gloo processes ({threads} thr each), "
          f"in drawn turns: median of {args.rounds} rounds of {args.steps} steps\n")
    print(f"{'model':<12} {'configuration':<14} {'cs ms/step':>11} {'DDP ms/step':>12} "
          f"{'cs / DDP':>9} {'DDP again / DDP':>16} {'CPU: cs / DDP':>14} {'again / DDP':>12} "
          f"{'DDP slices / DDP':>17} {'cs / DDP slices':>16}")
    for model_name in args.models:
        for local in (1, 2):
            row = _launch(
                2, ["ddp", model_name, str(local), str(args.steps), str(args.rounds)], threads
            )
            slices = (
                f"{row['slices / ddp']:>16.3f}x {row['cs / slices']:>15.3f}x" if local > 1
                else f"{'-':>17} {'-':>16}"
            )
            print(f"{model_name:<12} {f'W=2 x R={local}':<14} {row['cs']:>11.2f} "
                  f"{row['ddp']:>12.2f} {row['cs / ddp']:>8.3f}x {row['again / ddp']:>15.3f}x "
                  f"{row['cs / ddp cpu']:>13.3f}x {row['again / ddp cpu']:>11.3f}x {slices}",
                  flush=True)
    local = args.accumulation_replicas
    print(f"\naccumulating {MICRO_BATCHES} global batches a step, W=2 x R={local}, in drawn turns: "
          f"ms/step (median of {args.rounds} rounds of {args.steps} steps) and the ratio to "
          "DDP under no_sync")
    print(f"{'model':<12} {'cs':<15} {'cs ms/step':>11} {'DDP no_sync':>12} {'DDP each':>9} "
          f"{'cs / no_sync':>13} {'DDP each / no_sync':>19}")
    for model_name in [m for m in args.models if m in ("mlp", "transformer")]:
        for way, label in (("runs", "a run each"), ("loop", "one run, loop")):
            row = _launch(
                2, ["accumulate", model_name, way, str(args.steps), str(args.rounds), str(local)],
                threads,
            )
            print(f"{model_name:<12} {label:<15} {row['cs']:>11.2f} {row['ddp no_sync']:>12.2f} "
                  f"{row['ddp each']:>9.2f} {row['cs / no_sync']:>12.3f}x "
                  f"{row['ddp each / no_sync']:>18.3f}x", flush=True)
    print()
    parameters = (784 * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 10 + 10)
    print(f"MLP 784-1024-1024-10 ({parameters:,} parameters, {4 * parameters / MB:.2f} MB of "
          f"float32 gradients), global batch {BATCH}, {cores} cores, gloo on loopback\n")
    print(f"{'configuration':<34} {'ms/step':>8} {'collectives/step':>17} {'payload/step':>14} "
          f"{'wire/step (ring)':>17}")
    configs = [("plain PyTorch, 1 process", "plain", 1, 1),
               ("multi-worker W=1 (R=1)", "mw", 1, 1),
               ("multi-worker W=2 (R=1 each)", "mw", 2, 1),
               ("multi-worker W=2 (R=2 each)", "mw", 2, 2)]
    for label, config, world, local in configs:
        threads = max(cores // world, 1)
        result = _launch(world, ["steps", config, str(args.steps), str(local)], threads)
        ms = result["ms"]
        if "bytes" in result:
            payload = result["bytes"]
            wire = payload * 2 * (world - 1) / world
            print(f"{label + f' ({threads} thr)':<34} {ms:>8.1f} {result['collectives']:>17.0f} "
                  f"{payload / MB:>11.2f} MB {wire / MB:>14.2f} MB")
        else:
            print(f"{label + f' ({threads} thr)':<34} {ms:>8.1f} {'-':>17} {'-':>14} {'-':>17}")
    print(f"\nall_reduce (SUM, float32) between 2 gloo processes, median of {args.reps}")
    print(f"{'size':>8} {'ms':>9} {'bus GB/s':>9}")
    rows = _launch(2, ["allreduce", str(args.reps), *map(str, args.sizes_mb)], max(cores // 2, 1))
    for size, ms in rows.items():
        bus = float(size) * MB * 2 * (2 - 1) / 2 / (ms / 1000) / 1e9
        print(f"{float(size):>6g} MB {ms:>9.2f} {bus:>9.2f}")


def idioms_table(names: list[str], steps: int, rounds: int, threads: int) -> None:
    """``--idioms``: each idiom at W = 2 x R = 1 against DDP, and what a step sends."""
    from bench_idioms import IDIOMS, available

    unknown = sorted(set(names) - set(IDIOMS))
    if unknown:
        raise SystemExit(f"unknown idioms {unknown}: choose from {list(IDIOMS)}")
    names = [name for name in names or list(IDIOMS) if available(name)]
    print(f"bench_idioms.py's idioms at W=2 x R=1 against DistributedDataParallel in the same "
          f"2 gloo processes ({threads} thr each), global batch {IDIOM_BATCH}, in drawn "
          f"turns: median of {rounds} rounds of {steps} steps; what a step of this strategy "
          "sends (bytes, collectives) against the bytes of the gradients it trains\n")
    print(f"{'idiom':<17} {'gradients':>10} {'sent/step':>10} {'sent / grads':>13} "
          f"{'collectives':>12} {'cs ms/step':>11} {'DDP ms/step':>12} {'cs / DDP':>9} "
          f"{'DDP again / DDP':>16} {'CPU: cs / DDP':>14}")
    row = _launch(2, ["idioms", str(steps), str(rounds), *names], threads)
    for name in names:
        gradients, sent = row[f"{name} gradients"], row[f"{name} sent"]
        print(f"{name:<17} {gradients:>10,.0f} {sent:>10,.0f} {sent / gradients:>12.3f}x "
              f"{row[f'{name} collectives']:>12.1f} {row[f'{name} cs']:>11.2f} "
              f"{row[f'{name} ddp']:>12.2f} {row[f'{name} cs / ddp']:>8.3f}x "
              f"{row[f'{name} again / ddp']:>15.3f}x {row[f'{name} cs / ddp cpu']:>13.3f}x",
              flush=True)


def gpu_table(steps: int, rounds: int, fake: bool, threads: int) -> None:
    """``--gpu``: the table of GPU replicas whose variables are in host memory."""
    where = "fake GPUs (kernels on the host: no GPU's ratio)" if fake else "GPUs"
    print(f"2 gloo workers, a replica on a GPU each and the variables in host memory, on "
          f"{where}; global batch {BATCH}, SGD; in drawn turns: median of {rounds} rounds of "
          f"{steps} steps, each ending with torch.cuda.synchronize()\n")
    print(f"{'model':<10} {'early ms/step':>14} {'held ms/step':>13} {'early / held':>13}")
    row = _launch(2, ["gpu", str(steps), str(rounds), "fake" if fake else "real"], threads)
    for name in _GPU_MODELS:
        print(f"{name:<10} {row[f'{name} early']:>14.2f} {row[f'{name} held']:>13.2f} "
              f"{row[f'{name} early / held']:>12.3f}x", flush=True)


if __name__ == "__main__":
    main()
