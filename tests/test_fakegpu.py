"""The fake-GPU harness (tests/fakegpu): each rule it models, then centralstore under it.

First the model: tensors on fake ``cuda:i`` devices compute on the CPU with real autograd,
mixing devices raises, moves are copies, ``torch.cuda`` answers per thread, dropout draws
from the device's generator, and torch is left as it was found. Then the checker: each kind
of race is reported, and the synchronized version of the same code is not. Last,
centralstore's CUDA paths: training on two fake GPUs matches the CPU, and removing any one of
the synchronizations they rely on is reported as a hazard.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakegpu
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors

import centralstore as cs
from centralstore.input import distributed
from centralstore.variables import buckets, folding, views

uses_gpus = pytest.mark.usefixtures("fake_gpus")


def _kinds(hazards: list[fakegpu.Hazard]) -> set[str]:
    return {h.kind for h in hazards}


# -- tensors on fake devices -------------------------------------------------------------


@uses_gpus
def test_factories_and_moves_report_the_fake_device() -> None:
    x = torch.randn(3, device="cuda:1")
    assert x.device == torch.device("cuda:1") and x.is_cuda and not x.is_cpu
    assert torch.ones(2).to("cuda:0").device == torch.device("cuda:0")
    assert torch.ones(2).cuda().device == torch.device("cuda:0")  # the current device
    with torch.cuda.device(1):
        assert torch.ones(2).cuda().device == torch.device("cuda:1")
        assert torch.cuda.current_device() == 1
    with torch.device("cuda:1"):
        assert torch.zeros(2).device == torch.device("cuda:1")
        assert torch.zeros(2, device="cpu").device == torch.device("cpu")
    assert (x * 2).cpu().device == torch.device("cpu")
    assert x.cpu().tolist() == x.tolist()
    assert "device='cuda:1'" in repr(x)
    assert x.type() == "torch.cuda.FloatTensor" and x.get_device() == 1


@uses_gpus
def test_values_and_gradients_are_the_cpus() -> None:
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    gpu = copy.deepcopy(cpu).to("cuda:1")
    weight = gpu[0].weight
    assert isinstance(weight, nn.Parameter) and weight.device == torch.device("cuda:1")
    x = torch.randn(5, 4)
    cpu(x).square().sum().backward()
    gpu(x.to("cuda:1")).square().sum().backward()
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        assert b.grad is not None and b.grad.device == torch.device("cuda:1"), name
        assert torch.equal(a.grad, b.grad.cpu()), name
    for model in (cpu, gpu):
        torch.optim.Adam(model.parameters(), lr=0.1).step()
    for name, value in gpu.state_dict().items():
        assert value.device == torch.device("cuda:1")
        assert torch.equal(value.cpu(), cpu.state_dict()[name]), name
    direct = nn.Parameter(torch.ones(2, device="cuda:0"))
    assert isinstance(direct, nn.Parameter) and direct.requires_grad and direct.is_leaf
    (direct * 3).sum().backward()
    assert direct.grad is not None and direct.grad.device == torch.device("cuda:0")
    clone = copy.deepcopy(gpu)
    assert isinstance(clone[0].weight, nn.Parameter)
    assert clone[0].weight.device == torch.device("cuda:1")
    assert clone[0].weight is not weight and torch.equal(clone[0].weight.cpu(), weight.cpu())


@uses_gpus
def test_an_op_that_mixes_devices_raises_as_cuda_does() -> None:
    a, b = torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"same device.*cuda:0 and cuda:1"):
        a + b
    with pytest.raises(RuntimeError, match=r"same device.*cuda:0 and cpu"):
        torch.cat([a, torch.ones(3)])
    with pytest.raises(RuntimeError, match="same device"):
        nn.Linear(3, 1).to("cuda:1")(a)
    assert torch.equal((a + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))  # a CPU scalar
    with pytest.raises(TypeError, match="numpy"):
        a.numpy()


@uses_gpus
def test_moves_between_devices_are_copies() -> None:
    a = torch.zeros(3, device="cuda:0")
    host = a.cpu()
    host += 1
    other = a.to("cuda:1")
    other += 2
    assert a.to("cuda:0") is a and a.cuda(0) is a
    b = torch.empty(3, device="cuda:1")
    b.copy_(a)
    b += 5
    a.copy_(torch.arange(3.0))
    assert a.tolist() == [0.0, 1.0, 2.0]
    assert host.tolist() == [1.0] * 3 and other.tolist() == [2.0] * 3 and b.tolist() == [5.0] * 3
    assert torch.equal(a.to("cuda:1", copy=True).cpu(), a.cpu())


def test_copies_count_the_bytes_they_move(fake_gpus: fakegpu.FakeGPUs) -> None:
    """Each copy adds its bytes to ``moved`` by kind, as a real GPU's transfers would move
    them: to a device, to the host, between devices (a sparse tensor: its indices and
    values)."""
    host = torch.zeros(4, 4)  # 64 bytes
    a = host.to("cuda:0")
    b = torch.empty(4, 4, device="cuda:1")
    b.copy_(a)
    a.cpu()
    torch.empty(2, 4).copy_(a[:2])
    a.copy_(torch.ones(4, 4))
    torch.eye(3).to_sparse().to("cuda:1")  # 3 x 2 int64 indices, 3 float32 values
    assert fake_gpus.moved == Counter(
        {"copy to device": 64 + 64 + 6 * 8 + 3 * 4, "copy between devices": 64,
         "copy to host": 64 + 32}
    )


@uses_gpus
def test_pinned_memory() -> None:
    assert torch.empty(3, pin_memory=True).is_pinned()
    assert not torch.ones(3).is_pinned()
    pinned = torch.ones(3).pin_memory()
    assert pinned.is_pinned() and pinned.pin_memory() is pinned
    holder = torch.zeros(3)
    holder.data = pinned
    assert holder.is_pinned()
    assert not torch.ones(3, device="cuda:0").is_pinned()
    with pytest.raises(RuntimeError, match="pinned"):
        torch.ones(3, device="cuda:0").pin_memory()


@uses_gpus
def test_dropout_draws_from_its_devices_generator() -> None:
    def mask(device: str) -> torch.Tensor:
        return F.dropout(torch.ones(64, device=device), 0.5).cpu()

    torch.manual_seed(3)  # seeds every fake generator, as it seeds every CUDA one
    first = mask("cuda:0")
    torch.manual_seed(3)
    assert torch.equal(mask("cuda:1"), first)
    torch.manual_seed(3)
    mask("cuda:0")
    host = torch.rand(4)  # cuda:0's draw left the CPU's generator alone
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), host)
    assert torch.cuda.default_generators[1].initial_seed() == 3
    state = torch.cuda.get_rng_state(0)
    again = mask("cuda:0")
    torch.cuda.set_rng_state(state, 0)
    assert torch.equal(mask("cuda:0"), again)
    assert not torch.equal(mask("cuda:0"), again)


# -- torch.cuda, threads, and leaving torch as it was --------------------------------------


@uses_gpus
def test_threads_have_their_own_current_device_and_stream() -> None:
    side = torch.cuda.Stream(1)
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["device"] = torch.cuda.current_device()
        seen["stream"] = torch.cuda.current_stream(1)
        torch.cuda.set_device(0)

    torch.cuda.set_device(1)
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert torch.cuda.current_device() == 1
    assert seen == {"device": 0, "stream": torch.cuda.default_stream(1)}
    assert torch.cuda.current_stream(1) is torch.cuda.default_stream(1)
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3  # not forward's derivative: the custom backward is the one used


@uses_gpus
def test_custom_functions_and_full_backward_hooks_record_their_graph() -> None:
    """A ``torch.autograd.Function`` (and the full backward hooks torch builds on one) runs
    on the CPU tensors inside, so its node is recorded; its outputs are on the fake device."""
    x = torch.ones(3, device="cuda:1", requires_grad=True)
    y = _Twice.apply(x)
    assert y.device == torch.device("cuda:1") and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.device == torch.device("cuda:1")
    assert torch.equal(x.grad.cpu(), torch.full((3,), 3.0))
    layer = nn.Linear(3, 1).to("cuda:0")
    seen: list[torch.Tensor] = []
    layer.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0]))
    layer(torch.ones(2, 3, device="cuda:0", requires_grad=True)).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0].cpu(), torch.ones(2, 1))


@uses_gpus
def test_a_function_that_calls_layers_it_captured_runs_on_their_cpu_tensors() -> None:
    """A reentrant ``torch.utils.checkpoint`` is a Function whose forward and backward call
    the layers it was given, not only its arguments: their fake parameters stand for the CPU
    tensors they hold there, and the layers' gradients come out as without checkpointing."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to("cuda:1")
    x = torch.randn(2, 3).to("cuda:1").requires_grad_()
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad()
        out = (
            torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
            if checkpointed else layer(x)
        )
        assert out.device == torch.device("cuda:1")
        out.sum().backward()
        grads.append([p.grad.cpu() for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def _torch_state() -> dict[str, Any]:
    return {
        "cuda": {name: getattr(torch.cuda, name, None) for name in (
            "is_available", "device_count", "Stream", "Event", "current_stream", "stream",
            "manual_seed_all", "get_rng_state", "device", "synchronize",
        )},
        "tensor": {name: torch.Tensor.__dict__.get(name) for name in (
            "to", "cuda", "pin_memory", "is_pinned", "record_stream",
        )},
        "factories": {name: getattr(torch, name) for name in ("empty", "zeros", "randn")},
        "constructors": set(_device_constructors()),
        "thread_run": threading.Thread.run,
        "function_apply": torch.autograd.Function.__dict__["apply"],
        "device_context": DeviceContext.__dict__["__torch_function__"],
        "modes": len(_get_current_function_mode_stack()),
        "central": dict(views._CENTRAL_CLASS),
        "plain": dict(views._PLAIN_CLASS),
    }


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_torch_is_left_as_it_was_found(fails: bool) -> None:
    before = _torch_state()
    with pytest.raises(RuntimeError, match=r"body|same device"), fakegpu.devices(3) as gpus:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 3
        with pytest.raises(RuntimeError, match="already active"), fakegpu.devices(1):
            pass
        side = torch.cuda.Stream(2)
        with torch.cuda.stream(side), torch.device("cuda:2"):
            x = torch.randn(2, requires_grad=True)
        x.sum().backward()
        if fails:
            x.to("cuda:0") + x  # raises: two devices
        raise RuntimeError("body")
    assert _torch_state() == before
    assert gpus.hazards  # the unsynchronized side-stream write was seen


def test_a_fake_tensor_outliving_its_context_still_computes() -> None:
    with fakegpu.devices(1):
        x = torch.arange(3.0, device="cuda:0")
    assert (x * 2).tolist() == [0.0, 2.0, 4.0] and "cuda:0" in str(x.device)
    assert torch.ones(2).device == torch.device("cpu")


def test_the_cuda_tests_run_on_fake_gpus_with_the_environment_variable() -> None:
    """``CENTRALSTORE_FAKE_GPUS=2 pytest tests/test_cuda.py`` runs them (here a few, in a
    child pytest), where without a GPU they are skipped."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CENTRALSTORE_FAKE_GPUS="2")
    command = [
        sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider",
        "-p", "no:xdist", "-k", "two_gpu_replicas_train_like_one_device and mlp",
    ]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]


# -- the checker: each race, and its synchronized version ----------------------------------


def test_a_side_stream_write_read_on_the_default_stream_is_a_race(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        x = torch.ones(4, 3, device="cuda:0")
    x.sum()
    hazards = fake_gpus.take_hazards()
    assert _kinds(hazards) == {"write/read"}
    text = str(hazards[0])
    assert "(4, 3)" in text and "sum" in text and "cuda:0 default stream" in text
    assert f"stream {side.stream_id}" in text
    x.record_stream(torch.cuda.current_stream(0))  # else freeing it is a hazard too


def test_a_query_of_metadata_is_no_kernel_and_reads_no_memory(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """``data_ptr``, ``is_contiguous``, ``numel`` and the like answer from the tensor's
    metadata, on a real GPU too: no kernel counted, and no access for the checker, even of
    a tensor a side stream is still writing."""
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        x = torch.ones(4, 3, device="cuda:0")
    before = Counter(fake_gpus.calls)
    answers = (x.data_ptr(), x.is_contiguous(), x.numel(), x.dim(), x.stride(), x.nbytes)
    assert answers[1:] == (True, 12, 2, (3, 1), 48)
    assert Counter(fake_gpus.calls) == before
    assert fake_gpus.take_hazards() == []
    x.record_stream(torch.cuda.current_stream(0))


@uses_gpus
@pytest.mark.parametrize("order", ["wait_stream", "event", "synchronize"])
def test_an_ordered_side_stream_write_is_not_a_race(order: str) -> None:
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        x = torch.ones(4, device="cuda:0")
        event = torch.cuda.Event()
        event.record()
    current = torch.cuda.current_stream(0)
    if order == "wait_stream":
        current.wait_stream(side)
    elif order == "event":
        current.wait_event(event)
    else:
        torch.cuda.synchronize(0)
    x.sum()
    x.record_stream(current)


def test_reading_a_non_blocking_copy_to_the_host_before_synchronizing_is_a_race(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    x = torch.ones(8, device="cuda:1")
    host = x.to("cpu", non_blocking=True)  # into pinned memory, without waiting
    assert host.is_pinned()
    host.sum()
    assert _kinds(fake_gpus.take_hazards()) == {"write/read"}
    pinned = torch.empty(8, pin_memory=True)
    pinned.copy_(x, non_blocking=True)
    pinned.add_(1)
    assert _kinds(fake_gpus.take_hazards()) == {"write/write"}


@uses_gpus
@pytest.mark.parametrize("wait", ["event", "stream", "query", "device", "blocking"])
def test_a_synchronized_copy_to_the_host_is_not_a_race(wait: str) -> None:
    x = torch.ones(8, device="cuda:1")
    if wait == "blocking":
        host = x.to("cpu")
    else:
        host = x.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(1))
        if wait == "event":
            event.synchronize()
        elif wait == "stream":
            torch.cuda.current_stream(1).synchronize()
        elif wait == "query":
            assert event.query()  # the fake streams have always finished
        else:
            torch.cuda.synchronize(1)
    assert host.sum().item() == 8


def test_writing_pinned_memory_while_a_copy_reads_it_is_a_race(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    pinned = torch.ones(5).pin_memory()
    gpu = pinned.to("cuda:0", non_blocking=True)
    pinned.zero_()
    assert _kinds(fake_gpus.take_hazards()) == {"read/write"}
    gpu.sum().item()  # the host waits for the stream: the copy has read the buffer
    pinned.fill_(2)
    assert fake_gpus.hazards == []
    pageable = torch.ones(5)
    pageable.to("cuda:0", non_blocking=True)  # staged by the host: nothing to race
    pageable.zero_()


def test_freeing_a_block_another_stream_uses_needs_record_stream(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    side = torch.cuda.Stream(0)

    def use_on_side(record: bool) -> None:
        x = torch.ones(6, device="cuda:0")
        side.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(side):
            x.mul(2)
        if record:
            x.record_stream(side)

    use_on_side(record=False)
    hazards = fake_gpus.take_hazards()
    assert _kinds(hazards) == {"free"} and "record_stream" in str(hazards[0])
    use_on_side(record=True)
    assert fake_gpus.hazards == []


def test_the_checked_context_raises_with_a_report() -> None:
    report = r"(?s)1 stream hazard.*shape \(2,\)"
    with pytest.raises(fakegpu.HazardError, match=report), fakegpu.checked(1):
        with torch.cuda.stream(torch.cuda.Stream()):
            x = torch.ones(2, device="cuda")
        x.add_(1)


# -- centralstore on two fake GPUs ------------------------------------------------------

BATCH = 8
CLASSES = 3


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, CLASSES))


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 6, generator=generator),
         torch.randint(0, CLASSES, (BATCH,), generator=generator))
        for _ in range(steps)
    ]


def _per_replica(tensor: torch.Tensor, devices: tuple[str, ...]) -> cs.PerReplica:
    return cs.PerReplica([s.to(d) for s, d in zip(tensor.tensor_split(len(devices)), devices)])


def _train(strategy: cs.Strategy, state: dict[str, torch.Tensor], steps: int = 3) -> nn.Module:
    with strategy.scope():
        model = _model()
        model.load_state_dict(state)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        cs.compute_average_loss(per_example, global_batch_size=BATCH).backward()

    devices = strategy.compute_devices
    for x, y in _batches(steps):
        optimizer.zero_grad()
        strategy.run(step, args=(_per_replica(x, devices), _per_replica(y, devices)))
        optimizer.step()
    return model


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return copy.deepcopy(_model().state_dict())


def test_training_on_two_fake_gpus_matches_one_cpu(fake_gpu_placement: Any) -> None:
    """Data parallel over cuda:0 and cuda:1, variables on the CPU (views refreshed from
    pinned memory, gradients copied back on side streams) or on cuda:0 (replica 0 uses
    them, replica 1 copies): the weights come out as plain CPU training's, to 1e-6."""
    state = _initial_state()
    reference = _model()
    reference.load_state_dict(state)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches():
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    placement = fake_gpu_placement
    strategy = cs.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    )
    model = _train(strategy, state)
    home = torch.device(placement.parameter_device)
    for name, value in model.state_dict().items():
        assert value.device == home, name
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=0, atol=1e-6)


