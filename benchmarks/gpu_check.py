"""One command for a machine with a GPU: run the CUDA tests, then time training on the GPU.

centralstore's CUDA paths (central variables pinned in host memory, private views on the
GPUs refreshed by non-blocking copies, gradient copies started from backward hooks, the input
prefetch thread: docs/design.md §5.3, §5.6, §5.7) were written without a GPU (§8). A GPU
machine is lent rarely and briefly, so this script does in one run, in a few minutes, what
such a machine can tell:

0. In about a minute, one line per defect that the fake GPUs found on the GPU paths
   (tests/equivalence/test_gpu_paths.py, run on the real GPUs): refuted or confirmed; then
   the counts of all the file's cases, with pytest's output when any of them failed.
1. It runs tests/test_cuda.py (``pytest -m cuda``), which compares training on the GPUs with
   training on one device, then tests/test_multi_worker.py's cases on GPUs (two worker
   processes over gloo, each with its replicas on the GPUs: batch norm's buffers written
   in place and through views, a run inside ``scope()``, sparse gradients, the everyday
   idioms, training with Adam and SGD against one device, buckets copied from the GPUs
   leaving during backward), and prints pytest's output and the counts of passed, failed
   and skipped tests of each.
2. It prints one table of training steps on bench_train.py's models: the MLP 784-1024-1024-10
   and the CNN with BatchNorm (batch 512, SGD with momentum), and the small transformer (2
   encoder layers, d = 64, batch 32, Adam), each under these configurations:
     plain cuda:0            plain PyTorch on cuda:0, the baseline
     cs cpu -> cuda:0        centralstore, variables on the CPU, the replica on cuda:0
     cs cpu -> cuda:0 fused  the same with the optimizer's fused kernel (``fused=True``),
                             which updates the variables on the host in one pass
     cs cuda:0               centralstore, variables and the replica on cuda:0
     cs R=2 cpu -> cuda:0,1  two replicas, variables on the CPU (``cuda:0,0``, both on
                             cuda:0, with one GPU), their buckets added up on the host
                             while backward runs (``variables/sums.py``)
     ... held                the same with those sums left to the sync point
     ... x2, ... x2 held     the same two, accumulating: two runs a step (twice the
                             passes of plain), the second adding into a filled ``.grad``
     ... loop2               the same passes looped inside one run: each replica's first
                             gradients stay on its GPU for the second to add to, and go
                             back once (``GradientBuckets.holds``)
   Columns: the median ms per step over the rounds (timed between synchronizations of every
   GPU; the order of the configurations alternates between rounds), its ratio to plain, the
   median ms of the optimizer's step alone (``update``: with the variables on the CPU, the
   host's update, which docs/design.md §7's bound max(compute, transfers) leaves out), the
   peak GPU memory of the configuration measured while it is the only one built (model,
   optimizer state, activations), and the megabytes copied host to device and device to
   host per step. Those come from the memcpy events of the torch profiler, or, when the
   profiler reports no copy sizes, from the model of §7 (the table header says which). The
   inputs are placed on the GPUs before timing, so the copies counted are the step's own:
   views refreshed and gradients sent back.

3. It runs ``bench_multiworker.py --gpu`` (two gloo workers, a GPU replica each, the variables
   in host memory): the step with the gradient buckets leaving during backward against the
   same step with them held for the sync point, on the MLP and a wide MLP of 80 MB of
   gradients, and prints its table.

4. It times the optimizers' update alone on the host, as the variables on the CPU have it:
   median ms per ``optimizer.step()`` of each model's optimizer in its default form, with
   ``foreach=True`` and with ``fused=True``, over the same gradients, taking turns, with the
   page faults each step took; the models above and ``large``, Adam over a GPT-2 small's
   embedding and three of its feed-forward matrices (45.7 million parameters), whose
   tensors are past glibc's largest dynamic mmap threshold. This needs no GPU:
   ``--host-update`` prints only this table, on any machine.

5. It times the host's lookup of the current stream, which each gradient a GPU replica copies
   to host memory makes: microseconds per call of ``torch.cuda.current_stream(0)`` and of
   ``centralstore._devices.CurrentStreams``, which finds the stream by its raw handle; and
   the switch to a side stream that each bucket's copy to host memory and each input's copy
   to a GPU makes: ``with torch.cuda.stream(side)`` against ``CurrentStreams.switch``.

glibc's heap is as the process starts (or as ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set it); ``--keep-host-memory`` calls ``cs.keep_host_memory()``
first, so that steps 2 and 4 run with freed host memory kept (step 3's worker processes keep
glibc's as they start; each table's header says which).

A configuration that raises is reported in its row, and the others still run. Exit status: 0
when every test passed and every configuration ran (or without a CUDA device, where there is
nothing to check), else 1.

    python benchmarks/gpu_check.py [--rounds 7] [--steps 20] [--skip-tests] [--host-update]
        [--keep-host-memory]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import centralstore as cs
from centralstore.cli import at_least

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
import bench_train  # noqa: E402  (the benchmarks directory is not a package)

ROOT = BENCHMARKS.parent
# ``-o addopts=``: the lent machine may lack pytest-timeout and pytest-xdist
TESTS = [
    sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py",
    "-p", "no:cacheprovider", "-o", "addopts=",
]
DEFECT_TESTS = [
    sys.executable, "-m", "pytest", "-q", "-rA", "tests/equivalence/test_gpu_paths.py",
    "-p", "no:cacheprovider", "-o", "addopts=", "-k", "not everyday",
]
# The GPU-path defects the fake GPUs found, each with the test (tests/equivalence/
# test_gpu_paths.py) that fails while it is there; on real GPUs a pass refutes it.
DEFECTS = [
    ("fused optimizers left views stale", "test_a_fused_optimizer_trains_exactly_like"),
    (".data writes and replaced storage unseen, unpinned", "test_writes_through_data_reach"),
    ("sparse gradients broke the early copy", "test_sparse_gradients_fold"),
    ("optimizer state of merge_call on the GPU", "test_every_optimizer_stepping_in_merge"),
    ("replica threads ignored the caller's stream", "test_replica_threads_use_the_callers"),
    ("every GPU drew the same random numbers", "test_each_gpu_replica_draws_different"),
    ("a TorchFunctionMode in every CUDA replica", "test_a_gpu_replica_pays_no_python"),
    ("a pinned block per gradient and step", "test_the_early_gradient_copy_pins_its"),
    ("torch.cuda's heavier wrappers in every step", "test_a_steady_step_finds_its_streams"),
    ("a CUDA event made at every step", "test_a_steady_step_makes_no_cuda_event"),
]
DEFECTS_TIMEOUT_S = 90
WORKER_TESTS = [
    sys.executable, "-m", "pytest", "-q", "tests/test_multi_worker.py", "-k",
    "on_gpus or copied_from_gpus", "-p", "no:cacheprovider", "-o", "addopts=",
]
# twenty-four launches of two processes (fourteen on one GPU), each 4 to 10 s on a CPU
WORKER_TESTS_TIMEOUT_S = 240
# The tests' share of the 8 minutes the whole check may take: a little more than pytest's
# own limit per test (300 s, pyproject.toml), so that a test stuck there still reports.
TESTS_TIMEOUT_S = 330
MODEL_NAMES = ("mlp", "cnn", "transformer")  # of bench_train.MODELS, in eager mode
WARMUP_STEPS = 3
UPDATE_CALLS = 15  # optimizer steps timed alone, one by one, for the update column
PROFILED_STEPS = 3
MB = 2**20

Step = Callable[[], None]


@dataclass(frozen=True)
class Config:
    """Where one configuration keeps its variables and computes."""

    name: str
    parameter_device: str | None  # None: plain PyTorch, no strategy
    compute_devices: tuple[str, ...]
    fused: bool = False  # the optimizer's fused kernel instead of its default
    # several replicas, variables on the CPU: their buckets added up while backward runs
    # (``variables/sums.py``), or, False, at the sync point
    early_sums: bool = True
    runs: int = 1  # runs a step before the optimizer's: from the second on, .grad is filled
    loop: int = 1  # backward passes each replica makes inside a run



PLAIN = Config("plain cuda:0", None, ("cuda:0",))


def configs(num_gpus: int) -> list[Config]:
    found = [
        PLAIN,
        Config("cs cpu -> cuda:0", "cpu", ("cuda:0",)),
        Config("cs cpu -> cuda:0 fused", "cpu", ("cuda:0",), fused=True),
        Config("cs cuda:0", "cuda:0", ("cuda:0",)),
    ]
    pair = ("cuda:0", "cuda:1") if num_gpus >= 2 else ("cuda:0", "cuda:0")
    name = "cs R=2 cpu -> cuda:" + ("0,1" if num_gpus >= 2 else "0,0")
    found += [
        Config(name, "cpu", pair),
        Config(name + " held", "cpu", pair, early_sums=False),
        Config(name + " x2", "cpu", pair, runs=2),
        Config(name + " x2 held", "cpu", pair, early_sums=False, runs=2),
        Config(name + " loop2", "cpu", pair, loop=2),
    ]
    return found


# -- the tests ---------------------------------------------------------------------------


def defect_verdicts(output: str) -> list[str]:
    """One line per entry of ``DEFECTS`` from pytest's ``-rA`` summary in ``output``."""
    outcomes: dict[str, list[str]] = {}
    for line in output.splitlines():
        found = re.match(r"(PASSED|FAILED|ERROR|SKIPPED)\S* \S*::(\w+)", line)
        if found:
            outcomes.setdefault(found.group(2), []).append(found.group(1))
    lines = []
    for label, test in DEFECTS:
        seen = [kind for name, kinds in outcomes.items() if name.startswith(test)
                for kind in kinds]
        failed = seen.count("FAILED") + seen.count("ERROR")
        if seen and all(kind == "PASSED" for kind in seen):
            verdict = f"refuted ({len(seen)} cases pass)"
        elif not seen:
            verdict = "not run"
        elif failed:
            verdict = f"CONFIRMED ({failed} of {len(seen)} cases fail)"
        else:
            verdict = f"not run ({len(seen)} cases skipped)"
        lines.append(f"  {label:<52} {verdict}")
    return lines


