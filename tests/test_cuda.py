"""The CUDA paths, against training on one device: variables on the CPU or a GPU, replicas on GPUs.

Most tests train a model with centralstore on GPUs, and the same model from the same weights
on the same global batches with plain PyTorch on the CPU, and compare every weight and
buffer; the others compare two ways of training on the GPU (compiled and eager, stepping in
``merge_call`` and after ``run``), or BatchNorm over two GPU replicas with two replicas on
the host. Together they run what docs/design.md §8 lists as written for GPUs but never run
on one: central variables pinned in host memory, private views on the GPUs refreshed by
non-blocking copies (§5.3), gradients copied to pinned host memory on a side stream from
post-accumulate-grad hooks (§5.6), and the input prefetch thread (§5.7).

They skip without a CUDA device; ``python benchmarks/gpu_check.py`` runs them on a GPU
machine (``pytest -m cuda tests/test_cuda.py``). Tests that need two GPUs skip with one.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F

import centralstore as cs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

# The replica devices of the tests that run on one GPU, and on two where there are two.
COMPUTE_DEVICES = [
    pytest.param(("cuda:0",), id="cuda:0"),
    pytest.param(("cuda:0", "cuda:1"), marks=two_gpus, id="cuda:0+cuda:1"),
    # a GPU named twice: two replicas on it, as TensorFlow runs two on ["/cpu:0", "/cpu:0"]
    pytest.param(("cuda:0", "cuda:0"), id="cuda:0+cuda:0"),
]

CLASSES = 5
BATCH = 16  # the global batch; it splits evenly over two replicas
STEPS = 3
RTOL = ATOL = 1e-5  # float32 rounding, GPU kernels against CPU ones

Batches = list[tuple[torch.Tensor, torch.Tensor]]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@pytest.fixture(autouse=True)
def _ieee_float32() -> Iterator[None]:
    """Float32 on the GPU as on the CPU: cuDNN convolutions and RNNs default to TF32, whose
    10-bit mantissa puts results about 1e-3 away from the CPU's."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


# -- models, data, optimizers: every model takes a batch of 64 features -----------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )


def _cnn() -> nn.Module:
    """A convolution with BatchNorm: running statistics written by a kernel in place."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, CLASSES),
    )


def _conv() -> nn.Module:
    """``_cnn`` without BatchNorm, which normalizes each replica's slice on its own, so that
    several replicas can match one device (docs/design.md §3.6.4)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, CLASSES),
    )


class _Recurrent(nn.Module):
    """A two-layer LSTM over the 8 rows of an 8x8 input: its weights reach cuDNN as a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.view(-1, 8, 8))
        return self.head(out[:, -1])


def _batches(steps: int = STEPS) -> Batches:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 64, generator=generator),
         torch.randint(0, CLASSES, (BATCH,), generator=generator))
        for _ in range(steps)
    ]


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


# -- training on one device and with a strategy ----------------------------------------------


def _reference(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The one-device model on the CPU, and a copy of its initial state for the others."""
    torch.manual_seed(0)
    model = build()
    return model, copy.deepcopy(model.state_dict())