@uses_gpus
@pytest.mark.parametrize(
    "devices, direct, viewed",
    [(["cuda:0", "cuda:0"], True, [0, 0]), (["cuda:0", "cuda:1"], False, [3, 7])],
    ids=["both-on-the-parameter-gpu", "one-on-it"],
)
def test_replicas_on_the_fake_gpu_of_the_variables_use_them_as_on_a_real_one(
    devices: list[str], direct: bool, viewed: list[int]
) -> None:
    """Variables on ``cuda:0``: the replicas there compute on the parameters themselves, as
    they would on a real GPU (a fake tensor counts as a plain one). Two of them there take
    the run without views (``DirectRun``), sharing batch norm's buffers too; beside a
    replica on ``cuda:1``, the one on ``cuda:0`` sees views of the buffers only."""
    from centralstore.variables.runs import DirectRun

    strategy = cs.CentralStorageStrategy(devices, parameter_device="cuda:0")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    modes: list[bool] = []

    def step(x: torch.Tensor) -> None:
        modes.append(isinstance(strategy._store.run, DirectRun))  # type: ignore[attr-defined]
        model(x).sum().backward()

    strategy.run(step, args=(_per_replica(torch.randn(8, 3), tuple(devices)),))
    assert modes == [direct, direct]
    assert [len(v.views) for v in strategy._store.replicas] == viewed  # type: ignore[attr-defined]
    assert all(p.grad is not None and p.grad.device == torch.device("cuda:0")
               for p in model.parameters())


