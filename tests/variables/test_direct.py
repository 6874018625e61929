"""Replicas computing on the parameters themselves (variables/direct.py): each one finds only
its own gradients in ``.grad``, the sync point sums them in replica order after the gradients
already there, and a failed run puts those back."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import context, local, replica_id, strategy_of
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import centralstore as cs
from centralstore.variables import direct_buffers


def linear(strategy: cs.Strategy) -> nn.Linear:
    torch.manual_seed(0)
    with strategy.scope():
        return nn.Linear(3, 2)


def replica_gradients(model: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """What one device computes for ``x`` alone."""
    model.zero_grad()
    model(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("replicas", [2, 3])
def test_each_replica_finds_only_its_own_gradients_and_run_leaves_their_sum(
    replicas: int,
) -> None:
    strategy = strategy_of(replicas)
    model = linear(strategy)
    x = torch.randn(3 * replicas, 3)
    slices = list(x.chunk(replicas))

    def step(xs: torch.Tensor) -> list[torch.Tensor]:
        model(xs).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    seen = local(strategy, strategy.run(step, args=(cs.PerReplica(slices),)))
    oracle = linear(cs.OneDeviceStrategy("cpu"))
    expected = [replica_gradients(oracle, xs) for xs in slices]
    for got, want in zip(seen, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    for i, param in enumerate(model.parameters()):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, sum(want[i] for want in expected))


def test_gradients_already_in_grad_come_first_and_match_views_bit_for_bit() -> None:
    x = torch.randn(8, 3)

    def train(direct: bool) -> list[torch.Tensor]:
        strategy = strategy_of(3, direct=direct)
        model = linear(strategy)
        for part in x.chunk(2):  # two runs without zero_grad: the second adds to the first
            strategy.run(
                lambda xs: model(xs).pow(2).sum().backward(),
                args=(cs.PerReplica(list(part.tensor_split(3))),),
            )
        return [p.grad for p in model.parameters() if p.grad is not None]

    for direct, views in zip(train(True), train(False), strict=True):
        assert torch.equal(direct, views)


def test_a_failed_run_puts_the_gradients_already_there_back_untouched() -> None:
    strategy = strategy_of(3)
    model = linear(strategy)
    model(torch.randn(2, 3)).sum().backward()
    before = [p.grad for p in model.parameters()]
    values = [g.clone() for g in before if g is not None]

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        if replica_id() == 2:
            raise KeyError("boom")

    with pytest.raises(KeyError):
        strategy.run(step, args=(cs.PerReplica(list(torch.randn(6, 3).chunk(3))),))
    after = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(after, before, strict=True))
    for grad, value in zip(after, values, strict=True):
        assert grad is not None and torch.equal(grad, value)


def test_after_a_rendezvous_replica_0_still_finds_the_gradients_it_made_before_it() -> None:
    strategy = strategy_of(2)
    model = linear(strategy)
    x = torch.randn(4, 3)

    def step(xs: torch.Tensor) -> torch.Tensor:
        model(xs).pow(2).sum().backward()
        context().all_reduce("sum", xs.sum())  # replica 0 was alone so far: threads start
        weight = model.weight.grad
        assert weight is not None
        return weight.clone()

    seen = local(strategy, strategy.run(step, args=(cs.PerReplica(list(x.chunk(2))),)))
    oracle = linear(cs.OneDeviceStrategy("cpu"))
    expected = [replica_gradients(oracle, xs)[0] for xs in x.chunk(2)]
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.weight.grad, expected[0] + expected[1])


def test_clipping_inside_the_step_clips_each_replica_on_its_own() -> None:
    x = torch.randn(8, 3) * 10

    def clipped(strategy: cs.Strategy, parts: list[torch.Tensor]) -> torch.Tensor:
        model = linear(strategy)

        def step(xs: torch.Tensor) -> None:
            model(xs).pow(2).sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        for part in parts:
            strategy.run(step, args=(part,))
        assert model.weight.grad is not None
        return model.weight.grad

    together = clipped(strategy_of(2), [cs.PerReplica(list(x.chunk(2)))])
    one_by_one = clipped(cs.OneDeviceStrategy("cpu"), list(x.chunk(2)))
    torch.testing.assert_close(together, one_by_one)


def test_sparse_gradients_are_summed() -> None:
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])

    def gradient(strategy: cs.Strategy, args: object) -> torch.Tensor:
        torch.manual_seed(0)
        with strategy.scope():
            embed = nn.Embedding(4, 2, sparse=True)
        for _ in range(2):  # the second run adds to the first's gradient
            strategy.run(lambda xs: embed(xs).sum().backward(), args=(args,))
        assert embed.weight.grad is not None and embed.weight.grad.is_sparse
        return embed.weight.grad.to_dense()

    torch.testing.assert_close(
        gradient(strategy_of(2), cs.PerReplica(list(ids.chunk(2)))),
        gradient(cs.OneDeviceStrategy("cpu"), ids),
    )


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_run_with_gradients_in_grad_compares_no_tensor_with_eq(
    replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting gradients aside and taking them off goes by identity: ``tensor == None`` costs
    about 20 us per tensor (torch raises a TypeError inside and turns it into NotImplemented),
    which made a run with filled ``.grad`` cost more per tensor than one beginning empty."""
    strategy = strategy_of(replicas)
    model = linear(strategy)
    x = cs.PerReplica(list(torch.randn(2 * replicas, 3).chunk(replicas)))
    args = (x,) if replicas > 1 else (x.values[0],)

    def step(xs: torch.Tensor) -> None:
        model(xs).pow(2).sum().backward()

    strategy.run(step, args=args)  # .grad filled for the next run
    compared: list[object] = []
    original = torch.Tensor.__eq__

    def counting(self: torch.Tensor, other: object) -> object:
        compared.append(other)
        return original(self, other)

    monkeypatch.setattr(torch.Tensor, "__eq__", counting)
    strategy.run(step, args=args)
    monkeypatch.undo()
    assert compared == []