def check_defects() -> bool:
    """One line per GPU-path defect: refuted (its test passes on these GPUs) or confirmed,
    then the counts of the whole file's cases, whose output is printed when any failed.
    The layouts: cuda:0 and cuda:1 (or, with one GPU, cuda:0 and the logical cpu:1), the
    parameters on the CPU and on cuda:0. True when every case passed."""
    print("$ python " + " ".join(DEFECT_TESTS[1:]), flush=True)
    try:
        done = subprocess.run(
            DEFECT_TESTS, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=DEFECTS_TIMEOUT_S,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "CENTRALSTORE_REAL_GPUS": "1"},
        )
    except subprocess.TimeoutExpired:
        print(f"defects: stopped after {DEFECTS_TIMEOUT_S} s\n")
        return False
    lines = defect_verdicts(done.stdout)
    for line in lines:
        print(line)
    counts = summary_counts(done.stdout)
    print(f"  every case of the file: {counts.get('passed', 0)} passed, "
          f"{counts.get('failed', 0) + counts.get('error', 0)} failed, "
          f"{counts.get('skipped', 0)} skipped (pytest exit status {done.returncode})")
    passed = done.returncode == 0 and all(" refuted " in line for line in lines)
    if not passed:  # a defect confirmed, or another case failing (which no line names)
        print(done.stdout[-6000:])
    print()
    return passed


