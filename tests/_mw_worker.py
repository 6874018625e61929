"""One worker process of the multi-worker tests (``tests/test_multi_worker.py``).

Run as ``python tests/_mw_worker.py SCENARIO OUT_DIR LOCAL_REPLICAS [TIMEOUT_S]`` with
torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set, by torchrun or by
the test. Each worker writes what it observed to ``OUT_DIR/rank<r>.pt``; the test compares
it with a single-process twin. The model, data and step functions live here so that the
test builds its twin from the same code. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import centralstore as cs

if TYPE_CHECKING:
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}
# Global batches of one training run: even, uneven, tiny (empty slices), accumulated (two
# runs, one optimizer step), stepped inside run by merge_call, and backed through a reduced
# loss after run.
STEPS: list[tuple[str, list[int]]] = [
    ("run", [8]), ("run", [7]), ("run", [2]), ("accumulate", [5, 3]), ("merge_step", [8]),
    ("post_run", [7]),
]
BN_STEPS = [12, 8, 12]  # every replica gets >= 2 examples (batch norm needs them)
# Buckets of 64 bytes (in MB): the MLP's gradients, last layer first (12, 192, 64 and 384
# bytes), travel in 3, each closed once it holds 64 bytes: [12 + 192], [64], [384].
BUCKET = 64 / 2**20


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class BigCounter(nn.Module):
    """A layer that counts its calls in an int64 buffer starting at 2**60 + 1 (float64 holds
    it only as 2**60) and in a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.register_buffer("big", torch.tensor(2**60 + 1))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.big.add_(1)
        self.seen.add_(1)
        out: torch.Tensor = self.linear(x)
        return out


def batches(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(g, 6, generator=generator), torch.randint(0, 3, (g,), generator=generator))
        for g in sizes
    ]


def train_one_device(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The oracle: plain PyTorch on the global batches of ``STEPS``."""
    for seed, (_, sizes) in enumerate(STEPS):
        parts = batches(sizes, seed)
        total = sum(sizes)
        optimizer.zero_grad()
        for x, y in parts:
            (nn.functional.cross_entropy(model(x), y, reduction="sum") / total).backward()
        optimizer.step()


def train(strategy: cs.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``STEPS`` through ``experimental_distribute_dataset``, each replica on its slice."""

    def step(x: torch.Tensor, y: torch.Tensor, total: int, kind: str) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = cs.compute_average_loss(per_example, global_batch_size=total)
        if kind != "post_run":
            loss.backward()
        if kind == "merge_step":
            cs.get_replica_context().merge_call(lambda _: optimizer.step())
        return loss

    for seed, (kind, sizes) in enumerate(STEPS):
        total = sum(sizes)
        optimizer.zero_grad()
        for x, y in strategy.experimental_distribute_dataset(batches(sizes, seed)):
            losses = strategy.run(step, args=(x, y, total, kind))
            if kind == "post_run":  # exchanged at the optimizer step, the next sync point
                strategy.reduce("SUM", losses, axis=None).backward()
        if kind != "merge_step":
            optimizer.step()


def train_bn(strategy: cs.Strategy, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
    """A step per ``BN_STEPS``; after the first, a second batch norm joins the model (new
    central variables: across workers, the writes carried in the agreement since the first
    step no longer cover the written variables, so the next step's are summed instead)."""
    def step(x: torch.Tensor, y: torch.Tensor, total: int) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        cs.compute_average_loss(per_example, global_batch_size=total).backward()

    for seed, size in enumerate(BN_STEPS):
        if seed == 1:
            with strategy.scope():
                extra = nn.BatchNorm1d(3)
            model.append(extra)
            optimizer.add_param_group({"params": list(extra.parameters())})
        optimizer.zero_grad()
        for x, y in strategy.experimental_distribute_dataset(batches([size], 100 + seed)):
            strategy.run(step, args=(x, y, size))
        optimizer.step()


def heads() -> nn.ModuleDict:
    return nn.ModuleDict({"body": nn.Linear(6, 4), "a": nn.Linear(4, 1), "b": nn.Linear(4, 1)})


def optimizer_in_backward(strategy: cs.Strategy) -> dict[str, Any]:
    """The optimizer-in-backward idiom: an SGD step per parameter in its post-accumulate-grad
    hook. Replica 0 alone uses head ``a``, so on a job of several workers the others get its
    gradient only from the exchange; each hook must still fire once per run on every worker,
    with the sum over all replicas. Returns the final weights and which hooks fired."""
    torch.manual_seed(300)
    with strategy.scope():
        model = heads()
    names = {p: name for name, p in model.named_parameters()}
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    fired: list[str] = []

    def on_gradient(p: torch.Tensor) -> None:
        fired.append(names[p])
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_gradient)

    def step(x: torch.Tensor) -> None:
        first = cs.get_replica_context().replica_id_in_sync_group == 0
        head = model["a"] if first else model["b"]
        (head(model["body"](x)).pow(2).sum() / 8).backward()

    for seed in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(400 + seed))
        for batch in strategy.experimental_distribute_dataset([x]):
            strategy.run(step, args=(batch,))
    return {"weights": model.state_dict(), "fired": sorted(fired)}


