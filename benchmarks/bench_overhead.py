"""What centralstore's own bookkeeping executes per training step: Python calls and lines.

Timings on a shared machine move by several percent from run to run, more than a change to
the run path saves. The Python a step executes outside the model's own code does not move:
this script counts it, so that a change to ``run``, the sync point or the optimizer-step
hooks shows exactly, and so that the tables of the timing scripts can be read against it.
(It is not a time: Python right after a backward runs several times slower than in a loop,
and a torch call costs far more than a line; see docs/design.md §7.)

For each model and configuration of bench_models.py (its steps, at 4 examples per
replica), one step (after 5 untimed ones) runs under ``sys.settrace``; the calls and lines
of every Python frame are counted, except inside the model's forward and backward (the
step's ``replica_step`` or ``plain_loss``, and ``backward``), inside ``zero_grad`` and
inside the optimizer's own update (its ``step``, not the wrapper torch puts around it, which
runs the hooks); centralstore's code that those reach is counted again (gradient hooks
during backward, calls resolved to replica views), with what it calls.
``plain`` is the same step in plain PyTorch, so ``cs - plain`` is what centralstore adds:
its ``run``, its sync points and its hooks. Models: the demo's CNN, GPT-2 tiny, BERT tiny
and ViT tiny (transformers) and a CNN of ten batch-norm layers, with AdamW; ``cs R=2 x4``
accumulates 4 runs of two replicas per optimizer step.

``--workers`` also counts one step of bench_multiworker.py's small transformer on two gloo
worker processes of one replica each, and DistributedDataParallel's in the same processes
(the count of worker 0; both workers execute the same code).

``--where CONFIG`` lists the functions that execute the most lines in one configuration
(for example ``--where "cnn cs R=2"``).

``--fake-gpus`` counts the GPU path on the test suite's fake CUDA devices (``tests/fakegpu``:
CUDA semantics emulated on the CPU): centralstore's own lines per training step, all of them
(its hooks and views included), for two replicas on ``cuda:0`` and ``cuda:1`` with the
variables on the CPU or on ``cuda:0``, and one replica on ``cuda:0`` with the variables on the
CPU or on its own GPU, on stacks of linear layers and of linear and batch-norm layers, and
on a small stack whose replicas also add their loss to four metric variables (ON_READ); and
the step's CUDA transfers (copies to, from and between devices) and stream and event calls
(records, waits, synchronizations), which a real GPU pays for one by one; and its calls into
``torch.cuda``'s Python (``current_stream``, ``Event``, ``wait_stream``, ``stream``, ...),
each of which runs torch's Python on a real GPU and is not among the lines counted. The
fake devices' own Python is not counted; their tensors are a subclass, which a few of
centralstore's checks send to a general path (the one-replica undo record clones its
buffers; buffer writes to variables on a GPU are combined variable by variable), so a real
GPU may execute fewer.

``--rendezvous`` counts, on every thread (the replica threads' too), the calls and lines of
one ``run`` whose replicas meet once, in a ``merge_call`` of a function that does nothing or
an ``all_reduce`` of a tensor, at R = 2 and 4, beside a run that does not meet: the baton's
hand-offs between threads, which no step above makes.

``--phases`` times where a step's overhead falls instead (wall-clock microseconds, medians
of ``--phase-steps`` steps, cs and plain PyTorch taking turns step by step): from
``strategy.run``'s call to the first line of replica 0's function, from one replica's
return to the next one's first line, from the last replica's return to ``run``'s, and the
optimizer step's sync point (cs's ``optimizer.step()`` less plain's, the same update);
against the whole step's difference from plain (``halves`` at R = 2). Lines cost far more
here than in a loop: the step's kernels have just evicted the code and data they touch.
With ``--views`` the two replicas see views of every variable in the module slots instead
of computing on the parameters (R = 2 only): the path of replicas on GPUs away from the
parameter device and of replicas across workers, whose host bookkeeping logical CPU
devices otherwise never take (the copies a GPU adds are not there). ``--functions`` adds,
under each row, the median time per step inside each of the run path's main functions
(``FUNCTIONS``; the ones the step calls), each wrapped in a timer for the measurement.

``--phases --workers`` times the same phases of the small transformer's step on two gloo
workers of one replica each, against DDP's in the same processes (bench_multiworker.py's
comparison, in drawn turns step by step): for cs, ``run``'s opening (its call to the
replica's first line), the replica's forward and its backward (to the loss's
``backward()`` returning: the gradient buckets start from its hooks), and the sync point
(the replica's return to ``run``'s: the agreement, the wait for the buckets, the fold);
for DDP, its forward (with DDP's own work before it) and its backward (with the
all-reduce it waits for at the end); then the optimizer step, and the whole step. Each
worker prints its row: a worker waits at the sync point for the slower one. Medians, then
tenth percentiles: the quiet steps, where neither worker waited long for the other, show
the fixed cost of each phase. With ``--functions``, ``--phase-steps`` more cs steps then
time the functions of ``WORKER_FUNCTIONS`` (entering and leaving the views, the local
fold, the agreement and its all-gather, the buckets' sums handed out, ``.grad`` set,
``sync_across``, the sync point's exchange around them, the views' gradient hooks, and what
buffers' writes cost: folded locally, noted, carried in the agreement and combined),
printed under each worker's cs row: the median per step, then the tenth percentile (a time
nested in another counts in both; the tenth percentiles of the parts do not add up to the
whole's; a function the step never calls is not printed). ``--worker-model bn`` times
bench_multiworker.py's batch-norm CNN instead of the transformer: its sixty buffers take
the view path's writes.

``--phases --fake-gpus`` times the host's part of the GPU path with the variables in host
memory, on the fake GPUs (whose kernels run on the host, so only the host's work means
anything): for an MLP of 7.5 MB of gradients, one of 42.7 MB in 9.4 MB weights and an
``EmbeddingBag`` of 41 MB (one gradient over a bucket's 16 MiB), at R = 1 on ``cuda:0`` and
R = 2 on ``cuda:0`` and ``cuda:1``, the sync point (from the last replica's backward to
``run``'s return: the wait for the gradient buckets and the fold, which lends them to
``.grad``), the optimizer's update on the host and the whole step, medians of
``--phase-steps`` steps (default 20 here). At R = 2 twice, taking turns step by step: with
the replicas' buckets added up on a helper thread while backward runs (``early``,
``variables/sums.py``), and with that off, added up at the sync point (``held``); the fake
GPUs' backward runs on the host's cores too, beside the helper. ``--accumulate`` makes each
step two runs and times the second's sync point, which finds ``.grad`` filled (the helper
adds the old gradients first, and the sync point copies the sums into ``.grad``).
``--loop K`` makes each replica loop over K micro-batches inside one run (``docs/porting.md``)
and compares, at R = 1 and 2, each pass's gradients but the last held on their GPU, where
the next pass adds to them, and the sum copied once (``hold``, ``GradientBuckets.holds``),
against every pass's gradients copied as they come, the later ones alone, and added on the
host by the fold (``each``): the sync point, the optimizer's step, and the whole step.

``--shares`` bounds what the buffers that replicas share in place cost (``direct_buffers.py``:
batch norm's statistics and counters, small float tables): each model's R = 2 step of
bench_models.py, as it is and with the integers' work, the floats' work or both switched
off (a run's ``SharedIntegers`` / ``SharedFloats`` replaced by a stand-in that does nothing,
so the buffers end wrong: a bound, not a mode), against ``apart`` (the halves keeping their
gradients apart, the semantics' floor). As bench_models.py times: the process's CPU time,
every configuration once a round in a drawn order, ``--share-rounds`` rounds (default
150), medians; and ``--share-instances`` instances of each variant (default 3), built
apart, whose ratios' median and range it prints, since an instance's own offset moves a
ratio by a per cent or so (a single instance of each, in a fixed order, read a 1% gain
that did not exist: benchmarks/README.md).

Every ``--phases`` timing runs with glibc's mmap threshold fixed, as bench_models.py's
(``cs.keep_host_memory()``). On the fake GPUs device memory is the host's heap: with
the threshold dynamic, each step's freed gradients went back to the system and the next
step faulted them in again, which a GPU's caching allocator never does (the EmbeddingBag's
R = 2 step read 64 ms that way, 32 ms fixed).

    python benchmarks/bench_overhead.py [--models cnn gpt2 bert vit bn] [--workers]
        [--where "cnn cs R=2"] [--fake-gpus] [--rendezvous] [--phases [--views]
        [--functions]] [--phase-steps 200]
    python benchmarks/bench_overhead.py --phases --workers [--functions]
        [--worker-model transformer|bn]
    python benchmarks/bench_overhead.py --phases --fake-gpus [--phase-steps 20] [--accumulate]
        [--loop K]
    python benchmarks/bench_overhead.py --shares [--models bn llama] [--share-rounds 150]
        [--share-instances 3]
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch
from bench_models import MODELS, make_step
from torch import nn

import centralstore as cs
from centralstore.cli import at_least

PER_REPLICA = 4
# The model's work (bench_models' replica_step and plain_loss, and every backward; here
# model_work) and zero_grad, counted neither in plain nor in cs
SKIPPED = frozenset({"replica_step", "plain_loss", "backward", "model_work", "zero_grad"})
SKIPPED_CODE: set[Any] = set()  # code objects skipped too: a model's forward under DDP

Counts = tuple[collections.Counter[str], collections.Counter[str]]  # calls, lines by function


def count(step: Callable[[], None]) -> Counts:
    """The Python calls and lines one ``step`` executes, by function, outside the model's
    work (``SKIPPED``, ``SKIPPED_CODE``) and the optimizer's own update, except for
    centralstore's code that these reach (a gradient hook during backward, a call resolved
    to replica views during forward) and what that calls."""
    for _ in range(5):
        step()
    calls: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    counting = [True]  # per running frame: whether it is counted

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if counting[-1]:
            counted = not (
                code.co_name in SKIPPED or code in SKIPPED_CODE
                or (code.co_name == "step" and "torch/optim/" in code.co_filename)
            )
        else:
            counted = "/centralstore/" in code.co_filename
        counting.append(counted)
        where = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"
        if counted:
            calls[where] += 1

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and counted:
                lines[where] += 1
            elif event == "return":
                counting.pop()
            return local

        return local

    _traced(step, tracer)
    return calls, lines


def _traced(step: Callable[[], None], tracer: Callable[..., Any]) -> None:
    """``step`` under ``sys.settrace(tracer)``. Earlier configurations' garbage (a strategy's
    thread pool, its store's finalizers) is collected first and the collector held during
    the step: inside it, their finalizers added up to 35 lines to a count at random."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
        if collecting:
            gc.enable()