class Counting(nn.Module):
    """A layer with integer buffers, as transformers' BERT has ``position_ids``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("ids", torch.arange(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.ids)


def modes_of(strategy: cs.Strategy) -> list[str]:
    modes: list[str] = []
    strategy.run(lambda: modes.append(type(strategy._store.run).__name__))
    return modes


def test_parameters_and_buffers_replicas_can_share_take_no_views_and_other_buffers_do() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = Counting()
        norm = nn.BatchNorm1d(2)  # running statistics and num_batches_tracked
        tabled = nn.Module()
        tabled.register_buffer("table", torch.ones(4, 3))  # a floating buffer runs only read
    assert modes_of(strategy) == ["DirectRun", "DirectRun"]
    with strategy.scope():
        double = nn.BatchNorm1d(2, dtype=torch.float64)  # a second dtype: rows of its own
        halved = nn.Module()
        halved.register_buffer("scale", torch.ones(2, dtype=torch.float16))
    assert modes_of(strategy) == ["DirectRun", "DirectRun"]
    groups = strategy._store.plan().buffers
    assert groups is not None
    assert [(group.changing, len(group.records)) for group in groups.floats] == [
        (True, 2), (True, 2), (False, 1), (False, 1),
    ]
    del double, halved
    with strategy.scope():
        large = nn.Module()  # beside the table, more elements than a run copies
        large.register_buffer("mask", torch.ones(direct_buffers.SMALL_FLOATS - 11))
    assert modes_of(strategy) == ["ReplicasRun", "ReplicasRun"]
    seen = strategy._store.replicas[0].views
    assert id(large.mask) in seen and id(tabled.table) not in seen
    del large
    assert modes_of(strategy) == ["DirectRun", "DirectRun"]
    with strategy.scope():
        strided = nn.Module()  # shared only contiguous, where no two elements share memory
        strided.register_buffer("table", torch.ones(3, 4).t())
    assert modes_of(strategy) == ["ReplicasRun", "ReplicasRun"]
    del strided
    with strategy.scope():
        summed = nn.Module()
        summed.register_buffer("total", torch.zeros(3))
        cs.set_aggregation(summed.total, "SUM")  # an aggregation set
    assert modes_of(strategy) == ["ReplicasRun", "ReplicasRun"]
    del model, norm, tabled, summed


def test_a_floating_buffer_given_another_shape_by_data_is_seen_through_views() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        tabled = nn.Module()
        tabled.register_buffer("table", torch.ones(4, 3))
        tabled.weight = nn.Parameter(torch.ones(3))
    assert modes_of(strategy) == ["DirectRun", "DirectRun"]
    tabled.table.data = torch.zeros(2, 3)
    assert modes_of(strategy) == ["ReplicasRun", "ReplicasRun"]
    strategy.run(lambda: tabled.table.add_(1.0))
    assert torch.equal(tabled.table, torch.ones(2, 3))


def test_integer_buffers_nothing_writes_are_not_copied_again_by_later_runs() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = Counting()
    x = cs.PerReplica([torch.ones(2, 3), torch.ones(2, 3)])
    groups = strategy._store.plan().buffers
    assert groups is not None
    strategy.run(lambda xs: model(xs).sum().backward(), args=(x,))
    before = groups.integers_before([model.ids, model.count])
    strategy.run(lambda xs: model(xs).sum().backward(), args=(x,))
    assert groups.integers_before([model.ids, model.count]) is before
    model.count.fill_(3)  # written outside run: copied again before the next run
    assert groups.integers_before([model.ids, model.count]) is not before


def test_integer_buffers_every_run_writes_are_copied_once_a_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.BatchNorm1d(2)  # its integer buffer: num_batches_tracked
    copies: list[list[torch.Tensor]] = []
    copy = direct_buffers._copies

    def counted(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        copies.append(copy(tensors))
        return copies[-1]

    monkeypatch.setattr(direct_buffers, "_copies", counted)
    x = cs.PerReplica([torch.randn(3, 2), torch.randn(3, 2)])
    strategy.run(model, args=(x,))  # copies the counter before the run, and replica 0's
    assert len(copies) == 2
    for run in range(2, 5):  # replica 0's copy, given to the counter, is the next run's before
        strategy.run(model, args=(x,))
        assert len(copies) == run + 1
    assert int(model.num_batches_tracked) == 4
    groups = strategy._store.plan().buffers
    assert groups is not None
    (before,) = groups.integers_before([model.num_batches_tracked])  # no copy more
    assert len(copies) == 5 and int(before) == 4
    assert before.data_ptr() != model.num_batches_tracked.data_ptr()


def test_shared_buffers_list_their_writes_only_for_a_sync_point_that_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process's sync point does not ask the shared buffers for their writes (a sync
    point across workers does, to combine them): asked, they list each statistic and
    counter with its writers and its value from before the run, and fold the same."""
    from centralstore.variables.direct import DirectReplicas

    reports: list[tuple[bool, dict[int, Any]]] = []
    commit_buffers = DirectReplicas.commit_buffers

    def spy(ask: bool) -> None:
        """The sync point's ``commit_buffers``, asking for the writes if ``ask``."""

        def spied(self: DirectReplicas, report: bool = True) -> dict[int, Any]:
            written = commit_buffers(self, report or ask)
            reports.append((report or ask, written))
            return written

        monkeypatch.setattr(DirectReplicas, "commit_buffers", spied)

    x = cs.PerReplica([torch.randn(3, 2), torch.randn(3, 2) + 1])
    finals = []
    for ask in (False, True):
        torch.manual_seed(0)
        strategy = strategy_of(2)
        with strategy.scope():
            model = nn.BatchNorm1d(2)
        before = {name: value.clone() for name, value in model.named_buffers()}
        spy(ask)
        strategy.run(model, args=(x,))
        report, written = reports[-1]
        assert report is ask
        if not ask:
            assert written == {}
        else:
            keys = {id(buffer): name for name, buffer in model.named_buffers()}
            assert sorted(keys[key] for key in written) == sorted(keys.values())
            for key, entry in written.items():
                assert entry.writers == 2
                assert entry.assigned is (keys[key] != "num_batches_tracked")
                assert torch.equal(entry.before, before[keys[key]])
        finals.append([buffer.clone() for buffer in model.buffers()])
    for alone, listed in zip(*finals, strict=True):
        assert torch.equal(alone, listed)