def write_table(strategy: cs.Strategy) -> dict[str, float]:
    """Final values of variables written in run by every aggregation: replica i adds i + 1,
    or assigns it, or (mixed) even replicas assign and odd ones add."""
    out: dict[str, float] = {}
    for aggregation in ("SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        for how in ("add", "assign", "mixed"):
            with strategy.scope():
                var = cs.Variable(10.0, aggregation=aggregation, trainable=False)

            def write(var: torch.Tensor = var, how: str = how) -> None:
                i = cs.get_replica_context().replica_id_in_sync_group
                if how == "add" or (how == "mixed" and i % 2):
                    var.add_(float(i + 1))
                else:
                    var.copy_(torch.tensor(float(i + 1)))

            strategy.run(write)
            out[f"{aggregation}/{how}"] = float(var)
        # ON_READ: each replica adds i + 1 to its own copy (assign(var + x)), in two runs;
        # then 12 is assigned outside run (every copy reset), and one more run
        with strategy.scope():
            copies = cs.Variable(
                0.0, aggregation=aggregation, trainable=False, synchronization="ON_READ"
            )

        def own(var: torch.Tensor = copies) -> None:
            i = cs.get_replica_context().replica_id_in_sync_group
            var.copy_(var + float(i + 1))

        for _ in range(2):
            strategy.run(own)
        out[f"ON_READ {aggregation}"] = float(copies)
        copies.copy_(torch.tensor(12.0))
        strategy.run(own)
        out[f"ON_READ {aggregation}/after assign"] = float(copies)
    return out


def api(strategy: cs.Strategy) -> dict[str, Any]:
    """What the cross-worker calls return, for comparison with one process of R replicas."""
    ctx = cs.get_replica_context
    full = strategy.experimental_distribute_values_from_function(
        lambda c: torch.full((3,), float(c.replica_id_in_sync_group + 1))
    )
    ragged = strategy.experimental_distribute_values_from_function(
        lambda c: torch.arange(float(c.replica_id_in_sync_group + 1))
    )
    large = strategy.experimental_distribute_values_from_function(  # past the agreement's slot
        lambda c: torch.full((40,), float(c.replica_id_in_sync_group + 1))
    )
    # complex values travel as their real and imaginary parts
    large_complex = strategy.experimental_distribute_values_from_function(
        lambda c: torch.full((40,), complex(c.replica_id_in_sync_group + 1, 2))
    )
    ragged_complex = strategy.experimental_distribute_values_from_function(
        lambda c: torch.arange(float(c.replica_id_in_sync_group + 1)) * (2 - 1j)
    )
    if len(strategy.extended.worker_devices) == 1:
        full, ragged = full.values[0], ragged.values[0]  # as run returns them with R_local = 1
    made: dict[str, int] = {}  # the collectives each call made (none in one process)

    def counted(key: str, call: Callable[[], Any]) -> Any:
        before = getattr(strategy, "traffic", {"collectives": 0})["collectives"]
        value = call()
        made[key] = getattr(strategy, "traffic", {"collectives": 0})["collectives"] - before
        return value

    seen: list[Any] = []

    def dataset_fn(input_context: cs.InputContext) -> cs.Dataset:
        seen.append(input_context)
        return cs.Dataset.range(8).batch(2)

    strategy.distribute_datasets_from_function(dataset_fn)
    merges: list[int] = []

    def merged(s: cs.Strategy, value: Any) -> torch.Tensor:
        merges.append(1)
        assert cs.in_cross_replica_context()
        return s.reduce("SUM", value, axis=None)

    with strategy.scope():
        w = torch.ones((), requires_grad=True)

    def differentiable() -> None:
        i = ctx().replica_id_in_sync_group
        ctx().all_reduce("SUM", w * (i + 1)).backward()

    strategy.run(differentiable)
    local = strategy.experimental_local_results
    return {
        "ids": [int(i) for i in local(strategy.run(lambda: ctx().replica_id_in_sync_group))],
        "num_replicas": strategy.num_replicas_in_sync,
        "reduce": {
            f"{op}/{axis}": strategy.reduce(op, full if axis is None else ragged, axis=axis)
            for op in ("SUM", "MEAN") for axis in (None, 0)
        },
        "reduce_large": {
            op: counted(f"large {op}", lambda op=op: strategy.reduce(op, large, axis=None))
            for op in ("SUM", "MEAN")
        },
        "reduce_scalar": {
            op: counted(f"scalar {op}", lambda op=op: strategy.reduce(op, strategy.run(
                lambda: torch.tensor(float(ctx().replica_id_in_sync_group + 1))
            ), axis=None)) for op in ("SUM", "MEAN")
        },
        "collectives": made,
        "gather": counted("gather", lambda: strategy.gather(ragged, axis=0)),
        "complex": [
            strategy.reduce("SUM", large_complex, axis=None),
            strategy.gather(ragged_complex, axis=0),
        ],
        "all_reduce": [
            local(strategy.run(lambda op=op: ctx().all_reduce(
                op, float(ctx().replica_id_in_sync_group + 1)
            ))) for op in ("SUM", "MEAN")
        ],
        "all_gather": local(strategy.run(lambda: ctx().all_gather(
            torch.arange(float(ctx().replica_id_in_sync_group + 1)), axis=0
        ))),
        "merge_call": local(strategy.run(lambda: ctx().merge_call(
            merged, args=(torch.tensor(float(ctx().replica_id_in_sync_group + 1)),)
        ))),
        "merge_calls": len(merges),
        "input_context": [
            (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in seen
        ],
        "grad_through_all_reduce": float(w.grad),
        "should_checkpoint": strategy.extended.should_checkpoint,
        "slices": [
            [len(t) for t in local(x)]
            for x in strategy.experimental_distribute_dataset([torch.arange(7)])
        ],
        "writes": write_table(strategy),
    }


def main_scenario(local_replicas: int, explicit_group: bool) -> dict[str, Any]:
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    group = None
    if explicit_group:
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
        group = torch.distributed.new_group(list(range(int(os.environ["WORLD_SIZE"]))))
    devices = [f"cpu:{i}" for i in range(local_replicas)]
    # Buckets of 64 bytes: the MLP's gradients travel in 3 (see BUCKET).
    settings: dict[str, Any] = {"process_group": group, "timeout": 60, "bucket_cap_mb": BUCKET}
    strategy = MultiWorkerCentralStorageStrategy(devices, **settings)
    rank = strategy.worker_index
    results: dict[str, Any] = {"repr": repr(strategy)}
    for name in OPTIMIZERS:
        torch.manual_seed(100 + rank)  # different on every worker: the broadcast must fix it
        with strategy.scope():
            model = mlp()
            optimizer = OPTIMIZERS[name](list(model.parameters()))
        if name == "adam" and rank == 0:  # a checkpoint read by worker 0 alone, after the
            torch.manual_seed(7)  # scope: the first run broadcasts it
            model.load_state_dict(mlp().state_dict())
        results[f"{name}/initial"] = {k: v.clone() for k, v in model.state_dict().items()}
        train(strategy, model, optimizer)
        results[f"{name}/final"] = model.state_dict()
    # The same training with every bucket exchanged after the fold, as before buckets left
    # during backward: the same weights, bit for bit.
    late = MultiWorkerCentralStorageStrategy(devices, **settings)
    late._collectives._arm = lambda store: None  # type: ignore[method-assign]
    with late.scope():
        model = mlp()
        model.load_state_dict(results["sgd/initial"])
        optimizer = OPTIMIZERS["sgd"](list(model.parameters()))
    train(late, model, optimizer)
    results["sgd/after fold"] = model.state_dict()
    torch.manual_seed(200 + rank)
    with strategy.scope():
        model = bn_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results["bn/initial"] = {k: v.clone() for k, v in model.state_dict().items()}
    train_bn(strategy, model, optimizer)
    results["bn/final"] = model.state_dict()
    results["api"] = api(strategy)
    results["optimizer in backward"] = optimizer_in_backward(strategy)
    # A fresh strategy, so that no other model's variables (without gradients) take part.
    strategy = MultiWorkerCentralStorageStrategy(devices, **settings)
    with strategy.scope():
        model = mlp()
    strategy.run(lambda: None)  # the first run's broadcast; its sync point plans the buckets
    before = strategy.traffic
    x = torch.randn(4 * strategy.num_replicas_in_sync, 6)
    started: list[int] = []  # per local replica: collectives started when its backward returned

    def step(x: torch.Tensor, net: nn.Module = model) -> None:
        net(x).sum().backward()
        started.append(strategy.traffic["collectives"] - before["collectives"])

    strategy.run(step, args=(
        strategy.experimental_distribute_values_from_function(
            lambda c: x[c.replica_id_in_sync_group::c.num_replicas_in_sync]
        ),
    ))
    after = strategy.traffic
    results["step_traffic"] = {k: after[k] - before[k] for k in after}
    results["started_in_backward"] = started
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    count = strategy.traffic["collectives"]
    optimizer.step()  # nothing pending from a backward after run: no collective
    results["step_collectives"] = strategy.traffic["collectives"] - count
    parameter = weakref.ref(next(model.parameters()))  # the exchange keeps no model alive
    del model, step, optimizer
    gc.collect()
    results["freed"] = parameter() is None
    # Batch norm alone: every run writes the running statistics on every worker alike, so
    # the per-variable flags stay home; each run's collectives, and the plan's buckets.
    strategy = MultiWorkerCentralStorageStrategy(devices, **settings)
    torch.manual_seed(200)
    with strategy.scope():
        model = bn_model()
    strategy.run(lambda: None)  # the first run's broadcast; its sync point plans the buckets
    counts = []
    for size in BN_STEPS:
        for x, y in strategy.experimental_distribute_dataset(batches([size], 7)):
            count = strategy.traffic["collectives"]
            strategy.run(lambda x, y: nn.functional.cross_entropy(model(x), y).backward(),
                         args=(x, y))
            counts.append(strategy.traffic["collectives"] - count)
    results["bn_collectives"] = counts
    results["bn_buckets"] = len(strategy._collectives._plan.buckets)  # type: ignore[union-attr]
    # An integer buffer beyond float64's exact integers: the writes' sums keep their dtypes.
    strategy = MultiWorkerCentralStorageStrategy(devices, **settings)
    with strategy.scope():
        counter = BigCounter()
    strategy.run(lambda: None)
    results["big_collectives"] = []
    for _ in range(2):  # the second run's writes travel in its agreement
        count = strategy.traffic["collectives"]
        strategy.run(lambda x: counter(x).sum().backward(), args=(
            strategy.experimental_distribute_values_from_function(lambda c: torch.ones(2, 6)),
        ))
        results["big_collectives"].append(strategy.traffic["collectives"] - count)
    results["big_buckets"] = len(strategy._collectives._plan.buckets)  # type: ignore[union-attr]
    results["big"] = (int(counter.big), float(counter.seen))
    return results


def errors_scenario() -> dict[str, Any]:
    """Mistakes every worker must report the same way, then a replica raising on worker 1."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}

    def caught(fn: Any) -> str:
        try:
            fn()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    out["replicas"] = caught(lambda: MultiWorkerCentralStorageStrategy(
        ["cpu:0", "cpu:1"] if rank == 0 else ["cpu:0"], timeout=20
    ))
    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=20)
    out["shapes"] = caught(lambda: strategy.reduce("SUM", torch.ones(2 + rank), axis=None))
    out["out_of_step"] = caught(
        lambda: strategy.reduce("SUM", torch.ones(2), axis=None) if rank == 0
        else strategy.gather(torch.ones(2), axis=0)
    )
    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=20)
    with strategy.scope():
        model = nn.Linear(2, 1)
        counter = cs.Variable(0.0, aggregation="SUM", trainable=False)
    strategy.run(lambda x: model(x).sum().backward(), args=(torch.ones(3, 2),))
    before = [t.detach().clone() for t in (model.weight.grad, model.weight, counter)]

    def step(x: torch.Tensor) -> None:
        counter.add_(1.0)
        model(x).sum().backward()
        if rank == 1:
            raise ValueError("boom in the step of worker 1")

    start = time.monotonic()
    out["step"] = caught(lambda: strategy.run(step, args=(torch.ones(3, 2),)))
    out["step_seconds"] = time.monotonic() - start
    after = [model.weight.grad, model.weight, counter]
    out["discarded"] = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    out.update(failure_mid_backward(rank))
    out.update(backward_on_one_worker(rank))
    return out


def backward_on_one_worker(rank: int) -> dict[str, Any]:
    """Only worker 0 backs through the reduced loss after run: it has gradients pending at
    its optimizer step, worker 1 has none and exchanges nothing there (an optimizer step
    without gradients pending makes no collective), then reduces; both raise, out of step."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=20)
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = strategy.reduce("SUM", strategy.run(lambda x: model(x).sum(), args=(torch.ones(3, 2),)),
                           axis=None)
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            loss.backward()
        optimizer.step()
        strategy.reduce("SUM", torch.ones(1), axis=None)
    except RuntimeError as error:
        out["lopsided"] = str(error)
    else:
        out["lopsided"] = "no error"
    return out


def failure_mid_backward(rank: int) -> dict[str, Any]:
    """Worker 1 raises in the middle of its backward, after the first of three buckets left
    (worker 0's backward starts all three): the run is discarded on both, ``.grad`` as
    before it."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=20, bucket_cap_mb=BUCKET)
    with strategy.scope():
        net = mlp()
    x = torch.randn(4, 6)
    strategy.run(lambda: net(x).sum().backward())  # its sync point plans the buckets
    before = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    started: list[int] = []

    def step() -> None:
        count = strategy.traffic["collectives"]

        def boom(grad: torch.Tensor) -> None:
            started.append(strategy.traffic["collectives"] - count)
            raise ValueError("boom in the backward of worker 1")

        hidden = net[1](net[0](x))
        if rank == 1:
            hidden.register_hook(boom)
        net[2](hidden).sum().backward()
        started.append(strategy.traffic["collectives"] - count)

    error = ""
    try:
        strategy.run(step)
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    after = [p.grad for p in net.parameters()]
    return {
        "mid_backward": error,
        "mid_backward_started": started,
        "mid_backward_discarded": len(before) == len(after) == 4
        and all(torch.equal(a, b) for a, b in zip(after, before, strict=True)),
    }


AGAIN_PASSES = (2, 2, 1, 3, 4, 4)  # the backward passes of again_scenario's runs


def again_scenario(local: int, placement: str | None = None) -> dict[str, Any]:
    """Runs that back several times (``AGAIN_PASSES``). In the first, the buckets that left
    during the first backward are not what the fold produces: every worker exchanges again
    from the fold, and the workers learn that a run makes two backward passes; in the next
    run the buckets leave during the second. A run of one pass sends them during the
    agreement (the plan keeps waiting for two). A run of three passes learns three the same
    way; the next, of four, finds its buckets stale too: after two stale runs in a row the
    layout's buckets no longer leave early. With ``local`` replicas (each makes the run's
    passes on the whole input, one replica after the other), or on GPUs (``on_gpus``)
    placed as ``GPU_PLACEMENTS[placement]``."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    devices, parameter_device = placed(placement, local)
    with on_gpus(placement):
        strategy = MultiWorkerCentralStorageStrategy(
            devices, parameter_device=parameter_device, timeout=30, bucket_cap_mb=BUCKET
        )
        with strategy.scope():
            net = mlp()
        host = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))

        def inputs() -> torch.Tensor:  # on the replica's device (its view's)
            return host.to(next(net.parameters()).device)

        strategy.run(lambda: net(inputs()).sum().backward())  # its sync point plans the buckets
        out: dict[str, Any] = {
            "initial": {k: v.cpu() for k, v in net.state_dict().items()}, "collectives": [],
            "grads": [], "after_each_backward": [],
        }

        def passes(n: int) -> None:
            sent = out["after_each_backward"][-1]
            for part in inputs().tensor_split(n):
                net(part).sum().backward()
                sent.append(strategy.traffic["collectives"] - before)

        for n in AGAIN_PASSES:
            for p in net.parameters():
                p.grad = None
            before = strategy.traffic["collectives"]
            out["after_each_backward"].append([])
            strategy.run(passes, args=(n,))
            out["collectives"].append(strategy.traffic["collectives"] - before)
            out["grads"].append([p.grad.cpu() for p in net.parameters() if p.grad is not None])
    return out