def _train_on_cpu(model: nn.Module, batches: Batches) -> None:
    optimizer = _sgd(model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _central_model(
    strategy: cs.Strategy,
    build: Callable[[], nn.Module],
    state: dict[str, torch.Tensor],
    make_optimizer: MakeOptimizer = _sgd,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``build``'s model and an optimizer made in ``strategy``'s scope, from ``state``."""
    with strategy.scope():
        model = build()
        model.load_state_dict(state)
        optimizer = make_optimizer(model.parameters())
    return model, optimizer


def _per_replica(strategy: cs.Strategy, *tensors: torch.Tensor) -> tuple[object, ...]:
    """Each of ``tensors`` cut into one slice per replica, each on its replica's device (a
    plain tensor with one replica)."""
    devices = strategy.compute_devices
    placed: list[object] = []
    for tensor in tensors:
        slices = [s.to(d) for s, d in zip(tensor.tensor_split(len(devices)), devices)]
        placed.append(slices[0] if len(slices) == 1 else cs.PerReplica(slices))
    return tuple(placed)


def _replica_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  y: torch.Tensor) -> torch.Tensor:
    """This replica's share of the loss averaged over the global batch."""
    per_example = F.cross_entropy(model(x), y, reduction="none")
    return cs.compute_average_loss(per_example, global_batch_size=BATCH)


def _train_central(
    strategy: cs.Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    home: torch.device,
) -> None:
    """Train with ``strategy``, checking after each run that every ``.grad`` is on ``home``,
    the parameter device."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _replica_loss(model, x, y).backward()

    for x, y in batches:
        optimizer.zero_grad()
        strategy.run(step, args=_per_replica(strategy, x, y))
        for name, param in model.named_parameters():
            assert param.grad is not None, f"{name} has no gradient after run"
            assert param.grad.device == home, f"{name}.grad is on {param.grad.device}"
        optimizer.step()


def _assert_stored_on(model: nn.Module, home: torch.device) -> None:
    """Every variable is on ``home``, and pinned there if it is the host (so that the views'
    copies to the GPUs are asynchronous)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device == home, f"{name} is on {tensor.device}"
        if home.type == "cpu":
            assert tensor.is_pinned(), f"{name} is not in pinned memory"


def _assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    """Weights and buffers (BatchNorm's running statistics and counter too) agree."""
    want = expected.state_dict()
    for name, value in actual.state_dict().items():
        try:
            torch.testing.assert_close(value.cpu(), want[name], rtol=RTOL, atol=ATOL)
        except AssertionError as error:
            error.add_note(f"(in {name})")
            raise


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [_mlp, _cnn], ids=["mlp", "cnn-batchnorm"])
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_one_gpu_replica_trains_like_one_device(
    parameter_device: str, build: Callable[[], nn.Module]
) -> None:
    """Variables on the CPU: the replica computes on private views on cuda:0, refreshed from
    pinned memory, and its gradients are copied back from backward hooks. Variables on
    cuda:0: the replica uses them directly. Either way the weights and the BatchNorm
    statistics come out as on the CPU, and the variables and their ``.grad`` stay on the
    parameter device."""
    batches = _batches()
    reference, state = _reference(build)
    _train_on_cpu(reference, batches)
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device=parameter_device)
    model, optimizer = _central_model(strategy, build, state)
    home = torch.device(parameter_device)
    _assert_stored_on(model, home)
    _train_central(strategy, model, optimizer, batches, home)
    _assert_stored_on(model, home)
    _assert_same_state(model, reference)


@pytest.mark.parametrize("compute_devices", COMPUTE_DEVICES)
def test_gradients_lent_from_pinned_buckets_accumulate_like_one_device(
    compute_devices: tuple[str, ...],
) -> None:
    """Variables on the CPU: ``.grad`` is the pinned buckets the GPUs' gradients were copied
    into, not a copy of them. Two runs a step add into it (with two replicas, the second
    run's buckets take ``.grad`` and are added up while backward runs, ``sums.py``), and a
    ``.grad`` kept past ``zero_grad()`` keeps its values while the later steps' copies fill
    other buffers; the weights come out as on the CPU."""
    batches = _batches(6)
    reference, state = _reference(_mlp)
    reference_optimizer = _sgd(reference.parameters())
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        reference_optimizer.zero_grad()
        for x, y in (first, second):
            F.cross_entropy(reference(x), y).backward()
        reference_optimizer.step()
    strategy = cs.CentralStorageStrategy(list(compute_devices), parameter_device="cpu")
    model, optimizer = _central_model(strategy, _mlp, state)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _replica_loss(model, x, y).backward()

    kept = None
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        optimizer.zero_grad()
        for x, y in (first, second):
            strategy.run(step, args=_per_replica(strategy, x, y))
        sums = strategy._store._sums
        assert sums is None or sums.added > 0  # (the second run's: into a filled .grad)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.is_pinned() for g in grads)
        if kept is None:
            kept = grads[0]
            assert kept is not None
            value = kept.clone()
        del grads  # (else the step's gradients are kept too: a second buffer in use)
        optimizer.step()
    assert kept is not None and torch.equal(kept, value)
    _assert_same_state(model, reference)


