"""The GPU paths on two fake GPUs (``tests/fakegpu``), the parameters on the CPU and on
``cuda:0``: the parity matrix's everyday patterns against one device, and the defects that only
private per-device views, pinned memory and streams could have (every test is also checked
for stream races and allocator hazards at teardown)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from idioms import PATTERNS, X, Y, mse_step, step_optimizer
from paths import FakePlacement
from replicas import context, local
from torch import nn

import centralstore as cs
from centralstore import _tree
from centralstore.variables import views


def strategy_for(placement: FakePlacement) -> cs.CentralStorageStrategy:
    return cs.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    )


def to_replicas(t: torch.Tensor, devices: tuple[str, ...]) -> cs.PerReplica[torch.Tensor]:
    return cs.PerReplica([part.to(d) for part, d in zip(t.tensor_split(len(devices)), devices)])


def host_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train_on_gpus(
    placement: FakePlacement, spec: dict[str, Any], steps: int = 3,
) -> dict[str, torch.Tensor]:
    strategy = strategy_for(placement)
    torch.manual_seed(0)
    initial = spec["make"]().state_dict()  # drawn on the host: fake GPUs draw otherwise
    with strategy.scope():
        model = spec["make"]()
        model.load_state_dict(initial)
        optimizer = spec["optimizer_of"](model)
    step_of: Callable[[nn.Module], Callable[..., Any]] = spec.get("step_of", mse_step)
    xs, ys = to_replicas(X, placement.compute_devices), to_replicas(Y, placement.compute_devices)
    for _ in range(steps):
        for _ in range(spec.get("runs_per_step", 1)):
            strategy.run(step_of(model), args=(xs, ys))
        step_optimizer(spec, model, optimizer)
        spec.get("after_step", lambda m, o: None)(model, optimizer)
        optimizer.zero_grad()
    return host_state(model)


def train_on_one_device(spec: dict[str, Any], steps: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = spec["make"]()
    optimizer = spec["optimizer_of"](model)
    step_of: Callable[[nn.Module], Callable[..., Any]] = spec.get("step_of", mse_step)
    for _ in range(steps):
        for _ in range(spec.get("runs_per_step", 1)):
            step_of(model)(X, Y)
        step_optimizer(spec, model, optimizer)
        spec.get("after_step", lambda m, o: None)(model, optimizer)
        optimizer.zero_grad()
    return host_state(model)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_everyday_patterns_on_two_gpus_train_like_one_device(
    pattern: str, fake_gpu_placement: FakePlacement
) -> None:
    spec = PATTERNS[pattern]
    expected = train_on_one_device(spec)
    got = train_on_gpus(fake_gpu_placement, spec)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)


def _write_between(model: nn.Module, _: Any) -> None:
    with torch.no_grad():
        model[1].running_mean.add_(1.0)
        model[4].reset_running_stats()


def _batch_norm_stack() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6),
        nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 2),
    )


_BATCH_NORM_STACK = {
    "make": _batch_norm_stack,
    "optimizer_of": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "after_step": _write_between,
}


def test_batch_norm_stacks_on_gpus_train_like_logical_devices(
    fake_gpu_placement: FakePlacement,
) -> None:
    """Batch norm on GPU replicas (private copies of every buffer, refreshed and compared
    with their central values together) keeps the same running statistics and counters,
    step after step, as on two logical CPU devices, where the replicas use the buffers
    themselves (``direct_buffers.py``): every layer's, not only some, with writes to them
    between steps."""
    spec = _BATCH_NORM_STACK
    logical = FakePlacement(None, ("cpu:0", "cpu:1"), "cpu")
    expected = train_on_gpus(logical, spec, steps=4)
    got = train_on_gpus(fake_gpu_placement, spec, steps=4)
    assert int(got["1.num_batches_tracked"]) == 4 and int(got["4.num_batches_tracked"]) == 0
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)


def _convolutions_in_steps(
    devices: tuple[str, ...], storage: str, scenario: str
) -> dict[str, torch.Tensor]:
    """Three steps of a channels-last convolution and batch-norm network on ``devices``,
    with, in each, the ``scenario``: a sync point in the middle of the run (``merge_call``
    after a forward), a run that fails on its second replica before the step, or an
    evaluation run after it."""
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device=storage)

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
            nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2),
        ).to(memory_format=torch.channels_last)

    torch.manual_seed(0)
    initial = make().state_dict()
    with strategy.scope():
        model = make()
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    xs = to_replicas(x, devices)

    def step(xb: torch.Tensor) -> None:
        if scenario == "merge_call":
            model(xb)  # batch norm writes its statistics, then a sync point
            context().merge_call(lambda _: None)
        model(xb).sum().backward()

    def fails(xb: torch.Tensor) -> None:
        model(xb).sum().backward()
        if context().replica_id_in_sync_group == 1:
            raise RuntimeError("the second replica fails")

    for _ in range(3):
        if scenario == "failed_run":
            with pytest.raises(RuntimeError, match="second replica"):
                strategy.run(fails, args=(xs,))
        strategy.run(step, args=(xs,))
        optimizer.step()
        optimizer.zero_grad()
        if scenario == "evaluation":
            model.eval()
            strategy.run(lambda xb: model(xb).sum(), args=(xs,))
            model.train()
    return host_state(model)


@pytest.mark.parametrize("scenario", ["merge_call", "failed_run", "evaluation"])
def test_batch_norm_in_every_kind_of_run_on_gpus_matches_logical_devices(
    scenario: str, fake_gpu_placement: FakePlacement
) -> None:
    """Batch norm's statistics and counters on GPU replicas, across a sync point inside a
    run, a discarded run and an evaluation run, are those of two logical CPU devices."""
    expected = _convolutions_in_steps(("cpu:0", "cpu:1"), "cpu", scenario)
    got = _convolutions_in_steps(
        fake_gpu_placement.compute_devices, fake_gpu_placement.parameter_device, scenario
    )
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)


class _Buffers(nn.Module):
    """Buffers of every kind a refresh meets: small and large (over 64 KiB, copied alone)
    batch-norm statistics, a boolean mask, a counter its forward writes in place."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
        self.proj, self.big, self.out = nn.Linear(6, 16500), nn.BatchNorm1d(16500), nn.Linear(
            16500, 2
        )
        self.register_buffer("mask", torch.tensor([1, 0, 1, 1, 0, 1]).bool(), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.out(self.big(self.proj(self.bn(self.a(x) * self.mask))))


def _buffers_in_steps(
    devices: tuple[str, ...], storage: str, dtype: torch.dtype, between: str
) -> dict[str, torch.Tensor]:
    """Three steps of ``_Buffers``, a buffer changed ``between`` them: assigned anew (in the
    scope), its storage replaced through ``.data``, or loaded with ``load_state_dict``."""
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device=storage)
    torch.manual_seed(0)
    initial = _Buffers(dtype).state_dict()
    with strategy.scope():
        model = _Buffers(dtype)
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    for _ in range(3):
        strategy.run(lambda xb: model(xb).float().sum().backward(), args=(to_replicas(x, devices),))
        optimizer.step()
        optimizer.zero_grad()
        if between == "assigned":
            with strategy.scope():
                model.bn.running_mean = torch.full((6,), 0.5, dtype=dtype).to(storage)
        elif between == "data":
            model.bn.running_var.data = torch.full((6,), 2.0, dtype=dtype).to(storage)
        else:
            state = model.state_dict()
            state["bn.running_mean"] = state["bn.running_mean"] + 1
            model.load_state_dict(state)
    return host_state(model) | {"mask": model.mask.cpu(), "count": model.count.cpu()}