@uses_gpus
def test_a_scope_registers_what_a_parametrization_registers_and_no_cpu_tensor_inside() -> None:
    """``spectral_norm`` swaps a fake weight's contents with ``set_`` below the torch-function
    layer; the scope, which registers new leaves there, registers the module's four
    tensors, none of the CPU tensors the fake ones hold."""
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cuda:0")
    with strategy.scope():
        layer = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 8))
    records = [r.ref() for r in strategy._store.records.values()]  # type: ignore[attr-defined]
    assert len(records) == 4
    assert all(fakegpu.is_fake(t) for t in records)
    assert {id(t) for t in records} == {
        id(t) for t in [*layer.parameters(), *layer.buffers()]
    }


def test_batch_norm_writes_on_fake_gpus_combine_in_passes_as_on_a_real_one(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """Two replicas' writes to batch norm's buffers on ``cuda:0`` combine per dtype, as a
    real GPU's plain tensors do (``folding.py``), not variable by variable: the transfers
    of a run do not grow with the number of layers."""
    devices = ("cuda:0", "cuda:1")
    xs = _per_replica(torch.randn(8, 4), devices)

    def transfers(layers: int) -> int:
        strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cuda:0")
        with strategy.scope():
            model = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(layers)])
        strategy.run(lambda x: model(x).sum(), args=(xs,))  # the views made
        before = Counter(fake_gpus.calls)
        strategy.run(lambda x: model(x).sum(), args=(xs,))
        return sum(n for (what, _), n in (Counter(fake_gpus.calls) - before).items()
                   if what.startswith("copy"))

    assert transfers(2) == transfers(6) > 0


