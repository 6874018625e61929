"""The checks for modules that are not central (``variables/unscoped.py``)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import strategy_of
from torch import nn
from torch.nn.modules import module as torch_module

import centralstore as cs


def test_no_global_hook_is_left_after_runs_nested_in_merge_call() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(2, 2)

    def merge(s: cs.Strategy) -> None:
        s.run(lambda: model(torch.ones(1, 2)))

    def step() -> None:
        model(torch.ones(1, 2))
        cs.get_replica_context().merge_call(merge)

    strategy.run(step)
    assert not torch_module._global_forward_pre_hooks


def test_a_failed_first_run_checks_again_and_a_passed_one_stops_checking() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        strategy.run(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    early = nn.Linear(2, 2)
    early(torch.ones(1, 2))  # outside run: its own hook goes, the first-run check stays
    with pytest.raises(ValueError, match="The Linear module"):
        strategy.run(lambda: early(torch.ones(1, 2)))
    strategy.run(lambda: model(torch.ones(1, 2)))
    late = nn.Linear(2, 2)
    late(torch.ones(1, 2))
    strategy.run(lambda: late(torch.ones(1, 2)))  # not seen: first called outside run


def test_the_default_strategy_uses_any_module() -> None:
    model = nn.BatchNorm1d(2)
    cs.get_strategy().run(model, args=(torch.randn(4, 2),))
    assert int(model.num_batches_tracked) == 1
    assert not torch_module._global_forward_pre_hooks


def test_unpickling_outside_scope_is_plain_and_setstate_is_restored() -> None:
    strategy = strategy_of(2)
    original = nn.Module.__setstate__
    with strategy.scope():
        model = nn.Linear(2, 2)
        assert nn.Module.__setstate__ is not original
    assert nn.Module.__setstate__ is original
    outside = copy.deepcopy(model)
    assert not strategy.extended.variable_created_in_scope(outside.weight)
    with strategy.scope():
        inside = copy.deepcopy(model)
    assert strategy.extended.variable_created_in_scope(inside.weight)
    assert inside.weight is not model.weight


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.double(),
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.to("cpu", torch.float64),
    ],
    ids=["double", "half", "to-bfloat16", "to-device-and-dtype"],
)
def test_a_model_converted_in_scope_stays_central_and_apply_is_restored(convert: Any) -> None:
    strategy = strategy_of(2)
    original = nn.Module._apply
    with strategy.scope():
        model = convert(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert nn.Module._apply is original
    for tensor in (*model.parameters(), *model.buffers()):  # new buffers: taken too
        assert strategy.extended.variable_created_in_scope(tensor)
    dtype = model[0].weight.dtype
    x = cs.PerReplica([torch.randn(3, 2, dtype=dtype), torch.randn(3, 2, dtype=dtype)])
    strategy.run(lambda xs: model(xs).float().sum().backward(), args=(x,))
    assert int(model[1].num_batches_tracked) == 1  # one update, not one per replica
    outside = convert(nn.BatchNorm1d(2))  # outside every scope: plain
    assert not strategy.extended.variable_created_in_scope(outside.running_mean)


class Stepping(nn.Module):
    """Counts its calls in a buffer, in place (``+=``) or by assigning a new tensor."""

    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("steps", torch.tensor(0))
        self.assign = assign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.assign:
            self.steps = self.steps + 1
        else:
            self.steps += 1
        return self.linear(x).sum()


@each_path
def test_a_replica_assigning_a_new_tensor_to_a_central_buffer_is_told_to_write_in_place(
    path: str,
) -> None:
    strategy = strategy_on(path)
    with strategy.scope():
        model = Stepping(assign=True)
    central = model.steps
    x = cs.PerReplica([torch.ones(1, 2), torch.ones(1, 2)])
    with pytest.raises(ValueError, match=r"Replica 0 assigned a new tensor of shape \(\) to the "
                       r"buffer 'steps' of Stepping .*Write it in place"):
        run_on(path, strategy, lambda xs: model(xs).backward(), args=(x,))
    assert model.steps is central and int(central) == 0  # the run was rolled back
    model.assign = False  # the advice: += writes in place, and counts each step once
    for _ in range(3):
        run_on(path, strategy, lambda xs: model(xs).backward(), args=(x,))
    assert model.steps is central and int(central) == 3


def test_outside_run_a_central_buffer_may_take_a_new_tensor() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = Stepping(assign=True)
        model(torch.ones(1, 2))  # in the scope, cross-replica: a plain assignment
    assert int(model.steps) == 1


class LazyScale(nn.Module):
    """Creates a buffer at its first call, as some caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.full((2,), 2.0), persistent=False)
        return self.linear(x * self.scale).sum()