@pytest.mark.parametrize(("dtype", "between"), [
    (torch.float32, "assigned"), (torch.float32, "data"), (torch.float32, "loaded"),
    (torch.bfloat16, "loaded"),
])
def test_buffers_of_every_kind_on_gpus_match_logical_devices(
    dtype: torch.dtype, between: str, fake_gpu_placement: FakePlacement
) -> None:
    """Small buffers refreshed together, large ones alone, masks, counters, in two dtypes,
    each changed between steps in the three ways a user changes one: the same values on GPU
    replicas as on two logical CPU devices."""
    expected = _buffers_in_steps(("cpu:0", "cpu:1"), "cpu", dtype, between)
    got = _buffers_in_steps(
        fake_gpu_placement.compute_devices, fake_gpu_placement.parameter_device, dtype, between
    )
    # a real GPU's bfloat16 kernels round otherwise than the CPU's (on an H200 a weight was
    # 0.026 off after three steps, 3.4 times bfloat16's epsilon); the fake GPUs compute on the CPU
    epsilons = 4 * torch.finfo(dtype).eps
    tolerance = (
        {"rtol": epsilons, "atol": epsilons}
        if fake_gpu_placement.gpus is None and dtype is torch.bfloat16 else {}
    )
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name, **tolerance)


def _frozen_backbone_steps(
    devices: tuple[str, ...], storage: str, fused: bool
) -> tuple[dict[str, torch.Tensor], cs.CentralStorageStrategy, nn.Module]:
    """Fine-tuning the head of a frozen backbone, every parameter given to the optimizer,
    with the backbone changed between steps: written in place, then stepped by the
    optimizer through a ``.grad`` given to a frozen weight (a fused kernel moves no version
    counter)."""
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device=storage)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))

    torch.manual_seed(0)
    initial = make().state_dict()
    with strategy.scope():
        model = make()
        model.load_state_dict(initial)
        model[0].requires_grad_(False)
        model[2].requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    xs, ys = to_replicas(X, devices), to_replicas(Y, devices)
    for step in range(4):
        strategy.run(mse_step(model), args=(xs, ys))
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            with torch.no_grad():
                model[0].weight.mul_(0.5)
        elif step == 2:
            model[2].weight.grad = torch.ones_like(model[2].weight)
            optimizer.step()
            optimizer.zero_grad()
    return host_state(model), strategy, model


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_frozen_backbone_on_gpus_is_copied_only_when_it_changes(
    fused: bool, fake_gpu_placement: FakePlacement
) -> None:
    """GPU replicas copy a frozen parameter again only when it changed (its version counter,
    or the optimizer's stamp when it stepped one with a ``.grad``), not at every run, and
    train as two logical CPU devices do."""
    expected, _, _ = _frozen_backbone_steps(("cpu:0", "cpu:1"), "cpu", fused)
    got, strategy, model = _frozen_backbone_steps(
        fake_gpu_placement.compute_devices, fake_gpu_placement.parameter_device, fused
    )
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)
    frozen = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    copies = [
        view.tensor for replica in strategy._store.replicas
        for view in map(replica.views.get, map(id, frozen)) if view is not None and view.private
    ]
    assert copies  # the GPU replicas' own copies of the frozen parameters
    versions = [copy._version for copy in copies]
    xs, ys = to_replicas(X, fake_gpu_placement.compute_devices), to_replicas(
        Y, fake_gpu_placement.compute_devices
    )
    strategy.run(mse_step(model), args=(xs, ys))
    assert [copy._version for copy in copies] == versions  # not copied again


@pytest.mark.usefixtures("fake_gpus")
def test_a_batch_norm_stack_on_one_gpu_with_host_variables_trains_like_plain_pytorch() -> None:
    """One GPU replica, the variables in host memory: its buffers' writes come back in one
    copy per dtype (``apply_writes``) and match plain PyTorch's, step after step."""
    expected = train_on_one_device(_BATCH_NORM_STACK, steps=4)
    got = train_on_gpus(FakePlacement(None, ("cuda:0",), "cpu"), _BATCH_NORM_STACK, steps=4)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)


