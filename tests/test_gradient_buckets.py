"""The gradient buckets of CUDA replicas (``variables/buckets.py``) on two fake GPUs.

The early copy of gradients to the CPU costs a constant few CUDA calls per bucket, whatever
the number of parameters; the pinned memory it holds is the gradients' bytes rounded up to
buckets, per replica, allocated once; and training through the buckets gives bit for bit what
the same two replicas give on logical CPU devices (the twin: same gradients, same fold
order), through every way the layout can change. Every test is checked for stream hazards at
teardown (``fake_gpus``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import fakegpu
import pytest
import torch
from fakegpu._pinned import rounded
from replicas import strategy_of
from torch import nn

import centralstore as cs
from centralstore.variables import buckets, folding

GPUS = ("cuda:0", "cuda:1")
uses_gpus = pytest.mark.usefixtures("fake_gpus")


def _copy_calls(gpus: fakegpu.FakeGPUs, device: str) -> int:
    """The CUDA calls made for the gradient copies of the replica on ``device``: everything
    on its side stream (waits, kernels, copies, events recorded and synchronized,
    ``record_stream``)."""
    side = folding._side_stream(torch.device(device))
    return sum(n for (_, agent), n in gpus.calls.items() if agent is side)


def _pinned_allocations(gpus: fakegpu.FakeGPUs) -> int:
    return gpus.calls["pinned allocation", "host"]


def _stack(layers: int, width: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _inputs(devices: tuple[str, ...], width: int = 8, seed: int = 0) -> cs.PerReplica:
    generator = torch.Generator().manual_seed(seed)
    return cs.PerReplica([torch.randn(4, width, generator=generator).to(d) for d in devices])


class _Steps:
    """Trains ``make()`` on ``devices`` with SGD (momentum), one ``run`` per step."""

    def __init__(self, strategy: cs.Strategy, make: Callable[[], nn.Module]) -> None:
        torch.manual_seed(0)
        initial = make().state_dict()
        with strategy.scope():
            self.model = make()
            self.model.load_state_dict(initial)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.strategy = strategy
        self.devices = tuple(str(d) for d in strategy.compute_devices)

    def step(
        self, seed: int = 0, loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        runs: int = 1, zero: bool = True,
    ) -> None:
        model = self.model
        compute = loss or (lambda m, x: m(x).square().mean())
        for run in range(runs):
            x = _inputs(self.devices, seed=seed * 10 + run)
            self.strategy.run(lambda x: compute(model, x).backward(), args=(x,))
        self.optimizer.step()
        if zero:
            self.optimizer.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {
            k: None if p.grad is None else p.grad.detach().cpu()
            for k, p in self.model.named_parameters()
        }


def _on_gpus(make: Callable[[], nn.Module]) -> _Steps:
    return _Steps(cs.CentralStorageStrategy(list(GPUS), parameter_device="cpu"), make)


def _on_cpus(make: Callable[[], nn.Module]) -> _Steps:
    return _Steps(strategy_of(2, direct=False), make)


def _assert_same(gpu: _Steps, cpu: _Steps) -> None:
    for name, value in cpu.state().items():
        assert torch.equal(gpu.state()[name], value), name
    for name, grad in cpu.grads().items():
        got = gpu.grads()[name]
        assert (got is None) == (grad is None), name
        assert got is None or torch.equal(got, grad), name


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Buckets of 1 KiB: a few hundred parameters' worth of gradients span several, which
    close short of their end when the next gradient would cross it."""
    monkeypatch.setattr(buckets, "BUCKET_BYTES", 1024)
    yield 1024


# -- CUDA calls and pinned memory ------------------------------------------------------------