# (where it is looked up, its name, the label printed) of the functions ``--functions`` times
FUNCTIONS = [
    ("centralstore.variables.store:VariableStore", "open_run", "open run"),
    ("centralstore.variables.modules:Filled", "_fill_all", "fill parameters"),
    ("centralstore.variables.modules:Filled", "_fill_buffers", "fill buffers"),
    ("centralstore.variables.modules:Filled", "_fill", "fill one by one"),
    ("centralstore.variables.modules:Filled", "empty", "empty slots"),
    ("centralstore.variables.store:VariableStore", "close_run", "close run"),
    ("centralstore.variables.folding", "fold_gradients", "fold gradients"),
    ("centralstore.variables.folding", "apply_writes", "fold writes"),
    ("centralstore.variables.direct:DirectReplicas", "park", "park gradients"),
    ("centralstore.variables.direct:DirectReplicas", "commit", "commit direct"),
]


# the same for ``--phases --workers --functions``: the sync point across workers, split
WORKER_FUNCTIONS = [
    ("centralstore.variables.store:VariableStore", "open_run", "open run"),
    ("centralstore.variables.modules:Filled", "_fill_all", "fill parameters"),
    ("centralstore.variables.modules:Filled", "_fill_buffers", "fill buffers"),
    ("centralstore.variables.modules:Filled", "empty", "empty slots"),
    ("centralstore.variables.store:VariableStore", "close_run", "close run"),
    ("centralstore.strategies._exchange", "sync_across", "sync across"),
    ("centralstore.strategies._exchange:_Layout", "__init__", "layout"),
    ("centralstore.variables.store:VariableStore", "fold", "local fold"),
    ("centralstore.strategies._cross_worker:Collectives", "agree", "agreement"),
    ("centralstore.strategies._cross_worker:Collectives", "all_gather", "its all-gather"),
    ("centralstore.strategies._buckets:EarlyExchange", "exchanged", "sums handed out"),
    ("centralstore.strategies._exchange", "_add_back", "grad set"),
    # what buffers' writes cost (the batch-norm CNN's running statistics and counts)
    ("centralstore.variables.folding", "apply_writes", "writes folded"),
    ("centralstore.strategies._exchange", "local_writes", "writes noted"),
    ("centralstore.strategies._writes:CarriedWrites", "payload", "writes carried"),
    ("centralstore.strategies._writes:CarriedWrites", "combine", "writes combined"),
    # buffers the worker's replicas write in place (``direct_buffers.py``): their values
    # from before the run copied, and their writes combined locally (inside writes noted)
    ("centralstore.variables.direct_buffers:SharedFloats", "__init__", "floats before"),
    ("centralstore.variables.direct_buffers:SharedIntegers", "__init__", "integers before"),
    ("centralstore.variables.direct:DirectReplicas", "commit_buffers", "buffers committed"),
    # the views' gradient hooks, each bucket's packing and start included
    ("centralstore.strategies._buckets:EarlyExchange", "gradient_accumulated", "gradient hooks"),
]


