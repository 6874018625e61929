"""Replica views, and ``torch.compile`` inside ``run``: the counterpart of ``@tf.function``.

Module code sees its replica's views as plain tensors in its slots, so a compiled module or
step compiles whole for any number of replicas, gives the eager results, and after warm-up
compiles nothing again. What reaches a central variable by another path (a ``cs.Variable``)
resolves through the variable's class, which dynamo does not trace.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from paths import PATHS, each_path, run_on, strategy_on
from replicas import local, replica_id, strategy_of
from torch import nn

import centralstore as cs
from centralstore.variables import views


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (2, 2, 2)), nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(16, 1),
    )


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(4, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Unflatten(1, (2, 4)), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        nn.Flatten(), nn.Linear(8, 1),
    )


def _train(
    replicas: int, form: str, build: Callable[[], nn.Module] = _model, steps: int = 4,
    direct: bool = True,
) -> list[torch.Tensor]:
    """Weights and buffers after ``steps`` SGD steps with the model or step compiled as
    ``form`` ("eager", "model", "fullgraph" or "step"); recompiling after the first step
    raises. ``direct=False``: the replicas see views of the parameters (``strategy_of``)."""
    torch.manual_seed(0)
    strategy = strategy_of(replicas, direct=direct)
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward: Callable[..., Any] = model
    if form in ("model", "fullgraph"):
        forward = torch.compile(model, fullgraph=form == "fullgraph")

    def step(x: torch.Tensor) -> None:
        (forward(x).pow(2).sum() / 16).backward()

    runner = torch.compile(step) if form == "step" else step
    data = torch.randn(steps, 16, 8, generator=torch.Generator().manual_seed(1))
    for i, x in enumerate(data):
        torch._dynamo.config.error_on_recompile = i >= 1
        optimizer.zero_grad()
        args = (cs.PerReplica(list(x.chunk(replicas))),) if replicas > 1 else (x,)
        strategy.run(runner, args=args)
        optimizer.step()
    torch._dynamo.config.error_on_recompile = False
    return [t.detach().clone() for t in model.state_dict().values()]


def _assert_matches(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("form", ["model", "fullgraph", "step"])
def test_a_compiled_model_or_step_matches_eager_and_compiles_once(
    replicas: int, form: str
) -> None:
    _assert_matches(_train(replicas, form), _train(replicas, "eager"))


@pytest.mark.parametrize("form", ["model", "fullgraph", "step"])
def test_a_compiled_model_or_step_on_views_of_the_parameters_compiles_once(form: str) -> None:
    _assert_matches(_train(2, form, direct=False), _train(2, "eager"))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])
@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["batchnorm", "transformer"])
def test_batch_norm_and_attention_compile_whole_with_several_replicas(
    build: Callable[[], nn.Module], direct: bool
) -> None:
    _assert_matches(_train(2, "fullgraph", build, direct=direct), _train(2, "eager", build))


@each_path
def test_a_compiled_function_reading_a_central_variable_directly_cannot_be_fullgraph(
    path: str,
) -> None:
    strategy = strategy_on(path)
    with strategy.scope():
        scale = cs.Variable(2.0)
    scaled = torch.compile(lambda x: x * scale, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported) as raised:
        run_on(path, strategy, scaled, (torch.ones(2),))
    assert "compiled with fullgraph=True reached a central variable" in raised.value.__notes__[1]


def test_importing_centralstore_leaves_torch_compile_unloaded() -> None:
    """torch.compile's machinery (torch._dynamo, about a second) loads at the first
    compilation, not with centralstore: the command line and processes that never compile
    (a data loader's spawned workers) do not pay for it."""
    code = "import sys, centralstore; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_compiled_function_reading_a_central_variable_runs_that_call_eagerly() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        scale = cs.Variable(2.0)
    scaled = torch.compile(lambda x: (x * scale).sin())
    out = strategy.experimental_local_results(strategy.run(scaled, args=(torch.ones(2),)))
    for value in out:
        torch.testing.assert_close(value, torch.ones(2).mul(2.0).sin())


def test_central_variables_have_their_resolving_class_only_while_replicas_run() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = _model()
        counter = cs.Variable(0, aggregation="SUM", trainable=False)
    assert type(model[0].weight) is nn.Parameter and type(counter) is torch.Tensor

    def step() -> list[type]:
        assert type(counter + 1) is torch.Tensor  # results are plain
        seen = [type(model[0].weight), type(counter)]
        seen.append(cs.get_replica_context().merge_call(lambda s: type(model[0].weight)))
        seen.append(type(model[0].weight))
        return seen

    seen = strategy.experimental_local_results(strategy.run(step))[0]
    assert seen[0] is nn.Parameter  # replica 0 computes on the parameter directly
    assert seen[1] is not torch.Tensor
    assert seen[2] is nn.Parameter  # cross-replica code meets plain variables
    assert seen[3] is nn.Parameter  # and after the rendezvous too: one replica at a time
    assert type(model[0].weight) is nn.Parameter and type(counter) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(counter, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=True)) is torch.Tensor