@pytest.mark.parametrize("layers", [25, 50], ids=["50-parameters", "100-parameters"])
def test_the_early_copy_costs_five_cuda_calls_per_bucket_and_one_per_backward(
    fake_gpus: fakegpu.FakeGPUs, layers: int
) -> None:
    """One bucket (under 16 KiB of gradients): per replica and step, the side stream waits
    for backward, concatenates, copies, records the bucket's event, and the sync point
    synchronizes it; at the end of backward an event is recorded on it for the replica's
    stream to wait for: 6 calls for 50 parameters as for 100 (the copy of each gradient
    alone made 5 per parameter, and pinned a block for each)."""
    steps = _on_gpus(lambda: _stack(layers))
    counts = []
    for step in range(4):
        before = {d: _copy_calls(fake_gpus, d) for d in GPUS}
        pins = _pinned_allocations(fake_gpus)
        steps.step(seed=step)
        counts.append((
            [_copy_calls(fake_gpus, d) - before[d] for d in GPUS],
            _pinned_allocations(fake_gpus) - pins,
        ))
    # the first step pins the one bucket of each replica, the others pin nothing
    assert counts == [([6, 6], 2)] + [([6, 6], 0)] * 3


def test_the_calls_follow_the_buckets_not_the_parameters(
    fake_gpus: fakegpu.FakeGPUs, small_buckets: int
) -> None:
    """50 parameters (7200 bytes of gradients) in 1 KiB buckets: 9 buckets, since each
    gradient lands whole (three layers of 288 bytes a bucket, the first with a bias more,
    the last 256 bytes), 4 or 5 calls each."""
    steps = _on_gpus(lambda: _stack(25))
    steps.step(seed=0)
    count = len(_buckets_of(steps))
    assert [b.host.numel() * 4 for b in _buckets_of(steps)] == [896] + [864] * 7 + [256]
    before = {d: _copy_calls(fake_gpus, d) for d in GPUS}
    steps.step(seed=1)
    for device in GPUS:  # 4 for a bucket in one piece (a gradient's part): nothing to join
        assert 4 * count <= _copy_calls(fake_gpus, device) - before[device] <= 5 * count


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _stack(25), id="one-bucket"),
    pytest.param(lambda: nn.Sequential(nn.Linear(8, 30), nn.Linear(30, 7), nn.Linear(7, 3)),
                 id="odd-sizes"),
])
@pytest.mark.parametrize("bucket_bytes", [1 << 24, 1024, 128], ids=["16MiB", "1KiB", "128B"])
def test_pinned_memory_is_the_gradients_rounded_up_to_buckets_and_stays(
    fake_gpus: fakegpu.FakeGPUs, monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], nn.Module], bucket_bytes: int,
) -> None:
    """Over 20 steps the pinned memory held for gradients is, per replica, the buckets'
    sizes rounded up to powers of two by the host allocator: under twice the gradients'
    bytes, and no more than a bucket's bytes for a bucket of several gradients; it is all
    allocated by the first step."""
    monkeypatch.setattr(buckets, "BUCKET_BYTES", bucket_bytes)
    steps = _on_gpus(make)
    before = fake_gpus.pinned.reserved  # the central variables, pinned in the scope
    gradient_bytes = sum(p.numel() * p.element_size() for p in steps.model.parameters())
    held = []
    for step in range(20):
        steps.step(seed=step)
        held.append(fake_gpus.pinned.reserved - before)
    laid_out = _buckets_of(steps)
    sizes = [b.host.numel() * b.host.element_size() for b in laid_out]
    per_replica = sum(map(rounded, sizes))
    assert held == [2 * per_replica] * 20
    assert per_replica < 2 * gradient_bytes
    assert all(
        rounded(size) <= bucket_bytes
        for size, b in zip(sizes, laid_out, strict=True) if len(b.pieces) > 1
    )
    replicas = steps.strategy._store.replicas  # the buffers ask for the gradients' bytes
    assert [r.gradient_buckets.pinned_bytes for r in replicas] == [gradient_bytes] * 2


# -- the same results as the CPU twin --------------------------------------------------------