def writes_to_a_counter(path: str, fail: bool = False) -> tuple[list[int], list[int], int]:
    """Each replica adds 5 + its id to an integer buffer, reads it, meets the other in a
    rendezvous, reads it again, writes it again; ``fail``: the last replica raises at the end.
    Returns what replicas 0 and 1 saw, in order, and the buffer after two runs."""
    strategy = strategy_on(path)
    with strategy.scope():
        model = Counting()
    seen: dict[int, list[int]] = {0: [], 1: []}

    def step() -> None:
        replica = replica_id()
        seen[replica].append(int(model.count))
        model.count.add_(5 + replica)
        seen[replica].append(int(model.count))
        context().all_reduce("SUM", 1.0)
        seen[replica].append(int(model.count))
        model.count.add_(1)
        if fail and replica == 1:
            raise RuntimeError("the last replica fails")

    for _ in range(2):
        if fail:
            with pytest.raises(RuntimeError, match="the last replica fails"):
                run_on(path, strategy, step)
        else:
            run_on(path, strategy, step)
    return seen[0], seen[1], int(model.count)


@each_path
def test_a_replica_sees_only_its_own_writes_to_an_integer_buffer_and_the_first_one_wins(
    path: str,
) -> None:
    # on the direct paths the first run uses the buffer itself, and the second its views
    assert writes_to_a_counter(path) == ([0, 5, 5, 6, 11, 11], [0, 6, 6, 6, 12, 12], 12)


@each_path
def test_a_failed_run_leaves_an_integer_buffer_as_before_it(path: str) -> None:
    assert writes_to_a_counter(path, fail=True) == ([0, 5, 5, 0, 5, 5], [0, 6, 6, 0, 6, 6], 0)