def test_a_lazy_module_materialized_in_scope_takes_the_class_at_the_next_run() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        lazy = nn.LazyLinear(1)
        lazy(torch.zeros(1, 3))  # materialized here, after its registration
    x = torch.randn(4, 3)
    strategy.run(lambda x: lazy(x).sum().backward(), args=(cs.PerReplica(list(x.chunk(2))),))
    assert lazy.weight.grad is not None
    torch.testing.assert_close(lazy.weight.grad, x.sum(dim=0, keepdim=True))


def test_a_lazy_module_used_unmaterialized_in_run_raises_with_the_fix() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        lazy = nn.LazyLinear(1)
    with pytest.raises(TypeError, match="Materialize lazy modules before the first run"):
        strategy.run(lambda: lazy(torch.zeros(1, 3)))


def test_a_run_nested_in_merge_call_leaves_the_outer_run_to_take_the_class_back() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = _model()

    def step() -> None:
        model(torch.ones(1, 8)).sum().backward()
        cs.get_replica_context().merge_call(lambda s: s.run(lambda: model(torch.ones(1, 8))))

    strategy.run(step)
    assert all(type(p) is nn.Parameter for p in model.parameters())


def _calls(gpus: Any, kind: str) -> int:
    return sum(n for (what, _), n in gpus.calls.items() if what == kind)


def _copies_to(gpus: Any) -> int:
    return _calls(gpus, "copy to device")


def test_small_values_refresh_a_gpu_replica_in_one_copy_per_dtype(fake_gpus: Any) -> None:
    """``ReplicaViews.refresh`` from host memory to a GPU: the values of at most 64 KiB
    travel in one copy per dtype, larger ones in their own; each private copy ends equal to
    its central value, whatever its shape, layout and dtype, and one event follows them."""
    from centralstore.variables.views import ReplicaViews

    replica = ReplicaViews({}, 0, torch.device("cuda:0"), 2, None)
    centrals = [
        torch.randn(3, 4), torch.arange(5), torch.randn(2, 3, 4, 5), torch.randn(0, 4),
        torch.randn(128, 256),  # 128 KiB: a copy of its own
        torch.randn(7).half(), torch.arange(3) * 2, torch.randn(6, 1),
    ]
    tensors = [torch.zeros_like(c, device="cuda:0") for c in centrals]
    tensors[2] = tensors[2].to(memory_format=torch.channels_last)  # strides of its own
    copies, events = _copies_to(fake_gpus), _calls(fake_gpus, "Event.record")
    with torch.no_grad():
        replica.refresh(tensors, centrals)
    # float32, int64, float16 gathered (float16 alone: its own copy all the same), and the
    # large one
    assert _copies_to(fake_gpus) - copies == 4
    for tensor, central in zip(tensors, centrals, strict=True):
        assert tensor.device == torch.device("cuda:0") and tensor.dtype == central.dtype
        assert torch.equal(tensor.cpu(), central)
    assert tensors[2].is_contiguous(memory_format=torch.channels_last)
    assert _calls(fake_gpus, "Event.record") - events == 1


def test_kernel_writes_to_buffers_on_gpus_are_told_with_one_copy_per_device(
    fake_gpus: Any,
) -> None:
    """``modules._changed`` compares views on GPUs with their central values on the host
    in one copy and one wait per device, and views on the CPU pair by pair: each flag is
    its own pair's, in order, a NaN counting as a change as ``!=`` says."""
    from centralstore.variables.modules import _changed

    centrals = [torch.randn(4), torch.randn(2, 3), torch.zeros(0), torch.randn(5).half(),
                torch.tensor([float("nan"), 1.0]), torch.randn(3), torch.randn(2)]
    devices = ["cuda:0", "cuda:1", "cuda:0", "cuda:0", "cuda:1", "cpu", "cpu"]
    tensors = [c.to(d, copy=True) for c, d in zip(centrals, devices, strict=True)]
    tensors[1][0, 2] += 1
    tensors[3][4] = -tensors[3][4] - 1
    tensors[6][1] += 1
    copies = _copies_to(fake_gpus)
    assert _changed(tensors, centrals) == [False, True, False, True, True, False, True]
    assert _copies_to(fake_gpus) - copies == 2