def run_tests(
    command: Sequence[str] = TESTS, timeout_s: int = TESTS_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> bool:
    """Run the tests of ``command`` (the CUDA-marked ones) in a fresh process, with ``env``
    added to the environment; print their output and counts. True when pytest reports
    success."""
    settings = "".join(f"{name}={value} " for name, value in (env or {}).items())
    print(f"$ {settings}python " + " ".join(command[1:]), flush=True)
    try:
        done = subprocess.run(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    except subprocess.TimeoutExpired as timeout:  # unbuffered: its output so far is here
        partial = timeout.stdout
        print(partial.decode() if isinstance(partial, bytes) else partial or "")
        print(f"tests: stopped after {timeout_s} s\n")
        return False
    print(done.stdout.rstrip())
    counts = summary_counts(done.stdout)
    if counts:
        failed = counts.get("failed", 0) + counts.get("error", 0)
        print(f"\ntests: {counts.get('passed', 0)} passed, {failed} failed, "
              f"{counts.get('skipped', 0)} skipped (pytest exit status {done.returncode})\n")
    else:  # pytest itself failed (or the process died) before its summary
        print(f"\ntests: no pytest summary (exit status {done.returncode})\n")
    return done.returncode == 0


def summary_counts(output: str) -> dict[str, int]:
    """The counts on pytest's final line, such as ``9 passed, 2 skipped in 31.20s``."""
    finals = [line for line in output.splitlines() if re.search(r" in [\d.]+s\b", line)]
    if not finals:
        return {}
    found = re.findall(r"(\d+) (passed|failed|skipped|error)s?\b", finals[-1])
    return {kind: int(count) for count, kind in found}


# -- one configuration's training step ------------------------------------------------------


def sync_all() -> None:
    """Wait for every GPU: a step with replicas on two GPUs is done when both are."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def per_replica(tensors: Sequence[torch.Tensor], devices: Sequence[str]) -> tuple[object, ...]:
    """Each tensor cut into one slice per device and placed there (a plain tensor for one)."""
    placed: list[object] = []
    for tensor in tensors:
        slices = [s.to(d) for s, d in zip(tensor.tensor_split(len(devices)), devices)]
        placed.append(slices[0] if len(slices) == 1 else cs.PerReplica(slices))
    return tuple(placed)


@dataclass(frozen=True)
class Built:
    """One configuration, built: its training step (input already on the GPUs), the model it
    trains, and its optimizer's step alone."""

    step: Step
    model: nn.Module
    update: Step


def build_step(config: Config, model_name: str) -> Built:
    """``model_name`` under ``config``, ready to time."""
    torch.manual_seed(0)
    make_model, batch, shape, optimizer_kind = bench_train.MODELS[model_name]
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    if config.parameter_device is None:
        device = torch.device(config.compute_devices[0])
        model = make_model().to(device)
        optimizer = bench_train.make_optimizer(
            optimizer_kind, model, fused=config.fused or None
        )
        x, y = x.to(device), y.to(device)

        def plain_step() -> None:
            optimizer.zero_grad()
            (F.cross_entropy(model(x), y, reduction="sum") / batch).backward()
            optimizer.step()

        return Built(plain_step, model, optimizer.step)
    strategy = cs.CentralStorageStrategy(list(config.compute_devices), config.parameter_device)
    if not config.early_sums:
        strategy._store._sums = None
    with strategy.scope():
        model = make_model()
        optimizer = bench_train.make_optimizer(
            optimizer_kind, model, fused=config.fused or None
        )
    args = per_replica((x, y), config.compute_devices)

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        for _ in range(config.loop):
            per_example = F.cross_entropy(model(xs), ys, reduction="none")
            cs.compute_average_loss(per_example, global_batch_size=batch).backward()

    def cs_step() -> None:
        optimizer.zero_grad()
        for _ in range(config.runs):
            strategy.run(replica_step, args=args)
        optimizer.step()

    return Built(cs_step, model, optimizer.step)


# -- measurements --------------------------------------------------------------------------


def time_steps(step: Step, steps: int) -> float:
    """Milliseconds per step, timed between two synchronizations of every GPU."""
    sync_all()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync_all()
    return (time.perf_counter() - start) / steps * 1e3


def time_update(update: Step) -> float:
    """Median milliseconds of one optimizer step alone (the gradients of the last training
    step, every GPU synchronized before and after each)."""
    times = []
    for _ in range(UPDATE_CALLS):
        sync_all()
        start = time.perf_counter()
        update()
        sync_all()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def memcpy_bytes(prof: profile) -> dict[str, int]:
    """Bytes copied in a finished profile, by kind ("HtoD", "DtoH", "DtoD", ...). Kineto
    writes each copy's size into the trace it exports (``"bytes"`` in the arguments of
    events named like ``Memcpy HtoD (Pinned -> Device)``); torch's event objects lack it."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals: dict[str, int] = {}
    for event in events:
        kind = re.match(r"Memcpy (\w+)", str(event.get("name", "")))
        size = event.get("args", {}).get("bytes")
        if kind is not None and isinstance(size, int):
            totals[kind[1]] = totals.get(kind[1], 0) + size
    return totals


def profiler_counts_bytes() -> bool:
    """Whether the profiler reports copy sizes: one 4 KiB host-to-device copy, profiled."""
    host = torch.ones(1024)
    host.to("cuda:0")  # CUDA starts up outside the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        host.to("cuda:0")
        sync_all()
    return memcpy_bytes(prof).get("HtoD", 0) >= host.numel() * host.element_size()


def profiled_transfers(step: Step) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes per step, from the profiler."""
    sync_all()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        sync_all()
    totals = memcpy_bytes(prof)
    return totals.get("HtoD", 0) / PROFILED_STEPS, totals.get("DtoH", 0) / PROFILED_STEPS


def expected_transfers(config: Config, model: nn.Module) -> tuple[float, float]:
    """Bytes per step by the model of docs/design.md §7: with the variables on the CPU, each
    replica refreshes its copy of every variable at each run (the optimizer changes every
    weight, BatchNorm its statistics), and sends back a gradient of every parameter and the
    buffers it wrote; with the variables on the replica's GPU nothing crosses."""
    if config.parameter_device != "cpu":
        return 0.0, 0.0
    variables = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    each_way = float(config.runs * len(config.compute_devices) * variables)
    return each_way, each_way


@dataclass(frozen=True)
class Alone:
    """What one configuration measures while it is the only one built."""

    peak_mb: float
    h2d_mb: float
    d2h_mb: float
    update_ms: float


def measure_alone(config: Config, model_name: str, exact_bytes: bool) -> Alone:
    """Peak GPU memory of building ``config`` and training a few steps, above what the GPUs
    held before; then the bytes it copies per step (profiled if ``exact_bytes``), and its
    optimizer's step alone."""
    devices = [torch.device(d) for d in config.compute_devices]
    gc.collect()
    sync_all()
    before = [torch.cuda.memory_allocated(d) for d in devices]
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    built = build_step(config, model_name)
    for _ in range(WARMUP_STEPS):
        built.step()
    sync_all()
    peak = sum(torch.cuda.max_memory_allocated(d) - b for d, b in zip(devices, before))
    if exact_bytes:
        h2d, d2h = profiled_transfers(built.step)
    else:
        h2d, d2h = expected_transfers(config, built.model)
    return Alone(peak / MB, h2d / MB, d2h / MB, time_update(built.update))


def time_configs(model_name: str, chosen: list[Config], rounds: int, steps: int
                 ) -> dict[str, float]:
    """Median ms per step of each configuration, all built at once and timed round by
    round, the order alternating between rounds."""
    built = {config.name: build_step(config, model_name).step for config in chosen}
    for step in built.values():
        time_steps(step, WARMUP_STEPS)
    samples: dict[str, list[float]] = {name: [] for name in built}
    names = list(built)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            samples[name].append(time_steps(built[name], steps))
    return {name: statistics.median(values) for name, values in samples.items()}


def benchmark(rounds: int, steps: int, heap: str) -> bool:
    """Print the table (``heap``: how glibc's heap stands, for its header); False if a
    configuration raised."""
    num_gpus = torch.cuda.device_count()
    candidates = configs(num_gpus)
    exact_bytes = profiler_counts_bytes()
    source = (
        "the torch profiler's memcpy events" if exact_bytes else
        "analytic, as the profiler reported no copy sizes: R x (parameters + buffers) each "
        "way with the variables on the CPU, else 0"
    )
    print(f"{torch.cuda.get_device_name(0)} x {num_gpus}, torch {torch.__version__}, "
          f"{steps} steps x {rounds} rounds, medians; MB = 2**20 bytes; {heap}")
    print(f"H2D and D2H per step: {source}\n")
    print(f"{'model':<12} {'config':<30} {'ms/step':>8} {'/plain':>7} {'update':>7} "
          f"{'peak MB':>8} {'H2D MB':>8} {'D2H MB':>8}")
    all_ran = True
    for model_name in MODEL_NAMES:
        alone: dict[str, Alone] = {}
        errors: dict[str, str] = {}
        for config in candidates:
            try:
                alone[config.name] = measure_alone(config, model_name, exact_bytes)
            except Exception as error:  # reported in its row; the other configurations run
                errors[config.name] = f"{type(error).__name__}: {error}".splitlines()[0]
        working = [config for config in candidates if config.name not in errors]
        medians = time_configs(model_name, working, rounds, steps)
        plain = medians.get(PLAIN.name)
        for config in candidates:
            label = f"{model_name:<12} {config.name:<30}"
            if config.name in errors:
                print(f"{label} raised {errors[config.name]}")
                continue
            ms, measured = medians[config.name], alone[config.name]
            ratio = f"{ms / plain:7.3f}" if plain else f"{'-':>7}"
            print(f"{label} {ms:8.2f} {ratio} {measured.update_ms:7.2f} {measured.peak_mb:8.1f} "
                  f"{measured.h2d_mb:8.2f} {measured.d2h_mb:8.2f}", flush=True)
        all_ran = all_ran and not errors
    return all_ran


HOST_UPDATE_ROUNDS = 30
_AS_IT_COMES = "glibc's heap as the process starts"
IMPLEMENTATIONS = ("default", "foreach", "fused")


class Large(nn.Module):
    """The parameters of a GPT-2 small's embedding and of three of its feed-forward matrices
    (45.7 million): tensors past glibc's largest dynamic mmap threshold (32 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.zeros(50257, 768))
        self.layers = nn.ParameterList([torch.zeros(768, 3072) for _ in range(3)])


HOST_MODELS: dict[str, tuple[Callable[[], nn.Module], type]] = {
    **{name: (bench_train.MODELS[name][0], bench_train.MODELS[name][3]) for name in MODEL_NAMES},
    "large": (Large, torch.optim.Adam),
}


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def host_update(heap: str = _AS_IT_COMES) -> None:
    """Print the median ms of one optimizer step on the host per model and implementation
    (``IMPLEMENTATIONS``), each over fixed gradients, the order alternating between rounds;
    and the median of the page faults each step took: an update that makes temporaries as
    large as its tensors (Adam's default) gets them from glibc, which maps blocks over its
    threshold afresh and returns them when they are freed, so each step faults their pages
    in again (see the README's answer on GPUs)."""
    print(f"\nthe update on the host, ms per optimizer.step(), medians of {HOST_UPDATE_ROUNDS}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{heap}; page faults per step in brackets")
    print(f"{'model':<12} {'optimizer':<10} {'parameters':>10} "
          + " ".join(f"{name:>17}" for name in IMPLEMENTATIONS) + f" {'default/fused':>14}")
    for model_name, (make_model, kind) in HOST_MODELS.items():
        optimizers = {}
        for implementation in IMPLEMENTATIONS:
            torch.manual_seed(0)
            model = make_model()
            for parameter in model.parameters():
                parameter.grad = torch.randn_like(parameter) * 1e-3
            optimizers[implementation] = bench_train.make_optimizer(
                kind, model, foreach=implementation == "foreach" or None,
                fused=implementation == "fused" or None,
            )
        times: dict[str, list[float]] = {name: [] for name in optimizers}
        faults: dict[str, list[int]] = {name: [] for name in optimizers}
        for optimizer in optimizers.values():
            for _ in range(WARMUP_STEPS):
                optimizer.step()
        for round_ in range(HOST_UPDATE_ROUNDS):
            names = list(optimizers) if round_ % 2 == 0 else list(reversed(optimizers))
            for name in names:
                before = _minor_faults()
                start = time.perf_counter()
                optimizers[name].step()
                times[name].append((time.perf_counter() - start) * 1e3)
                faults[name].append(_minor_faults() - before)
        medians = {name: statistics.median(values) for name, values in times.items()}
        count = sum(p.numel() for p in model.parameters())
        cells = [
            f"{medians[name]:8.3f} [{int(statistics.median(faults[name])):>6}]"
            for name in IMPLEMENTATIONS
        ]
        print(f"{model_name:<12} {kind.__name__:<10} {count:>10} " + " ".join(cells)
              + f" {medians['default'] / medians['fused']:14.2f}", flush=True)
        del optimizers, model
        gc.collect()


WORKERS_ON_GPUS = [
    sys.executable, "benchmarks/bench_multiworker.py", "--gpu", "--rounds", "5", "--steps", "10",
]
WORKERS_ON_GPUS_TIMEOUT_S = 150


def workers_on_gpus() -> bool:
    """Step 3: ``bench_multiworker.py --gpu``'s table; True when it ran."""
    print("$ python " + " ".join(WORKERS_ON_GPUS[1:]), flush=True)
    try:
        done = subprocess.run(
            WORKERS_ON_GPUS, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=WORKERS_ON_GPUS_TIMEOUT_S,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired:
        print(f"workers on GPUs: stopped after {WORKERS_ON_GPUS_TIMEOUT_S} s\n")
        return False
    print(done.stdout.rstrip() + "\n")
    return done.returncode == 0


def stream_lookup(calls: int = 20_000) -> None:
    """Step 5: us per lookup of the current stream, and per switch to a side stream, torch's
    and centralstore's, in turns."""
    from centralstore import _devices

    device = torch.device("cuda", 0)
    streams = _devices.CurrentStreams()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def torch_s_switch() -> None:
        with torch.cuda.stream(side):  # type: ignore[arg-type]
            pass

    def switch() -> None:
        with streams.switch(side):
            pass

    for title, calls_of in (
        ("the current stream's lookup", {
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream(0),
            "centralstore (by handle)": lambda: streams(device),
        }),
        ("a switch to a side stream and back", {
            "torch.cuda.stream": torch_s_switch,
            "CurrentStreams.switch": switch,
        }),
    ):
        times: dict[str, list[float]] = {name: [] for name in calls_of}
        for turn in range(5):
            for name in calls_of if turn % 2 == 0 else reversed(calls_of):
                call = calls_of[name]
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                times[name].append((time.perf_counter() - start) / calls * 1e6)
        print(f"\n{title}, us per call (median of 5 turns of {calls:,} calls):")
        for name, values in times.items():
            print(f"  {name:<28} {statistics.median(values):.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=at_least(1), default=7,
                        help="timing rounds; the table gives the median (default 7)")
    parser.add_argument("--steps", type=at_least(1), default=20,
                        help="training steps per round (default 20)")
    parser.add_argument("--skip-tests", action="store_true",
                        help="only the benchmark, without step 1's tests")
    parser.add_argument("--host-update", action="store_true",
                        help="only the table of the optimizers' update on the host (no GPU "
                             "needed)")
    parser.add_argument("--keep-host-memory", action="store_true",
                        help="call cs.keep_host_memory() first: glibc keeps freed host memory")
    options = parser.parse_args(argv)
    heap = _AS_IT_COMES
    if options.keep_host_memory:
        heap = (
            "host memory kept (cs.keep_host_memory())" if cs.keep_host_memory()
            else "no mallopt here: " + _AS_IT_COMES
        )
    if options.host_update:
        host_update(heap)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--host-update runs without one)")
        return 0
    paths_passed = check_defects()
    tests_passed = options.skip_tests or all([  # (both run, whatever the first's verdict)
        run_tests(),
        run_tests(WORKER_TESTS, WORKER_TESTS_TIMEOUT_S, {"CENTRALSTORE_REAL_GPUS": "1"}),
    ])
    all_ran = benchmark(options.rounds, options.steps, heap)
    all_ran = workers_on_gpus() and all_ran
    host_update(heap)
    stream_lookup()
    return 0 if paths_passed and tests_passed and all_ran else 1


if __name__ == "__main__":
    sys.exit(main())
