"""Module slots: a replica running on the calling thread finds its views in the modules."""

from __future__ import annotations

import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import context, local, replica_id, strategy_of
from torch import nn

import centralstore as cs


def per_replica(x: torch.Tensor, replicas: int = 2) -> cs.PerReplica[torch.Tensor]:
    return cs.PerReplica(list(x.chunk(replicas)))


# On logical CPU devices the replicas use the parameters directly (variables/direct.py);
# "views" makes them see views of every parameter, as replicas on other GPUs do.
MECHANISMS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])


@MECHANISMS
def test_module_code_sees_the_parameters_or_plain_views_and_they_come_back_after_run(
    direct: bool,
) -> None:
    strategy = strategy_of(2, direct=direct)
    with strategy.scope():
        model = nn.Linear(3, 1)
    central = model.weight

    def step() -> tuple[type, bool, bool]:
        weight = model.weight
        return type(weight), weight is central, bool(torch.equal(weight, central))

    for kind, same, equal in local(strategy, strategy.run(step)):
        if direct:
            assert kind is nn.Parameter and same
        else:
            assert kind is torch.Tensor and not same and equal
    assert model.weight is central and type(central) is nn.Parameter


@MECHANISMS
def test_replicas_on_threads_after_a_rendezvous_resolve_through_the_class(direct: bool) -> None:
    strategy = strategy_of(2, direct=direct)
    with strategy.scope():
        model = nn.Linear(3, 1)
    x = torch.randn(4, 3)

    def step(xs: torch.Tensor) -> torch.Tensor:
        hidden = model(xs)  # before the rendezvous: replica 0 directly or through its slots
        total = context().all_reduce("sum", hidden.detach().sum())
        loss = (model(xs) + hidden).sum() + 0 * total  # after it: every replica on a thread
        loss.backward()
        return loss.detach()

    strategy.run(step, args=(per_replica(x),))
    torch.testing.assert_close(model.weight.grad, 2 * x.sum(0, keepdim=True))
    assert model.weight.grad is not None and type(model.weight) is nn.Parameter


def test_batch_norm_writes_through_slots_are_averaged_and_counted_once() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    strategy.run(bn, args=(per_replica(x),))
    expected = 0.1 * (x[:4].mean(0) + x[4:].mean(0)) / 2
    torch.testing.assert_close(bn.running_mean, expected)
    assert int(bn.num_batches_tracked) == 1


def test_batch_norm_before_a_rendezvous_is_recorded_when_threads_start() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
    x = torch.randn(8, 3)

    def step(xs: torch.Tensor) -> None:
        bn(xs)
        context().all_reduce("sum", torch.ones(()))

    strategy.run(step, args=(per_replica(x),))
    torch.testing.assert_close(bn.running_mean, 0.1 * (x[:4].mean(0) + x[4:].mean(0)) / 2)