def test_a_failed_run_on_the_fake_gpu_of_its_variables_copies_their_buffers_at_once(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """One replica on the fake GPU that holds the variables: a run copies batch norm's
    buffers in one kernel, as a real GPU's plain tensors (``direct.Copier``), not one
    each, and a failed run puts them back."""

    def kernels(layers: int) -> int:
        strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cuda:0")
        with strategy.scope():
            model = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(layers)])
        state = {name: value.cpu() for name, value in model.state_dict().items()}

        def fails() -> None:
            with torch.no_grad():
                model[0].running_mean.add_(1.0)
            raise RuntimeError("the run fails")

        counted = 0
        for _ in range(2):  # the second with the copier's views made
            before = Counter(fake_gpus.calls)
            with pytest.raises(RuntimeError, match="the run fails"):
                strategy.run(fails)
            counted = sum(n for (what, _), n in (Counter(fake_gpus.calls) - before).items()
                          if what == "kernel")
            for name, value in model.state_dict().items():
                assert torch.equal(value.cpu(), state[name]), name
        return counted

    assert kernels(2) == kernels(6)


@uses_gpus
def test_a_run_on_the_fake_gpu_of_its_variables_copies_no_frozen_weight() -> None:
    """A frozen weight is a parameter, not state that a run copies for its undo record
    (``direct.Copier``; a fake parameter is one by its flag, as ``isinstance`` says), so
    a failed run leaves it as written, as on a real GPU and on the CPU; the buffer it
    wrote is put back."""
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cuda:0")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[0].requires_grad_(False)
    weight, mean = model[0].weight.cpu(), model[1].running_mean.cpu()

    def fails() -> None:
        with torch.no_grad():
            model[0].weight.add_(1.0)
            model[1].running_mean.add_(1.0)
        raise RuntimeError("the run fails")

    with pytest.raises(RuntimeError, match="the run fails"):
        strategy.run(fails)
    assert torch.equal(model[0].weight.cpu(), weight + 1.0)
    assert torch.equal(model[1].running_mean.cpu(), mean)