class _Transposed(nn.Module):
    """A linear layer whose weight is stored transposed: its gradients, which follow the
    parameter's strides, arrive non-contiguous (they take the buckets' general path)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(30, 8).t())
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


@pytest.mark.parametrize("make", [
    pytest.param(
        lambda: nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 7), nn.Linear(7, 8)),
        id="contiguous",
    ),
    pytest.param(lambda: nn.Sequential(nn.Linear(8, 30), _Transposed(), nn.Linear(8, 8)),
                 id="non-contiguous"),
])
@pytest.mark.parametrize("bucket_bytes", [1 << 24, 1024, 100], ids=["16MiB", "1KiB", "100B"])
@uses_gpus
def test_training_through_buckets_is_bit_for_bit_the_cpu_twins(
    monkeypatch: pytest.MonkeyPatch, bucket_bytes: int, make: Callable[[], nn.Module]
) -> None:
    monkeypatch.setattr(buckets, "BUCKET_BYTES", bucket_bytes)
    gpu, cpu = _on_gpus(make), _on_cpus(make)
    transposed = [m for m in gpu.model.modules() if isinstance(m, _Transposed)]
    assert all(not m.weight.is_contiguous() for m in transposed)
    for step in range(4):
        for steps in (gpu, cpu):
            steps.step(seed=step, zero=step < 3)  # the last step's .grad is compared too
    _assert_same(gpu, cpu)


@uses_gpus
def test_gradients_accumulated_across_runs_and_steps_do_not_alias_the_buckets(
    small_buckets: int,
) -> None:
    """Two runs per step and ``.grad`` kept across steps (no ``zero_grad``): each sync point
    adds into ``.grad``, and the ``.grad`` of a step is not the buffer the next step's
    copies overwrite."""
    gpu, cpu = _on_gpus(lambda: _stack(3)), _on_cpus(lambda: _stack(3))
    for step in range(3):
        for steps in (gpu, cpu):
            steps.step(seed=step, runs=2, zero=False)
        _assert_same(gpu, cpu)
    kept = [p.grad for p in gpu.model.parameters()]
    values = [g.clone() for g in kept if g is not None]
    assert len(values) == len(kept)
    gpu.model.zero_grad()  # set to None: the next sync point's sum is the first gradient's
    for seed in (9, 10):
        gpu.step(seed=seed, runs=2)
    for grad, value in zip(kept, values, strict=True):
        assert torch.equal(grad, value)  # type: ignore[arg-type]


def _buckets_of(steps: _Steps, replica: int = 0) -> list[buckets.Bucket]:
    """The replica's buckets, in the order of the layout's slots."""
    return steps.strategy._store.replicas[replica].gradient_buckets.buckets


def _buffer_of(tensor: torch.Tensor | None) -> int:
    assert tensor is not None
    return tensor.untyped_storage().data_ptr()


def _buffers(steps: _Steps, replica: int = 0) -> list[int]:
    """The buffers the replica's buckets have pinned (the spare last), by address."""
    return [
        _buffer_of(buffer[0]) for b in _buckets_of(steps, replica)
        for buffer in [*b._buffers, *([] if b._spare is None else [b._spare])]
    ]


@pytest.mark.parametrize("devices", [("cuda:0",), GPUS], ids=["one-gpu", "two-gpus"])
@uses_gpus
def test_the_sync_point_lends_the_buckets_to_grad_and_the_next_fill_reuses_them(
    devices: tuple[str, ...],
) -> None:
    """With ``zero_grad()`` after each step, ``.grad`` is the first replica's bucket buffer
    itself (the others' gradients added into it): no copy, and every step fills the same
    buffer, bit for bit as the CPU twin."""
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cpu")
    twin = strategy_of(len(devices), direct=False)
    gpu, cpu = _Steps(strategy, lambda: _stack(3)), _Steps(twin, lambda: _stack(3))
    seen = []
    for step in range(4):
        for steps in (gpu, cpu):
            steps.step(seed=step, zero=False)
        _assert_same(gpu, cpu)
        seen.append({_buffer_of(p.grad) for p in gpu.model.parameters()})
        for steps in (gpu, cpu):
            steps.optimizer.zero_grad()
    assert seen == [set(_buffers(gpu))] * 4  # (one bucket: one buffer, at every step)
    assert all(len(_buffers(gpu, r)) == 1 for r in range(len(devices)))