@two_gpus
@pytest.mark.parametrize("build", [_mlp, _conv], ids=["mlp", "cnn"])
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_two_gpu_replicas_train_like_one_device_on_the_global_batch(
    parameter_device: str, build: Callable[[], nn.Module]
) -> None:
    """Replicas on cuda:0 and cuda:1, each on half the global batch. With the variables on
    cuda:0, replica 0 shares them and replica 1 computes on copies on cuda:1."""
    batches = _batches()
    reference, state = _reference(build)
    _train_on_cpu(reference, batches)
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device=parameter_device)
    model, optimizer = _central_model(strategy, build, state)
    home = torch.device(parameter_device)
    _train_central(strategy, model, optimizer, batches, home)
    _assert_stored_on(model, home)
    _assert_same_state(model, reference)


@two_gpus
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_two_gpu_replicas_with_batchnorm_train_like_two_replicas_on_the_host(
    parameter_device: str
) -> None:
    """BatchNorm normalizes each replica's slice and averages the replicas' running
    statistics (docs/design.md §3.6.4), so the reference is not one device but two replicas
    on the logical CPU devices cpu:0 and cpu:1. On the GPUs, kernels write the statistics
    behind the version counter, on two devices at once."""
    batches = _batches()
    _, state = _reference(_cnn)
    on_host = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    expected, host_optimizer = _central_model(on_host, _cnn, state)
    _train_central(on_host, expected, host_optimizer, batches, torch.device("cpu"))
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device=parameter_device)
    model, optimizer = _central_model(strategy, _cnn, state)
    _train_central(strategy, model, optimizer, batches, torch.device(parameter_device))
    _assert_same_state(model, expected)


@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_two_replicas_on_one_gpu_train_like_one_device(parameter_device: str) -> None:
    """A GPU named twice is two replicas on it (docs/design.md §3.1.3; TensorFlow 2.21 gives
    ``["/cpu:0", "/cpu:0"]`` two replicas on CPU:0), each on half the global batch. With the
    variables on cuda:0 both replicas use them directly; on the CPU both compute on views on
    cuda:0, their gradients copied back on one side stream."""
    batches = _batches()
    reference, state = _reference(_mlp)
    _train_on_cpu(reference, batches)
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:0"], parameter_device=parameter_device)
    assert strategy.compute_devices == ("cuda:0", "cuda:0")
    assert strategy.num_replicas_in_sync == 2
    model, optimizer = _central_model(strategy, _mlp, state)
    home = torch.device(parameter_device)
    _train_central(strategy, model, optimizer, batches, home)
    _assert_stored_on(model, home)
    _assert_same_state(model, reference)


@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_two_replicas_on_one_gpu_with_batchnorm_train_like_two_on_one_host_device(
    parameter_device: str
) -> None:
    """BatchNorm normalizes each replica's slice (§3.6.4): the reference is two replicas on
    the host's cpu:0, named twice too."""
    batches = _batches()
    _, state = _reference(_cnn)
    on_host = cs.CentralStorageStrategy(["cpu:0", "cpu:0"])
    expected, host_optimizer = _central_model(on_host, _cnn, state)
    _train_central(on_host, expected, host_optimizer, batches, torch.device("cpu"))
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:0"], parameter_device=parameter_device)
    model, optimizer = _central_model(strategy, _cnn, state)
    _train_central(strategy, model, optimizer, batches, torch.device(parameter_device))
    _assert_same_state(model, expected)


@pytest.mark.parametrize("compute_devices", COMPUTE_DEVICES)
@pytest.mark.parametrize("parameter_device", ["cpu", "cuda:0"])
def test_clip_grad_norm_after_a_backward_through_a_reduced_loss_sees_the_whole_gradient(
    parameter_device: str, compute_devices: tuple[str, ...]
) -> None:
    """The step returns its loss; the backward runs after ``run``, through
    ``strategy.reduce("SUM", ...)``. The gradients it leaves on the views reach the central
    ``.grad`` before ``backward`` returns, so ``clip_grad_norm_`` measures and scales the
    gradient of the whole global batch."""
    max_norm = 0.05
    reference, state = _reference(_mlp)
    reference_optimizer = _sgd(reference.parameters())
    strategy = cs.CentralStorageStrategy(list(compute_devices), parameter_device=parameter_device)
    model, optimizer = _central_model(strategy, _mlp, state)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _replica_loss(model, x, y)

    for x, y in _batches():
        reference_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        want = nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        reference_optimizer.step()

        optimizer.zero_grad()
        losses = strategy.run(step, args=_per_replica(strategy, x, y))
        strategy.reduce("SUM", losses).backward()
        got = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        assert float(want) > max_norm  # the clipping scaled the gradient
        torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
    _assert_same_state(model, reference)