class Masked(nn.Module):
    """A floating buffer too large for replicas to share (``SMALL_FLOATS``): it keeps its
    views, so that a run of replicas computing where the variables live is a
    ``ReplicasRun``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.register_buffer("mask", torch.ones(direct_buffers.SMALL_FLOATS + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask[: self.size]


def normalized(strategy: cs.Strategy, masked: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    with strategy.scope():
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
            Masked(16) if masked else nn.Identity(), nn.Linear(16, 2),
            nn.BatchNorm1d(2, momentum=None),  # a cumulative average: num_batches_tracked
        )


def three_steps(
    path: str, strategy: cs.Strategy, model: nn.Module,
    step: Callable[[torch.Tensor, bool], None], x: torch.Tensor, write: str = "none",
) -> dict[str, torch.Tensor]:
    """Three SGD steps of ``step`` on ``x``'s slices, one per replica, each told whether
    it is the second step; that step evaluates if ``write`` is ``eval``, and a run may
    raise only if it is ``fail``. Returns the model's state after them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    slices = cs.PerReplica(list(x.chunk(strategy.num_replicas_in_sync)))
    for second in (False, True, False):
        model.train(not (write == "eval" and second))
        optimizer.zero_grad()
        try:
            run_on(path, strategy, step, args=(slices, second))
        except RuntimeError:
            assert write == "fail"
        optimizer.step()
    return {name: value.clone() for name, value in model.state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def statistics_after(
    path: str, replicas: int, write: str, masked: bool = False
) -> dict[str, torch.Tensor]:
    """Three steps of a model with batch norm; ``write``: what the replicas do besides
    (``skip``: the last one makes no forward; ``add``: each adds to a statistic in
    place; ``fail``: the last one raises after its forward, in the second step; ``eval``:
    the model evaluates in the second step; ``merge``: a ``merge_call`` between two
    forwards; ``dead``: a channel that training leaves at its running mean; ``compiled``:
    the model compiled, whose code writes the statistics through their version counters,
    where eager kernels write behind them; ``touch``: each adds zero to every statistic, a
    write through the counters that changes no value). ``masked``: with a floating buffer
    that keeps its views."""
    strategy = strategy_on(path, replicas)
    model = normalized(strategy, masked)
    forward = torch.compile(model, backend="aot_eager") if write == "compiled" else model
    x = torch.randn(2 * replicas, 3, 4, 4)

    def step(xs: torch.Tensor, second: bool) -> None:
        replica = replica_id()
        if write == "skip" and replica == replicas - 1:
            return
        if write == "dead":  # a channel of zeros: its running mean stays 0, its variance not
            hidden = model[0](xs) * torch.tensor([0.0, 1.0, 1.0, 1.0]).view(1, 4, 1, 1)
            model[1:](hidden).pow(2).mean().backward()
        else:
            forward(xs).pow(2).mean().backward()
        if write == "add":
            model[1].running_mean.add_(replica + 0.1)  # a change, not an assignment
        if write == "touch":
            for norm in (model[1], model[6]):
                norm.running_mean.add_(0.0)
                norm.running_var.add_(0.0)
        if write == "fail" and second and replica == replicas - 1:
            raise RuntimeError("the last replica fails")
        if write == "merge":  # a sync point inside the run, then the replicas run on
            context().merge_call(lambda strategy: None)
            model(xs * 2).pow(2).mean().backward()

    return three_steps(path, strategy, model, step, x, write)


@each_path
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize(
    "write", ["none", "skip", "add", "fail", "eval", "merge", "dead", "compiled", "touch"]
)
def test_batch_norm_statistics_shared_directly_fold_like_views_bit_for_bit(
    path: str, replicas: int, write: str,
) -> None:
    assert_same_state(
        statistics_after(path, replicas, write), statistics_after("views", replicas, write)
    )


@pytest.mark.parametrize("path", ["direct", "threads"])
@pytest.mark.parametrize("write", ["none", "skip", "add", "fail", "eval", "merge", "dead"])
def test_statistics_shared_beside_buffers_with_views_fold_like_views_bit_for_bit(
    path: str, write: str,
) -> None:
    """A floating mask keeps its views, so the run is a ``ReplicasRun``; its replicas still
    share the statistics and counters, and leave what views leave, on the calling thread
    and on replica threads after a rendezvous."""
    strategy = strategy_on("direct")
    model = normalized(strategy, masked=True)
    modes = modes_of(strategy)
    seen = strategy._store.replicas[0].views
    assert modes == ["ReplicasRun", "ReplicasRun"]
    assert id(model[4].mask) in seen and id(model[1].running_mean) not in seen
    assert_same_state(
        statistics_after(path, 2, write, masked=True),
        statistics_after("views", 2, write, masked=True),
    )


@each_path
def test_statistics_shared_directly_after_a_run_in_inference_mode(path: str) -> None:
    """The statistics' copies made in a run under ``torch.inference_mode`` serve the training
    runs after it."""

    def train(path: str) -> dict[str, torch.Tensor]:
        strategy = strategy_on(path)
        model = normalized(strategy)
        x = cs.PerReplica(list(torch.randn(4, 3, 4, 4).chunk(2)))
        with torch.inference_mode():
            run_on(path, strategy, model, args=(x,))
        model.eval()
        with torch.inference_mode():
            run_on(path, strategy, model, args=(x,))
        model.train()
        run_on(path, strategy, lambda xs: model(xs).sum().backward(), args=(x,))
        return {name: value.clone() for name, value in model.state_dict().items()}

    torch.manual_seed(1)
    got = train(path)
    torch.manual_seed(1)
    want = train("views")
    assert_same_state(got, want)


class Tabled(nn.Module):
    """Floating buffers that are not running statistics, small enough for replicas to share:
    a table (a matrix) and a scale (a scalar, of its own dtype if ``scale_dtype`` differs)."""

    def __init__(self, scale_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("table", torch.linspace(0.0, 1.0, 6).view(2, 3))
        self.register_buffer("scale", torch.tensor(0.5, dtype=scale_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.table[0]) * self.scale


def tables_after(path: str, replicas: int, write: str) -> dict[str, torch.Tensor]:
    """Three steps of ``Tabled``, its scale in float64 (a group of its own); ``write``: what
    the replicas do to its buffers besides reading them (``none``; ``add``: each adds to
    the table in place, a change; ``fill``: each fills the scale; ``data``: each scales the
    table through ``.data``, behind its counter; ``skip``: as ``data``, but the last replica
    makes no forward and writes nothing; ``one``: only replica 0 adds; ``fail``: as
    ``add``, and the last replica raises in the second step; ``merge``: as ``add``, then a
    ``merge_call``, then ``add`` again)."""
    strategy = strategy_on(path, replicas)
    torch.manual_seed(0)
    with strategy.scope():
        model = Tabled(torch.float64)
    x = torch.randn(2 * replicas, 3)

    def step(xs: torch.Tensor, second: bool) -> None:
        replica = replica_id()
        if write == "skip" and replica == replicas - 1:
            return
        model(xs).pow(2).mean().backward()
        if write in ("add", "fail", "merge") or (write == "one" and replica == 0):
            model.table.add_(replica + 0.1)
        elif write == "fill":
            model.scale.fill_(replica + 0.25)
        elif write in ("data", "skip"):
            model.table.data.mul_(replica + 1.5)
        if write == "fail" and second and replica == replicas - 1:
            raise RuntimeError("the last replica fails")
        if write == "merge":
            context().merge_call(lambda strategy: None)
            model.table.add_(replica + 0.2)

    return three_steps(path, strategy, model, step, x, write)


@each_path
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize(
    "write", ["none", "add", "fill", "data", "skip", "one", "fail", "merge"]
)
def test_floating_buffers_shared_directly_fold_like_views_bit_for_bit(
    path: str, replicas: int, write: str,
) -> None:
    got = tables_after(path, replicas, write)
    assert_same_state(got, tables_after("views", replicas, write))
    if write == "none":
        assert torch.equal(got["table"], torch.linspace(0.0, 1.0, 6).view(2, 3))


class Operations(TorchDispatchMode):
    """Counts the torch operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_a_training_run_of_two_replicas_adds_a_few_operations_on_batch_norm() -> None:
    """Right after a step each torch operation costs 10 to 15 us on a CPU: a training run of
    two replicas over batch-norm layers dispatches, besides both replicas' passes, the
    copies of the statistics (before the run, replica 0's, the last replica's) and of the
    counters, one comparison of every replica's statistics and one test of it (no stacking
    of copies, no reduction), their mean, and the sum of the gradients: 13 operations."""

    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(2, 2), nn.BatchNorm1d(2))])

    strategy = strategy_of(2)
    with strategy.scope():
        model = layers()
    plain = layers()
    x = torch.randn(8, 2)
    halves = x.chunk(2)

    def step(xs: torch.Tensor) -> None:
        model(xs).pow(2).sum().backward()

    for _ in range(2):
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    model.zero_grad()  # (gradients already in ``.grad`` would add a sum of their own)
    with Operations() as run:
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    with Operations() as passes:
        for half in halves:  # each with ``.grad`` empty, as each replica finds it
            plain.zero_grad()
            plain(half).pow(2).sum().backward()
    extra = run.counts - passes.counts
    assert sum(extra.values()) <= 13, extra
    assert "aten.stack.default" not in extra and "aten.all.default" not in extra, extra


def test_statistics_every_replica_wrote_through_their_counters_are_averaged_at_once() -> None:
    """Compiled code writes batch norm's statistics through their version counters (an
    eager kernel writes behind them): when every replica wrote every one, the sync point
    averages them on their rows as it does an eager step's, without comparing them, and
    folds none through the replicas' views (a copy into a view and one out of it per
    statistic and replica): 11 operations, an eager step's 13 but its comparison and test."""

    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(2, 2), nn.BatchNorm1d(2))])

    def through_counters(model: nn.Sequential, xs: torch.Tensor) -> None:
        model(xs).pow(2).sum().backward()
        for norm in model[1::2]:
            norm.running_mean.mul_(1.0)
            norm.running_var.mul_(1.0)

    strategy = strategy_of(2)
    with strategy.scope():
        model = layers()
    plain = layers()
    halves = torch.randn(8, 2).chunk(2)
    for _ in range(2):
        strategy.run(through_counters, args=(model, cs.PerReplica(list(halves))))
    model.zero_grad()
    with Operations() as run:
        strategy.run(through_counters, args=(model, cs.PerReplica(list(halves))))
    with Operations() as passes:
        for half in halves:
            plain.zero_grad()
            through_counters(plain, half)
    extra = run.counts - passes.counts
    assert sum(extra.values()) <= 11, extra
    assert "aten.ne.Tensor" not in extra, extra