BUFFER_RUNS = 6  # ``buffers_scenario``'s runs: the third's gradients kept, the sixth zeroed


def buffers_scenario(local: int, placement: str | None = None) -> dict[str, Any]:
    """Runs whose buckets leave during backward (from the second: the first plans them),
    each packed into the flat buffers of the run before while ``.grad`` let them go
    (``BucketPlan.buffer``): every run's ``.grad`` and where each lies. ``.grad`` is set to
    None before every run but the sixth, before which ``zero_grad(set_to_none=False)``
    zeroes it in place; the third run's gradients are kept (a reference, as code that keeps
    the last step's gradients has) through the later runs. Worker ``w``'s replicas all step
    on input ``k`` times ``w + 1``; no optimizer step, so every run's sums are of the
    initial weights."""
    with on_gpus(placement):
        strategy = worker_strategy(*placed(placement, local), bucket_cap_mb=BUCKET)
        with strategy.scope():
            net = mlp()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        params = list(net.parameters())
        scale = strategy.worker_index + 1
        out: dict[str, Any] = {
            "initial": {k: v.cpu() for k, v in net.state_dict().items()}, "grads": [],
            "pointers": [],
        }

        def step(x: torch.Tensor) -> None:
            net(x.to(next(net.parameters()).device) * scale).sum().backward()

        kept: list[torch.Tensor] = []
        for k in range(BUFFER_RUNS):
            optimizer.zero_grad(set_to_none=k != 5)
            strategy.run(step, args=(buffer_input(k),))
            out["grads"].append([p.grad.clone() for p in params])
            out["pointers"].append([p.grad.data_ptr() for p in params])
            if k == 2:
                kept = [p.grad for p in params]
                out["kept then"] = [g.clone() for g in kept]
        out["kept after"] = [g.clone() for g in kept]
    return out