class _Timers:
    """``functions`` (``FUNCTIONS`` by default) wrapped in timers while this is entered:
    ``spent`` is the nanoseconds inside each (by label) since it was last cleared."""

    def __init__(self, functions: list[tuple[str, str, str]] | None = None) -> None:
        self.spent: dict[str, int] = {}
        self._functions = FUNCTIONS if functions is None else functions
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _Timers:
        for where, name, label in self._functions:
            module_name, _, owner_name = where.partition(":")
            owner: Any = importlib.import_module(module_name)
            if owner_name:
                owner = getattr(owner, owner_name)
            function = owner.__dict__[name] if owner_name else getattr(owner, name)
            self._saved.append((owner, name, function))
            setattr(owner, name, self._timed(function, label))
        return self

    def _timed(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        spent, clock = self.spent, time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + clock() - start

        return timed

    def __exit__(self, *exc: object) -> None:
        for owner, name, function in reversed(self._saved):
            setattr(owner, name, function)
        self._saved.clear()


def phase_steps(
    model_name: str, replicas: int, views: bool = False
) -> tuple[Callable[[], list[float]], Callable[[], list[float]]]:
    """One AdamW step of ``model_name`` with ``replicas`` replicas of ``PER_REPLICA``
    examples, and plain PyTorch's passes over the same slices; each returns its phases in
    seconds (see ``--phases``): cs before, between, after, optimizer step, whole step; plain
    optimizer step, whole step. ``views``: the replicas see views (``--views``)."""
    build, inputs, per_example = MODELS[model_name]
    clock = time.perf_counter
    global_batch = PER_REPLICA * replicas
    torch.manual_seed(0)
    x, y = inputs(global_batch)
    slices = [(x[i * PER_REPLICA:(i + 1) * PER_REPLICA], y[i * PER_REPLICA:(i + 1) * PER_REPLICA])
              for i in range(replicas)]
    plain_model = build()
    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)

    def plain_step() -> list[float]:
        start = clock()
        plain_optimizer.zero_grad()
        for xs, ys in slices:
            (per_example(plain_model, xs, ys).sum() / global_batch).backward()
        update = clock()
        plain_optimizer.step()
        end = clock()
        return [end - update, end - start]

    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    if views:  # as replicas on GPUs away from the parameters do (tests/replicas.py)
        strategy._store.on_parameters = (False,) * replicas
        strategy._store.on_storage = (False,) * replicas
    with strategy.scope():
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    arguments = slices[0] if replicas == 1 else (
        cs.PerReplica([xs for xs, _ in slices]), cs.PerReplica([ys for _, ys in slices])
    )
    marks: list[float] = []  # each replica's first line and return

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        marks.append(clock())
        # one expression, so that the graph is freed before the mark, as plain's is
        cs.compute_average_loss(  # type: ignore[no-untyped-call]
            per_example(model, xs, ys), global_batch_size=global_batch
        ).backward()
        marks.append(clock())

    def cs_step() -> list[float]:
        start, called, returned, end = _timed_step(
            strategy, optimizer, replica_step, arguments, marks
        )
        between = sum(marks[i + 1] - marks[i] for i in range(1, len(marks) - 1, 2))
        return [marks[0] - called, between, returned - marks[-1], end - returned, end - start]

    return cs_step, plain_step


def phases(models: list[str], steps: int, views: bool = False, functions: bool = False) -> None:
    """The ``--phases`` table (see the module's docstring); ``views``: ``--views``;
    ``functions``: ``--functions``."""
    print(f"{'model':<6} {'config':<9} {'before':>7} {'between':>8} {'after':>7} "
          f"{'opt step':>9} {'sum':>7} {'step - plain':>13}   (us, wall-clock medians of "
          f"{steps} steps)")
    for model_name in models:
        for replicas in (2,) if views else (1, 2):
            cs_step, plain_step = phase_steps(model_name, replicas, views)
            for _ in range(30):
                cs_step()
                plain_step()
            cs_times, plain_times = [], []
            for i in range(steps):
                if i % 2:
                    cs_times.append(cs_step())
                    plain_times.append(plain_step())
                else:
                    plain_times.append(plain_step())
                    cs_times.append(cs_step())
            inside: dict[str, list[int]] = {}
            if functions:
                with _Timers() as timers:
                    for _ in range(steps):
                        timers.spent.clear()
                        cs_step()
                        for label, spent in timers.spent.items():
                            inside.setdefault(label, []).append(spent)
            c = [statistics.median(column) * 1e6 for column in zip(*cs_times)]
            p = [statistics.median(column) * 1e6 for column in zip(*plain_times)]
            parts = [c[0], c[1], c[2], c[3] - p[0]]
            between = f"{parts[1]:.1f}" if replicas > 1 else "-"
            config = f"R={replicas}" + (" views" if views else "")
            print(f"{model_name:<6} {config:<9} {parts[0]:>7.1f} {between:>8} "
                  f"{parts[2]:>7.1f} {parts[3]:>9.1f} {sum(parts):>7.1f} {c[4] - p[1]:>13.1f}")
            if inside:
                print("    inside: " + ", ".join(
                    f"{label} {statistics.median(times) / 1e3:.1f}"
                    for label, times in inside.items()
                ))