def test_an_evaluation_run_of_two_replicas_compares_batch_norm_statistics_once() -> None:
    """Layers in evaluation change no statistic: besides both replicas' forwards, a run
    copies the statistics (before it, replica 0's, the last replica's), puts them back for
    replica 1, compares every replica's with those from before once and finds the result
    all False in one test, with no search statistic by statistic (its index sums, and
    their conversion to a list, a sync on a GPU): 7 operations."""

    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(2, 2), nn.BatchNorm1d(2))])

    strategy = strategy_of(2)
    with strategy.scope():
        model = layers().eval()
    plain = layers().eval()
    halves = torch.randn(8, 2).chunk(2)

    @torch.no_grad()
    def step(xs: torch.Tensor) -> torch.Tensor:
        return model(xs).sum()

    for _ in range(2):
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with Operations() as run:
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    with Operations() as passes, torch.no_grad():
        for half in halves:
            plain(half).sum()
    extra = run.counts - passes.counts
    assert sum(extra.values()) <= 7, extra
    assert "aten.index_add_.default" not in extra, extra
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


@each_path
@pytest.mark.parametrize("write", ["none", "skip", "eval"])
def test_statistics_of_two_dtypes_fold_like_views_bit_for_bit(path: str, write: str) -> None:
    """Batch norm in float32 and in float64: each dtype's statistics are rows of their own,
    shared directly, and leave what views leave (``skip``: the last replica makes no
    forward; ``eval``: the second step evaluates)."""

    def train(path: str) -> dict[str, torch.Tensor]:
        strategy = strategy_on(path)
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(
                nn.Linear(3, 2), nn.BatchNorm1d(2), Doubled(),
                nn.BatchNorm1d(2, dtype=torch.float64),
            )

        def step(xs: torch.Tensor, second: bool) -> None:
            if write == "skip" and replica_id() == 1:
                return
            model(xs).pow(2).mean().backward()

        state = three_steps(path, strategy, model, step, torch.randn(8, 3), write)
        if path != "views":
            assert modes_of(strategy) == ["DirectRun", "DirectRun"]
        return state

    assert_same_state(train(path), train("views"))