def _linear_run(
    placement: FakePlacement, optimizer_of: Callable[[Any], torch.optim.Optimizer],
    between: Callable[[nn.Module], None] = lambda m: None, steps: int = 3,
) -> dict[str, torch.Tensor]:
    strategy = strategy_for(placement)
    torch.manual_seed(0)
    initial = nn.Linear(4, 2).state_dict()
    with strategy.scope():
        model = nn.Linear(4, 2)
        model.load_state_dict(initial)
        optimizer = optimizer_of(model.parameters())
    xs, ys = to_replicas(X, placement.compute_devices), to_replicas(Y, placement.compute_devices)
    for _ in range(steps):
        strategy.run(mse_step(model), args=(xs, ys))
        optimizer.step()
        optimizer.zero_grad()
        between(model)
    return host_state(model)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD"])
def test_a_fused_optimizer_trains_exactly_like_a_plain_one(
    kind: str, fake_gpu_placement: FakePlacement
) -> None:
    make = getattr(torch.optim, kind)
    options: dict[str, Any] = {"lr": 0.05} | ({"momentum": 0.9} if kind == "SGD" else {})
    plain = _linear_run(fake_gpu_placement, lambda p: make(p, foreach=False, **options))
    fused = _linear_run(fake_gpu_placement, lambda p: make(p, fused=True, **options))
    for name, value in plain.items():
        torch.testing.assert_close(fused[name], value, msg=name)


def test_writes_through_data_reach_every_replica(fake_gpu_placement: FakePlacement) -> None:
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        model = nn.Linear(4, 2)
    xs = to_replicas(X, fake_gpu_placement.compute_devices)
    strategy.run(lambda x: model(x).sum().backward(), args=(xs,))
    for write in (
        lambda: model.weight.data.zero_(),
        lambda: model.weight.data.add_(1.0),
        lambda: model.weight.data.clamp_(-0.5, 0.5),
        lambda: setattr(model.weight, "data", torch.full_like(model.weight, 3.0)),
        lambda: torch.nn.utils.vector_to_parameters(
            torch.full((10,), 2.0, device=model.weight.device), model.parameters()
        ),
    ):
        write()
        seen = strategy.run(lambda: model.weight.detach().abs().sum().cpu())
        expected = model.weight.detach().abs().sum().cpu()
        for value in local(strategy, seen):
            torch.testing.assert_close(value, expected)
        if fake_gpu_placement.parameter_device == "cpu":
            assert model.weight.is_pinned()  # replaced storage is pinned again


def test_frozen_parameters_and_buffers_written_in_place_reach_every_replica(
    fake_gpu_placement: FakePlacement,
) -> None:
    """Between runs, a frozen parameter (an EMA's), a floating buffer and an integer buffer
    written in place under ``torch.no_grad()`` move their version counters, so the GPU
    replicas' copies of them are refreshed at the next run (docs/porting.md)."""
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        holder = nn.Module()
        holder.frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
        holder.register_buffer("mask", torch.zeros(3))
        holder.register_buffer("count", torch.zeros(3, dtype=torch.long))
    names = ("frozen", "mask", "count")

    def seen() -> list[list[float]]:
        out = strategy.run(
            lambda: [getattr(holder, name).detach().float().sum().cpu() for name in names]
        )
        return [[float(v) for v in values] for values in local(strategy, out)]

    assert seen() == [[0.0, 0.0, 0.0]] * 2
    with torch.no_grad():
        holder.frozen.lerp_(torch.ones(3, device=holder.frozen.device), 0.5)
        holder.mask.fill_(2.0)
        holder.count.add_(3)
    assert seen() == [[1.5, 6.0, 9.0]] * 2


@pytest.mark.parametrize("mixed", [False, True])
def test_each_replica_sees_only_its_own_writes_to_an_integer_buffer(
    fake_gpu_placement: FakePlacement, mixed: bool,
) -> None:
    """``mixed``: replica 0 on ``cpu:0`` beside the parameters, replica 1 on ``cuda:0``.
    What each replica sees, and the first replica's write kept, are what one host's
    replicas sharing the buffer see (tests/variables/test_direct.py)."""
    compute = ("cpu:0", "cuda:0") if mixed else fake_gpu_placement.compute_devices
    parameters = "cpu" if mixed else fake_gpu_placement.parameter_device
    strategy = cs.CentralStorageStrategy(list(compute), parameter_device=parameters)
    with strategy.scope():
        holder = nn.Module()
        holder.register_buffer("count", torch.zeros((), dtype=torch.long))
    seen: dict[int, list[int]] = {0: [], 1: []}

    def step() -> None:
        replica = context().replica_id_in_sync_group
        seen[replica].append(int(holder.count))
        holder.count.add_(5 + replica)
        context().all_reduce("SUM", 1.0)  # a rendezvous: the other replica ran meanwhile
        seen[replica].append(int(holder.count))

    strategy.run(step)
    strategy.run(step)
    assert seen == {0: [0, 5, 5, 10], 1: [0, 6, 5, 11]}
    assert int(holder.count) == 10