def test_small_values_refresh_a_gpu_replica_from_another_gpu_in_one_copy(fake_gpus: Any) -> None:
    """From variables on another GPU (the parameter device ``cuda:1``), the small values
    are gathered there and copied once; values already on the replica's GPU do not pass
    through ``refresh``'s gathering at all."""
    from centralstore.variables.views import ReplicaViews

    replica = ReplicaViews({}, 0, torch.device("cuda:0"), 2, None)
    centrals = [torch.randn(3, 4, device="cuda:1"), torch.randn(5, device="cuda:1"),
                torch.randn(2, 2, device="cuda:1")]
    tensors = [torch.zeros_like(c, device="cuda:0") for c in centrals]
    copies = _calls(fake_gpus, "copy between devices")
    with torch.no_grad():
        replica.refresh(tensors, centrals)
    assert _calls(fake_gpus, "copy between devices") - copies == 1
    for tensor, central in zip(tensors, centrals, strict=True):
        assert tensor.device == torch.device("cuda:0")
        assert torch.equal(tensor.cpu(), central.cpu())
    mixed = [torch.randn(3), torch.randn(2, device="cuda:1"), torch.randn(4)]  # one each
    copies = [torch.zeros_like(c, device="cuda:0") for c in mixed]
    with torch.no_grad():
        replica.refresh(copies, mixed)
    for tensor, central in zip(copies, mixed, strict=True):
        assert torch.equal(tensor.cpu(), central.cpu())


# write_in_place: a write to a replica's view by a caller that knows the variable (Keras'
# assign_add), the same as the torch call that receives the variable.

ON_READ = cs.VariableSynchronization.ON_READ


def _by_torch_call(variable: torch.Tensor, value: Callable[[], Any]) -> None:
    with torch.no_grad():
        variable.add_(value())


def _by_write_in_place(variable: torch.Tensor, value: Callable[[], Any]) -> None:
    def add(tensor: torch.Tensor) -> None:
        tensor.add_(value())

    with torch.no_grad():
        if not views.write_in_place(variable, add):
            add(variable)  # one replica on the variables' device uses them directly


def _written(
    path: str, aggregation: str, write: Callable[[torch.Tensor, Callable[[], Any]], None]
) -> tuple[float, list[float], float]:
    """Three runs in which replica r adds r + 1 to ``scale``'s copy and then its copy of
    ``scale`` to ``total``'s; 10 assigned to ``total`` outside run; a run adding 1 to it."""
    strategy = strategy_on(path)
    with strategy.scope():
        total = cs.Variable(0.0, aggregation=aggregation, trainable=False,
                            synchronization=ON_READ)
        scale = cs.Variable(0.0, aggregation="SUM", trainable=False, synchronization=ON_READ)
    for _ in range(3):  # each replica's copy of scale is read through its own view
        run_on(path, strategy, lambda: write(scale, lambda: replica_id() + 1.0))
        run_on(path, strategy, lambda: write(total, lambda: scale * 1.0))
    with torch.no_grad():
        total.copy_(torch.tensor(10.0))  # the copies begin again from the variable itself
    run_on(path, strategy, lambda: write(total, lambda: torch.tensor(1.0)))
    copies = local(strategy, run_on(path, strategy, lambda: total.clone()))
    return float(total), [float(c) for c in copies], float(scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("aggregation", ["SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_write_in_place_writes_the_copies_as_the_torch_call_does(
    path: str, aggregation: str
) -> None:
    by_call = _written(path, aggregation, _by_torch_call)
    assert _written(path, aggregation, _by_write_in_place) == by_call
    # scale's copies: 1 and 2, 2 and 4, 3 and 6, added to total's at each run: 6 and 12
    expected = {"SUM": (12.0, [6.0, 6.0]), "MEAN": (11.0, [11.0, 11.0]),
                "ONLY_FIRST_REPLICA": (11.0, [11.0, 11.0])}[aggregation]
    assert by_call == (*expected, 9.0)


def test_write_in_place_leaves_what_is_not_a_replicas_view_to_the_caller() -> None:
    variable = torch.zeros(())
    assert not views.write_in_place(variable, torch.Tensor.zero_)  # no run: no views
    strategy = strategy_of(2, direct=False)
    with strategy.scope():
        central = cs.Variable(0.0, aggregation="SUM", trainable=False, synchronization=ON_READ)
    plain = torch.zeros(())

    def step() -> tuple[bool, bool]:
        with torch.no_grad():
            return (
                views.write_in_place(plain, lambda t: t.add_(1.0)),
                views.write_in_place(central, lambda t: t.add_(1.0)),
            )

    assert strategy.run(step) == (False, True)  # in every replica
    assert float(plain) == 0.0 and float(central) == 2.0
    one = strategy_of(1)  # one replica on the variables' device uses them directly
    with one.scope():
        own = cs.Variable(0.0, aggregation="SUM", trainable=False, synchronization=ON_READ)
    assert one.run(lambda: views.write_in_place(own, torch.Tensor.zero_)) is False