@pytest.mark.parametrize("path", ["direct", "threads"])
def test_spectral_norm_shares_its_vectors_and_trains_like_views_bit_for_bit(path: str) -> None:
    """Spectral norm's power iteration writes its vectors ``_u`` and ``_v`` (small floating
    buffers) in place at every training forward: the replicas share them, and every write
    folds as views fold it."""

    def train(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        strategy = strategy_on(path)
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(
                nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4)), nn.Tanh(),
                nn.Linear(4, 2),
            )

        def step(xs: torch.Tensor, second: bool) -> None:
            model(xs).pow(2).mean().backward()

        return three_steps(path, strategy, model, step, torch.randn(8, 3)), modes_of(strategy)

    got, modes = train(path)
    want, _ = train("views")
    assert modes == ["DirectRun", "DirectRun"]
    assert_same_state(got, want)


def test_a_run_of_two_replicas_that_only_read_a_small_floating_buffer_adds_five_operations(
) -> None:
    """A table the replicas only read (a positional table) costs a run of two the copies of
    its values (before the run, replica 0's, the last replica's), their putting back for
    replica 1 and one test of both replicas' against those from before: 5 operations, and
    no view, where views cost several hundred lines of Python a step."""

    def tabled() -> Tabled:
        torch.manual_seed(0)
        return Tabled()

    strategy = strategy_of(2)
    with strategy.scope():
        model = tabled()
    plain = tabled()
    halves = torch.randn(8, 3).chunk(2)

    def step(xs: torch.Tensor) -> None:
        model(xs).pow(2).sum().backward()

    for _ in range(2):
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    model.zero_grad()  # (gradients already in ``.grad`` would add a sum of their own)
    before = {name: value.clone() for name, value in model.named_buffers()}
    with Operations() as run:
        strategy.run(step, args=(cs.PerReplica(list(halves)),))
    with Operations() as passes:
        for half in halves:
            plain.zero_grad()
            plain(half).pow(2).sum().backward()
    extra = run.counts - passes.counts
    extra -= collections.Counter({"aten._foreach_add_.List": 1})  # the gradients' sum
    assert sum(extra.values()) == 5, extra
    assert extra["aten.equal.default"] == 1 and "aten.ne.Tensor_out" not in extra, extra
    assert not strategy._store.replicas[0].views
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name


def mixed_tensors() -> list[torch.Tensor]:
    """Vectors and scalars of two dtypes each, a matrix, a vector alone of its dtype, a
    boolean mask, and a transposed matrix (not contiguous)."""
    return [
        torch.randn(3), torch.tensor(4), torch.randn(5), torch.tensor(7), torch.randn(2, 2),
        torch.randn(4, dtype=torch.float64), torch.tensor(9), torch.tensor(1.5),
        torch.tensor(2.5), torch.rand(3) > 0.5, torch.randn(3, 2).t(),
    ]


def scramble(tensors: list[torch.Tensor]) -> None:
    """Change every element of ``tensors`` in place."""
    for tensor in tensors:
        if tensor.dtype is torch.bool:
            tensor.logical_not_()
        elif tensor.is_sparse:
            tensor.mul_(2)
        else:
            tensor.mul_(2).add_(1)


def test_copies_restore_every_tensor_exactly_from_fresh_memory() -> None:
    from centralstore.variables.direct import Copier

    tensors = mixed_tensors()
    before = [t.clone() for t in tensors]
    copier = Copier()
    copies = copier.copy(tensors)
    # the bytes of every contiguous tensor in one tensor, whatever its dtype and shape;
    # the transposed matrix cloned
    assert len(copies._parts) == 2
    assert copies._parts[0][2].dtype == torch.uint8
    assert isinstance(copies._parts[1][2], list) and len(copies._parts[1][2]) == 1
    originals = {t.untyped_storage().data_ptr() for t in tensors}
    for group, _, copy, _ in copies._parts:
        for piece in group.pieces(copy):
            assert piece.untyped_storage().data_ptr() not in originals
    scramble(tensors)
    copies.restore()
    for tensor, old in zip(tensors, before, strict=True):
        assert torch.equal(tensor, old)