@pytest.mark.filterwarnings("ignore:RNN module weights are not part of single contiguous chunk")
def test_an_lstm_trains_like_one_device_from_weights_on_the_cpu() -> None:
    """The replica's LSTM receives its views as its list of weights, not flattened into one
    buffer (cuDNN then warns that it compacts them at each call), and the list holds the
    central parameters again after each run."""
    batches = _batches()
    reference, state = _reference(_Recurrent)
    _train_on_cpu(reference, batches)
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    model, optimizer = _central_model(strategy, _Recurrent, state)
    home = torch.device("cpu")
    _train_central(strategy, model, optimizer, batches, home)
    lstm = model.lstm
    assert isinstance(lstm, nn.LSTM)
    for name, weight in zip(lstm._flat_weights_names, lstm._flat_weights, strict=True):
        assert weight is getattr(lstm, name), f"the LSTM's list holds a view of {name}"
    _assert_stored_on(model, home)
    _assert_same_state(model, reference)


def _train_on_views(build: Callable[[], nn.Module], compiled: bool, steps: int = 4) -> nn.Module:
    """Train with the variables on the CPU and the replica on cuda:0, the model compiled with
    ``fullgraph=True`` or eager; a recompilation from the second step on raises."""
    _, state = _reference(build)
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    model, optimizer = _central_model(strategy, build, state)
    forward = torch.compile(model, fullgraph=True) if compiled else model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _replica_loss(forward, x, y).backward()

    for i, (x, y) in enumerate(_batches(steps)):
        torch._dynamo.config.error_on_recompile = i >= 1
        optimizer.zero_grad()
        strategy.run(step, args=_per_replica(strategy, x, y))
        optimizer.step()
    torch._dynamo.config.error_on_recompile = False
    return model


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="torch.compile on CUDA needs Triton"
)
@pytest.mark.parametrize("build", [_mlp, _cnn], ids=["mlp", "cnn-batchnorm"])
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_fullgraph_compiled_model_on_views_matches_eager_and_compiles_once(
    build: Callable[[], nn.Module]
) -> None:
    compiled = _train_on_views(build, compiled=True)
    _assert_same_state(compiled, _train_on_views(build, compiled=False))


def _train_stepping(make_optimizer: MakeOptimizer, in_merge_call: bool) -> nn.Module:
    """Train with the variables on the CPU and the replica on cuda:0, the optimizer stepped
    inside the step through ``merge_call`` or after ``run``."""
    _, state = _reference(_mlp)
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    model, optimizer = _central_model(strategy, _mlp, state, make_optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _replica_loss(model, x, y).backward()
        if in_merge_call:
            replica_context = cs.get_replica_context()
            assert replica_context is not None
            replica_context.merge_call(lambda _: optimizer.step())

    for x, y in _batches():
        optimizer.zero_grad()
        strategy.run(step, args=_per_replica(strategy, x, y))
        if not in_merge_call:
            optimizer.step()
    for name, value in ((n, v) for s in optimizer.state.values() for n, v in s.items()):
        if isinstance(value, torch.Tensor):  # the optimizer's state lives with the weights
            assert value.device.type == "cpu", f"optimizer state {name} is on {value.device}"
    return model


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam], ids=["sgd-momentum", "adam"])
def test_stepping_in_merge_call_matches_stepping_after_run(make_optimizer: MakeOptimizer) -> None:
    _assert_same_state(
        _train_stepping(make_optimizer, in_merge_call=True),
        _train_stepping(make_optimizer, in_merge_call=False),
    )