IDLE_RUNS, IDLE_JOINS = 6, 3  # ``idle_scenario``'s runs; the run from which the spare head learns


def idle_scenario(local: int, placement: str | None = None) -> dict[str, Any]:
    """Trainable variables that runs leave without gradients: beside the MLP, the scope
    holds an EMA copy of it (``AveragedModel``, updated after each optimizer step, never
    given a gradient) and a spare head that the loss takes in from run ``IDLE_JOINS`` on.
    The first run (a no-op) plans every variable into the buckets; the next ones learn
    which stay idle. Per training run: bytes and collectives sent, (buckets that left
    during backward, buckets in the plan), each gradient after the run; then the final
    states. Worker ``w``'s replicas all step on the same input times ``w + 1``."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    with on_gpus(placement):
        strategy = worker_strategy(*placed(placement, local), bucket_cap_mb=BUCKET)
        torch.manual_seed(3)
        with strategy.scope():
            net = mlp()
            spare = nn.Linear(6, 1)
            ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            trained = [*net.parameters(), *spare.parameters()]
            optimizer = torch.optim.SGD(trained, lr=0.001)
        left = buckets_left(strategy)
        collectives = strategy._collectives
        plans: list[int] = []
        disarm = collectives._disarm

        def planned() -> Any:  # the buckets of the plan each sync point started from
            early = disarm()
            if early is not None:
                plans.append(len(early.plan.buckets))
            return early

        collectives._disarm = planned  # type: ignore[method-assign]
        host = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
        scale = strategy.worker_index + 1
        out: dict[str, Any] = {
            "initial": {k: _host(v) for k, v in net.state_dict().items()},
            "spare": {k: _host(v) for k, v in spare.state_dict().items()},
            "bytes": [], "collectives": [], "grads": [],
        }

        def step(k: int) -> None:
            x = host.to(next(net.parameters()).device) * scale
            loss = net(x).sum()
            if k >= IDLE_JOINS:
                loss = loss + spare(x).sum()
            loss.backward()

        strategy.run(lambda: None)  # the first run's broadcast; its sync point plans buckets
        for k in range(IDLE_RUNS):
            optimizer.zero_grad()
            before = strategy.traffic
            strategy.run(step, args=(k,))
            after = strategy.traffic
            out["bytes"].append(after["bytes"] - before["bytes"])
            out["collectives"].append(after["collectives"] - before["collectives"])
            out["grads"].append([None if p.grad is None else _host(p.grad) for p in trained])
            optimizer.step()
            ema.update_parameters(net)
        out["left"] = list(zip(left, plans, strict=True))  # (the no-op run starts none)
        out["final"] = [_host(p) for p in trained]
        out["ema"] = [_host(p) for p in ema.parameters()]
        out["ema grads"] = [p.grad for p in ema.parameters()]
    return out


COMPILED_RUNS = 5  # ``compiled_scenario``'s training runs


def compiled_scenario(local: int) -> dict[str, Any]:
    """The MLP's loss ``torch.compile``d (``aot_eager``: dynamo and AOTAutograd, no code
    generation), trained for ``COMPILED_RUNS`` runs of global batches of 8 with ``local``
    replicas per worker: dynamo's counts of graphs (a recompilation makes one more) and of
    graph breaks after each run, the initial and final states."""
    from torch._dynamo.utils import counters

    strategy = worker_strategy([f"cpu:{i}" for i in range(local)], bucket_cap_mb=BUCKET)
    torch.manual_seed(11)
    with strategy.scope():
        net = mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    out: dict[str, Any] = {"initial": {k: _host(v) for k, v in net.state_dict().items()}}

    @torch.compile(backend="aot_eager")
    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(net(x), y, reduction="sum") / 8

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss(x, y).backward()

    out["counts"] = []
    for k in range(COMPILED_RUNS):
        (x, y), = batches([8], 30 + k)
        inputs = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        optimizer.zero_grad()
        strategy.run(step, args=inputs)
        optimizer.step()
        out["counts"].append(
            (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        )
    out["final"] = {k: _host(v) for k, v in net.state_dict().items()}
    return out


def buffer_input(k: int) -> torch.Tensor:
    """``buffers_scenario``'s input of run ``k``."""
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(20 + k))