def test_a_copier_groups_again_when_a_tensor_changes_in_place() -> None:
    from centralstore.variables.direct import Copier

    tensors = mixed_tensors()
    copier = Copier()
    copier.copy(tensors)

    def assign(value: torch.Tensor) -> Callable[[torch.Tensor], object]:
        return lambda tensor: setattr(tensor, "data", value)

    changes: list[tuple[int, Callable[[torch.Tensor], object]]] = [
        (0, assign(torch.randn(6))),  # a vector of another size
        (1, assign(torch.tensor(3.0, dtype=torch.float64))),  # a scalar of another dtype
        (3, assign(torch.ones(2))),  # a scalar that became a vector
        (2, lambda t: t.resize_(2)),  # fewer bytes where they began
        (0, assign(torch.randn(7))),  # (copied afresh while the former is short)
        (2, lambda t: t.resize_(5)),  # more bytes again, in the same memory
        (4, lambda t: t.set_(torch.randn(3))),  # other memory
        (5, lambda t: tensors.__setitem__(5, torch.randn(4).to_sparse())),  # no storage
    ]
    for index, change in changes:
        change(tensors[index])
        before = [t.clone() for t in tensors]
        copies = copier.copy(tensors)
        scramble(tensors)
        copies.restore()
        for tensor, old in zip(tensors, before, strict=True):
            assert torch.equal(tensor.to_dense(), old.to_dense()) and tensor.dtype == old.dtype


def test_a_copier_reads_unchanged_tensors_through_the_same_views() -> None:
    """The views of the tensors as bytes are made once: a later copy of the same tensors
    joins the same views, and its restore writes the tensors themselves."""
    from centralstore.variables.direct import Copier

    tensors = mixed_tensors()
    copier = Copier()
    first = copier.copy(tensors)._parts[0][1]
    scramble(tensors)
    before = [t.clone() for t in tensors]
    copies = copier.copy(tensors)
    assert all(map(lambda a, b: a is b, copies._parts[0][1], first))
    for tensor in tensors:
        tensor.zero_()
    copies.restore()
    for tensor, old in zip(tensors, before, strict=True):
        assert torch.equal(tensor, old)


def test_a_copier_keeps_which_tensors_are_state_while_its_key_and_flags_stay() -> None:
    """``Copier.state``: the tensors that do not require grad and are not parameters. It is
    worked out again when the requires_grad flags or the key differ, and only then (the key
    vouches that the list holds the same tensors)."""
    from centralstore.variables.direct import Copier

    weight, frozen = nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(2))
    frozen.requires_grad_(False)
    buffer, learned = torch.zeros(2), torch.zeros(2, requires_grad=True)
    tensors = [weight, frozen, buffer, learned]
    key = object()
    copier = Copier()

    def state(tensors: list[torch.Tensor], key: object) -> list[torch.Tensor]:
        return copier.state(tensors, [t.requires_grad for t in tensors], key)

    assert state(tensors, key) == [buffer]
    learned.requires_grad_(False)  # frozen since: state now
    got = state(tensors, key)
    assert len(got) == 2 and got[0] is buffer and got[1] is learned
    other = nn.Parameter(torch.zeros(2), requires_grad=False)  # where the buffer was
    swapped = [weight, frozen, other, learned]
    assert state(swapped, key)[0] is other  # the same key: the same positions
    assert state(swapped, object()) == [learned]  # another key: worked out again
    assert state(swapped, None) == [learned]


def test_a_failed_run_of_one_replica_restores_statistics_given_other_memory() -> None:
    """Buffers given other memory between runs (``.data =``, ``set_``), or reshaped in
    place, are copied and put back where they now are."""
    strategy = strategy_of(1)
    model = normalized(strategy)
    x = torch.randn(4, 3, 4, 4)
    norm = model[1]

    def fails(xs: torch.Tensor) -> None:
        model(xs).pow(2).mean().backward()
        raise RuntimeError("the replica fails")

    changes = [
        lambda: setattr(norm.running_mean, "data", torch.randn(4)),
        lambda: norm.running_var.set_(torch.rand(4) + 1),
        lambda: norm.num_batches_tracked.resize_(1).resize_(()),
        lambda: setattr(norm.num_batches_tracked, "data", torch.tensor(5)),
    ]
    for change in changes:
        strategy.run(lambda xs: model(xs).pow(2).mean().backward(), args=(x,))
        change()
        kept = {name: value.clone() for name, value in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="the replica fails"):
            strategy.run(fails, args=(x,))
        for name, value in model.state_dict().items():
            assert torch.equal(value, kept[name]), name


def test_a_failed_run_of_one_replica_restores_statistics_in_any_mode() -> None:
    """The views through which a run copies the statistics serve runs in any mode: made in
    a run under ``torch.inference_mode``, they put the statistics back after one outside."""
    strategy = strategy_of(1)
    model = normalized(strategy)
    x = torch.randn(4, 3, 4, 4)

    def fails(xs: torch.Tensor) -> None:
        model(xs)
        raise RuntimeError("the replica fails")

    kept = {name: value.clone() for name, value in model.state_dict().items()}
    for mode in (torch.inference_mode(), torch.inference_mode(False), torch.no_grad()):
        with mode, pytest.raises(RuntimeError, match="the replica fails"):
            strategy.run(fails, args=(x,))
        for name, value in model.state_dict().items():
            assert torch.equal(value, kept[name]), name