def _counts_through_failures(compute: tuple[str, ...], parameters: str) -> None:
    """Runs that each add one to an integer counter (the first replica's write), beside
    integer position ids no run writes, alternating with runs that fail after their
    backward: each failed run leaves the counter where the last passing one left it, so the
    copy kept from run to run is made again after each write."""
    strategy = cs.CentralStorageStrategy(list(compute), parameter_device=parameters)
    with strategy.scope():
        holder = nn.Module()
        holder.linear = nn.Linear(4, 4)
        holder.register_buffer("ids", torch.arange(4).unsqueeze(0), persistent=False)
        holder.register_buffer("steps", torch.zeros((), dtype=torch.long))
    inputs: Any = torch.randn(2 * len(compute), 4)
    inputs = to_replicas(inputs, compute) if len(compute) > 1 else inputs.to(compute[0])

    def step(xs: torch.Tensor, fail: bool = False) -> None:
        holder.steps.add_(1)
        (holder.linear(xs) + holder.ids.to(xs.device).float()).sum().backward()
        if fail:
            raise RuntimeError("the replica fails")

    for passed in range(1, 4):
        strategy.run(step, args=(inputs,))
        for _ in range(2):
            with pytest.raises(RuntimeError, match="the replica fails"):
                strategy.run(step, args=(inputs,), kwargs={"fail": True})
            assert int(holder.steps) == passed
    assert holder.ids.cpu().tolist() == [[0, 1, 2, 3]]


def test_failed_runs_put_back_the_integer_buffers_they_wrote(
    fake_gpu_placement: FakePlacement,
) -> None:
    placement = fake_gpu_placement
    _counts_through_failures(placement.compute_devices, placement.parameter_device)


@pytest.mark.usefixtures("fake_gpus")
def test_failed_runs_of_one_replica_on_the_gpu_of_its_variables_put_back_its_integers() -> None:
    """One replica on the GPU that holds the variables uses them directly (``Undo``)."""
    _counts_through_failures(("cuda:0",), "cuda:0")


METRIC_VARIABLES = {  # name: (initial value, aggregation); each replica adds to its copy
    "total": (torch.zeros(2), "SUM"),
    "count": (torch.zeros((), dtype=torch.long), "SUM"),
    "mean": (torch.zeros((), dtype=torch.float64), "MEAN"),
    "first": (torch.zeros(()), "ONLY_FIRST_REPLICA"),
    "first count": (torch.zeros((), dtype=torch.long), "ONLY_FIRST_REPLICA"),
}


def _add(variable: torch.Tensor, value: float) -> None:
    variable.add_(value)  # a torch call given the variable


def _add_in_place(variable: torch.Tensor, value: float) -> None:
    # as Keras' assign_add does: on the replica's view, without the call's argument search
    if not views.write_in_place(variable, functools.partial(torch.Tensor.add_, other=value)):
        variable.add_(value)


@pytest.mark.parametrize("add", [_add, _add_in_place])
def test_metric_variables_reduce_on_gpus_as_on_logical_devices(
    add: Callable[[torch.Tensor, float], None], fake_gpu_placement: FakePlacement,
) -> None:
    """ON_READ variables of every aggregation and of three dtypes, updated in place in each
    GPU replica at every run as metrics are, read outside ``run`` as the same replicas on
    logical CPU devices read them (the copies' changes come from each GPU together; the
    fake GPUs' variables on ``cuda:0``, a subclass, are reduced one by one)."""

    def step(variables: dict[str, torch.Tensor]) -> None:
        own = context().replica_id_in_sync_group + 1
        add(variables["total"], 1.5 * own)
        add(variables["count"], own)
        add(variables["mean"], 0.25 * own)
        add(variables["first"], own + 1.0)
        add(variables["first count"], 3 * own)

    read: dict[str, dict[str, torch.Tensor]] = {}
    for where, strategy in (
        ("gpus", strategy_for(fake_gpu_placement)),
        ("logical", cs.CentralStorageStrategy(["cpu:0", "cpu:1"])),
    ):
        with strategy.scope():
            variables = {
                name: cs.Variable(value, aggregation=aggregation, trainable=False,
                                  synchronization=cs.VariableSynchronization.ON_READ)
                for name, (value, aggregation) in METRIC_VARIABLES.items()
            }
        for _ in range(3):
            strategy.run(step, args=(variables,))
        read[where] = {name: v.detach().cpu() for name, v in variables.items()}
    assert read["logical"]["total"].tolist() == [13.5, 13.5]  # 3 x (1.5 + 3.0)
    assert int(read["logical"]["count"]) == 9
    assert float(read["logical"]["mean"]) == 1.125  # 3 x (0.25 + 0.5) / 2
    assert float(read["logical"]["first"]) == 6.0  # replica 0's 2.0, three times
    assert int(read["logical"]["first count"]) == 9
    for name in METRIC_VARIABLES:
        assert torch.equal(read["gpus"][name], read["logical"][name]), name


def test_metrics_written_alike_on_gpus_reduce_as_on_logical_devices(
    fake_gpu_placement: FakePlacement,
) -> None:
    """Four float SUM variables that every GPU replica writes in the same order, as a Keras
    model's loss tracker and accuracy are, over runs, a failed run and the run after it:
    reduced together (``folding._reduce_aligned``), each copy counted from the start the
    previous fold left it, as on logical CPU devices."""

    def step(variables: list[torch.Tensor], fail: bool) -> None:
        own = context().replica_id_in_sync_group + 1
        for k, variable in enumerate(variables):
            _add_in_place(variable, 0.5 * own + k)
        if fail and own == 2:
            raise RuntimeError("replica 1 fails")

    read: dict[str, list[torch.Tensor]] = {}
    for where, strategy in (
        ("gpus", strategy_for(fake_gpu_placement)),
        ("logical", cs.CentralStorageStrategy(["cpu:0", "cpu:1"])),
    ):
        with strategy.scope():
            variables = [
                cs.Variable(0.0, aggregation="SUM", trainable=False,
                            synchronization=cs.VariableSynchronization.ON_READ)
                for _ in range(4)
            ]
        for fail in (False, False, True, False):
            if fail:
                with pytest.raises(RuntimeError, match="replica 1 fails"):
                    strategy.run(step, args=(variables, fail))
            else:
                strategy.run(step, args=(variables, fail))
        read[where] = [v.detach().cpu() for v in variables]
    assert [float(v) for v in read["logical"]] == [4.5, 10.5, 16.5, 22.5]  # 3 x (1.5 + 2k)
    for gpus, logical in zip(read["gpus"], read["logical"], strict=True):
        assert torch.equal(gpus, logical)