class LazyMask(nn.Module):
    """Registers its buffer empty and fills it at its first call, as causal-mask caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.register_buffer("mask", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.tensor([1.0, 0.5])
        return self.linear(x * self.mask).sum()


@each_path
@pytest.mark.parametrize("lazy, name, made", [
    (LazyScale, "scale", r"registered a new buffer 'scale' of shape"),
    (LazyMask, "mask", r"filled the empty buffer 'mask' with a tensor of shape"),
], ids=["new", "empty"])
def test_a_replica_making_a_buffer_is_told_to_create_it_in_the_scope(
    path: str, lazy: type[nn.Module], name: str, made: str
) -> None:
    """A buffer a module creates at its first call, under a new name or in an entry
    registered empty (``None``), is no central variable when a replica makes it."""
    strategy = strategy_on(path)
    with strategy.scope():
        model = lazy()
    x = cs.PerReplica([torch.ones(1, 2), torch.ones(1, 2)])
    with pytest.raises(ValueError, match=rf"Replica 0 {made} \(2,\) in {lazy.__name__} "
                       r"inside run.*call the module once inside"):
        run_on(path, strategy, lambda xs: model(xs).backward(), args=(x,))
    assert getattr(model, name, None) is None
    with strategy.scope():  # the advice: its first call in the scope makes the buffer central
        model(torch.ones(1, 2))
    run_on(path, strategy, lambda xs: model(xs).backward(), args=(x,))
    assert id(getattr(model, name)) in strategy._store.records


def test_a_buffer_put_in_a_scoped_module_after_the_scope_is_refused_as_such() -> None:
    """The module's other variables are central: the message says the buffer came after the
    scope, not that the module was built outside it."""
    strategy = strategy_of(2)
    with strategy.scope():
        model = LazyMask()
    model.mask = torch.tensor([1.0, 0.5])  # after the scope: a plain buffer
    x = cs.PerReplica([torch.ones(1, 2), torch.ones(1, 2)])
    with pytest.raises(ValueError, match=r"holds the buffer 'mask' of shape \(2,\), which is "
                       r"not a central variable .*, although the module's other variables are: "
                       r"the buffer was put there after strategy.scope\(\) ended"):
        strategy.run(lambda xs: model(xs).backward(), args=(x,))
    with strategy.scope():  # the advice: assigned in the scope, it is central
        model.mask = torch.tensor([1.0, 0.5])
    strategy.run(lambda xs: model(xs).backward(), args=(x,))
    assert id(model.mask) in strategy._store.records


def test_a_layer_made_inside_run_is_refused_by_its_parameter() -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match=r"registered a new parameter 'weight' of shape \(1, 2\) "
                       r"in Linear inside run"):
        strategy.run(lambda: nn.Linear(2, 1))


@each_path
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_compiled_function_creating_a_tensor_constant_trains_like_eager(
    path: str, backend: str
) -> None:
    # The compiler builds its graph modules inside the replica, each constant a buffer
    # (inductor's at compile time, aot_eager's also called at run time): not variables.
    def train(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        strategy = strategy_on(path)
        with strategy.scope():
            model = nn.Linear(3, 3)

        def loss(x: torch.Tensor) -> torch.Tensor:
            return (model(x) * torch.tensor([1.0, 2.0, 3.0])).sum()

        forward = torch.compile(loss, backend=backend) if compiled else loss
        x = cs.PerReplica([torch.ones(2, 3), torch.full((2, 3), 2.0)])
        for _ in range(2):
            run_on(path, strategy, lambda xs: forward(xs).backward(), args=(x,))
        return [model.weight.grad.clone(), model.bias.grad.clone()]

    for got, want in zip(train(compiled=True), train(compiled=False), strict=True):
        torch.testing.assert_close(got, want)


@each_path
def test_a_compiled_module_in_the_first_run_warns_of_no_global_hooks(path: str) -> None:
    # The first run's check is a global forward pre-hook, torch warns at each call of a
    # compiled module while one exists: that warning is not the user's to see.
    strategy = strategy_on(path)
    with strategy.scope():
        model = torch.compile(nn.Linear(3, 1), backend="eager")
    x = cs.PerReplica([torch.ones(2, 3), torch.ones(2, 3)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        run_on(path, strategy, lambda xs: model(xs).sum().backward(), args=(x,))
        assert warnings.filters == filters  # the run's own filter went with its hook
    assert [str(w.message) for w in caught] == []


@each_path
def test_code_compiled_in_the_first_run_is_not_compiled_again_at_the_second(path: str) -> None:
    # The first run's check is a global hook, which torch.compile guards on: a compilation
    # that starts in the first run withdraws it first, or the second run would compile again.
    torch._dynamo.reset()
    strategy = strategy_on(path)
    with strategy.scope():
        model = nn.Linear(3, 1)
    forward = torch.compile(model, backend="eager")
    x = cs.PerReplica([torch.ones(2, 3), torch.ones(2, 3)])
    try:
        for i in range(3):
            torch._dynamo.config.error_on_recompile = i >= 1
            run_on(path, strategy, lambda xs: forward(xs).sum().backward(), args=(x,))
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
    assert not torch_module._global_forward_pre_hooks


def test_a_first_run_checks_modules_until_a_compilation_starts() -> None:
    torch._dynamo.reset()
    outside = nn.Linear(3, 1)
    outside(torch.ones(1, 3))  # its own hook goes: only the first run's global one sees it
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(3, 1)
    forward = torch.compile(model, backend="eager")
    hooks: list[int] = []

    def step() -> None:
        hooks.append(len(torch_module._global_forward_pre_hooks))
        forward(torch.ones(1, 3))
        hooks.append(len(torch_module._global_forward_pre_hooks))

    try:
        with pytest.raises(ValueError, match="The Linear module called in replica 0"):
            strategy.run(lambda: (outside(torch.ones(1, 3)), forward(torch.ones(1, 3))))
        strategy.run(step)  # a first run again: the one before failed
    finally:
        torch._dynamo.reset()
    assert hooks[0] == hooks[1] + 1 == hooks[2] + 1 == hooks[3] + 1  # gone once compiling
    assert not torch_module._global_forward_pre_hooks


class Prefix(nn.Module):
    """Calls its first layers through a slice, a new ``ModuleList`` at every call (as
    transformers' Llama does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_a_module_built_outside_the_scope_compiles_whole_beside_a_strategy() -> None:
    # From a strategy's creation on, a module that registers a tensor outside every scope is
    # watched, and so is a container of it: made inside compiled code, the watch's hook would
    # break the graph at each call.
    strategy_of(2)
    model = Prefix()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")  # a break raises
        torch.testing.assert_close(compiled(torch.ones(1, 2)), model(torch.ones(1, 2)))
    finally:
        torch._dynamo.reset()


class Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def test_a_traced_module_built_outside_the_scope_is_still_refused_by_its_buffers() -> None:
    strategy = strategy_of(2)
    traced = torch.fx.symbolic_trace(Shift())  # its buffer is the module's: not a constant
    assert isinstance(traced, torch.fx.GraphModule)
    with pytest.raises(ValueError, match=r"Shift module called in replica 0 holds the buffer "
                       r"'offset'"):
        strategy.run(traced, args=(torch.ones(2, 3),))
