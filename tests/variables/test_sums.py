"""GPU replicas' buckets added up on the host while backward runs (``variables/sums.py``).

Every test trains on fake GPUs with the variables on the CPU and compares bit for bit: with
a twin whose replicas are logical CPU devices seeing views (the same fold), or, where that
twin agrees only to rounding (second backward passes, whose order differs on GPUs), with the
same GPU training with the sums held for the sync point. A bucket added up early is the
fold's own arithmetic, from the ``.grad`` already there where a run accumulates; where the
fold would add something else (replicas whose buckets differ, a replica that runs on after
a rendezvous, a bucket whose variables' ``.grad`` are partly empty) the buckets wait for the
fold as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from replicas import strategy_of
from torch import nn

import centralstore as cs
from centralstore.variables import buckets
from centralstore.variables.sums import ReplicaSums

pytestmark = pytest.mark.usefixtures("fake_gpus")


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Buckets of 1 KiB, so that a small stack's gradients span several."""
    monkeypatch.setattr(buckets, "BUCKET_BYTES", 1024)
    yield


class _Heads(nn.Module):
    """A stack of linear layers and two heads; the loss picks the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor, heads: tuple[int, ...] = (0, 1)) -> torch.Tensor:
        x = self.trunk(x)
        return sum((self.heads[i](x) for i in heads), torch.zeros_like(x))


Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _own_head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each replica's loss through a head of its own."""
    replica = cs.get_replica_context().replica_id_in_sync_group
    return model(x, (replica,)).square().mean()