def faulty_training(timeout: float, peer: str) -> Iterator[None]:
    """Train a small model for 5 steps, yielding after each; worker 1 dies (``peer`` "dead")
    or hangs ("hung") in the middle of its third step."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=timeout)
    rank = strategy.worker_index
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, i: int) -> None:
        if rank == 1 and i == 2:
            if peer == "dead":
                os._exit(3)  # dies without a word, mid-step
            time.sleep(60)
        model(x).sum().backward()

    for i in range(5):
        strategy.run(step, args=(torch.ones(3, 2), i))
        optimizer.step()
        yield


def fault_scenario(timeout: float) -> dict[str, Any]:
    """Worker 1 exits in the middle of its third step; the others must raise in time."""
    start = time.monotonic()
    try:
        for _ in faulty_training(timeout, "dead"):
            start = time.monotonic()
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


def survivor_scenario(peer: str) -> None:
    """Worker 1 dies (or hangs) in its third step; worker 0 lets the error end the process,
    as an ordinary training script does."""
    for _ in faulty_training(4.0, peer):
        pass


RESTART_STEPS = 8  # training steps of the restart scenario
RESTART_KILL_AFTER = 4  # worker 1 dies after this step of the first attempt (last save: 3)


def restart_data() -> cs.Dataset:
    """Global batches of 8 for the restart scenario: seeded shuffle, repeated."""
    generator = torch.Generator().manual_seed(11)
    x, y = torch.randn(24, 6, generator=generator), torch.randint(0, 3, (24,), generator=generator)
    return cs.Dataset.from_tensor_slices((x, y)).shuffle(10, seed=4).repeat().batch(8)


def restart_scenario(out_dir: str) -> dict[str, Any]:
    """Train ``RESTART_STEPS`` steps, checkpointing every 2 into ``out_dir/ckpts``; in the
    first attempt worker 1 SIGKILLs itself after step ``RESTART_KILL_AFTER``, torchrun
    restarts both workers, and they resume from the latest checkpoint."""
    import signal

    from centralstore.checkpoint import Checkpoint, CheckpointManager
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    strategy = MultiWorkerCentralStorageStrategy(["cpu:0"], timeout=30)
    rank = strategy.worker_index
    torch.manual_seed(3)
    with strategy.scope():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = torch.zeros((), dtype=torch.int64)
    iterator = iter(strategy.experimental_distribute_dataset(restart_data()))
    checkpoint = Checkpoint(model=model, optimizer=optimizer, iterator=iterator, step=step)
    manager = CheckpointManager(
        checkpoint, os.path.join(out_dir, "ckpts"), max_to_keep=2, step_counter=step,
        checkpoint_interval=2,
    )
    restored = manager.restore_or_initialize()
    if restored is None and rank == 0:
        torch.save(model.state_dict(), os.path.join(out_dir, "initial.pt"))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        cs.compute_average_loss(per_example, global_batch_size=8).backward()

    while int(step) < RESTART_STEPS:
        x, y = next(iterator)
        optimizer.zero_grad()
        strategy.run(replica_step, args=(x, y))
        optimizer.step()
        step += 1
        manager.save()
        if attempt == 0 and rank == 1 and int(step) == RESTART_KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"final": model.state_dict(), "attempt": attempt, "restored": restored}


def patterns_scenario(placement: str | None = None) -> dict[str, Any]:
    """Every everyday idiom of the parity matrix (``tests/idioms.py``) on the workers' path:
    each worker's replicas take their slices of the same global batch, 3 optimizer steps.
    With ``placement``, on its GPUs (``on_gpus``); the parity rows with one replica."""
    from idioms import PATTERNS, X, Y, mse_step, step_optimizer

    devices, parameter_device = placed(placement)
    device, local = devices[0], len(devices)
    results: dict[str, Any] = {}
    with on_gpus(placement):
        for name, spec in PATTERNS.items():
            s = worker_strategy(devices, parameter_device)
            torch.manual_seed(0)  # drawn on the host: a GPU draws otherwise
            initial = spec["make"]().state_dict()
            with s.scope():
                model = spec["make"]()
                model.load_state_dict(initial)
                optimizer = spec["optimizer_of"](model)
            step = spec.get("step_of", mse_step)(model)
            mine = (replica_slices(s, X, devices), replica_slices(s, Y, devices))
            for _ in range(3):
                for _ in range(spec.get("runs_per_step", 1)):
                    s.run(step, args=mine)
                step_optimizer(spec, model, optimizer)
                spec.get("after_step", lambda m, o: None)(model, optimizer)
                optimizer.zero_grad()
            results[name] = host_state(model)
        if local == 1:
            results["rows"] = parity_rows(worker_strategy(devices, parameter_device), device)
    return results


def replica_slices(strategy: cs.Strategy, tensor: torch.Tensor, devices: list[str]) -> Any:
    """``tensor``'s slice for each of ``strategy``'s replicas, every worker's counted, on
    the replica's device (``devices``: the worker's)."""
    parts = tensor.tensor_split(strategy.num_replicas_in_sync)
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group].to(
            devices[ctx.replica_id_in_sync_group % len(devices)]
        )
    )


# ids of a global batch of 8 rows: the first ids below 3 come in the first half only, the
# 9s in the second, so that worker 1 of 2 never uses the "rare" table, and only it reads
# the "mixed" one densely
SPARSE_IDS = torch.tensor([[1, 2, 4], [2, 2, 5], [0, 7, 8], [3, 1, 1],
                           [4, 5, 6], [9, 9, 8], [3, 7, 5], [6, 4, 8]])


class SparseTables(nn.Module):
    """Sparse-gradient tables as recommenders use them: an ``Embedding`` and an
    ``EmbeddingBag`` every slice uses, a ``rare`` table only slices with ids below 3 use, and
    a ``mixed`` table looked up sparsely everywhere and also read densely for rows with an
    id 9 (its gradient dense where a slice has one: sparse plus dense is dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(10, 3, sparse=True)
        self.items = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
        self.rare = nn.Embedding(3, 3, sparse=True)
        self.mixed = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.users(ids[:, 0]) + self.items(ids[:, 1:]) + self.mixed(ids[:, 2])
        rare = ids[:, 0] < 3
        if bool(rare.any()):
            out = out + torch.zeros_like(out).index_add(0, rare.nonzero()[:, 0],
                                                        self.rare(ids[rare][:, 0]))
        nines = (ids == 9).any(1, keepdim=True)
        if bool(nines.any()):
            out = out + nines * self.mixed.weight.sum() * 0.01
        return self.head(out).sum() / len(SPARSE_IDS)

    def optimizer(self) -> Any:
        """SparseAdam for the tables whose gradients stay sparse, Adam for the rest."""
        from idioms import SparseAndDense

        tables = [*self.users.parameters(), *self.items.parameters(), *self.rare.parameters()]
        return SparseAndDense(tables, [*self.mixed.parameters(), *self.head.parameters()])


class WideTable(nn.Module):
    """A 50,000 x 8 table with sparse gradients (1.6 MB dense) and a head: a run touches a
    few rows, so its traffic across workers is far below the table's size unless the table
    travels densified. With ``dense``, the rows with an id 9 (one, in the second half of
    ``SPARSE_IDS``) also read the whole table, which makes that slice's gradient dense."""

    ROWS = 50_000

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(self.ROWS, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, dense: bool = False) -> torch.Tensor:
        out = self.table(ids[:, 0])
        nines = ids[:, :1] == 9
        if dense and bool(nines.any()):
            out = out + nines * self.table.weight.sum() * 1e-3
        return self.head(out).sum() / len(SPARSE_IDS)


WIDE_RUNS = (False, True, False)  # ``dense`` of WideTable's runs, one after another


def sparse_scenario(local: int, placement: str | None = None) -> dict[str, Any]:
    """``SparseTables`` on W workers of ``local`` replicas: the gradients after one run, and
    the weights after 3 steps of SparseAdam beside Adam, two runs a step. Then
    ``WideTable``'s ``WIDE_RUNS``: each run's gradients and the bytes this worker gave to
    collectives. With ``placement``, on GPUs placed as ``GPU_PLACEMENTS[placement]``
    (``on_gpus``; ``local`` is theirs)."""
    devices, parameter_device = placed(placement, local)
    local = len(devices)
    with on_gpus(placement):
        strategy = worker_strategy(devices, parameter_device)
        workers = strategy.num_workers
        torch.manual_seed(0)  # drawn on the host: a GPU draws otherwise
        initial = SparseTables().state_dict()
        with strategy.scope():
            model = SparseTables()
            model.load_state_dict(initial)
            optimizer = model.optimizer()
        mine = strategy.experimental_distribute_values_from_function(  # global replica ids
            lambda ctx: SPARSE_IDS.tensor_split(workers * local)[ctx.replica_id_in_sync_group]
            .to(devices[ctx.replica_id_in_sync_group % local])
        )
        out: dict[str, Any] = {}
        strategy.run(lambda ids: model(ids).backward(), args=(mine,))
        out["grads"] = {name: _host(p.grad) for name, p in model.named_parameters()}
        optimizer.zero_grad()
        for _ in range(3):
            strategy.run(lambda ids: model(ids).backward(), args=(mine,))
            strategy.run(lambda ids: model(ids).backward(), args=(mine,))
            optimizer.step()
            optimizer.zero_grad()
        out["state"] = host_state(model)
        torch.manual_seed(1)
        initial = WideTable().state_dict()
        with strategy.scope():
            wide = WideTable()
            wide.load_state_dict(initial)
        out["wide"], out["wide_gathers"] = [], []
        collectives: Any = strategy._collectives
        gathers: list[str] = []
        gather = collectives.all_gather
        collectives.all_gather = lambda what, flat: gathers.append(what) or gather(what, flat)
        for dense in WIDE_RUNS:
            before = strategy.traffic["bytes"]
            gathers.clear()
            strategy.run(lambda ids, dense=dense: wide(ids, dense).backward(), args=(mine,))
            grads = {name: _host(p.grad) for name, p in wide.named_parameters()}
            out["wide"].append((strategy.traffic["bytes"] - before, grads))
            out["wide_gathers"].append(list(gathers))
            wide.zero_grad()
    return out


METRIC_ROWS = [8, 6, 12]  # a worker's global batches; every replica gets rows


def metric_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``rank``'s batches for ``metrics_scenario``: scores of 3 classes and labels."""
    generator = torch.Generator().manual_seed(11 + rank)
    return [
        (torch.randn(n, 3, generator=generator).softmax(-1),
         torch.randint(0, 3, (n,), generator=generator))
        for n in METRIC_ROWS
    ]


def metrics_scenario(local: int) -> dict[str, Any]:
    """torchmetrics metrics made in the scope, updated in every run of a training step: a
    collection with two compute groups and a mean of the loss, called as a function (its
    forward). Each worker folds its own replicas; ``compute`` combines the workers through
    torchmetrics' own synchronization. Per run, the mean's cached step value (this worker's
    batch); at the end, every metric's computed value and the collection's groups."""
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision

    import centralstore.metrics

    centralstore.metrics.install()
    rank = int(os.environ["RANK"])
    strategy = worker_strategy(*placed(None, local))
    torch.manual_seed(2)
    with strategy.scope():
        head = nn.Linear(3, 3)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
        collection = torchmetrics.MetricCollection({
            "accuracy": MulticlassAccuracy(3, average="macro"),
            "precision": MulticlassPrecision(3, average="macro"),
            "top 2": MulticlassAccuracy(3, top_k=2, average="micro"),
        })
        loss_mean = torchmetrics.MeanMetric()

    def step(scores: torch.Tensor, labels: torch.Tensor) -> None:
        collection.update(scores, labels)
        loss = nn.functional.cross_entropy(head(scores), labels)
        loss.backward()
        loss_mean(scores.max(-1).values)  # (a value the weights do not move)

    steps = []
    for scores, labels in metric_batches(rank):
        optimizer.zero_grad()
        strategy.run(step, args=_metric_args(strategy, scores, labels))
        optimizer.step()
        steps.append(loss_mean._forward_cache.clone())
    return {
        "steps": steps,
        "collection": {k: v.clone() for k, v in collection.compute().items()},
        "groups": collection.compute_groups,
        "mean": loss_mean.compute().clone(),
    }


def _metric_args(
    strategy: cs.Strategy, scores: torch.Tensor, labels: torch.Tensor
) -> tuple[Any, Any]:
    """``scores`` and ``labels`` (this worker's batch) cut into its replicas' slices, in
    order (a worker's replicas have consecutive ids)."""
    local = len(strategy.extended.worker_devices)
    cut = [t.tensor_split(local) for t in (scores, labels)]
    return tuple(
        strategy.experimental_distribute_values_from_function(
            lambda ctx, parts=parts: parts[ctx.replica_id_in_sync_group % local]
        )
        for parts in cut
    )


def _host(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor.to("cpu", copy=True)


def parity_rows(strategy: cs.Strategy, device: str = "cpu:0") -> dict[str, Any]:
    """Rows of the parity table on the workers' path: ``requires_grad`` read when a run
    begins, tensor hooks on every replica's gradient, ``inference_mode`` around ``run``
    (``device``: the one replica's)."""
    from idioms import X

    rank, workers = strategy.worker_index, strategy.num_workers
    mine = X.tensor_split(workers)[rank].to(device)
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).state_dict()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        model.load_state_dict(initial)
    out: dict[str, Any] = {}

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()

    model[0].weight.requires_grad_(False)  # frozen: no gradient, nor one exchanged
    strategy.run(step, args=(mine,))
    out["frozen"] = [p.grad is not None for p in model.parameters()]
    model[0].weight.requires_grad_(True)
    model.zero_grad()
    seen: list[int] = []
    model[0].weight.register_hook(lambda g: seen.append(len(g)) or g * 0)  # type: ignore[func-returns-value]
    strategy.run(step, args=(mine,))
    out["hooked"] = (len(seen), float(model[0].weight.grad.abs().sum()))  # type: ignore[union-attr]
    model.eval()
    with torch.inference_mode():
        out["inference"] = _host(strategy.run(lambda x: model(x), args=(mine,)))
    out["state"], out["input"] = host_state(model), _host(mine)
    return out


STATISTICS_WRITES = ["none", "skip", "add", "fail", "eval", "merge", "dead", "data", "touch"]


class Shifted(nn.Module):
    """A small floating buffer that is not a running statistic (replicas share it too)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


def normalized() -> nn.Sequential:
    """Batch norm of both kinds, a cumulative average (``num_batches_tracked``), and a shift."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2),
        nn.BatchNorm1d(2, momentum=None), Shifted(),
    )