def _collectives(strategy: cs.Strategy) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One run whose replicas meet in a differentiable ``all_reduce`` and ``all_gather``
    and back through both: each replica's results, and the gradients, on the host."""
    torch.manual_seed(0)  # all drawn on the host: a GPU draws otherwise
    state, x = nn.Linear(3, 2).state_dict(), torch.randn(4, 3)
    with strategy.scope():
        layer = nn.Linear(3, 2)
        layer.load_state_dict(state)
    devices = tuple(str(d) for d in strategy.extended.worker_devices)

    def step(x: torch.Tensor) -> torch.Tensor:
        context = cs.get_replica_context()
        assert context is not None
        y = layer(x)
        total = context.all_reduce("SUM", y.sum())
        gathered = context.all_gather(y, axis=0)
        assert total.device == gathered.device == x.device
        (total + gathered.pow(2).sum()).backward()
        return torch.cat([total.reshape(1), gathered.reshape(-1)]).detach()

    results = strategy.run(step, args=(_per_replica(x, devices),))
    outputs = [r.cpu() for r in strategy.experimental_local_results(results)]
    return outputs, {name: p.grad.cpu() for name, p in layer.named_parameters()}


def test_replica_collectives_on_fake_gpus_give_what_logical_devices_give(
    fake_gpu_placement: Any,
) -> None:
    """``all_reduce`` and ``all_gather`` in replica context, and their backward, on two
    GPUs: each replica's result on its own GPU, results and gradients as on ``cpu:0`` and
    ``cpu:1``. (A custom Function that returns its result on a fake GPU used to abort the
    process: the harness hands autograd the CPU tensors.)"""
    placement = fake_gpu_placement
    got, grads = _collectives(cs.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    ))
    expected, expected_grads = _collectives(cs.CentralStorageStrategy(["cpu:0", "cpu:1"]))
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want)
    for name, want in expected_grads.items():
        torch.testing.assert_close(grads[name], want, msg=name)