class _Worker(NamedTuple):
    """(In a worker process.) A model (``WORKER_MODELS``) under this strategy, and under
    DDP on this worker's share of the same batch of 32."""

    strategy: cs.Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: Any  # the strategy's distributed batch
    ddp: nn.Module
    ddp_optimizer: torch.optim.Optimizer
    mine: tuple[torch.Tensor, torch.Tensor]  # DDP's share


def _worker_models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """``--worker-model``'s choices: bench_multiworker.py's small transformer and its
    batch-norm CNN (twenty convolutions, each with batch norm, whose running statistics and
    counts every run writes), each with one example's shape."""
    from bench_multiworker import _batch_norm_cnn
    from bench_train import Transformer

    return {"transformer": (Transformer, (16, 64)), "bn": (_batch_norm_cnn, (3, 16, 16))}


WORKER_MODELS = {"transformer": "small transformer", "bn": "batch-norm CNN"}


def _worker(model_name: str = "transformer") -> _Worker:
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    build, shape = _worker_models()[model_name]
    torch.manual_seed(0)
    x, y = torch.randn(32, *shape), torch.randint(0, 10, (32,))
    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=120)
    rank, world = strategy.worker_index, strategy.num_workers
    with strategy.scope():
        model = build()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    ddp = nn.parallel.DistributedDataParallel(build())
    ddp_optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    share = 32 // world
    mine = (x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
    return _Worker(strategy, model, optimizer, inputs, ddp, ddp_optimizer, mine)


def _timed_step(
    strategy: cs.Strategy, optimizer: torch.optim.Optimizer, fn: Callable[..., None],
    args: Any, marks: list[float], zero: bool = True,
) -> tuple[float, float, float, float]:
    """One cs training step (``marks`` cleared before its run): the clock at its start, at
    ``run``'s call and return, and at its end. ``zero``: it begins with ``zero_grad()``
    (else its run adds to the ``.grad`` there)."""
    clock = time.perf_counter
    start = clock()
    if zero:
        optimizer.zero_grad()
    marks.clear()
    called = clock()
    strategy.run(fn, args=args)
    returned = clock()
    optimizer.step()
    return start, called, returned, clock()


def worker_counts() -> dict[str, dict[str, Any]]:
    """(In a worker process started by ``--workers``.) One step of the small transformer
    with this strategy and with DDP."""
    from bench_train import Transformer

    strategy, model, optimizer, inputs, ddp, ddp_optimizer, mine = _worker()

    def model_work(xs: torch.Tensor, ys: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(xs), ys, reduction="none")
        cs.compute_average_loss(per_example, global_batch_size=32).backward()  # type: ignore[no-untyped-call]

    def cs_step() -> None:
        optimizer.zero_grad()
        strategy.run(model_work, args=inputs)
        optimizer.step()

    def ddp_step() -> None:  # DDP's forward wrapper and reducer hooks are counted
        ddp_optimizer.zero_grad()
        outputs = ddp(mine[0])
        model_work_ddp(outputs)
        ddp_optimizer.step()

    def model_work_ddp(outputs: torch.Tensor) -> None:
        nn.functional.cross_entropy(outputs, mine[1]).backward()  # type: ignore[no-untyped-call]

    SKIPPED_CODE.add(Transformer.forward.__code__)  # DDP's forward wrapper counts, not it
    out = {}
    for name, step in (("cs", cs_step), ("DDP", ddp_step)):
        calls, lines = count(step)
        out[name] = {"calls": sum(calls.values()), "lines": sum(lines.values()),
                     "top": lines.most_common(8)}
    return out


WORKER_PHASES = ("opening", "forward", "backward", "sync point", "opt step", "step")


def worker_phases(
    steps: int, functions: bool = False, model_name: str = "transformer"
) -> dict[str, Any]:
    """(In a worker process started by ``--phases --workers``.) Medians and tenth
    percentiles in microseconds of ``WORKER_PHASES`` for cs, then for DDP, over ``steps``
    steps of each in drawn turns, on ``model_name`` (``WORKER_MODELS``); with
    ``functions`` (``--functions``), then ``steps`` more cs steps timing
    ``WORKER_FUNCTIONS`` (``inside``: label -> [median, tenth percentile])."""
    import random

    clock = time.perf_counter
    strategy, model, optimizer, inputs, ddp, ddp_optimizer, (xs, ys) = _worker(model_name)
    marks: list[float] = []  # the replica's first line, forward's end, backward's end

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        marks.append(clock())
        per_example = nn.functional.cross_entropy(model(xs), ys, reduction="none")
        loss = cs.compute_average_loss(per_example, global_batch_size=32)
        marks.append(clock())
        loss.backward()  # type: ignore[no-untyped-call]
        marks.append(clock())

    def cs_step() -> list[float]:
        start, called, returned, end = _timed_step(
            strategy, optimizer, replica_step, inputs, marks
        )
        first, forward, backward = marks
        return [first - called, forward - first, backward - forward, returned - backward,
                end - returned, end - start]

    def ddp_step() -> list[float]:
        start = clock()
        ddp_optimizer.zero_grad()
        called = clock()
        loss = nn.functional.cross_entropy(ddp(xs), ys)
        forward = clock()
        loss.backward()  # type: ignore[no-untyped-call]
        backward = clock()
        ddp_optimizer.step()
        end = clock()
        return [0.0, forward - called, backward - forward, 0.0, end - backward, end - start]

    steps_of = {"cs": cs_step, "ddp": ddp_step}
    times: dict[str, list[list[float]]] = {name: [] for name in steps_of}
    for _ in range(10):
        for step in steps_of.values():
            step()
    draw = random.Random(0)  # the same order on every worker
    for _ in range(steps):
        order = list(steps_of)
        draw.shuffle(order)
        for name in order:
            times[name].append(steps_of[name]())
    columns = [column for name in steps_of for column in zip(*times[name], strict=True)]
    inside: dict[str, list[float]] = {}
    if functions:  # after the timed steps: the timers cost a Python call each
        with _Timers(WORKER_FUNCTIONS) as timers:
            for _ in range(steps):
                timers.spent.clear()
                cs_step()
                for label, spent in timers.spent.items():
                    inside.setdefault(label, []).append(spent / 1e3)
    return {
        "median": [statistics.median(column) * 1e6 for column in columns],
        "p10": [statistics.quantiles(column, n=10)[0] * 1e6 for column in columns],
        "inside": {
            label: [statistics.median(times), statistics.quantiles(times, n=10)[0]]
            for label, times in inside.items()
        },
    }


def count_package(step: Callable[[], None]) -> collections.Counter[str]:
    """centralstore's lines in one ``step`` (after 3 untimed ones), by function: every frame
    of the package, wherever it is called from, and nothing else."""
    for _ in range(3):
        step()
    package = os.path.dirname(cs.__file__) + os.sep
    lines: collections.Counter[str] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return None
        where = f"{code.co_filename[len(package):]}:{code.co_name}"

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                lines[where] += 1
            return local

        return local

    _traced(step, tracer)
    return lines


def rendezvous_counts() -> None:
    """``--rendezvous``: the Python calls and lines of one ``run`` whose replicas meet once,
    on every thread (the replica threads' too), beside a run that does not meet: the
    threaded path's own bookkeeping, which the steps above never take."""
    tensor = torch.ones(4)

    def nothing() -> None:
        return None

    def merge() -> None:
        cs.get_replica_context().merge_call(lambda strategy: None)  # type: ignore[union-attr]

    def all_reduce() -> None:
        cs.get_replica_context().all_reduce(cs.ReduceOp.SUM, tensor)  # type: ignore[union-attr]

    cases = {
        "run(lambda: None)": nothing,
        "run with one merge_call": merge,
        "run with one all_reduce": all_reduce,
    }
    replicas = (2, 4)
    print(f"{'case':<26}" + "".join(f"{f'R={r} calls':>12}{'lines':>8}" for r in replicas))
    for name, fn in cases.items():
        row = f"{name:<26}"
        for r in replicas:
            strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(r)])
            calls, lines = _count_threads(strategy, fn)
            row += f"{calls:>12}{lines:>8}"
        print(row)