def statistics_after(strategy: cs.Strategy, write: str) -> dict[str, Any]:
    """Three steps of ``normalized`` on ``strategy``'s W x R replicas (the global batch the
    same on every worker), with ``write`` besides (``tests/variables/test_direct.py``'s
    patterns: ``skip``: the last replica makes no forward; ``add``: each adds to a
    statistic and to the shift in place; ``fail``: the last one raises in the second step;
    ``eval``: the second step evaluates; ``merge``: a ``merge_call`` between two forwards;
    ``dead``: a channel that training leaves at its running mean; ``data``: each scales
    the shift through ``.data``, behind its counter; ``touch``: each adds zero to every
    statistic, through its counter, as compiled code writes them). Returns the final state
    and how many buffers some local replica saw through a view of its own."""
    replicas = strategy.num_replicas_in_sync
    torch.manual_seed(0)  # all drawn on the host: a GPU draws otherwise
    initial = normalized().state_dict()
    x = torch.randn(2 * replicas, 3, 4, 4).chunk(replicas)
    with strategy.scope():
        model = normalized()
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xs: torch.Tensor, second: bool) -> None:
        context = cs.get_replica_context()
        assert context is not None
        replica = context.replica_id_in_sync_group
        xs = xs.to(model[0].weight.device)  # (a GPU replica's: cpu:i's stay where they are)
        if write == "skip" and replica == replicas - 1:
            return
        if write == "dead":
            mask = torch.tensor([0.0, 1.0, 1.0, 1.0], device=xs.device)
            hidden = model[0](xs) * mask.view(1, 4, 1, 1)
            model[1:](hidden).pow(2).mean().backward()
        else:
            model(xs).pow(2).mean().backward()
        if write == "add":
            model[1].running_mean.add_(replica + 0.1)
            model[6].shift.add_(replica + 0.1)
        if write == "data":
            model[6].shift.data.mul_(replica + 1.5)
        if write == "touch":
            for norm in (model[1], model[5]):
                norm.running_mean.add_(0.0)
                norm.running_var.add_(0.0)
        if write == "fail" and second and replica == replicas - 1:
            raise RuntimeError("the last replica fails")
        if write == "merge":
            context.merge_call(lambda strategy: None)
            model(xs * 2).pow(2).mean().backward()

    for second in (False, True, False):
        model.train(not (write == "eval" and second))
        optimizer.zero_grad()
        inputs = strategy.experimental_distribute_values_from_function(
            lambda c: x[c.replica_id_in_sync_group]
        )
        try:
            strategy.run(step, args=(inputs, second))
        except RuntimeError:
            assert write == "fail"
        optimizer.step()
    buffers = {id(b) for b in model.buffers()}
    store = strategy._store  # type: ignore[attr-defined]
    viewed = {key for views in store.replicas for key in views.views if key in buffers}
    return {"state": host_state(model), "viewed": len(viewed)}