OPTIMIZERS = [
    name for name in dir(torch.optim)
    if isinstance(getattr(torch.optim, name), type)
    and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and name not in ("Optimizer", "LBFGS", "SparseAdam")  # closure-only; sparse only
]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_stepping_in_merge_call_keeps_its_state_beside_the_weights(
    name: str, fake_gpu_placement: FakePlacement
) -> None:
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        model = nn.Linear(4, 2)
        params = [model.weight] if name == "Muon" else model.parameters()  # Muon: 2-D only
        optimizer = getattr(torch.optim, name)(params, lr=0.01)
    xs, ys = (to_replicas(t, fake_gpu_placement.compute_devices) for t in (X, Y))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mse_step(model)(x, y)
        context().merge_call(lambda s: optimizer.step())

    for _ in range(2):
        strategy.run(step, args=(xs, ys))
    home = model.weight.device
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device == home, (name, key, value.device)
            elif isinstance(value, torch.Tensor):  # step counters: CPU scalars or the device
                assert value.device in (home, torch.device("cpu")), (name, key, value.device)


def test_replica_threads_use_the_callers_current_stream(fake_gpu_placement: FakePlacement) -> None:
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        model = nn.Linear(4, 2)
    xs, ys = (to_replicas(t, fake_gpu_placement.compute_devices) for t in (X, Y))
    gpus = [torch.device(d) for d in fake_gpu_placement.compute_devices if d.startswith("cuda")]
    streams = {device: torch.cuda.Stream(device) for device in gpus}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        context().all_reduce("SUM", x.sum())
        mse_step(model)(x, y)
        if x.device in streams:
            assert torch.cuda.current_stream(x.device) == streams[x.device]

    with contextlib.ExitStack() as stack:
        for device, stream in streams.items():
            stream.wait_stream(torch.cuda.current_stream(device))
            stack.enter_context(torch.cuda.stream(stream))
        strategy.run(step, args=(xs, ys))
    for device, stream in streams.items():
        torch.cuda.current_stream(device).wait_stream(stream)
    assert model.weight.grad is not None


def test_each_gpu_replica_draws_different_reproducible_numbers(
    fake_gpu_placement: FakePlacement,
) -> None:
    def program() -> tuple[torch.Tensor, ...]:
        strategy = strategy_for(fake_gpu_placement)
        torch.manual_seed(7)
        ones = cs.PerReplica([torch.ones(64, device=d) for d in fake_gpu_placement.compute_devices])
        out = strategy.run(lambda x: nn.functional.dropout(x, 0.5).cpu(), args=(ones,))
        return tuple(local(strategy, out))

    first, second = program(), program()
    assert not torch.equal(first[0], first[1])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_merge_function_on_the_gpu_path_draws_what_no_replica_draws(
    fake_gpu_placement: FakePlacement,
) -> None:
    """``test_random``'s merge test where GPU users are: the function draws on the parameter
    device from a stream of its own, the replicas on their GPUs from theirs, and neither
    repeats the other's numbers or the next run's."""
    strategy = strategy_for(fake_gpu_placement)
    merged: list[torch.Tensor] = []

    def merge(s: cs.Strategy) -> None:
        merged.append(torch.rand(64, device=fake_gpu_placement.parameter_device).cpu())

    def step() -> torch.Tensor:
        context().merge_call(merge)
        return torch.rand(64, device=context().device).cpu()

    torch.manual_seed(0)
    after_merge = local(strategy, strategy.run(step))
    next_run = local(strategy, strategy.run(
        lambda: torch.rand(64, device=context().device).cpu()
    ))
    drawn = [merged[0], *after_merge, *next_run]
    for i, a in enumerate(drawn):
        for b in drawn[i + 1:]:
            assert not torch.equal(a, b)


def test_a_gpu_replica_pays_no_python_per_torch_call(fake_gpu_placement: FakePlacement) -> None:
    """No ``TorchFunctionMode`` of centralstore's in a CUDA replica: its ops cost what they cost
    in plain PyTorch under ``torch.cuda.device``; ``device="cuda"`` is the replica's GPU."""
    strategy = strategy_for(fake_gpu_placement)
    with torch.cuda.device(0):
        plain = torch._C._len_torch_function_stack()

    def step() -> tuple[int, int, torch.device]:
        device = context().device  # (a real GPU's replica may share the run with ``cpu:1``)
        return (
            context().replica_id_in_sync_group,
            torch._C._len_torch_function_stack(),
            torch.empty(1, device="cuda").device if device.type == "cuda" else device,
        )

    for replica, depth, device in local(strategy, strategy.run(step)):
        assert depth == plain
        wanted = torch.device(fake_gpu_placement.compute_devices[replica])
        if wanted.type == "cuda":
            assert device == wanted