def _count_threads(strategy: cs.Strategy, fn: Callable[[], None]) -> tuple[int, int]:
    """The calls and lines of one ``strategy.run(fn)`` (after 5 untraced ones), on every
    thread: the tracer is installed before the strategy's replica threads start."""
    counts = [0, 0]
    tracing = [False]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not tracing[0]:
            return None
        counts[0] += 1

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                counts[1] += 1
            return local

        return local

    threading.settrace(tracer)
    try:
        for _ in range(5):
            strategy.run(fn)
        tracing[0] = True
        _traced(lambda: strategy.run(fn), tracer)
        tracing[0] = False
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    return counts[0], counts[1]


def _training_step(
    devices: list[str], storage: str, model: Callable[[], nn.Module], metrics: int = 0,
) -> tuple[Callable[[], None], int]:
    """A training step of ``model`` built in a strategy on ``devices`` with its variables on
    ``storage``, over a distributed ``DataLoader``; and the model's number of variables.
    ``metrics``: that many ON_READ variables (SUM, as Keras' metrics declare theirs), each
    replica adding its loss to every one at every step."""
    strategy = cs.CentralStorageStrategy(devices, parameter_device=storage)
    torch.manual_seed(0)
    with strategy.scope():
        module = model()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        meters = [
            cs.Variable(torch.zeros(()), aggregation="SUM", trainable=False,
                        synchronization=cs.VariableSynchronization.ON_READ)
            for _ in range(metrics)
        ]
    batches = torch.utils.data.DataLoader(
        # eight steps an epoch: no step counted is an epoch's first, whose iterator is new
        torch.utils.data.TensorDataset(torch.randn(32 * len(devices), 4)),
        batch_size=4 * len(devices),
    )
    source = strategy.experimental_distribute_dataset(batches)
    inputs = iter(source)

    def step() -> None:
        nonlocal inputs
        try:
            (xs,) = next(inputs)
        except StopIteration:
            inputs = iter(source)
            (xs,) = next(inputs)
        optimizer.zero_grad()
        strategy.run(replica, args=(xs,))
        optimizer.step()

    def replica(x: torch.Tensor) -> None:
        loss = module(x).sum()
        loss.backward()
        for meter in meters:
            meter.add_(loss.detach())

    return step, len(list(module.parameters())) + len(list(module.buffers())) + metrics


def count_cuda_python(step: Callable[[], None]) -> int:
    """The calls into ``torch.cuda``'s Python in one run of ``step``, as the fake GPUs
    answer them: each stands for a call of torch's own Python on a real GPU (a
    ``current_stream`` builds a ``Stream``, a ``wait_stream`` an ``Event``), which
    ``count_package`` does not count. The current stream's raw handle, a C function in
    torch, is not counted."""
    fakes = os.path.join("fakegpu", "_cuda.py")
    calls = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal calls
        caller = frame.f_back
        if (
            frame.f_code.co_filename.endswith(fakes) and frame.f_code.co_name != "raw_stream"
            and caller is not None and "fakegpu" not in caller.f_code.co_filename
        ):
            calls += 1
        return None

    _traced(step, tracer)
    return calls


# The CUDA runtime calls of a step that the fake GPUs count and a real GPU pays for each
# (its kernels are not comparable: the fake devices count every op on a fake tensor; a
# ``wait_stream`` counts as CUDA's two calls, an event's record and a wait for it).
_TRANSFERS = ("copy to device", "copy to host", "copy between devices")
_EVENTS = ("Event.record", "Event.synchronize", "Stream.wait_event", "Stream.synchronize",
           "synchronize")