def _evaluate_then_write_on_the_host() -> None:
    """A forward-only run (no gradients, so no gradient event orders the host after the
    view copies), then the host changes the variables the copies read."""
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu")
    with strategy.scope():
        model = _model()

    def step(x: torch.Tensor) -> None:
        with torch.no_grad():
            model(x)

    strategy.run(step, args=(_per_replica(torch.randn(BATCH, 6), strategy.compute_devices),))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)


def _train_on_cpu_parameters() -> None:
    _train(cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu"),
           _initial_state(), steps=2)


def _clip_inside_the_step() -> None:
    """GPU replicas of host variables that clip their gradients inside the step: the clip
    writes each ``.grad`` in place, which its copy to the host has just read (or still
    reads, without the stream's wait at the end of backward)."""
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu")
    with strategy.scope():
        model = _model()

    def step(x: torch.Tensor) -> None:
        model(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)

    for _ in range(2):
        strategy.run(step, args=(_per_replica(torch.randn(BATCH, 6), strategy.compute_devices),))


def _iterate_a_distributed_dataset() -> None:
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu")
    with strategy.scope():
        model = _model()
    dataset = cs.Dataset.from_tensor_slices((torch.randn(4 * BATCH, 6),)).batch(BATCH)
    for (x,) in strategy.experimental_distribute_dataset(dataset, cs.InputOptions()):
        strategy.run(lambda x: model(x).sum(), args=(x,))