def test_a_steady_step_finds_its_streams_without_torch_s_python(
    fake_gpu_placement: FakePlacement, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every lookup of a GPU's current stream that a training step makes (each gradient
    copied to host memory, the end of each backward, the copies of the variables and of the
    input, the streams a replica thread takes on) goes through a ``_devices.CurrentStreams``,
    which finds a stream it met before by its raw handle, and so do its switches to a side
    stream and its waits of one stream for another: once the first steps have met the
    streams, centralstore's code in a step of two layers or of twenty, with or without a
    rendezvous, never calls ``torch.cuda.current_stream`` (whose Python builds a ``Stream``
    at every call), ``torch.cuda.stream`` (which parses the current device twice) or
    ``Stream.wait_stream`` (which makes an event). (Calls from torch's own wrappers, on a
    real GPU, are not counted.)"""
    asked = 0
    package = os.path.dirname(cs.__file__)

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal asked
            asked += sys._getframe(1).f_code.co_filename.startswith(package)
            return original(*args, **kwargs)

        return call

    def calls_in_one_step(layers: int, rendezvous: bool) -> int:
        nonlocal asked
        strategy = strategy_for(fake_gpu_placement)
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
        batches = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8
        )
        inputs = iter(strategy.experimental_distribute_dataset(batches))

        def replica(x: torch.Tensor) -> None:
            loss = model(x).sum()
            if rendezvous:  # (the replicas go on on threads of their own)
                loss = context().all_reduce("SUM", loss)
            loss.backward()

        def step() -> None:
            (xs,) = next(inputs)
            strategy.run(replica, args=(xs,))
            model.zero_grad()

        step()  # (the buckets' layout, and the streams' first lookups)
        step()
        asked = 0
        step()
        return asked

    for owner, name in (
        (torch.cuda, "current_stream"), (torch.cuda, "stream"), (torch.cuda.Stream, "wait_stream")
    ):
        monkeypatch.setattr(owner, name, counted(getattr(owner, name)))
    for layers in (2, 20):
        for rendezvous in (False, True):
            assert calls_in_one_step(layers, rendezvous) == 0, (layers, rendezvous)


def test_a_steady_step_makes_no_cuda_event(
    fake_gpu_placement: FakePlacement, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events a step records (after the copies of the variables to a replica's GPU, after
    each bucket's copy to host memory) are made once and recorded again at every step: a
    step whose input is on the replicas' GPUs already makes none."""
    made = 0
    make = torch.cuda.Event

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return make(*args, **kwargs)

    strategy = strategy_for(fake_gpu_placement)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    xs = to_replicas(X, fake_gpu_placement.compute_devices)

    def step() -> None:
        strategy.run(lambda x: model(x).sum().backward(), args=(xs,))
        model.zero_grad()

    monkeypatch.setattr(torch.cuda, "Event", counted)
    step()
    first = made
    step()
    step()
    assert made == first


def test_sparse_gradients_fold(fake_gpu_placement: FakePlacement) -> None:
    strategy = strategy_for(fake_gpu_placement)
    torch.manual_seed(0)
    initial = nn.Embedding(10, 3, sparse=True).state_dict()
    with strategy.scope():
        embedding = nn.Embedding(10, 3, sparse=True)
        embedding.load_state_dict(initial)
    tokens = torch.tensor([1, 2, 2, 5, 7, 1])
    parts = to_replicas(tokens, fake_gpu_placement.compute_devices)
    strategy.run(lambda t: embedding(t).pow(2).sum().backward(), args=(parts,))
    oracle = nn.Embedding(10, 3, sparse=True)
    oracle.load_state_dict(initial)
    oracle(tokens).pow(2).sum().backward()
    assert embedding.weight.grad is not None and oracle.weight.grad is not None
    torch.testing.assert_close(
        embedding.weight.grad.cpu().to_dense(), oracle.weight.grad.to_dense()
    )


def _pinned_memory(placement: FakePlacement) -> tuple[int, int]:
    """(the bytes of pinned memory torch's host allocator holds, the blocks it has handed
    out so far), from the fake GPUs' model of it or from the real allocator's statistics."""
    if placement.gpus is not None:
        return placement.gpus.pinned.reserved, placement.gpus.calls["pinned allocation", "host"]
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.current", 0), stats.get("active_requests.allocated", 0)


def test_the_early_gradient_copy_pins_its_buckets_once(fake_gpu_placement: FakePlacement) -> None:
    """GPU replicas copy their gradients to CPU parameters in pinned buckets allocated at
    the first step: later steps take no pinned block at all (a copy per gradient took one
    per gradient and step), and the pinned memory held for gradients stays under twice
    their bytes per GPU replica."""
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)], nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = (to_replicas(t, fake_gpu_placement.compute_devices) for t in (X, Y))
    held, _ = _pinned_memory(fake_gpu_placement)
    pinned = []
    for _ in range(6):
        strategy.run(mse_step(model), args=(xs, ys))
        optimizer.step()
        optimizer.zero_grad()
        pinned.append(_pinned_memory(fake_gpu_placement))
    assert all(later == pinned[0] for later in pinned[1:]), pinned
    gpu_replicas = sum(d.startswith("cuda") for d in fake_gpu_placement.compute_devices)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pinned[0][0] - held < 2 * gradient_bytes * gpu_replicas


def test_modules_copied_in_scope_are_central_and_ones_built_outside_are_refused(
    fake_gpu_placement: FakePlacement,
) -> None:
    import copy

    strategy = strategy_for(fake_gpu_placement)
    devices = fake_gpu_placement.compute_devices
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        copied = copy.deepcopy(model)
    outside = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(
        fake_gpu_placement.parameter_device
    )
    xs = to_replicas(X, devices)
    strategy.run(lambda x: copied(x).sum().backward(), args=(xs,))
    assert int(copied[1].num_batches_tracked) == 1
    assert copied[0].weight.grad is not None and model[0].weight.grad is None
    with pytest.raises(ValueError, match=r"The Linear module .* 'weight'"):
        strategy.run(lambda x: outside(x), args=(xs,))
    assert int(outside[1].num_batches_tracked) == 0