@pytest.mark.parametrize("kept", ["grad", "a view of it"])
@uses_gpus
def test_a_gradient_kept_after_zero_grad_keeps_its_buffer_from_the_next_fill(
    kept: str,
) -> None:
    """A reference to ``.grad`` (or to a view of it) kept past ``zero_grad()`` keeps its
    values: the next step fills a second buffer; once the reference is gone, the buffers
    are reused and no third is pinned."""
    gpu = _Steps(cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu"), lambda: _stack(2))
    gpu.step(seed=0, zero=False)
    grad = gpu.model[1].weight.grad
    assert grad is not None
    held = grad if kept == "grad" else grad[1:]
    value = held.clone()
    del grad
    gpu.optimizer.zero_grad()
    for seed in (1, 2):
        gpu.step(seed=seed)
    assert torch.equal(held, value) and len(_buffers(gpu)) == 2
    del held
    for seed in (3, 4, 5):
        gpu.step(seed=seed)
    assert len(_buffers(gpu)) == 2


@uses_gpus
def test_every_steps_gradients_kept_pin_no_more_than_the_lent_buffers_and_a_spare() -> None:
    """A program that keeps every step's ``.grad``: the bucket lends ``LENT_BUFFERS``, then
    fills a spare whose gradients the sync point copies out (pageable, as before buckets
    were lent); every kept gradient keeps its values. Once they are let go, the buffers are
    lent again."""
    gpu = _Steps(cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu"), lambda: _stack(2))
    kept: list[torch.Tensor] = []
    values = []
    for seed in range(5):
        gpu.step(seed=seed, zero=False)
        grad = gpu.model[1].weight.grad
        assert grad is not None
        kept.append(grad)
        values.append(grad.clone())
        gpu.optimizer.zero_grad()
    assert [g.is_pinned() for g in kept] == [True] * buckets.LENT_BUFFERS + [False] * 3
    assert all(torch.equal(g, v) for g, v in zip(kept, values, strict=True))
    (bucket,) = _buckets_of(gpu)
    assert len(bucket._buffers) == buckets.LENT_BUFFERS and bucket._spare is not None
    kept.clear()
    gpu.step(seed=5, zero=False)
    grad = gpu.model[1].weight.grad
    assert grad is not None and grad.is_pinned() and bucket.lends


@uses_gpus
def test_one_replicas_gradients_accumulated_across_steps_stay_in_their_buffer() -> None:
    """``.grad`` kept across steps (no ``zero_grad``): the first step's lent buffer takes
    the later steps' gradients in place, which fill a second buffer, bit for bit as the CPU
    twin."""
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    twin = cs.CentralStorageStrategy(["cpu:0"])
    gpu, cpu = _Steps(strategy, lambda: _stack(2)), _Steps(twin, lambda: _stack(2))
    grads = []
    for step in range(3):
        for steps in (gpu, cpu):
            steps.step(seed=step, zero=False)
        grads.append(gpu.model[1].bias.grad)
        _assert_same(gpu, cpu)
    assert len({id(g) for g in grads}) == 1  # accumulated into in place
    assert grads[0] is not None and grads[0].is_pinned()
    assert len(_buffers(gpu)) == 2 and _buffer_of(grads[0]) == _buffers(gpu)[0]


class _Branches(nn.Module):
    """A trunk and three heads; which heads a step uses is the caller's."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        x = self.trunk(x)
        return sum((self.heads[i](x) for i in heads), torch.zeros_like(x))


@uses_gpus
def test_one_replicas_gradients_summed_and_alone_leave_no_bucket_in_grad() -> None:
    """A second backward through part of the model, into a ``.grad`` kept across steps:
    the trunk's and the first head's gradients are sums of two passes made on the GPU, the
    second head's is its bucket's view alone, which ``.grad`` keeps across steps in its
    bucket's first buffer while the later steps fill another. The fold adds each pass's sum
    to ``.grad``, where the twin adds the passes one after the other: equal to rounding."""
    strategy = cs.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")
    twin = cs.CentralStorageStrategy(["cpu:0"])
    gpu, cpu = _Steps(strategy, _Branches), _Steps(twin, _Branches)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        model(x, (0,)).square().mean().backward()
        return model(x, (0, 1)).square().mean()

    for step in range(3):
        for steps in (gpu, cpu):
            steps.step(seed=step, loss=loss, zero=False)
        torch.testing.assert_close(gpu.state(), cpu.state())
        torch.testing.assert_close(gpu.grads(), cpu.grads())
    alone = gpu.model.heads[1].weight.grad
    assert alone is not None and alone.is_pinned()
    assert _buffer_of(alone) in _buffers(gpu)


def _heads_loss(heads: tuple[int, ...], passes: int = 1) -> Callable[..., torch.Tensor]:
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for _ in range(passes - 1):
            model(x, heads).square().mean().backward()
        return model(x, heads).square().mean()

    return loss


def _layout_of(steps: _Steps) -> tuple[int, ...]:
    slots = steps.strategy._store.replicas[0].gradient_buckets.slots
    return tuple(id(bucket) for slot in slots.values() for bucket, _ in slot.pieces)


@pytest.mark.parametrize("bucket_bytes", [1 << 24, 300], ids=["16MiB", "300B"])
def test_the_layout_follows_the_parameters_that_are_used(
    fake_gpus: fakegpu.FakeGPUs, monkeypatch: pytest.MonkeyPatch, bucket_bytes: int
) -> None:
    """Heads that come and go (a slot left empty, gradients without a slot), a parameter
    replaced by a new one: the same values as the twin, and the buckets laid out again only
    when a step did not fit them."""
    monkeypatch.setattr(buckets, "BUCKET_BYTES", bucket_bytes)
    plan = [(0,), (0,), (0, 1), (0, 1), (1,), (1,), (0, 1, 2), (0, 1, 2), (0, 1, 2)]
    gpu, cpu = _on_gpus(_Branches), _on_cpus(_Branches)
    layouts = []
    for step, heads in enumerate(plan):
        if step == 7:
            for steps in (gpu, cpu):
                with steps.strategy.scope():
                    steps.model.heads[2].bias = nn.Parameter(torch.full((8,), 0.5))
                steps.optimizer.add_param_group({"params": [steps.model.heads[2].bias]})
        for steps in (gpu, cpu):
            steps.step(seed=step, loss=_heads_loss(heads))
        layouts.append(_layout_of(gpu))
        _assert_same(gpu, cpu)
    changed = [i for i in range(1, len(plan)) if layouts[i] != layouts[i - 1]]
    # laid out at the sync points of steps 2 (head 1 new), 6 (heads 0 and 2 new) and 7 (the
    # new bias), and at the start of step 5 (head 0's slots left empty at step 4)
    assert changed == [2, 5, 6, 7]


def _backward(steps: _Steps, loss: Callable[..., torch.Tensor], seed: int) -> None:
    """A run of ``loss``'s backward on ``steps``, no optimizer step."""
    x = _inputs(steps.devices, seed=seed)
    steps.strategy.run(lambda x: loss(steps.model, x).backward(), args=(x,))


def test_a_loop_of_backwards_in_a_run_copies_each_gradient_once_from_the_second_step(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """Three micro-batches inside one run. The first step copies the later passes'
    gradients alone (a pinned block each) and learns that each comes three times; from then
    on the first two stay on their GPU, where the next pass adds to them, and the sum goes
    into its slot: the calls and the pinned memory of one backward. Each pass adds to the
    view's ``.grad`` on the GPU either way, so the fold adds each replica's sum, as the CPU
    twin does: its gradients bit for bit from the same weights (at the first step, from the
    last copy, the only one that still stands for the gradient)."""
    gpu, cpu = _on_gpus(_Branches), _on_cpus(_Branches)
    loss = _heads_loss((0, 1, 2), passes=3)
    calls, allocations = [], []
    for step in range(4):
        before = [_copy_calls(fake_gpus, d) for d in GPUS]
        pins = _pinned_allocations(fake_gpus)
        for steps in (gpu, cpu):
            _backward(steps, loss, seed=step)
        calls.append([_copy_calls(fake_gpus, d) - n for d, n in zip(GPUS, before, strict=True)])
        allocations.append(_pinned_allocations(fake_gpus) - pins)
        _assert_same(gpu, cpu)
        for steps in (gpu, cpu):
            steps.optimizer.zero_grad()
    parameters = len(list(gpu.model.parameters()))
    assert allocations == [2 + 2 * 2 * parameters] + [0] * 3  # the buckets, two alone each
    # one bucket each, as one backward's, and an event at the end of the backward that copies
    assert calls[1:] == [[6, 6]] * 3


def test_a_loop_whose_passes_change_trains_bit_for_bit_like_the_cpu_twin(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """Each step holds as many passes as the step before brought. One fewer leaves sums on
    the GPU, copied into their slots when the replica returns (one bucket's calls, as
    always); one more goes alone (calls of its own), and the last copy, of the sum, stands
    for the gradient. The next step counts again, and the buckets keep their layout
    throughout."""
    gpu, cpu = _on_gpus(_Branches), _on_cpus(_Branches)
    plan = [4, 4, 2, 2, 1, 3, 3]
    layouts, calls = set(), []
    for step, passes in enumerate(plan):
        before = [_copy_calls(fake_gpus, d) for d in GPUS]
        for steps in (gpu, cpu):
            steps.step(seed=step, loss=_heads_loss((0, 1, 2), passes=passes))
        calls.append([_copy_calls(fake_gpus, d) - n for d, n in zip(GPUS, before, strict=True)])
        _assert_same(gpu, cpu)
        layouts.add(_layout_of(gpu))
    assert len(layouts) == 1
    # steps 1 to 4 and 6 expect as many passes as they make, or fewer: one bucket's copy,
    # and the event that the replica's stream waits for after it (at the end of the
    # backward whose pass copies, or where the replica's return copies the sums held)
    assert [calls[i] for i in (1, 2, 3, 4, 6)] == [[6, 6]] * 5
    assert min(calls[5]) > 5  # three passes where one was expected: two go alone
    passes = gpu.strategy._store.replicas[1].gradient_buckets.passes
    assert sorted(passes.values()) == [3] * len(list(gpu.model.parameters()))


@uses_gpus
def test_a_failed_run_leaves_the_buckets_ready_for_the_next() -> None:
    gpu, cpu = _on_gpus(lambda: _stack(3)), _on_cpus(lambda: _stack(3))
    for steps in (gpu, cpu):
        steps.step(seed=0)

        def fails(x: torch.Tensor, model: nn.Module = steps.model) -> None:
            model(x).sum().backward()
            raise RuntimeError("after backward")

        with pytest.raises(RuntimeError, match="after backward"):
            steps.strategy.run(fails, args=(_inputs(steps.devices),))
        steps.step(seed=1)
    _assert_same(gpu, cpu)


# -- the layout, as a pure function ----------------------------------------------------------


def _arrival(key: int, *shape: int, dtype: torch.dtype = torch.float32) -> Any:
    return buckets._Arrival(key, torch.Size(shape), dtype)


@uses_gpus
def test_the_layout_puts_each_gradient_whole_into_buckets_in_arrival_order() -> None:
    arrivals = [
        _arrival(1, 3, 4), _arrival(2, 10), _arrival(3, 2, dtype=torch.float16),
        _arrival(1, 3, 4), _arrival(4, 0), _arrival(5, 30), _arrival(6, 2), _arrival(7, 5),
    ]
    slots = buckets.lay_out(arrivals, bucket_bytes=64)  # 16 float32s, 32 float16s per bucket
    assert list(slots) == [1, 2, 4, 5, 6, 7, 3]  # by dtype, first arrivals first
    where = {key: [(b.host.numel(), tuple(p)) for b, p in slot.pieces]
             for key, slot in slots.items()}
    assert where == {
        1: [(12, (0, 0, 12))],  # 12 + 10 would cross the bucket's end: closed at 12
        2: [(12, (0, 0, 10))],  # a new bucket, which 6 fills up after 5's
        4: [],  # no element: no piece
        5: [(30, (0, 0, 30))],  # larger than a bucket: one of its own
        6: [(12, (1, 10, 2))],
        7: [(5, (0, 0, 5))],  # 12 + 5 > 16
        3: [(2, (0, 0, 2))],
    }
    assert slots[2].pieces[0][0] is slots[6].pieces[0][0]
    assert slots[4].pieces == ()
    bucket, piece = slots[1].pieces[0]
    assert bucket.views[piece.position].shape == (3, 4)
    float32 = [b for key in (1, 2, 5, 7) for b, _ in slots[key].pieces]
    assert all(b.host.is_pinned() for b in float32)


@pytest.mark.parametrize("devices", [GPUS[:1], GPUS], ids=["one-gpu", "two-gpus"])
@uses_gpus
def test_the_gradients_copied_are_let_go_at_the_sync_point(devices: tuple[str, ...]) -> None:
    """A replica's gradients stay in its views' ``.grad`` until the sync point, which lets
    them go: nothing keeps them (a slot's copy outlives the step, and holding what it
    copied would keep GPU memory into the next step's forward)."""
    strategy = cs.CentralStorageStrategy(list(devices), parameter_device="cpu")
    steps = _Steps(strategy, lambda: _stack(3))
    seen: list[weakref.ref[torch.Tensor]] = []

    def step(x: torch.Tensor) -> None:
        steps.model(x).square().mean().backward()
        seen.extend(weakref.ref(p.grad) for p in steps.model.parameters() if p.grad is not None)

    for seed in range(2):
        seen.clear()
        steps.strategy.run(step, args=(_inputs(steps.devices, seed=seed),))
        gc.collect()
        assert len(seen) == 6 * len(devices)
        assert [ref() for ref in seen] == [None] * len(seen)


# -- the synchronizations of the buckets -------------------------------------------------------


def test_a_deferred_gradient_left_at_its_sync_point_is_copied_alone_at_the_next_step(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """A gradient without a slot whose view a sync point did not fold (the layout it would
    have got was never built) is copied alone when the next step begins, and taken later."""
    side = torch.cuda.Stream(0)
    gradients = buckets.GradientBuckets()

    def grad(value: float) -> torch.Tensor:
        return torch.full((3,), value, device="cuda:0")

    gradients.copy(1, grad(1.0), side).take()  # the first sync point lays out variable 1
    in_bucket = gradients.copy(1, grad(2.0), side)
    late = gradients.copy(2, grad(3.0), side)  # no slot for variable 2: deferred
    assert isinstance(in_bucket, buckets.InBucket) and isinstance(late, buckets.Deferred)
    assert torch.equal(in_bucket.take(), torch.full((3,), 2.0))  # the sync point's only
    pins = _pinned_allocations(fake_gpus)
    gradients.copy(1, grad(4.0), side)  # the next step: laid out for 1 and 2, and late alone
    assert _pinned_allocations(fake_gpus) - pins == 2  # the new bucket, and late's block
    assert torch.equal(late.take(), torch.full((3,), 3.0)) and not late.borrowed


def test_take_all_waits_for_each_bucket_once_and_reads_every_slot(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """A steady step's copies, several in one bucket: ``take_all`` gives what each
    ``take()`` gives, synchronizes the bucket's event once, and leaves it read and all taken,
    so that the next step fills it again."""
    side = torch.cuda.Stream(0)
    gradients = buckets.GradientBuckets()

    def step(value: float) -> list[buckets.GradientCopy]:
        return [
            gradients.copy(key, torch.full((key + 1,), value + key, device="cuda:0"), side)
            for key in range(3)
        ]

    buckets.take_all(step(0.0))  # deferred: the sync point lays the three out
    copies = step(10.0)
    assert all(isinstance(c, buckets.InBucket) and c.borrowed for c in copies)
    syncs = fake_gpus.calls["Event.synchronize", side]
    taken = buckets.take_all(copies)
    assert fake_gpus.calls["Event.synchronize", side] - syncs == 1
    assert [t.tolist() for t in taken] == [[10.0], [11.0, 11.0], [12.0, 12.0, 12.0]]
    (bucket,) = {id(b): b for c in copies for b, _ in c.slot.pieces}.values()
    assert bucket.state is buckets.BucketState.READ and bucket.unread == 0
    assert gradients.synced
    again = step(20.0)
    assert all(isinstance(c, buckets.InBucket) for c in again)  # the bucket took them
    assert [c.take().tolist() for c in again] == [[20.0], [21.0, 21.0], [22.0, 22.0, 22.0]]