def fake_gpu_counts() -> None:
    """``--fake-gpus``: centralstore's lines per step on the GPU path (module docstring)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    import fakegpu

    def stack(depth: int, norm: bool, frozen: int = 0) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            layers: list[nn.Module] = [nn.Linear(4, 8)]
            for _ in range(depth):
                layers += [nn.Linear(8, 8)] + ([nn.BatchNorm1d(8)] if norm else [])
                layers.append(nn.ReLU())
            for layer in [m for m in layers if isinstance(m, nn.Linear)][:frozen]:
                layer.requires_grad_(False)
            return nn.Sequential(*layers, nn.Linear(8, 2))

        return build

    print(f"{'model':<36} {'placement':<44} {'variables':>9} {'lines':>7} {'per variable':>12} "
          f"{'transfers':>9} {'events':>6} {'torch.cuda':>10}")
    top: collections.Counter[str] = collections.Counter()
    with fakegpu.devices(2) as gpus:
        for depth, norm, frozen, metrics in (
            (2, False, 0, 0), (20, False, 0, 0), (20, False, 16, 0), (10, True, 0, 0),
            (2, False, 0, 4),
        ):
            name = f"{depth} x Linear(8, 8)" + (" + BatchNorm1d" if norm else "") + (
                f", first {frozen} frozen" if frozen else ""
            ) + (f", {metrics} metric variables" if metrics else "")
            for devices, storage in (
                (["cuda:0", "cuda:1"], "cpu"), (["cuda:0", "cuda:1"], "cuda:0"),
                (["cuda:0"], "cpu"), (["cuda:0"], "cuda:0"),
            ):
                step, variables = _training_step(
                    devices, storage, stack(depth, norm, frozen), metrics
                )
                lines = count_package(step)
                before = collections.Counter(gpus.calls)
                cuda_python = count_cuda_python(step)  # the step whose runtime calls count
                calls = collections.Counter()
                for (what, _), n in (collections.Counter(gpus.calls) - before).items():
                    calls[what] += n
                if depth == 20 and not frozen and len(devices) == 2 and storage == "cpu":
                    top = lines
                total = sum(lines.values())
                transfers = sum(calls[kind] for kind in _TRANSFERS)
                events = sum(calls[kind] for kind in _EVENTS)
                placement = f"R = {len(devices)} on {'+'.join(devices)}, variables on {storage}"
                print(f"{name:<36} {placement:<44} {variables:>9} {total:>7} "
                      f"{total / variables:>12.1f} {transfers:>9} {events:>6} {cuda_python:>10}")
    print("\n20 x Linear(8, 8), two GPUs, variables on the CPU: functions by lines")
    for where, n in top.most_common(12):
        print(f"  {n:>6}  {where}")


def _mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(widths):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


SYNC_BATCH = 16  # examples per replica
# ``--phases --fake-gpus``: (the model, an input of one replica). Gradients of 7.5, 42.7 and
# 41 MB: the second's 9.4 MB weights crossed the 16 MiB buckets' ends before each gradient
# landed whole, the embedding's 41 MB spanned three
SYNC_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "MLP 784-1024-1024-10": (
        lambda: _mlp(784, 1024, 1024, 10), lambda: torch.randn(SYNC_BATCH, 784),
    ),
    "MLP 784-1536x5-10": (
        lambda: _mlp(784, *[1536] * 5, 10), lambda: torch.randn(SYNC_BATCH, 784),
    ),
    "EmbeddingBag 20000x512": (
        lambda: nn.Sequential(nn.EmbeddingBag(20000, 512, mode="mean"), nn.Linear(512, 10)),
        lambda: torch.randint(0, 20000, (SYNC_BATCH, 32)),
    ),
}


def fake_gpu_sync_points(steps: int, accumulate: bool = False, loop: int = 1) -> None:
    """``--phases --fake-gpus``: the host's time at the sync point of GPU replicas whose
    variables are in host memory (module docstring); ``accumulate``: two runs a step, the
    sync point the second's, which finds ``.grad`` filled (``--accumulate``); ``loop``: the
    micro-batches each replica loops over inside a run (``--loop``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    import fakegpu

    print(f"{'model':<24} {'placement':<40} {'kind' if loop > 1 else 'sums':<10} "
          f"{'gradients MB':>12} "
          f"{'sync point':>11} {'opt step':>9} {'step':>8}   (ms, medians of {steps} steps "
          "after 3)")
    with fakegpu.devices(2):
        for name, (build, example) in SYNC_MODELS.items():
            for devices in (["cuda:0"], ["cuda:0", "cuda:1"]):
                placement = f"R = {len(devices)} on {'+'.join(devices)}, variables on cpu"
                kinds = (
                    ["hold", "each"] if loop > 1 else ["-"] if len(devices) == 1
                    else ["early", "held"]
                )
                found = _sync_points(build, example, devices, steps, kinds, accumulate, loop)
                for kind, (megabytes, sync, update, step) in zip(kinds, found, strict=True):
                    print(f"{name:<24} {placement:<40} {kind:<10} {megabytes:>12.1f} "
                          f"{sync * 1e3:>11.2f} {update * 1e3:>9.2f} {step * 1e3:>8.2f}")


def _sync_points(
    build: Callable[[], nn.Module], example: Callable[[], torch.Tensor], devices: list[str],
    steps: int, kinds: list[str], accumulate: bool = False, loop: int = 1,
) -> list[tuple[float, float, float, float]]:
    """An SGD step of ``build()`` on ``devices`` with its variables on the CPU, each replica
    on an ``example()``, for each of ``kinds`` (``early``: the replicas' buckets added up
    while backward runs, ``sums.py``; ``held``: at the sync point), the kinds taking turns
    step by step, each its own model: its gradients' megabytes, and the median seconds from
    the last replica's backward to ``run``'s return (the sync point), of
    ``optimizer.step()`` and of the whole step. ``accumulate``: a first run before the
    timed one, whose sync point then finds ``.grad`` filled (the step timed is then the
    second run and the optimizer's step). ``loop``: each replica's backward passes in a run,
    over the same example, the kinds ``hold`` and ``each`` (``--loop``)."""
    timed = []
    for kind in kinds:
        strategy = cs.CentralStorageStrategy(devices, parameter_device="cpu")
        if kind == "held":
            strategy._store._sums = None
        elif kind == "each":  # the hook copies every gradient as it comes
            for replica in strategy._store.replicas:
                replica.gradient_buckets.learns = False
        torch.manual_seed(0)
        with strategy.scope():
            model = build()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        xs = cs.PerReplica([example().to(d) for d in devices])
        marks: list[float] = []

        def replica(x: torch.Tensor, model: nn.Module = model, marks: list[float] = marks) -> None:
            for _ in range(loop):
                model(x).square().mean().backward()
            marks.append(time.perf_counter())

        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        timed.append((strategy, optimizer, replica, xs, marks, megabytes, []))
    for i in range(steps + 3):
        for strategy, optimizer, replica, xs, marks, _, times in (
            timed if i % 2 else reversed(timed)
        ):
            if accumulate:  # the first run, into an empty .grad
                optimizer.zero_grad()
                strategy.run(replica, args=(xs,))
            start, _, returned, end = _timed_step(
                strategy, optimizer, replica, (xs,), marks, zero=not accumulate
            )
            if i >= 3:
                times.append((returned - marks[-1], end - returned, end - start))
    return [
        (megabytes, *(statistics.median(column) for column in zip(*times)))
        for *_, megabytes, times in timed
    ]


class _Inert:
    """``--shares``' stand-in for a run's shared buffers (``SharedIntegers``,
    ``SharedFloats``): it keeps no values, restores nothing and folds nothing."""

    def __init__(self, groups: Any, tensors: list[torch.Tensor], *rest: Any) -> None:
        self.tensors = tensors

    def take(self, replica: int, last: bool) -> None:
        pass

    def put_back(self, replica: int) -> None:
        pass

    def commit(self, report: bool) -> dict[int, Any]:
        return {}

    def restore(self) -> None:
        pass

    def again(self) -> _Inert:
        return self


# --shares' variants: the classes of ``variables/runs.py`` each replaces by ``_Inert``
SHARE_VARIANTS: dict[str, tuple[str, ...]] = {
    "as it is": (),
    "integers' work off": ("SharedIntegers",),
    "floats' work off": ("SharedFloats",),
    "both off": ("SharedIntegers", "SharedFloats"),
}


def shares(models: list[str], rounds: int, instances: int) -> None:
    """The ``--shares`` table (see the module's docstring)."""
    runs_module = importlib.import_module("centralstore.variables.runs")
    clock = time.process_time

    def timed(step: Callable[[], None], switched_off: tuple[str, ...]) -> float:
        saved = [(name, getattr(runs_module, name)) for name in switched_off]
        for name in switched_off:
            setattr(runs_module, name, _Inert)
        try:
            start = clock()
            step()
            return clock() - start
        finally:
            for name, value in saved:
                setattr(runs_module, name, value)

    print(f"{'model':<6} {'cs R=2 / apart':<20} {'median':>7}  range of {instances} instances   "
          f"(CPU time, medians of {rounds} rounds in drawn orders)")
    for model_name in models:
        configs: list[tuple[str, Callable[[], None]]] = [
            ("apart", make_step(model_name, "apart", PER_REPLICA, False))
        ]
        for variant in SHARE_VARIANTS:
            configs += [
                (variant, make_step(model_name, "cs R=2", PER_REPLICA, False))
                for _ in range(instances)
            ]
        for variant, step in configs:
            for _ in range(10):
                timed(step, SHARE_VARIANTS.get(variant, ()))
        times: list[list[float]] = [[] for _ in configs]
        order = list(range(len(configs)))
        draw = random.Random(0)
        for _ in range(rounds):
            draw.shuffle(order)
            for i in order:
                variant, step = configs[i]
                times[i].append(timed(step, SHARE_VARIANTS.get(variant, ())))
        medians = [statistics.median(column) for column in times]
        for variant in SHARE_VARIANTS:
            ratios = sorted(
                medians[i] / medians[0]
                for i, (name, _) in enumerate(configs) if name == variant
            )
            print(f"{model_name:<6} {variant:<20} {statistics.median(ratios):>7.3f}  "
                  f"{ratios[0]:.3f} to {ratios[-1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        default=["cnn", "gpt2", "llama", "bert", "vit", "bn"])
    parser.add_argument("--workers", action="store_true")
    parser.add_argument("--where", default=None, help='e.g. "cnn cs R=2"')
    parser.add_argument("--fake-gpus", action="store_true",
                        help="count the GPU path on the test suite's fake GPUs")
    parser.add_argument("--phases", action="store_true",
                        help="time where the overhead falls instead of counting lines")
    parser.add_argument("--phase-steps", type=at_least(1), default=None,
                        help="steps timed with --phases (default 200; with --fake-gpus 20)")
    parser.add_argument("--views", action="store_true",
                        help="with --phases: the replicas see views, as on GPUs")
    parser.add_argument("--functions", action="store_true",
                        help="with --phases: the time inside the run path's main functions "
                        "(with --workers: the multi-worker sync point's)")
    parser.add_argument("--rendezvous", action="store_true",
                        help="count the lines of a run whose replicas meet (merge_call, "
                        "all_reduce) on every thread")
    parser.add_argument("--worker-model", choices=list(WORKER_MODELS), default="transformer",
                        help="with --phases --workers: the model of the two workers")
    parser.add_argument("--accumulate", action="store_true",
                        help="with --phases --fake-gpus: two runs a step, timing the "
                        "second's sync point, which finds .grad filled")
    parser.add_argument("--loop", type=at_least(1), default=1,
                        help="with --phases --fake-gpus: micro-batches each replica loops "
                        "over inside one run, its gradients held on its GPU or copied each")
    parser.add_argument("--shares", action="store_true",
                        help="time each model's R = 2 step with the shared buffers' work "
                        "switched off (a bound on what it costs) against apart")
    parser.add_argument("--share-rounds", type=at_least(1), default=150,
                        help="with --shares: rounds, each configuration once a round")
    parser.add_argument("--share-instances", type=at_least(1), default=3,
                        help="with --shares: instances of each variant, built apart")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.phase_steps is None:
        options.phase_steps = 20 if options.fake_gpus else 200
    if (options.views or options.functions) and not options.phases:
        parser.error("--views and --functions go with --phases: add --phases")
    if options.worker_model != "transformer" and not (
        options.worker or (options.phases and options.workers)
    ):
        parser.error("--worker-model goes with --phases --workers: add both")
    if options.accumulate and not (options.phases and options.fake_gpus):
        parser.error("--accumulate goes with --phases --fake-gpus: add both")
    if options.loop != 1 and not (options.phases and options.fake_gpus):
        parser.error("--loop goes with --phases --fake-gpus: add both")
    if options.loop < 1:
        parser.error(f"--loop takes a number of micro-batches, 1 or more, not {options.loop}")
    if options.shares and (options.phases or options.workers or options.fake_gpus):
        parser.error("--shares times one process on logical CPU devices: leave out "
                     "--phases, --workers and --fake-gpus")
    if options.views and options.workers:
        parser.error("--views is for one process (across workers every replica sees views "
                     "already): leave out --views or --workers")
    # glibc's heap as bench_models.py times it; on the fake GPUs it stands for a GPU's
    # caching allocator, which does not hand freed gradients back to be faulted in again
    fixed = options.phases and cs.keep_host_memory()
    if options.worker:
        torch.set_num_threads(1)
        result = (
            worker_phases(options.phase_steps, options.functions, options.worker_model)
            if options.phases else worker_counts()
        )
        if options.phases or os.environ["RANK"] == "0":  # phases: each worker its row
            print(json.dumps(result))
        return
    torch.set_num_threads(1)
    if options.phases:
        print(f"mmap threshold {'fixed' if fixed else 'dynamic (no mallopt here)'}")
    if options.fake_gpus:
        if options.phases:
            fake_gpu_sync_points(options.phase_steps, options.accumulate, options.loop)
        else:
            fake_gpu_counts()
        return
    if options.rendezvous:
        rendezvous_counts()
        return
    if options.shares:
        shares(options.models, options.share_rounds, options.share_instances)
        return
    if options.phases and options.workers:
        print_worker_phases(options.phase_steps, options.functions, options.worker_model)
        return
    if options.phases:
        phases(options.models, options.phase_steps, options.views, options.functions)
        return
    print(f"{'model':<6} {'config':<11} {'calls':>6} {'lines':>6} {'cs - plain calls':>17} "
          f"{'cs - plain lines':>17}")
    where: Counts | None = None
    for model_name in options.models:
        configs = ["plain", "cs R=1", "cs R=2"] + (["cs R=2 x4"] if model_name == "gpt2" else [])
        base: tuple[int, int] | None = None
        for config in configs:
            calls, lines = count(make_step(model_name, config, PER_REPLICA, False))
            totals = (sum(calls.values()), sum(lines.values()))
            if options.where == f"{model_name} {config}":
                where = (calls, lines)
            if base is None:
                base = totals
                print(f"{model_name:<6} {config:<11} {totals[0]:>6} {totals[1]:>6}")
                continue
            print(f"{model_name:<6} {config:<11} {totals[0]:>6} {totals[1]:>6} "
                  f"{totals[0] - base[0]:>17} {totals[1] - base[1]:>17}")
    if where is not None:
        print(f"\n{options.where}: functions by lines (calls)")
        for name, n in where[1].most_common(25):
            print(f"  {n:>5} ({where[0][name]:>3})  {name}")
    if options.workers:
        print("\nsmall transformer, 2 gloo workers x 1 replica, worker 0, one step:")
        print(_launch_workers())


def _worker_outputs(*flags: str) -> list[Any]:
    """Start two gloo workers of this script (``--worker`` and ``flags``); each one's JSON."""
    from bench_multiworker import _free_port

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", *flags],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"a worker failed: {[p.returncode for p in processes]}")
    return [json.loads(output) for output in outputs if output.strip()]


def print_worker_phases(
    steps: int, functions: bool = False, model_name: str = "transformer"
) -> None:
    """The ``--phases --workers`` table (see the module's docstring); ``functions``:
    ``--functions``; ``model_name``: ``--worker-model``."""
    flags = ["--phases", "--phase-steps", str(steps), "--worker-model", model_name]
    outputs = _worker_outputs(*flags, *(["--functions"] if functions else []))
    for k, (statistic, title) in enumerate((("median", "medians"), ("p10", "tenth percentiles"))):
        print(f"{WORKER_MODELS[model_name]}, 2 gloo workers x 1 replica against DDP in the same "
              f"processes; us, wall-clock {title} of {steps} steps")
        print(f"{'worker':<7} {'':<4} " + " ".join(f"{name:>10}" for name in WORKER_PHASES))
        for rank, output in enumerate(outputs):
            row = output[statistic]
            cs_row, ddp_row = row[:len(WORKER_PHASES)], row[len(WORKER_PHASES):]
            for name, values in (("cs", cs_row), ("DDP", ddp_row)):
                cells = [f"{v:>10.1f}" if v or name == "cs" else f"{'-':>10}" for v in values]
                print(f"{rank:<7} {name:<4} " + " ".join(cells))
            print(f"{rank:<7} {'diff':<4} " + " ".join(
                f"{c - d:>10.1f}" for c, d in zip(cs_row, ddp_row, strict=True)
            ))
            if output["inside"]:
                print(f"{'':<7} cs inside: " + ", ".join(
                    f"{label} {times[k]:.1f}" for label, times in output["inside"].items()
                ))
        print()


def _launch_workers() -> str:
    (result,) = _worker_outputs()
    rows = [
        f"  {name:<4} {r['calls']:>6} calls {r['lines']:>6} lines" for name, r in result.items()
    ]
    top = "\n".join(f"      {n:>5}  {where}" for where, n in result["cs"]["top"])
    return "\n".join(rows) + "\n  cs, functions by lines:\n" + top


if __name__ == "__main__":
    main()