def host_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state, copied to the host (from a fake GPU too)."""
    return {name: value.to("cpu", copy=True) for name, value in model.state_dict().items()}


def statistics_scenario(devices: list[str], parameter_device: str | None = None) -> dict[str, Any]:
    """``statistics_after`` for every pattern, with the buffers written in place by the
    worker's replicas (where they compute where the variables live) and through views."""
    from replicas import see_views

    results: dict[str, Any] = {}
    for write in STATISTICS_WRITES:
        results[write] = statistics_after(worker_strategy(devices, parameter_device), write)
        views = worker_strategy(devices, parameter_device)
        see_views(views)  # type: ignore[arg-type]
        results[f"{write}/views"] = statistics_after(views, write)
    return results


def trained_in_scope(strategy: cs.Strategy, inside: bool) -> dict[str, Any]:
    """Three steps of ``bn_model`` whose ``run`` (with a ``merge_call``) and ``reduce`` are
    called inside ``strategy.scope()`` (``inside``) or outside it. The scope's
    ``torch.device`` context (the parameter device's) must not reach what the sync point
    makes on the host: agreement rows, carried writes, a reduced loss's words. Returns the
    final state and the reduced losses."""
    torch.manual_seed(0)
    with strategy.scope():
        model = bn_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replicas = strategy.num_replicas_in_sync
    x = torch.randn(4 * replicas, 6).chunk(replicas)

    def step(xs: torch.Tensor) -> torch.Tensor:
        loss = model(xs.to(model[0].weight.device)).pow(2).mean()
        loss.backward()
        context = cs.get_replica_context()
        assert context is not None
        context.merge_call(lambda strategy: None)
        return loss.detach()

    losses = []
    with strategy.scope() if inside else contextlib.nullcontext():
        for _ in range(3):
            optimizer.zero_grad()
            inputs = strategy.experimental_distribute_values_from_function(
                lambda c: x[c.replica_id_in_sync_group]
            )
            per_replica = strategy.run(step, args=(inputs,))
            losses.append(strategy.reduce("MEAN", per_replica, axis=None).cpu())
            optimizer.step()
    return {"state": host_state(model), "losses": losses}


def all_reduced_grad(strategy: cs.Strategy) -> float:
    """``train_bn``, then the gradient of a new central scalar through a differentiable
    ``all_reduce`` of each replica's multiple of it (``api``'s case), whose backward meets
    the other replicas again, beside the trained model's variables."""
    torch.manual_seed(0)
    with strategy.scope():
        model = bn_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_bn(strategy, model, optimizer)
    with strategy.scope():
        w = torch.ones((), requires_grad=True)

    def step() -> None:
        context = cs.get_replica_context()
        assert context is not None
        context.all_reduce("SUM", w * (context.replica_id_in_sync_group + 1)).backward()

    strategy.run(step)
    assert w.grad is not None
    return float(w.grad)


# The fake-GPU scenario's placements: each worker's replicas, and its parameter device.
GPU_PLACEMENTS: dict[str, tuple[list[str], str]] = {
    "one-gpu": (["cuda:0"], "cuda:0"),
    "one-gpu-params-on-host": (["cuda:0"], "cpu"),
    "two-on-the-parameter-gpu": (["cuda:0", "cuda:0"], "cuda:0"),
    "two-gpus": (["cuda:0", "cuda:1"], "cuda:0"),
    "two-gpus-params-on-host": (["cuda:0", "cuda:1"], "cpu"),
}


def placed(placement: str | None, local: int = 1) -> tuple[list[str], str | None]:
    """A scenario's local compute devices and parameter device: ``local`` logical CPU
    devices and the default, or ``GPU_PLACEMENTS[placement]``."""
    if placement is None:
        return [f"cpu:{i}" for i in range(local)], None
    return GPU_PLACEMENTS[placement]


def worker_strategy(
    devices: list[str], parameter_device: str | None = None, bucket_cap_mb: float = 25.0
) -> MultiWorkerCentralStorageStrategy:
    """This worker's strategy over ``devices``, its variables on ``parameter_device``, its
    gradient buckets of ``bucket_cap_mb`` (``BUCKET``: several for the small models)."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    return MultiWorkerCentralStorageStrategy(
        devices, parameter_device=parameter_device, timeout=60, bucket_cap_mb=bucket_cap_mb
    )


@contextlib.contextmanager
def on_gpus(placement: str | None) -> Iterator[None]:
    """For a ``placement`` (None: logical CPU devices, nothing to do), two fake GPUs per
    worker (``tests/fakegpu``), a stream hazard failing the worker (``fakegpu.checked``),
    and the process group on gloo: the fake GPUs have no NCCL, and a real GPU may be the
    only one of both workers, so the collectives' buffers stay on the host. With
    ``CENTRALSTORE_REAL_GPUS=1``, the real GPUs (``benchmarks/gpu_check.py``), with cuDNN
    deterministic and without TF32, whose convolutions stray from the CPU's by 1e-2."""
    import fakegpu

    if placement is None:
        yield
        return
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    if os.environ.get("CENTRALSTORE_REAL_GPUS"):
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        yield
        return
    with fakegpu.checked(2):
        yield


def gpus_scenario(placement: str) -> dict[str, Any]:
    """``statistics_scenario``, ``trained_in_scope`` and ``all_reduced_grad`` on GPUs
    (``on_gpus``) placed as ``GPU_PLACEMENTS[placement]``."""
    devices, parameter_device = placed(placement)
    with on_gpus(placement):
        results = statistics_scenario(devices, parameter_device)
        for inside in (False, True):
            strategy = worker_strategy(devices, parameter_device)
            results[f"scope/{inside}"] = trained_in_scope(strategy, inside)
        results["all_reduce grad"] = all_reduced_grad(worker_strategy(devices, parameter_device))
    return results