def test_a_gpu_replica_assigning_or_registering_a_tensor_is_refused(
    fake_gpu_placement: FakePlacement,
) -> None:
    """The checks of tests/variables/test_unscoped.py on GPU replicas, whose slots hold
    views: a new tensor in a central buffer's slot, and a buffer registered inside run."""
    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        holder = nn.Module()
        holder.register_buffer("count", torch.zeros((), dtype=torch.long))

    def assign() -> None:
        holder.count = holder.count + 1

    def register() -> None:
        holder.register_buffer("cache", torch.ones(2))

    with pytest.raises(ValueError, match=r"assigned a new tensor of shape \(\) to the buffer "
                       r"'count' of Module"):
        strategy.run(assign)
    with pytest.raises(ValueError, match=r"registered a new buffer 'cache' of shape \(2,\)"):
        strategy.run(register)
    strategy.run(lambda: holder.count.add_(1))  # in place: the first replica's write
    assert int(holder.count) == 1 and not hasattr(holder, "cache")


@pytest.mark.fake_gpus(1)
def test_a_failed_run_of_one_gpu_replica_leaves_batch_norm_as_before_it(
    fake_gpus: Any,
) -> None:
    """One replica on the GPU that holds the variables uses them directly (``OwnRun``): a
    run that fails after its forward puts back the statistics and the counter."""
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cuda:0")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    x = torch.randn(6, 3).to("cuda:0")
    strategy.run(lambda xs: model(xs).sum().backward(), args=(x,))
    kept = host_state(model)

    def fails(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        raise RuntimeError("the replica fails")

    with pytest.raises(RuntimeError, match="the replica fails"):
        strategy.run(fails, args=(x,))
    for name, value in host_state(model).items():
        assert torch.equal(value, kept[name]), name


@pytest.mark.fake_gpus(2)
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_gpu_replica_writing_a_parameter_in_place_is_applied_or_refused_at_every_run(
    fake_gpus: Any, replicas: int,
) -> None:
    """Private views of trained parameters are refreshed and stamped all at once from the
    second run on (``modules.Filled._fill_all``); a write through them is still recorded:
    one replica's applies to the variable, as on one device, and with two replicas a write
    to a parameter whose aggregation is NONE is refused, the variable untouched."""
    devices = ["cuda:0", "cuda:1"][:replicas]
    strategy = cs.CentralStorageStrategy(devices, parameter_device="cpu")
    with strategy.scope():
        model = nn.Linear(3, 2)

    def write() -> None:
        with torch.no_grad():
            model.weight.add_(1.0)

    for run in range(1, 4):
        before = model.weight.detach().clone()
        if replicas == 1:
            strategy.run(write)
            assert torch.equal(model.weight.detach(), before + 1.0), run
        else:
            with pytest.raises(ValueError, match="aggregation is NONE"):
                strategy.run(write)
            assert torch.equal(model.weight.detach(), before), run


@pytest.mark.fake_gpus(2)
def test_gpu_replicas_find_their_own_copies_of_parameters_and_buffers_at_every_run(
    fake_gpus: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first run makes each replica's views slot by slot (``Filled._fill``: the
    parameters', then the buffers'); from the second run on, the parameters' slots and the
    buffers' are each filled at once (``Filled._fill_all``, ``Filled._fill_buffers``): every
    replica still finds each of them on its own GPU."""
    from centralstore.variables.modules import Filled

    by_slot: list[int] = []
    fill = Filled._fill
    monkeypatch.setattr(
        Filled, "_fill", lambda self, items: by_slot.append(len(items)) or fill(self, items)
    )
    devices = ("cuda:0", "cuda:1")
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cpu")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    seen: list[tuple[str, ...]] = []

    def step(xs: torch.Tensor) -> None:
        seen.append(tuple(str(t.device) for t in (*model.parameters(), *model.buffers())))
        model(xs).sum().backward()

    for _ in range(3):
        strategy.run(step, args=(to_replicas(torch.randn(6, 3), devices),))
    assert seen == [(device,) * 7 for device in devices] * 3
    assert by_slot == [4, 3] * 2  # the first run makes every view, none one by one later


@pytest.mark.fake_gpus(2)
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_optimizer_step_inside_a_gpu_replica_is_refused(
    fake_gpus: Any, replicas: int, parameter_device: str,
) -> None:
    """As on logical devices (``tests/variables/test_store.py``): after a run has passed (one
    GPU holding its variables then takes the short path), a step inside a replica raises,
    the variables and their gradients stay as before the run, and the step after it works."""
    devices = ["cuda:0", "cuda:1"][:replicas]
    strategy = cs.CentralStorageStrategy(devices, parameter_device=parameter_device)
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = to_replicas(torch.ones(2 * replicas, 3), tuple(devices))

    def backward(xs: torch.Tensor) -> None:
        model(xs).sum().backward()

    def step(xs: torch.Tensor) -> None:
        backward(xs)
        optimizer.step()

    strategy.run(backward, args=(x,))
    kept = model.weight.detach().cpu().clone(), model.weight.grad.cpu().clone()
    with pytest.raises(RuntimeError, match="merge_call"):
        strategy.run(step, args=(x,))
    assert torch.equal(model.weight.detach().cpu(), kept[0])
    assert torch.equal(model.weight.grad.cpu(), kept[1])
    optimizer.step()
    torch.testing.assert_close(model.weight.detach().cpu(), kept[0] - 0.1 * kept[1])


def test_torchmetrics_updated_in_gpu_replicas_fold_as_one_device(
    fake_gpu_placement: FakePlacement,
) -> None:
    """torchmetrics metrics and a collection with compute groups, updated in each GPU
    replica (one by its forward): each replica's copy of the states lives on its GPU, and
    the sync point folds the copies into the metric where it lives, and computes the step's
    value of the forward from them (``centralstore.metrics``)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    import centralstore.metrics

    centralstore.metrics.install()
    from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision

    def metrics() -> dict[str, Any]:
        return {
            "sum": torchmetrics.MeanMetric(),
            "max": torchmetrics.MaxMetric(),
            "cat": torchmetrics.CatMetric(),
            "collection": torchmetrics.MetricCollection({
                "accuracy": MulticlassAccuracy(3, average="macro"),
                "precision": MulticlassPrecision(3, average="macro"),
                "top 2": MulticlassAccuracy(3, top_k=2, average="micro"),
            }),
        }

    def update(found: dict[str, Any], values: torch.Tensor, scores: torch.Tensor,
               labels: torch.Tensor) -> None:
        found["sum"](values)  # (its forward: the step's value is cached)
        for name in ("max", "cat"):
            found[name].update(values)
        found["collection"].update(scores, labels)

    strategy = strategy_for(fake_gpu_placement)
    with strategy.scope():
        found = metrics()
    expected = metrics()
    generator = torch.Generator().manual_seed(0)
    devices = fake_gpu_placement.compute_devices
    for rows in (6, 4, 8):
        values = torch.randn(rows, generator=generator)
        scores = torch.randn(rows, 3, generator=generator).softmax(-1)
        labels = torch.randint(0, 3, (rows,), generator=generator)
        parts = [to_replicas(t, devices) for t in (values, scores, labels)]
        strategy.run(update, args=(found, *parts))
        update(expected, values, scores, labels)
        for name in expected:  # (the metrics live where the scope makes tensors)
            torch.testing.assert_close(
                _tree.map_leaves(torch.Tensor.cpu, found[name].compute()), expected[name].compute()
            )
        step = found["sum"]._forward_cache
        torch.testing.assert_close(step.cpu(), expected["sum"]._forward_cache)
    assert found["collection"].compute_groups == expected["collection"].compute_groups


@pytest.mark.fake_gpus(1)
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_torchmetrics_of_one_gpu_replica_fold_or_update_in_place_as_one_device(
    fake_gpus: Any, parameter_device: str,
) -> None:
    """One GPU replica: where the metric lives on its GPU (the scope's device), it updates the
    states themselves, and a failed run puts them back; where they live on the host, it
    updates copies on its GPU, which the sync point folds. Both count as one device."""
    torchmetrics = pytest.importorskip("torchmetrics")
    import centralstore.metrics

    centralstore.metrics.install()
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device=parameter_device)
    with strategy.scope():
        found = {"mean": torchmetrics.MeanMetric(), "cat": torchmetrics.CatMetric()}
    expected = {"mean": torchmetrics.MeanMetric(), "cat": torchmetrics.CatMetric()}
    assert all(str(s.device) == parameter_device for s in (found["mean"].mean_value,))

    def update(metrics: dict[str, Any], values: torch.Tensor, fail: bool = False) -> None:
        metrics["mean"](values)  # (its forward)
        metrics["cat"].update(values)
        if fail:
            raise ValueError("the replica fails after its updates")

    generator = torch.Generator().manual_seed(0)
    for rows, fail in ((6, False), (4, True), (8, False)):
        values = torch.randn(rows, generator=generator)
        if fail:
            with pytest.raises(ValueError, match="fails after its updates"):
                strategy.run(update, args=(found, values.to("cuda:0"), True))
        else:
            strategy.run(update, args=(found, values.to("cuda:0")))
            update(expected, values)
        for name in expected:
            torch.testing.assert_close(found[name].compute().cpu(), expected[name].compute())
            assert found[name]._update_count == expected[name]._update_count