def test_a_failed_run_of_one_replica_leaves_batch_norm_as_before_it() -> None:
    """One replica uses the statistics and counters themselves (``Undo``): a run that fails
    after its forward puts back all of them, and the runs that pass train like one device."""
    strategy = strategy_of(1)
    model = normalized(strategy)
    alone = normalized(cs.get_strategy())  # the default strategy: one device
    x = torch.randn(4, 3, 4, 4)

    def fails(xs: torch.Tensor) -> None:
        model(xs).pow(2).mean().backward()
        raise RuntimeError("the replica fails")

    for _ in range(2):
        strategy.run(lambda xs: model(xs).pow(2).mean().backward(), args=(x,))
        alone(x).pow(2).mean().backward()
        kept = {name: value.clone() for name, value in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="the replica fails"):
            strategy.run(fails, args=(x,))
        for name, value in model.state_dict().items():
            assert torch.equal(value, kept[name]), name
    for name, value in alone.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


class Tagged(torch.Tensor):
    """A tensor subclass, as a library's buffer might be."""


def test_copies_clone_the_tensors_no_concatenation_may_join() -> None:
    """Sparse vectors and vectors of a tensor subclass are cloned and put back one by one."""
    from centralstore.variables.direct import Copier

    tensors = [
        torch.randn(5).to_sparse(), torch.randn(5).to_sparse(),
        torch.randn(3).as_subclass(Tagged), torch.randn(2).as_subclass(Tagged),
    ]
    before = [t.clone() for t in tensors]
    copies = Copier().copy(tensors)
    for tensor in tensors:
        tensor.mul_(2)
    copies.restore()
    for tensor, old in zip(tensors, before, strict=True):
        assert type(tensor) is type(old) and torch.equal(tensor.to_dense(), old.to_dense())


def test_a_copier_keeps_the_copy_of_integers_while_no_one_writes_them() -> None:
    """A device's tensors that are all integers are copied again only when a version
    counter moved; a restore writes them only then. (A write through ``.data`` moves none:
    it stays, as on one device.) Floating tensors beside them are copied every time."""
    from centralstore.variables.direct import Copier

    integers = [torch.arange(4), torch.zeros(1, 4, dtype=torch.long), torch.tensor(3),
                torch.ones(3, dtype=torch.bool)]
    copier = Copier()
    first = copier.copy(integers)._parts[0][2]
    copies = copier.copy(integers)
    assert copies._parts[0][2] is first
    integers[2].add_(1)  # written: copied again
    before = [t.clone() for t in integers]
    copies = copier.copy(integers)
    assert copies._parts[0][2] is not first
    scramble(integers)
    copies.restore()
    for tensor, old in zip(integers, before, strict=True):
        assert torch.equal(tensor, old)
    copies = copier.copy(integers)
    integers[0].data.fill_(7)  # moves no counter
    copies.restore()
    assert integers[0].tolist() == [7] * 4
    mixed = [torch.arange(4), torch.randn(2)]
    other = Copier()
    assert other.copy(mixed)._parts[0][2] is not other.copy(mixed)._parts[0][2]


class Positions(nn.Module):
    """A layer with integer buffers that no forward writes (BERT's position ids and token
    types) and a step counter that a forward adds to when ``counting``."""

    def __init__(self, counting: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("ids", torch.arange(4).unsqueeze(0), persistent=False)
        self.register_buffer("types", torch.zeros(1, 4, dtype=torch.long), persistent=False)
        self.register_buffer("steps", torch.tensor(0))
        self.counting = counting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.counting:
            self.steps.add_(1)
        return self.linear(x) + (self.ids + self.types).float()


def test_a_run_of_one_replica_copies_no_integer_buffer_that_no_one_wrote() -> None:
    """Right after a step each torch operation costs 10 to 15 us on a CPU: a run of one
    replica over integer buffers that no run writes dispatches only the replica's own
    operations, as plain PyTorch would, once their copy exists."""
    strategy = strategy_of(1)
    with strategy.scope():
        model = Positions()
    plain = Positions()
    x = torch.randn(2, 4)

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()

    for _ in range(2):
        strategy.run(step, args=(x,))
    model.zero_grad()
    with Operations() as run:
        strategy.run(step, args=(x,))
    with Operations() as alone:
        plain(x).sum().backward()
    assert not run.counts - alone.counts, run.counts - alone.counts


@each_path
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_failed_run_puts_back_the_integers_it_wrote(path: str, replicas: int) -> None:
    """The copies of integer buffers kept from run to run are made again after a run that
    wrote one: each failed run leaves the counter where the last passing run left it (each
    run adds one: the first replica's write), on every path."""
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        model = Positions(counting=True)
    x = torch.randn(2 * replicas, 4)
    inputs = x if replicas == 1 else cs.PerReplica(list(x.chunk(replicas)))

    def fails(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        raise RuntimeError("the replica fails")

    for passed in range(1, 4):
        run_on(path, strategy, lambda xs: model(xs).sum().backward(), (inputs,))
        for _ in range(2):
            with pytest.raises(RuntimeError, match="the replica fails"):
                run_on(path, strategy, fails, (inputs,))
            assert model.steps.item() == passed
        assert model.ids.tolist() == [[0, 1, 2, 3]] and not model.types.any()