class _Training:
    """``_Heads`` with SGD (momentum) under ``strategy``, from the same initial weights."""

    def __init__(self, strategy: cs.CentralStorageStrategy) -> None:
        torch.manual_seed(0)
        initial = _Heads().state_dict()
        with strategy.scope():
            self.model = _Heads()
            self.model.load_state_dict(initial)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.strategy = strategy
        self.devices = [str(d) for d in strategy.compute_devices]
        self.handed_in_backward: list[int] = []  # buckets handed to the helper by then

    def run(self, seed: int, loss: Loss = _square, passes: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        x = cs.PerReplica([torch.randn(4, 8, generator=generator).to(d) for d in self.devices])
        sums = self.strategy._store._sums

        def replica(x: torch.Tensor) -> None:
            for _ in range(passes):
                loss(self.model, x).backward()
            last = cs.get_replica_context().replica_id_in_sync_group == len(self.devices) - 1
            if last and sums is not None:
                self.handed_in_backward.append(len(sums._handed))

        self.strategy.run(replica, args=(x,))

    def step(self, seed: int, zero: bool = True, **run: object) -> None:
        self.run(seed, **run)  # type: ignore[arg-type]
        self.optimizer.step()
        if zero:
            self.optimizer.zero_grad()

    def sums(self) -> ReplicaSums:
        sums = self.strategy._store._sums
        assert sums is not None
        return sums


def _pair(replicas: int = 2) -> tuple[_Training, _Training]:
    gpus = [f"cuda:{i}" for i in range(replicas)]
    strategy = cs.CentralStorageStrategy(gpus, parameter_device="cpu")
    return _Training(strategy), _Training(strategy_of(replicas, direct=False))


def _assert_same(gpu: _Training, cpu: _Training) -> None:
    for (name, got), want in zip(
        gpu.model.state_dict().items(), cpu.model.state_dict().values(), strict=True
    ):
        assert torch.equal(got.cpu(), want), name
    for (name, p), q in zip(
        gpu.model.named_parameters(), cpu.model.parameters(), strict=True
    ):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


def _bucket_count(training: _Training) -> int:
    return len(training.strategy._store.replicas[-1].gradient_buckets.buckets)


def _first_buffers(training: _Training) -> set[int]:
    """The first replica's bucket buffers, by address."""
    return {
        host.untyped_storage().data_ptr()
        for bucket in training.strategy._store.replicas[0].gradient_buckets.buckets
        for host, _, _ in bucket._buffers
    }


@pytest.mark.parametrize("replicas", [2, 3], ids=["two-gpus", "three-gpus"])
@pytest.mark.fake_gpus(3)
def test_the_buckets_are_added_up_during_backward_bit_for_bit(replicas: int) -> None:
    """From the second step on (the first lays the buckets out at its sync point), every
    bucket is handed to the helper before the replicas return, the first replica's buckets
    hold the sums, lent to ``.grad``, and training matches the twin bit for bit."""
    gpu, cpu = _pair(replicas)
    for step in range(4):
        for training in (gpu, cpu):
            training.step(seed=step, zero=False)
        _assert_same(gpu, cpu)
        count = _bucket_count(gpu)
        assert count > 2  # (1 KiB buckets)
        assert gpu.sums().added == (0 if step == 0 else count)
        lent = {p.grad.untyped_storage().data_ptr() for p in gpu.model.parameters()}
        assert lent <= _first_buffers(gpu)
        for training in (gpu, cpu):
            training.optimizer.zero_grad()
    assert gpu.handed_in_backward == [0] + [_bucket_count(gpu)] * 3


@pytest.mark.parametrize("replicas", [2, 3], ids=["two-gpus", "three-gpus"])
@pytest.mark.fake_gpus(3)
def test_gradients_accumulated_in_grad_are_added_up_early_and_copied_into_it(
    replicas: int,
) -> None:
    """A run that finds ``.grad`` filled (two runs a step, or no ``zero_grad``): the helper
    adds the old gradients into each of the first replica's buckets as its copy starts,
    then the other replicas' buckets, ``((old + r0) + r1) + r2`` as the fold adds them, and
    the sync point copies the sums into ``.grad``, which stays the same tensors. Bit for
    bit the twin."""
    gpu, cpu = _pair(replicas)
    for step in range(4):
        for training in (gpu, cpu):
            training.run(seed=2 * step)
        added_first = gpu.sums().added
        lent = [p.grad for p in gpu.model.parameters()]
        for training in (gpu, cpu):
            training.run(seed=2 * step + 1)
        assert (gpu.sums().added, gpu.sums().begun) == (_bucket_count(gpu), 0)
        assert all(a is b for a, b in zip(lent, (p.grad for p in gpu.model.parameters())))
        del lent
        for training in (gpu, cpu):
            training.optimizer.step()
            if step % 2:
                training.optimizer.zero_grad()
        _assert_same(gpu, cpu)
        # every run adds up early but the first (the layout is made at its sync point),
        # whether it finds .grad filled (steps 1 and 3) or empty (step 2)
        assert added_first == (_bucket_count(gpu) if step else 0)


def test_a_bucket_whose_grads_are_partly_filled_is_folded() -> None:
    """One variable of a bucket has no ``.grad`` where the others have one: the fold would
    take that one's sum as it is and add the others', so the bucket waits for the fold;
    the other buckets are added up early. Bit for bit the twin."""
    gpu, cpu = _pair()
    for step in range(3):
        for training in (gpu, cpu):
            training.run(seed=2 * step)
            training.model.heads[1].bias.grad = None
            training.run(seed=2 * step + 1)
        if step:
            assert 0 < gpu.sums().added < _bucket_count(gpu)
        for training in (gpu, cpu):
            training.optimizer.step()
            training.optimizer.zero_grad()
        _assert_same(gpu, cpu)


@pytest.mark.parametrize("change", ["written in place", "replaced"])
def test_a_grad_changed_under_the_early_sums_fails_the_run(change: str) -> None:
    """A ``.grad`` changed inside ``run`` after its bucket was handed to the helper (which
    may have read it already): written in place through a tensor kept from before the run,
    or replaced (which replica code can do only with the variables' torch function off):
    the run raises and its gradients are discarded, ``.grad`` keeps the change alone; the
    next run adds up early again, bit for bit the twin given the same change."""
    gpu, cpu = _pair()
    for training in (gpu, cpu):
        training.step(seed=0)
        training.run(seed=1)
    head = gpu.model.heads[1].weight
    kept = head.grad
    assert kept is not None
    before = {p: p.grad.clone() for p in gpu.model.parameters()}  # type: ignore[union-attr]
    doubled = 2 * kept

    def changes_kept(x: torch.Tensor) -> None:
        _square(gpu.model, x).backward()
        if cs.get_replica_context().replica_id_in_sync_group == 1:
            if change == "replaced":
                with torch._C.DisableTorchFunctionSubclass():
                    head.grad = doubled
            else:
                kept.mul_(2)

    x = cs.PerReplica([torch.randn(4, 8).to(d) for d in gpu.devices])
    with pytest.raises(RuntimeError, match=rf"{change} during run\(\) after the replicas"):
        gpu.strategy.run(changes_kept, args=(x,))
    assert head.grad is (doubled if change == "replaced" else kept)
    for p, old in before.items():
        assert torch.equal(p.grad, 2 * old if p is head else old)  # type: ignore[arg-type]
    assert gpu.sums().added == 0 and not gpu.sums()._handed
    cpu.model.heads[1].weight.grad.mul_(2)  # type: ignore[union-attr]
    for training in (gpu, cpu):
        training.step(seed=3)
    _assert_same(gpu, cpu)
    assert gpu.sums().added == _bucket_count(gpu)


def _held(replicas: int = 2) -> _Training:
    """The same training on GPUs with the buckets added up at the sync point only."""
    gpus = [f"cuda:{i}" for i in range(replicas)]
    strategy = cs.CentralStorageStrategy(gpus, parameter_device="cpu")
    strategy._store._sums = None
    return _Training(strategy)


def _assert_equal_states(a: _Training, b: _Training) -> None:
    """``_assert_same`` of two GPU trainings; then both zeroed for the next step."""
    _assert_same(a, b)
    for training in (a, b):
        training.optimizer.zero_grad()


def _against_held(
    loss: Loss, added: Callable[[int, _Training], int]
) -> tuple[_Training, _Training]:
    """Three steps of ``loss`` on the GPUs with the early sums and held, bit for bit (weights
    and ``.grad``), and on the twin, to rounding; ``added(step, gpu)``: the buckets added
    up early at each step. Returns the two GPU trainings."""
    (gpu, cpu), held = _pair(), _held()
    for step in range(3):
        for training in (gpu, held, cpu):
            training.step(seed=step, loss=loss, zero=False)
        _assert_equal_states(gpu, held)
        for name, value in cpu.model.state_dict().items():
            torch.testing.assert_close(gpu.model.state_dict()[name], value, msg=name)
        cpu.optimizer.zero_grad()
        assert gpu.sums().added == added(step, gpu)
    return gpu, held


def test_a_second_backward_of_the_last_replica_is_added_after_the_sum() -> None:
    """The last replica makes a second backward after its buckets were handed over: those
    gradients are copied alone and the fold adds them after the sum, as it adds them after
    the other replicas' without early sums (bit for bit that path, and the twin, which adds
    each replica's two passes first, to rounding). Where every replica makes two, nothing is
    added early."""

    def second_pass_on_the_last(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if cs.get_replica_context().replica_id_in_sync_group == 1:
            _square(model, x).backward()
        return _square(model, x)

    gpu, held = _against_held(
        second_pass_on_the_last, lambda step, gpu: _bucket_count(gpu) if step else 0
    )
    for training in (gpu, held):
        training.step(seed=3, passes=2)
    _assert_equal_states(gpu, held)
    assert gpu.sums().added == 0


def test_a_second_backward_of_the_first_replica_after_its_buckets_took_grad_is_folded() -> None:
    """A run that accumulates, whose first replica makes a second backward after its
    buckets took ``.grad``: that backward adds to the gradients in place on the GPU, so
    the copies no longer stand for them, the bucket's start is dropped, and the fold adds
    the replica's sum of two, then the other's: the twin's order, bit for bit, as the path
    without early sums."""

    def second_pass_on_the_first(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if cs.get_replica_context().replica_id_in_sync_group == 0:
            _square(model, x).backward()
        return _square(model, x)

    (gpu, cpu), held = _pair(), _held()
    for step in range(3):
        for training in (gpu, held, cpu):
            training.run(seed=2 * step)
            training.run(seed=2 * step + 1, loss=second_pass_on_the_first)
            training.optimizer.step()
        assert (gpu.sums().added, gpu.sums().begun) == (0, 0)
        _assert_same(gpu, cpu)
        _assert_equal_states(gpu, held)
        cpu.optimizer.zero_grad()


@pytest.mark.parametrize("accumulating", [False, True], ids=["grad-empty", "grad-filled"])
def test_a_grad_the_last_replica_scales_after_the_hand_over_is_folded(
    accumulating: bool,
) -> None:
    """The last replica halves its ``.grad`` inside the step, after its backward, when its
    buckets have been handed over: the copies no longer stand for the gradients, the sync
    point drops the sums (and the ``.grad`` the first replica's buckets took stays as it
    was), and the fold adds the gradients themselves: bit for bit the twin."""
    gpu, cpu = _pair()
    handed = []

    def halved_on_the_last(x: torch.Tensor, t: _Training) -> None:
        _square(t.model, x).backward()
        if cs.get_replica_context().replica_id_in_sync_group == 1:
            if t is gpu:
                handed.append(len(gpu.sums()._handed))
            for p in t.model.parameters():
                p.grad.mul_(0.5)  # type: ignore[union-attr]

    for step in range(3):
        for training in (gpu, cpu):
            if accumulating:
                training.run(seed=10 + step)
            generator = torch.Generator().manual_seed(step)
            x = cs.PerReplica(
                [torch.randn(4, 8, generator=generator).to(d) for d in training.devices]
            )
            training.strategy.run(halved_on_the_last, args=(x, training))
            training.optimizer.step()
        _assert_same(gpu, cpu)
        for training in (gpu, cpu):
            training.optimizer.zero_grad()
        if step:
            assert handed[-1] == _bucket_count(gpu)  # handed over, then
            assert gpu.sums().added == 0  # dropped


def test_runs_that_loop_over_micro_batches_and_accumulate_add_up_early() -> None:
    """Two runs a step, each looping over three micro-batches, the second into a filled
    ``.grad``. Once a first run has counted the passes (no optimizer step: the same
    weights), each replica keeps its passes' sum on its GPU until the third
    (``GradientBuckets.holds``): the first replica's buckets take ``.grad`` as their copies
    start, the last's are added up early, each replica's three passes first, then the
    replicas: the twin's order, bit for bit."""
    gpu, cpu = _pair()
    for training in (gpu, cpu):  # the passes counted
        training.run(seed=99, passes=3)
        training.optimizer.zero_grad()
    for step in range(3):
        counts = []
        for training in (gpu, cpu):
            training.run(seed=2 * step, passes=3)
            if training is gpu:
                counts.append((gpu.sums().added, gpu.sums().begun))
            training.run(seed=2 * step + 1, passes=3)
            if training is gpu:
                counts.append((gpu.sums().added, gpu.sums().begun))
            training.optimizer.step()
        _assert_same(gpu, cpu)
        for training in (gpu, cpu):
            training.optimizer.zero_grad()
        # every bucket added up early in both runs (in the second, a hand-over needs the
        # first replica's bucket to have taken .grad)
        assert counts == [(_bucket_count(gpu), 0)] * 2


def test_an_accumulating_run_that_meets_in_merge_call_after_backward() -> None:
    """Each replica makes its backward into a filled ``.grad``, then meets the others in
    ``merge_call`` (an optimizer's ``apply_gradients`` in TensorFlow code): the first
    replica's buckets take ``.grad`` as their copies start, the first replica waits while
    the last computes (so nothing is handed over), and the merge's sync point copies
    ``old + r0`` into ``.grad`` and folds ``r1`` after it. Bit for bit the path without
    early sums, and the twin."""
    (gpu, cpu), held = _pair(), _held()
    begun: list[int] = []

    for step in range(3):
        for training in (gpu, held, cpu):
            training.run(seed=2 * step)
            generator = torch.Generator().manual_seed(2 * step + 1)
            x = cs.PerReplica(
                [torch.randn(4, 8, generator=generator).to(d) for d in training.devices]
            )

            def backward_then_merge(x: torch.Tensor, t: _Training = training) -> None:
                _square(t.model, x).backward()
                cs.get_replica_context().merge_call(
                    lambda strategy: begun.append(gpu.sums().begun) if t is gpu else None
                )

            training.strategy.run(backward_then_merge, args=(x,))
            training.optimizer.step()
        _assert_same(gpu, cpu)
        _assert_equal_states(gpu, held)
        cpu.optimizer.zero_grad()
    assert begun == [_bucket_count(gpu)] * 3


def test_replicas_that_use_different_heads_fold_the_buckets_that_differ() -> None:
    """Each replica uses a head of its own: the buckets holding the heads differ between
    the replicas and wait for the fold; the trunk's are added up early. Bit for bit the
    twin."""

    gpu, cpu = _pair()
    for step in range(4):
        for training in (gpu, cpu):
            training.step(seed=step, loss=_own_head)
        _assert_same(gpu, cpu)
        if step:
            assert 0 < gpu.sums().added < _bucket_count(gpu)


def test_accumulating_replicas_with_heads_of_their_own_copy_the_first_bucket_alone() -> None:
    """Each replica uses a head of its own and every run accumulates: the first replica's
    bucket holding its head takes ``.grad`` as its copy starts, but the last replica's
    bucket there holds other variables, so the sync point copies that bucket alone into
    ``.grad`` and the fold adds the last replica's gradients to it; the trunk's buckets
    are added up. Bit for bit the twin."""

    gpu, cpu = _pair()
    for step in range(4):
        for training in (gpu, cpu):
            training.run(seed=2 * step, loss=_own_head)
            training.run(seed=2 * step + 1, loss=_own_head)
        if step:
            assert 0 < gpu.sums().added < _bucket_count(gpu)
            assert gpu.sums().begun == 1
        for training in (gpu, cpu):
            training.optimizer.step()
            training.optimizer.zero_grad()
        _assert_same(gpu, cpu)


def test_a_replica_that_runs_on_after_a_rendezvous_keeps_its_buckets_for_the_fold() -> None:
    """Each replica makes a backward, meets the others in an ``all_reduce``, and makes a
    second. At the first step each backward's gradients are copied: when the last replica's
    buckets fill, the first waits in the rendezvous and will add a second backward's
    gradients, which the fold adds before the last replica's, so nothing is added early.
    From then on each replica holds its first pass's gradients on its GPU
    (``GradientBuckets.holds``) and copies the sums at the second: the first has returned
    when the last one's buckets fill, and they are added up early. A last step of one pass
    copies what it held when each replica returns, and adds up early too. Bit for bit the
    path without early sums throughout (and the twin to rounding)."""

    def backward_meet_backward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        _square(model, x).backward()
        cs.get_replica_context().all_reduce(cs.ReduceOp.SUM, x.sum())
        return _square(model, x)

    gpu, held = _against_held(
        backward_meet_backward, lambda step, gpu: _bucket_count(gpu) if step else 0
    )
    for training in (gpu, held):
        training.step(seed=3)
    _assert_equal_states(gpu, held)
    assert gpu.sums().added == _bucket_count(gpu)


def test_replicas_that_meet_before_their_backward_add_up_early_on_threads() -> None:
    """Replicas that meet in an ``all_reduce`` before their backward run on replica threads
    from there on; the first has returned when the last one's buckets fill, so they are
    added up early, bit for bit the twin."""

    def meets_first(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cs.get_replica_context().all_reduce(cs.ReduceOp.SUM, x.sum())
        return _square(model, x)

    gpu, cpu = _pair()
    for step in range(3):
        for training in (gpu, cpu):
            training.step(seed=step, loss=meets_first)
        _assert_same(gpu, cpu)
        assert gpu.sums().added == (_bucket_count(gpu) if step else 0)


@pytest.mark.parametrize("accumulating", [False, True], ids=["grad-empty", "grad-filled"])
def test_a_failed_run_discards_the_buckets_after_the_helper(accumulating: bool) -> None:
    """The last replica raises after its backward (every bucket handed to the helper by
    then, after the first replica's took ``.grad`` where it was filled): the run's gradients
    are discarded once the helper is done, ``.grad`` stays as before the run (the same
    tensors and values), and the next steps match the twin."""
    gpu, cpu = _pair()
    for training in (gpu, cpu):
        training.step(seed=0)
        training.step(seed=1, zero=not accumulating)
    before = [p.grad for p in gpu.model.parameters()]
    values = [None if g is None else g.clone() for g in before]
    handed = []

    def fails(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = _square(model, x)
        if cs.get_replica_context().replica_id_in_sync_group == 1:
            loss.backward()
            if model is gpu.model:
                handed.append(len(gpu.sums()._handed))
            raise RuntimeError("after backward")
        return loss

    for training in (gpu, cpu):
        with pytest.raises(RuntimeError, match="after backward"):
            training.run(seed=2, loss=fails)
    assert all(a is b for a, b in zip(before, (p.grad for p in gpu.model.parameters())))
    for grad, value in zip(before, values, strict=True):
        assert (grad is None) == (not accumulating)
        assert grad is None or torch.equal(grad, value)  # type: ignore[arg-type]
    del before
    _assert_same(gpu, cpu)
    assert handed == [_bucket_count(gpu)]
    assert gpu.sums().added == 0 and not gpu.sums()._handed and not gpu.sums()._begun
    for step in (3, 4):
        for training in (gpu, cpu):
            training.step(seed=step)
        _assert_same(gpu, cpu)
        assert gpu.sums().added == _bucket_count(gpu)


def test_a_gradient_kept_past_zero_grad_keeps_its_values() -> None:
    """A ``.grad`` lent from the first replica's bucket and kept past ``zero_grad()``: the
    next steps' sums go into another buffer of that bucket, and the kept values stay."""
    gpu, cpu = _pair()
    for training in (gpu, cpu):
        training.step(seed=0)
        training.step(seed=1, zero=False)
    kept = gpu.model.trunk[0].weight.grad
    assert kept is not None
    value = kept.clone()
    for training in (gpu, cpu):
        training.optimizer.zero_grad()
        for seed in (2, 3):
            training.step(seed=seed)
    assert torch.equal(kept, value)
    _assert_same(gpu, cpu)
    assert gpu.sums().added == _bucket_count(gpu)


@pytest.mark.parametrize("through", ["reduce", "each loss"])
def test_a_backward_after_run_is_folded_as_it_comes(through: str) -> None:
    """The replicas return their losses and the backward runs after ``run``, through
    ``strategy.reduce`` or each replica's loss in turn (the first replica's buckets fill
    before the last's): its gradients reach the buckets outside any run, where nothing is
    handed to the helper (each backward's are folded as it ends), bit for bit the path
    without early sums."""
    (gpu, cpu), held = _pair(), _held()
    for step in range(3):
        for training in (gpu, held, cpu):
            generator = torch.Generator().manual_seed(step)
            x = cs.PerReplica(
                [torch.randn(4, 8, generator=generator).to(d) for d in training.devices]
            )
            training.optimizer.zero_grad()
            losses = training.strategy.run(lambda x, t=training: _square(t.model, x), args=(x,))
            if through == "reduce":
                training.strategy.reduce("SUM", losses).backward()
            else:
                for loss in training.strategy.experimental_local_results(losses):
                    loss.backward()
            training.optimizer.step()
        _assert_equal_states(gpu, held)
        for name, value in cpu.model.state_dict().items():
            torch.testing.assert_close(gpu.model.state_dict()[name], value, msg=name)
        assert not gpu.sums()._handed and gpu.sums().added == 0