def _copies(fake_gpus: Any) -> Counter[str]:
    """The copies to and from the GPUs made so far, by kind (every stream's together)."""
    counts: Counter[str] = Counter()
    for (what, _), n in fake_gpus.calls.items():
        if what in ("copy to device", "copy to host"):
            counts[what] += n
    return counts


@pytest.mark.fake_gpus(2)
def test_torchmetrics_copies_travel_in_one_copy_per_dtype_and_replica(fake_gpus: Any) -> None:
    """The states of a metric on the host reach each GPU replica, and its copies come back,
    in one copy per dtype (``folding.brought_to``), not one per state: a mean's two float
    states and an accuracy's four integer counts cost each replica two copies each way,
    besides those torchmetrics' own updates make; the metrics still count as one device."""
    torchmetrics = pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAccuracy

    import centralstore.metrics

    centralstore.metrics.install()
    devices = ("cuda:0", "cuda:1")

    def metrics() -> dict[str, Any]:
        return {"mean": torchmetrics.MeanMetric(), "accuracy": MulticlassAccuracy(3)}

    def update(found: dict[str, Any], values: torch.Tensor, scores: torch.Tensor,
               labels: torch.Tensor) -> None:
        found["mean"].update(values)
        found["accuracy"].update(scores, labels)

    strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cpu")
    with strategy.scope():
        found = metrics()
    expected, alone = metrics(), {k: m.to("cuda:0") for k, m in metrics().items()}
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        values = torch.randn(8, generator=generator)
        scores = torch.randn(8, 3, generator=generator).softmax(-1)
        labels = torch.randint(0, 3, (8,), generator=generator)
        parts = [to_replicas(t, devices) for t in (values, scores, labels)]
        halves = [t[:4].to("cuda:0") for t in (values, scores, labels)]
        before = _copies(fake_gpus)
        strategy.run(update, args=(found, *parts))
        ran = _copies(fake_gpus) - before
        before = _copies(fake_gpus)
        update(alone, *halves)  # torchmetrics' own copies, for one replica's slice
        own = _copies(fake_gpus) - before
        update(expected, values, scores, labels)
        dtypes = 2  # (the mean's float32 states, the accuracy's int64 counts)
        assert ran == Counter(
            {"copy to device": 2 * dtypes, "copy to host": 2 * (dtypes + own["copy to host"])}
        ), step
        for name in expected:
            torch.testing.assert_close(found[name].compute(), expected[name].compute())