def copied_early_scenario(placement: str, pinned_bytes: int | None) -> dict[str, Any]:
    """GPU replicas of variables in host memory (``GPU_PLACEMENTS[placement]``), whose
    gradients reach the host through the store's pinned buckets: ``copied_runs`` with the
    buckets allowed to leave during backward and not (``late``). ``pinned_bytes``: the
    pinned buckets' size instead of 16 MiB, so that they fill, and their copies start, one
    after another during backward."""
    from centralstore.variables import buckets

    devices, parameter_device = placed(placement)
    if pinned_bytes is not None:
        buckets.BUCKET_BYTES = pinned_bytes
    with on_gpus(placement):
        torch.manual_seed(0)  # drawn on the host: a GPU draws otherwise
        initial = mlp().state_dict()
        return {
            "early": copied_runs(devices, parameter_device, initial, late=False),
            "late": copied_runs(devices, parameter_device, initial, late=True),
        }


def copied_runs(
    devices: list[str], parameter_device: str | None, initial: dict[str, Any], late: bool
) -> dict[str, Any]:
    """The MLP's ``COPIED_RUNS``, its buckets 64 bytes each (with ``late``, exchanged after
    the fold): the gradients after each run (of a run that failed, those set before it), how
    many buckets had left when the first layer's weight got its gradient (the last but one
    to come) in each pass, and at the end of each replica's passes, and what each run
    raised. Then (not ``late``) a run of two passes, after which each replica holds the
    first of two passes on its GPU (``GradientBuckets.holds``), so that the next copies
    one sum per view, which may leave early; and that next run, of two passes, without the
    helper thread: what it raised, and how many replicas' passes returned."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    strategy = MultiWorkerCentralStorageStrategy(
        devices, parameter_device=parameter_device, timeout=60, bucket_cap_mb=BUCKET
    )
    if late:
        strategy._collectives._arm = lambda store: None  # type: ignore[method-assign]
    with strategy.scope():
        net = mlp()
        net.load_state_dict(initial)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))

    def left() -> int:
        early = strategy._collectives._early
        return 0 if early is None else early.early

    before_first: list[int] = []
    net[0].weight.register_hook(lambda grad: before_first.append(left()))
    after: list[int] = []

    def passes(n: int, fails: bool) -> None:
        replica = cs.get_replica_context().replica_id_in_sync_group % len(devices)
        mine = x.to(devices[replica]) * (1 + strategy.worker_index)
        for part in mine.tensor_split(n):
            net(part).sum().backward()
        after.append(left())
        if fails and strategy.worker_index == 1:
            raise ValueError("worker 1 fails after its backward")

    grads, errors = [], []
    for n, fails in COPIED_RUNS:
        for p in net.parameters():  # a run that fails leaves these
            p.grad = torch.full_like(p, 7.0) if fails else None
        try:
            strategy.run(passes, args=(n, fails))
            errors.append(None)
        except (RuntimeError, ValueError) as error:
            errors.append(type(error).__name__)
        grads.append([_host(p.grad) for p in net.parameters()])
    out = {
        "before first": list(before_first), "after": list(after), "grads": grads,
        "errors": errors,
    }
    if not late:  # the helper thread gone (an interpreter exiting): the buckets cannot
        strategy.run(passes, args=(2, False))
        returned = len(after)
        strategy._collectives._copies[1].shutdown()  # start, yet every backward returns
        out["helper gone"] = _raised(lambda: strategy.run(passes, args=(2, False)))
        out["helper gone returned"] = len(after) - returned
    return out


def _raised(call: Callable[[], object]) -> str | None:
    """What ``call`` raised, as ``type: message``, or None."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def training_scenario(placement: str) -> dict[str, Any]:
    """``train`` with each of ``OPTIMIZERS`` on GPUs placed as ``GPU_PLACEMENTS[placement]``
    (``on_gpus``), the MLP's gradients in buckets of 64 bytes that may leave during backward,
    and the SGD run again with every bucket held for the sync point: the initial and final
    states, on the host."""
    from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

    devices, parameter_device = placed(placement)
    results: dict[str, Any] = {}
    with on_gpus(placement):
        for name, late in [*((name, False) for name in OPTIMIZERS), ("sgd", True)]:
            strategy = MultiWorkerCentralStorageStrategy(
                devices, parameter_device=parameter_device, timeout=60, bucket_cap_mb=BUCKET
            )
            if late:
                strategy._collectives._arm = lambda store: None  # type: ignore[method-assign]
            left = buckets_left(strategy)
            torch.manual_seed(100)  # drawn on the host: a GPU draws otherwise
            initial = mlp().state_dict()
            with strategy.scope():
                model = mlp()
                model.load_state_dict(initial)
                optimizer = OPTIMIZERS[name](list(model.parameters()))
            train(strategy, model, optimizer)
            key = f"{name}/after fold" if late else name
            results[key] = {"initial": initial, "final": host_state(model), "left": left}
    return results


def buckets_left(strategy: MultiWorkerCentralStorageStrategy) -> list[int]:
    """Filled at each of ``strategy``'s sync points that could start buckets early: how
    many left during backward."""
    left: list[int] = []
    collectives = strategy._collectives
    disarm = collectives._disarm

    def recorded() -> Any:
        early = disarm()
        if early is not None:
            left.append(early.early)
        return early

    collectives._disarm = recorded  # type: ignore[method-assign]
    return left


# copied_runs' runs: (backward passes, whether worker 1 raises after them)
COPIED_RUNS = ((1, False), (1, False), (1, True), (2, False), (2, False), (1, False))


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    if scenario == "survivor":
        survivor_scenario(sys.argv[3])  # raises: the process ends on the error
        return
    rank = int(os.environ["RANK"])
    if scenario == "main":
        results = main_scenario(int(sys.argv[3]), explicit_group=sys.argv[4] == "explicit")
    elif scenario == "errors":
        results = errors_scenario()
    elif scenario == "training":
        results = training_scenario(sys.argv[3])
    elif scenario == "copied":
        pinned = None if sys.argv[4] == "-" else int(sys.argv[4])
        results = copied_early_scenario(sys.argv[3], pinned)
    elif scenario == "again":
        results = again_scenario(int(sys.argv[3]), *sys.argv[4:5])
    elif scenario == "buffers":
        results = buffers_scenario(int(sys.argv[3]), *sys.argv[4:5])
    elif scenario == "idle":
        results = idle_scenario(int(sys.argv[3]), *sys.argv[4:5])
    elif scenario == "compiled":
        results = compiled_scenario(int(sys.argv[3]))
    elif scenario == "fault":
        results = fault_scenario(float(sys.argv[3]))
    elif scenario == "restart":
        results = restart_scenario(out_dir)
    elif scenario == "patterns":
        results = patterns_scenario(*sys.argv[3:4])
    elif scenario == "sparse":
        results = sparse_scenario(int(sys.argv[3]), *sys.argv[4:5])
    elif scenario == "statistics":
        results = statistics_scenario(*placed(None, int(sys.argv[3])))
    elif scenario == "gpus":
        results = gpus_scenario(sys.argv[3])
    elif scenario == "metrics":
        results = metrics_scenario(int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()
    # Skip the interpreter's teardown: with torch 2.13, a process that has imported
    # torch._dynamo (every optimizer step does) and used gloo sometimes aborts there with
    # "terminate called without an active exception", even after destroy_process_group
    # (https://github.com/pytorch/pytorch/issues/190489). The results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