@pytest.mark.parametrize("compute_devices", COMPUTE_DEVICES)
def test_a_distributed_dataset_puts_each_replica_slice_on_its_gpu(
    compute_devices: tuple[str, ...]
) -> None:
    """With the default ``InputOptions`` a background thread copies each step's slices to
    the replicas' GPUs ahead of the loop; each arrives whole, on its GPU."""
    features = torch.randn(4 * BATCH, 64)
    labels = torch.arange(4 * BATCH)
    dataset = cs.Dataset.from_tensor_slices((features, labels)).batch(BATCH)
    strategy = cs.CentralStorageStrategy(list(compute_devices), parameter_device="cpu")
    steps = 0
    for x, y in strategy.experimental_distribute_dataset(dataset, cs.InputOptions()):
        rows = slice(steps * BATCH, (steps + 1) * BATCH)
        for value, source in ((x, features), (y, labels)):
            parts = strategy.experimental_local_results(value)
            for part, device in zip(parts, compute_devices, strict=True):
                assert part.device == torch.device(device)
            assert torch.equal(torch.cat([part.cpu() for part in parts]), source[rows])
        steps += 1
    assert steps == 4


def test_a_stream_switch_leaves_what_torch_s_stream_context_leaves() -> None:
    """``CurrentStreams.switch``, the ``torch.cuda.stream`` of a bucket's copy and an input's:
    inside, and after, the current device and each device's current stream are what torch's
    context leaves, from every current device to a stream on every device, inside another
    stream's context or not, and when the block raises."""
    from centralstore import _devices

    streams = _devices.CurrentStreams()
    gpus = range(torch.cuda.device_count())

    def state() -> tuple[int, tuple[int, ...]]:
        return torch.cuda.current_device(), tuple(
            torch.cuda.current_stream(i).cuda_stream for i in gpus
        )

    targets = [torch.cuda.Stream(i) for i in gpus]  # type: ignore[no-untyped-call]
    outers = [torch.cuda.Stream(i) for i in gpus]  # type: ignore[no-untyped-call]
    for current in gpus:
        for target in targets:
            for outer in (None, *outers):
                with torch.cuda.device(current), torch.cuda.stream(outer):  # type: ignore[arg-type]
                    before = state()
                    with torch.cuda.stream(target):  # type: ignore[arg-type]
                        torch_s = state()
                    assert state() == before
                    with streams.switch(target):
                        assert state() == torch_s
                    assert state() == before
                    with pytest.raises(KeyError), streams.switch(target):
                        raise KeyError("inside")
                    assert state() == before


def test_current_streams_answer_torch_s_current_stream_with_one_object_per_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CurrentStreams``, which a GPU replica's gradient buckets ask at every gradient for the
    stream that produced it: the stream torch says is current, on each device (every default
    stream's handle is 0), inside ``torch.cuda.stream`` and on another thread, the same object
    while it stays current; past the streams it keeps, it starts again and still answers
    right."""
    from centralstore import _devices

    streams = _devices.CurrentStreams()

    def agrees(device: torch.device) -> torch.cuda.Stream:
        stream = streams(device)
        torch_s = torch.cuda.current_stream(device.index)
        assert (stream.device_index, stream.cuda_stream) == (device.index, torch_s.cuda_stream)
        return stream

    cuda0 = torch.device("cuda", 0)
    first = agrees(cuda0)
    assert agrees(cuda0) is first
    if torch.cuda.device_count() > 1:
        assert agrees(torch.device("cuda", 1)) is not first
    side = torch.cuda.Stream(cuda0)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):  # type: ignore[arg-type]
        inside = agrees(cuda0)
        assert inside is not first and inside.cuda_stream == side.cuda_stream
        assert agrees(cuda0) is inside
        found: list[torch.cuda.Stream] = []
        thread = threading.Thread(target=lambda: found.append(agrees(cuda0)))
        thread.start()
        thread.join()
        assert found[0] is first  # another thread's current stream is its own, the default
    assert agrees(cuda0) is first
    monkeypatch.setattr(_devices, "_MAX_STREAMS", 2)
    others = [torch.cuda.Stream(cuda0) for _ in range(3)]  # type: ignore[no-untyped-call]
    for stream in [*others, *others]:
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            assert agrees(cuda0).cuda_stream == stream.cuda_stream
        assert len(streams._known) <= 2
    assert agrees(cuda0).cuda_stream == first.cuda_stream