# Each synchronization of centralstore's CUDA paths, switched off in the one function that
# makes it: (the function's owner, its name, the primitive dropped there, the workload, the
# hazard expected). Re-point an entry when the function moves.
_MUTATIONS = [
    pytest.param(views.ReplicaViews, "wait_for_copies", "Event.synchronize",
                 _evaluate_then_write_on_the_host, "read/write", id="views-wait_for_copies"),
    pytest.param(folding, "_fold_rounds", "Event.synchronize", _train_on_cpu_parameters,
                 "write/", id="folding-gradient-event-sync"),
    pytest.param(buckets.GradientBuckets, "copy", "Event.record", _train_on_cpu_parameters,
                 "write/", id="gradient-copy-event-record"),
    pytest.param(buckets.GradientBuckets, "copy", "Stream.wait_event",
                 _train_on_cpu_parameters, "write/read",
                 id="gradient-copy-side-stream-waits-for-backward"),
    pytest.param(buckets.GradientBuckets, "after_backward", "Stream.wait_event",
                 _clip_inside_the_step, "read/write", id="gradient-copy-ordered-after-backward"),
    pytest.param(buckets.Bucket, "_launch", "Event.record", _train_on_cpu_parameters,
                 "write/", id="bucket-event-record"),
    pytest.param(buckets.Bucket, "wait", "Event.synchronize", _train_on_cpu_parameters,
                 "write/", id="bucket-event-sync"),
    pytest.param(buckets.Bucket, "_launch", "Stream.wait_event", _train_on_cpu_parameters,
                 "write/read", id="bucket-side-stream-waits-for-backward"),
    pytest.param(distributed._CudaReady, "__call__", "Stream.wait_event",
                 _iterate_a_distributed_dataset, "write/read", id="input-copy-event"),
]


@pytest.mark.parametrize("owner, name, primitive, workload, expected", _MUTATIONS)
def test_each_synchronization_is_needed(
    fake_gpus: fakegpu.FakeGPUs, owner: Any, name: str, primitive: str,
    workload: Callable[[], None], expected: str,
) -> None:
    """With the synchronization in place the workload has no hazard (the fixture checks at
    teardown); without it the harness reports one. A test that fails if it is NOT reported."""
    workload()
    assert fake_gpus.hazards == [], fake_gpus.report()
    with fake_gpus.skipping(primitive, owner, name):
        workload()
        import gc

        gc.collect()
    hazards = fake_gpus.take_hazards()
    assert hazards, f"no hazard reported without {primitive} in {name}"
    assert any(h.kind.startswith(expected) for h in hazards), "\n".join(map(str, hazards))


class _RefillingSource:
    """A source that refills one pinned buffer for every batch (a ring of one)."""

    def __iter__(self) -> Any:
        buffer = torch.empty(BATCH, 6, pin_memory=True)
        for i in range(3):
            buffer.fill_(float(i))
            yield (buffer,)

    def __len__(self) -> int:
        return 3


def test_a_source_that_refills_a_pinned_buffer_is_not_raced(fake_gpus: fakegpu.FakeGPUs) -> None:
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu")
    dataset = strategy.experimental_distribute_dataset(_RefillingSource(), cs.InputOptions())
    # The loop must not wait for the copies: the host is one agent in the model, so a wait
    # on the loop's thread would order the producer thread's next fill after them too.
    steps = [strategy.experimental_local_results(x) for (x,) in dataset]
    firsts = [[part.cpu()[0, 0].item() for part in parts] for parts in steps]
    assert firsts == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]  # eager copies: values are right
    hazards = fake_gpus.take_hazards()
    assert hazards == [], "\n".join(map(str, hazards))