class Counting(nn.Module):
    """A module that writes its own buffers in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("average", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        self.average.lerp_(x.mean(0), 0.5)
        return x


def test_a_sum_buffer_stays_with_the_class_and_adds_every_replicas_delta() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        module = Counting()
        cs.set_aggregation(module.seen, "SUM")
    x = torch.randn(6, 3)
    strategy.run(module, args=(per_replica(x),))
    assert float(module.seen) == 6.0
    halves = [0.5 * x[:3].mean(0), 0.5 * x[3:].mean(0)]
    torch.testing.assert_close(module.average, (halves[0] + halves[1]) / 2)


@MECHANISMS
@pytest.mark.parametrize("writer", [0, 1])
def test_a_shared_parameter_written_in_place_raises_in_that_replica(
    direct: bool, writer: int
) -> None:
    strategy = strategy_of(2, direct=direct)
    with strategy.scope():
        model = nn.Linear(3, 1)

    def step() -> None:
        if replica_id() == writer:
            with torch.no_grad():
                model.weight.mul_(2.0)

    with pytest.raises(ValueError, match=rf"Replica {writer} wrote.*'weight'.*NONE") as info:
        strategy.run(step)
    assert f"replica {writer}" in str(info.value.__notes__)


def test_a_parameter_with_an_aggregation_is_written_through_the_class() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(1, 1, bias=False)
        nn.init.constant_(model.weight, 1.0)
        cs.set_aggregation(model.weight, "MEAN")

    def step() -> None:
        with torch.no_grad():
            model.weight.add_(float(replica_id() + 1))

    strategy.run(step)
    assert model.weight.item() == 2.5


def test_a_failed_replica_leaves_no_kernel_write_in_its_views() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
    x = torch.randn(8, 3)

    def failing(xs: torch.Tensor) -> None:
        bn(xs)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        strategy.run(failing, args=(per_replica(x),))
    assert torch.equal(bn.running_mean, torch.zeros(3))
    bn.eval()
    outs = local(strategy, strategy.run(bn, args=(per_replica(x),)))
    torch.testing.assert_close(torch.cat(outs), x / (1 + 1e-5) ** 0.5)


def lstm_gradients(strategy: cs.Strategy, x: torch.Tensor) -> list[torch.Tensor | None]:
    """The LSTM's gradients on ``x``, checking that its list of weights holds the weights
    its module code sees, inside and after ``run``."""
    torch.manual_seed(0)
    with strategy.scope():
        lstm = nn.LSTM(3, 4, batch_first=True)

    def step(xs: torch.Tensor) -> bool:
        lstm(xs)[0].sum().backward()
        return all(w is p for w, p in zip(lstm._flat_weights, lstm.parameters(), strict=True))

    args = per_replica(x) if strategy.num_replicas_in_sync == 2 else x
    assert all(local(strategy, strategy.run(step, args=(args,))))
    assert all(w is p for w, p in zip(lstm._flat_weights, lstm.parameters(), strict=True))
    return [p.grad for p in lstm.parameters()]


@MECHANISMS
def test_an_lstm_uses_the_views_in_its_list_of_weights_and_matches_one_device(
    direct: bool,
) -> None:
    x = torch.randn(4, 5, 3)
    got = lstm_gradients(strategy_of(2, direct=direct), x)
    want = lstm_gradients(cs.OneDeviceStrategy("cpu"), x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def tied_gradient(strategy: cs.Strategy, x: torch.Tensor) -> torch.Tensor | None:
    torch.manual_seed(0)
    with strategy.scope():
        embed = nn.Embedding(5, 3)
        head = nn.Linear(3, 5, bias=False)
        head.weight = embed.weight
    model = nn.Sequential(embed, head)

    def step(xs: torch.Tensor) -> bool:
        model(xs).sum().backward()
        return head.weight is embed.weight

    args = per_replica(x) if strategy.num_replicas_in_sync == 2 else x
    assert all(local(strategy, strategy.run(step, args=(args,))))
    return embed.weight.grad


@MECHANISMS
def test_tied_weights_share_one_view_and_one_gradient(direct: bool) -> None:
    x = torch.randint(0, 5, (4, 2))
    torch.testing.assert_close(
        tied_gradient(strategy_of(2, direct=direct), x),
        tied_gradient(cs.OneDeviceStrategy("cpu"), x),
    )


@MECHANISMS
def test_a_module_given_another_tensor_keeps_it(direct: bool) -> None:
    strategy = strategy_of(2, direct=direct)
    with strategy.scope():
        model = nn.Linear(1, 1, bias=False)
    replacement = nn.Parameter(torch.full((1, 1), 3.0))
    model.weight = replacement  # outside the scope: not a central variable
    assert strategy.run(lambda: model.weight is replacement) is True  # on both replicas


def test_a_kernel_write_to_a_buffer_that_forbids_writes_raises_and_is_discarded() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
        cs.set_aggregation(bn.running_mean, "NONE")
    x = torch.randn(8, 3)
    with pytest.raises(ValueError, match="aggregation is NONE"):
        strategy.run(bn, args=(per_replica(x),))
    assert torch.equal(bn.running_mean, torch.zeros(3))
    assert int(bn.num_batches_tracked) == 0  # the whole run was discarded


@each_path
@pytest.mark.parametrize("aggregation", ["NONE", "ONLY_FIRST_REPLICA"])
def test_a_counted_write_to_a_buffer_is_refused_or_kept_by_its_aggregation(
    path: str, aggregation: str
) -> None:
    """Batch norm's counter moves by ``add_`` (its version counter sees the write): with
    aggregation NONE two replicas' writes are refused and the run discarded, with the
    usual ONLY_FIRST_REPLICA the first replica's count is kept."""
    strategy = strategy_on(path)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
        cs.set_aggregation(bn.num_batches_tracked, aggregation)
    x = torch.randn(8, 3)
    if aggregation == "NONE":
        with pytest.raises(ValueError, match="aggregation is NONE"):
            run_on(path, strategy, bn, (per_replica(x),))
        assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(3))
    else:
        run_on(path, strategy, bn, (per_replica(x),))
        assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("tied", [False, True], ids=["parameters", "tied"])
def test_shared_views_of_parameters_fill_every_slot_at_once(
    tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas that see views sharing their parameters' storage (a worker process's replica
    on the parameter device) fill and empty a model of parameters in passes in C
    (``Filled._fill_all``), and train as one device; a parameter in two slots (tied
    weights) takes the slot-by-slot path, and the other slots are still filled at once."""
    from centralstore.variables.modules import Filled

    by_slot: list[int] = []
    fill = Filled._fill
    monkeypatch.setattr(
        Filled, "_fill", lambda self, items: by_slot.append(len(items)) or fill(self, items)
    )

    def gradients(strategy: cs.Strategy) -> list[torch.Tensor]:
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
            if tied:
                model[2].weight = model[0].weight
        x = torch.randn(4, 3)

        def step(xs: torch.Tensor) -> None:
            cs.compute_average_loss(model(xs).pow(2).sum(1), global_batch_size=4).backward()

        args = per_replica(x) if strategy.num_replicas_in_sync == 2 else x
        for _ in range(3):  # the first run makes the views, slot by slot; later ones check them
            strategy.run(step, args=(args,))
        return [p.grad for p in model.parameters()]  # type: ignore[misc]

    expected = gradients(cs.OneDeviceStrategy("cpu"))
    by_slot.clear()
    got = gradients(strategy_of(2, direct=False))
    # the first run's fills, of every slot (the plain ones, then the tied weight's two), then
    # per run and replica those of the tied weight's two slots
    assert by_slot == ([2, 2] * 2 + [2] * 4 if tied else [4, 4]), by_slot
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
