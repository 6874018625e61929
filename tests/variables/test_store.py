"""Central variables: scope, replica views, gradient folding and aggregated writes."""

from __future__ import annotations

import copy
import gc
import io
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from paths import PATHS, run_on, strategy_on
from replicas import strategy_of
from torch import nn

import centralstore as cs

AGG = cs.VariableAggregation


def halves(x: torch.Tensor) -> cs.PerReplica[torch.Tensor]:
    size = -(-len(x) // 2)
    return cs.PerReplica([x[:size], x[size:]])


# -- scope -----------------------------------------------------------------------------------


def test_scope_registers_parameters_buffers_and_requires_grad_tensors() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(3)
        w = torch.zeros(2, requires_grad=True)
        plain = torch.zeros(2)
    created = strategy.extended.variable_created_in_scope
    assert created(bn.weight) and created(bn.running_mean) and created(bn.num_batches_tracked)
    assert created(w)
    assert not created(plain)
    assert not created(nn.Linear(1, 1).weight)  # built outside the scope
    assert not strategy_of(2).extended.variable_created_in_scope(bn.weight)


def test_variables_are_held_weakly() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        models = [nn.Linear(3, 3)]

    def step() -> None:
        models[0](torch.ones(1, 3)).sum().backward()

    strategy.run(step)
    assert len(strategy._store.records) == 2
    models.clear()
    gc.collect()
    assert strategy._store.records == {}
    assert all(not views.views for views in strategy._store.replicas)


def test_scope_places_factories_on_the_parameter_device() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:1", "cpu:2"], parameter_device="cpu:3")
    with strategy.scope():
        t = torch.zeros(2)
    assert t.device == torch.device("cpu")
    assert torch.get_default_device() == torch.device("cpu")


def test_explicit_device_in_scope_is_respected_and_still_central() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        v = torch.zeros(2, device="cpu", requires_grad=True)
    assert strategy.extended.variable_created_in_scope(v)


def test_variable_and_set_aggregation() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        v = cs.Variable([1.0, 2.0], aggregation="sum")
        frozen = cs.Variable(3, trainable=False)
        cs.set_aggregation(frozen, AGG.ONLY_FIRST_REPLICA)
    assert v.requires_grad and not frozen.requires_grad
    assert strategy._store.record(v).aggregation is AGG.SUM
    assert strategy._store.record(frozen).aggregation is AGG.ONLY_FIRST_REPLICA
    with pytest.raises(ValueError, match="not one"), strategy.scope():
        cs.set_aggregation(torch.zeros(1), AGG.SUM)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        AGG.parse("max")


def test_integer_variables_cannot_be_mean_aggregated() -> None:
    strategy = strategy_of(2)
    with strategy.scope(), pytest.raises(ValueError, match="cannot be MEAN"):
        cs.Variable(1, aggregation=AGG.MEAN, trainable=False)


# -- views -----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])
def test_no_parameter_copies_on_cpu(direct: bool) -> None:
    strategy = strategy_of(3, direct=direct)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pointers = {p.data_ptr() for p in model.parameters()}
    seen: list[set[int]] = []

    def step(x: torch.Tensor) -> None:
        seen.append({p.data_ptr() for p in model.parameters()})
        model(x).sum().backward()

    for _ in range(3):
        strategy.run(step, args=(cs.PerReplica([torch.ones(2, 4)] * 3),))
    assert all(s == pointers for s in seen)
    views = [v for r in strategy._store.replicas for v in r.views.values()]
    assert len(views) == (0 if direct else 3 * 4)  # direct: the replicas use the parameters
    assert {v.tensor.data_ptr() for v in views} <= pointers


def test_replicas_see_views_not_central_variables() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(2, 2)
    owners = strategy.run(lambda: strategy.extended.value_container(torch.mul(model.weight, 1)))
    assert all(o is not model.weight for o in owners)
    inside = strategy.run(lambda: torch.Tensor.detach(model.weight))
    assert all(t.data_ptr() == model.weight.data_ptr() for t in inside)


def test_in_place_write_on_parameter_is_routed_to_a_private_copy() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        w = cs.Variable([10.0], aggregation=AGG.MEAN)
    seen = []

    def step() -> None:
        replica = cs.get_replica_context().replica_id_in_sync_group
        with torch.no_grad():
            w.add_(replica + 1.0)
        seen.append(float(torch.mul(w, 1).detach()))  # the replica reads its own write

    strategy.run(step)
    assert seen == [11.0, 12.0]
    assert w.item() == 11.5


# -- the aggregation table of docs/design.md §3.6.5 -----------------------------------------------

WRITES = {
    "add_": lambda v, x: v.add_(x),
    "sub_": lambda v, x: v.sub_(x),
    "copy_": lambda v, x: v.copy_(torch.tensor(x)),
    "fill_": lambda v, x: v.fill_(x),
}
TABLE_R2 = {  # var = 10; replicas write 1 and 2
    ("add_", AGG.SUM): 13, ("add_", AGG.MEAN): 11.5, ("add_", AGG.ONLY_FIRST_REPLICA): 11,
    ("sub_", AGG.SUM): 7, ("sub_", AGG.MEAN): 8.5, ("sub_", AGG.ONLY_FIRST_REPLICA): 9,
    ("copy_", AGG.SUM): 3, ("copy_", AGG.MEAN): 1.5, ("copy_", AGG.ONLY_FIRST_REPLICA): 1,
    ("fill_", AGG.SUM): 3, ("fill_", AGG.MEAN): 1.5, ("fill_", AGG.ONLY_FIRST_REPLICA): 1,
}
TABLE_R3_ADD = {AGG.SUM: 16, AGG.MEAN: 12, AGG.ONLY_FIRST_REPLICA: 11}


def write_in_replicas(replicas: int, op: str, aggregation: AGG, trainable: bool) -> float:
    strategy = strategy_of(replicas)
    with strategy.scope():
        var = cs.Variable(10.0, aggregation=aggregation, trainable=trainable)

    def step() -> None:
        with torch.no_grad():
            WRITES[op](var, float(cs.get_replica_context().replica_id_in_sync_group + 1))

    strategy.run(step)
    return var.item()


@pytest.mark.parametrize("trainable", [True, False])
@pytest.mark.parametrize(("op", "aggregation"), list(TABLE_R2))
def test_aggregation_table_two_replicas(op: str, aggregation: AGG, trainable: bool) -> None:
    assert write_in_replicas(2, op, aggregation, trainable) == TABLE_R2[op, aggregation]


@pytest.mark.parametrize("aggregation", list(TABLE_R3_ADD))
def test_aggregation_three_replicas_adding(aggregation: AGG) -> None:
    assert write_in_replicas(3, "add_", aggregation, False) == TABLE_R3_ADD[aggregation]


@pytest.mark.parametrize("op", list(WRITES))
def test_aggregation_none_raises_in_the_writing_replica(op: str) -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        var = cs.Variable(10.0)

    def step() -> None:
        with torch.no_grad():
            WRITES[op](var, 1.0)

    with pytest.raises(ValueError, match="aggregation is NONE") as info:
        strategy.run(step)
    assert "replica 0" in str(info.value.__notes__)
    assert var.item() == 10.0


def test_mixed_assign_and_add_takes_final_values() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        var = cs.Variable(10.0, aggregation=AGG.SUM, trainable=False)

    def step() -> None:
        if cs.get_replica_context().replica_id_in_sync_group == 0:
            var.copy_(torch.tensor(1.0))
        else:
            var.add_(2.0)

    strategy.run(step)
    assert var.item() == 1.0 + 12.0


def test_single_replica_writes_apply_directly_whatever_the_aggregation() -> None:
    strategy = strategy_of(1)
    with strategy.scope():
        var = cs.Variable(10.0, trainable=False)
    strategy.run(lambda: var.add_(5.0))
    assert var.item() == 15.0


def test_cross_replica_writes_apply_directly() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        var = cs.Variable(10.0, trainable=False)
        var.add_(1.0)
    strategy.extended.update(var, lambda v: v.mul_(2.0))
    assert var.item() == 22.0


# -- BatchNorm ---------------------------------------------------------------------------------


def test_batch_norm_running_statistics_are_averaged() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        bn = nn.BatchNorm1d(2, momentum=0.5)
    torch.manual_seed(0)
    x = torch.randn(8, 2) * 3 + 1
    strategy.run(lambda b: bn(b).sum().backward(), args=(halves(x),))
    # Hand computation: each replica updates (1 - m) * old + m * batch statistic of its half.
    a, b = x[:4], x[4:]
    mean = 0.5 * (0.5 * 0 + 0.5 * a.mean(0)) + 0.5 * (0.5 * 0 + 0.5 * b.mean(0))
    var = 0.5 * (0.5 * 1 + 0.5 * a.var(0)) + 0.5 * (0.5 * 1 + 0.5 * b.var(0))
    torch.testing.assert_close(bn.running_mean, mean)
    torch.testing.assert_close(bn.running_var, var)
    assert bn.num_batches_tracked.item() == 1
    strategy.run(lambda b: bn(b), args=(halves(x),))
    assert bn.num_batches_tracked.item() == 2


# -- gradients ----------------------------------------------------------------------------------


def linear_model(strategy: cs.Strategy) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def test_gradients_are_summed_in_replica_order_and_added_to_existing() -> None:
    strategy = strategy_of(3)
    with strategy.scope():
        w = torch.ones(1, requires_grad=True)
    w.grad = torch.full((1,), 100.0)
    parts = cs.PerReplica([torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0])])
    strategy.run(lambda c: (w * c).sum().backward(), args=(parts,))
    assert w.grad.item() == 107.0


def test_gradient_accumulation_over_two_runs_equals_one_step_on_the_concatenation() -> None:
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    oracle, oracle_opt = linear_model(cs.OneDeviceStrategy("cpu"))
    nn.functional.mse_loss(oracle(x), y, reduction="sum").backward()
    oracle_opt.step()

    strategy = strategy_of(2)
    model, optimizer = linear_model(strategy)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        nn.functional.mse_loss(model(xs), ys, reduction="sum").backward()

    for part in (slice(0, 4), slice(4, 8)):
        strategy.run(step, args=(halves(x[part]), halves(y[part])))
    optimizer.step()
    torch.testing.assert_close(model.weight, oracle.weight)
    torch.testing.assert_close(model.bias, oracle.bias)


def test_clip_grad_norm_after_run_sees_folded_gradients() -> None:
    x = torch.randn(6, 3)
    strategy = strategy_of(2)
    model, _ = linear_model(strategy)
    strategy.run(lambda xs: model(xs).sum().backward(), args=(halves(x),))
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    oracle, _ = linear_model(cs.OneDeviceStrategy("cpu"))
    oracle(x).sum().backward()
    torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(oracle.parameters(), 1e9))


def test_backward_on_reduced_loss_outside_run_reaches_central_grad() -> None:
    x = torch.randn(6, 3)
    strategy = strategy_of(2)
    model, _ = linear_model(strategy)
    losses = strategy.run(lambda xs: model(xs).sum(), args=(halves(x),))
    assert model.weight.grad is None
    strategy.reduce("SUM", losses).backward()
    oracle, _ = linear_model(cs.OneDeviceStrategy("cpu"))
    oracle(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, oracle.weight.grad)
    torch.testing.assert_close(model.bias.grad, oracle.bias.grad)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])
def test_a_backward_through_a_kept_tensor_is_folded_at_the_next_run(direct: bool) -> None:
    x = torch.randn(6, 3)
    strategy = strategy_of(2, direct=direct)
    model, _ = linear_model(strategy)
    kept: list[torch.Tensor] = []
    strategy.run(lambda xs: kept.append(model(xs).sum()), args=(halves(x),))
    for loss in kept:  # not returned by run: with views, the gradients stay on them
        loss.backward()
    assert (model.weight.grad is not None) is direct  # used directly: in .grad at once
    strategy.run(lambda: None)  # its sync point takes what the views have
    oracle, _ = linear_model(cs.OneDeviceStrategy("cpu"))
    oracle(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, oracle.weight.grad)


def test_merge_call_optimizer_step_inside_the_step_function() -> None:
    x = torch.randn(6, 3)
    strategy = strategy_of(2)
    model, optimizer = linear_model(strategy)
    after: list[torch.Tensor] = []

    def step(xs: torch.Tensor) -> None:
        model(xs).sum().backward()
        cs.get_replica_context().merge_call(lambda s: optimizer.step())
        after.append(torch.mul(model.weight, 1).detach())

    strategy.run(step, args=(halves(x),))
    oracle, oracle_opt = linear_model(cs.OneDeviceStrategy("cpu"))
    oracle(x).sum().backward()
    oracle_opt.step()
    torch.testing.assert_close(model.weight, oracle.weight)
    for seen in after:  # replicas read the updated value after the merge
        torch.testing.assert_close(seen, oracle.weight.detach())


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_optimizer_step_inside_a_replica_raises(path: str, replicas: int) -> None:
    """Refused on every path, the one-replica short path included (a run has passed first),
    with the variables and their gradients as before the run; the step after it works."""
    strategy = strategy_on(path, replicas)
    model, optimizer = linear_model(strategy)
    x = cs.PerReplica([torch.ones(1, 3)] * replicas) if replicas > 1 else torch.ones(1, 3)

    def backward(xs: torch.Tensor) -> None:
        model(xs).sum().backward()

    def step(xs: torch.Tensor) -> None:
        backward(xs)
        optimizer.step()

    run_on(path, strategy, backward, (x,))
    grad, weight = model.weight.grad.clone(), model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="merge_call"):
        run_on(path, strategy, step, (x,))
    torch.testing.assert_close(model.weight.grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(model.weight.detach(), weight, rtol=0, atol=0)
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), weight - 0.1 * grad)


def test_autocast_bfloat16_inside_run() -> None:
    x = torch.randn(4, 3)
    strategy = strategy_of(2)
    model, _ = linear_model(strategy)

    def step(xs: torch.Tensor) -> torch.dtype:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xs)
        out.float().sum().backward()
        return out.dtype

    dtypes = strategy.run(step, args=(halves(x),))
    assert dtypes == torch.bfloat16
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32


# -- checkpoints -------------------------------------------------------------------------------


def test_checkpoint_moves_between_replica_counts() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(6, 3), torch.randn(6, 1)) for _ in range(6)]

    def train(strategy: cs.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
              steps: list) -> None:
        replicas = strategy.num_replicas_in_sync
        def step(a: torch.Tensor, b: torch.Tensor, global_batch: int) -> None:
            per_example = (model(a) - b).pow(2).sum(1)
            cs.compute_average_loss(per_example, global_batch_size=global_batch).backward()

        for x, y in steps:
            optimizer.zero_grad()
            size = -(-len(x) // replicas)
            xs = cs.PerReplica([x[i * size:(i + 1) * size] for i in range(replicas)])
            ys = cs.PerReplica([y[i * size:(i + 1) * size] for i in range(replicas)])
            strategy.run(step, args=(xs, ys, len(x)))
            optimizer.step()

    oracle_strategy = strategy_of(1)
    oracle, oracle_opt = linear_model(oracle_strategy)
    oracle_opt = torch.optim.Adam(oracle.parameters(), lr=0.05)
    train(oracle_strategy, oracle, oracle_opt, batches)

    two = strategy_of(2)
    model, _ = linear_model(two)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    train(two, model, optimizer, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)

    three = strategy_of(3)
    with three.scope():
        restored = nn.Linear(3, 1)
        restored.load_state_dict(checkpoint["model"])
        restored_opt = torch.optim.Adam(restored.parameters(), lr=0.05)
        restored_opt.load_state_dict(checkpoint["optimizer"])
    train(three, restored, restored_opt, batches[3:])
    torch.testing.assert_close(restored.weight, oracle.weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(restored.bias, oracle.bias, atol=1e-6, rtol=1e-5)


# -- extended and losses -------------------------------------------------------------------------


def test_extended_calls() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        v = cs.Variable([1.0, 2.0])
    parts = cs.PerReplica([torch.tensor(1.0), torch.tensor(3.0)])
    assert strategy.extended.reduce_to("SUM", parts, "cpu:0").item() == 4.0
    assert strategy.extended.reduce_to("MEAN", parts, v).item() == 2.0
    assert [t.item() for t in strategy.extended.batch_reduce_to("SUM", [(parts, v)] * 2)] == [4, 4]
    with pytest.raises(ValueError, match="destinations"):
        strategy.extended.reduce_to("SUM", parts, 3)
    with strategy.extended.colocate_vars_with(v):
        assert torch.zeros(1).device == v.device
    assert strategy.extended.value_container(v) is v
    with pytest.raises(RuntimeError, match="merge_call"):
        strategy.run(lambda: strategy.extended.update(v, lambda t: t))


def test_compute_average_loss() -> None:
    per_example = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert cs.compute_average_loss(per_example, global_batch_size=8).item() == 1.25
    weights = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert cs.compute_average_loss(per_example, weights, global_batch_size=4).item() == 1.0
    matrix = torch.ones(2, 3)
    assert cs.compute_average_loss(matrix, torch.tensor([1.0, 2.0]), 2).item() == 4.5
    assert cs.compute_average_loss(per_example).item() == 2.5  # default replica context: R = 1
    strategy = strategy_of(2)
    local = strategy.run(lambda x: cs.compute_average_loss(x), args=(halves(per_example),))
    assert [t.item() for t in local.values] == [0.75, 1.75]  # local sum / (2 * R)
    with strategy.scope(), pytest.raises(RuntimeError, match="global_batch_size"):
        cs.compute_average_loss(per_example)
    with pytest.raises(TypeError, match="must be an int"):
        cs.compute_average_loss(per_example, global_batch_size=2.0)  # type: ignore[arg-type]


def test_scale_regularization_loss() -> None:
    strategy = strategy_of(2)
    out = strategy.run(lambda: cs.scale_regularization_loss(torch.tensor([1.0, 3.0])))
    assert out.item() == 2.0 if not isinstance(out, cs.PerReplica) else out[0].item() == 2.0
    with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica"):
        cs.scale_regularization_loss(torch.tensor(1.0))


# -- isolation: a sync point folds only its own strategy's variables ---------------------------


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


# Initial weights drawn up front: threads share torch's global generator.
_INITIAL = {seed: (torch.manual_seed(seed), _model().state_dict())[1] for seed in (1, 2)}


def _train(strategy: cs.Strategy, seed: int, steps: int = 15) -> list[torch.Tensor]:
    with strategy.scope():
        model = _model()
        model.load_state_dict(_INITIAL[seed])
        # SGD, not Adam: Adam scales the rounding noise of a near-zero gradient (the bias
        # before BatchNorm) up to lr, and threads may round differently (intra-op threads).
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(steps, 8, 8, generator=torch.Generator().manual_seed(seed))

    def step(x: torch.Tensor) -> None:
        loss = model(x).pow(2).sum() / 8
        loss.backward()
        cs.get_replica_context().all_reduce("sum", loss.detach())  # the threaded path

    for x in data:
        optimizer.zero_grad()
        strategy.run(step, args=(halves(x),))
        optimizer.step()
    return [t.detach().clone() for t in model.state_dict().values()]


def test_two_strategies_in_two_threads_train_as_they_do_one_after_the_other() -> None:
    expected = [_train(strategy_of(2), seed) for seed in (1, 2)]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def train(seed: int) -> None:
        try:
            results[seed] = _train(strategy_of(2), seed)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for seed, reference in zip((1, 2), expected, strict=True):
        for got, want in zip(results[seed], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _blocked_run(
    strategy: cs.Strategy, step: Callable[[], None]
) -> tuple[threading.Thread, threading.Event, threading.Event, list[BaseException]]:
    """Start ``strategy.run(step)`` on a thread named 'trainer' and wait until replica 0 has
    run ``step`` and blocks; set the second event to let it finish."""
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def blocking() -> None:
        step()
        if cs.get_replica_context().replica_id_in_sync_group == 0:
            inside.set()
            release.wait(10)

    def target() -> None:
        try:
            strategy.run(blocking)
        except BaseException as error:  # reported by the test
            errors.append(error)

    thread = threading.Thread(target=target, name="trainer")
    thread.start()
    assert inside.wait(10)
    return thread, release, inside, errors


def test_one_strategy_used_by_two_threads_at_once_raises_naming_both() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        w = torch.ones(2, requires_grad=True)
        optimizer = torch.optim.SGD([w], lr=1.0)
    thread, release, _, errors = _blocked_run(strategy, lambda: w.sum().backward())
    me = threading.current_thread().name
    try:
        with pytest.raises(RuntimeError, match=f"Thread '{me}' called strategy.run.*'trainer'"):
            strategy.run(lambda: None)
        with pytest.raises(RuntimeError, match=f"Thread '{me}' called optimizer.step.*'trainer'"):
            optimizer.step()
    finally:
        release.set()
        thread.join()
    assert not errors
    assert w.grad is not None and w.grad.tolist() == [2.0, 2.0]  # exactly right, once
    optimizer.step()
    assert w.tolist() == [-1.0, -1.0]


def test_an_optimizer_step_syncs_only_the_strategies_that_own_its_parameters() -> None:
    busy, other = strategy_of(2), strategy_of(2)
    with busy.scope():
        w = torch.ones(2, requires_grad=True)
    with other.scope():
        v = torch.ones(2, requires_grad=True)
        optimizer = torch.optim.SGD([v], lr=1.0)
    thread, release, _, errors = _blocked_run(busy, lambda: (w * 3).sum().backward())
    try:
        other.run(lambda: v.sum().backward())
        optimizer.step()  # the busy strategy is mid-run on another thread: left alone
        assert w.grad is None
    finally:
        release.set()
        thread.join()
    assert not errors
    assert w.grad is not None and w.grad.tolist() == [6.0, 6.0]
    assert v.tolist() == [-1.0, -1.0]


# -- nothing leaks ---------------------------------------------------------------------------


def _step_once(strategy: cs.Strategy, replicas: int, views: bool) -> list[weakref.ref[Any]]:
    """Build a model and its optimizer in scope, step them once, drop them; weak references
    to them, a parameter, a running statistic and every replica view (``views``: whether
    the replicas see views)."""
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        optimizer = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        cs.get_replica_context().all_reduce("sum", 1.0)

    x = torch.randn(4, 4)
    strategy.run(step, args=(halves(x) if replicas == 2 else x,))
    optimizer.step()
    seen = [view for r in strategy._store.replicas for view in r.views.values()]
    assert bool(seen) == views
    return [
        weakref.ref(o)
        for o in (model, optimizer, model[0].weight, model[1].running_mean, *seen)
    ]


@pytest.mark.parametrize(("replicas", "direct"), [(1, True), (2, True), (2, False)])
def test_dropped_models_optimizers_and_strategies_are_freed(replicas: int, direct: bool) -> None:
    strategy = strategy_of(replicas, direct=direct)
    refs = _step_once(strategy, replicas, views=not direct)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    strategy_ref, store_ref = weakref.ref(strategy), weakref.ref(strategy._store)
    del strategy
    gc.collect()
    assert strategy_ref() is None and store_ref() is None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_stays_flat_over_many_dropped_models() -> None:
    strategy = strategy_of(2)
    x = halves(torch.randn(8, 1024))

    def one_model() -> None:
        with strategy.scope():
            model = nn.Linear(1024, 1024)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        strategy.run(lambda x: model(x).sum().backward(), args=(x,))
        optimizer.step()

    for _ in range(5):  # the allocator's working set
        one_model()
    gc.collect()
    start = _rss_bytes()
    for _ in range(40):
        one_model()
    gc.collect()
    weights = 40 * (1024 * 1024 + 1024) * 4
    # A tensor of a model's size kept per step would add all of ``weights``; the allocator
    # alone moves the resident size by some 20 MB on a busy machine (CI once read 21 MB).
    assert _rss_bytes() - start < 0.5 * weights


def test_a_variable_created_inside_run_is_replica_local() -> None:
    strategy = strategy_of(2)

    def step() -> torch.Tensor:
        v = cs.Variable(1.0, aggregation="SUM")
        assert not strategy.extended.variable_created_in_scope(v)
        return v

    out = strategy.run(step)
    assert all(not strategy.extended.variable_created_in_scope(v) for v in out.values)
    assert strategy._store.records == {}
    assert [v.item() for v in out.values] == [1.0, 1.0]


def test_an_augmented_assignment_inside_run_keeps_the_module_bound_to_the_variable() -> None:
    class Total(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(()))
            cs.set_aggregation(self.total, "SUM")

        def forward(self, x: torch.Tensor) -> None:
            self.total += x.sum()

    strategy = strategy_of(2)
    with strategy.scope():
        total = Total()
    strategy.run(total, args=(halves(torch.arange(4.0)),))
    assert strategy.extended.variable_created_in_scope(total.total)
    assert total.total.item() == 6.0


def test_modules_deep_copied_in_scope_are_central_too() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # deep copies
        norms = nn.ModuleList(copy.deepcopy(nn.BatchNorm1d(3)) for _ in range(2))
    created = strategy.extended.variable_created_in_scope
    assert all(created(p) for p in encoder.parameters())
    assert all(created(b) for b in norms.buffers())
    assert strategy._store.record(norms[0].running_mean).aggregation is AGG.MEAN


def test_an_optimizer_step_stamps_frozen_variables_only_where_views_exist() -> None:
    """A fused optimizer changes a frozen parameter that has a ``.grad`` without moving its
    version counter: views that exist refresh by its stamp, and while no replica holds a
    view (replicas that use the variables themselves) nothing needs stamping, since a view
    made later copies the value then."""
    from replicas import see_views

    strategy = strategy_of(2)
    with strategy.scope():
        model = nn.Linear(3, 1, bias=False)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5, fused=True)
    store = strategy._store
    record = store.records[id(model.weight)]
    model.weight.requires_grad_(False)  # frozen, yet given a gradient: Adam steps it
    model.weight.grad = torch.ones_like(model.weight)
    strategy.run(lambda: None)
    assert not store.viewed()
    optimizer.step()
    assert record.stamp == 0  # no views: nothing stamped
    see_views(strategy)  # from here on the replicas see views, made afresh
    seen = strategy.experimental_local_results(strategy.run(lambda: model.weight.clone()))
    assert store.viewed()
    for value in seen:
        torch.testing.assert_close(value, model.weight.detach())
    model.weight.grad = torch.ones_like(model.weight)
    before = model.weight.detach().clone()
    optimizer.step()
    assert record.stamp == 1  # views exist: they refresh before their next use
    seen = strategy.experimental_local_results(strategy.run(lambda: model.weight.clone()))
    for value in seen:
        assert not torch.equal(value, before)
        torch.testing.assert_close(value, model.weight.detach())


_POST_HOOK_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks as post_hooks
from replicas import see_views
import centralstore as cs

def trained(strategy):
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
        optimizer.step()
    return strategy

kept = [trained(cs.CentralStorageStrategy(devices)) for devices in (["cpu:0"], ["cpu:0", "cpu:1"])]
print(len(post_hooks))
viewing = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
see_views(viewing)
kept.append(trained(viewing))
print(len(post_hooks))
del kept, viewing
import gc; gc.collect()
print(len(post_hooks))
"""


def test_optimizer_steps_pay_no_post_hook_until_some_replica_holds_views() -> None:
    """(The post-hook stamps frozen variables for views; replicas that use the variables
    themselves make none, so a process whose replicas all do has no post-hook. It is
    counted in a process of its own: the suite's other strategies live in this one.)"""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _POST_HOOK_SCRIPT, str(tests)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "0"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("replicas", [1, 2])
def test_fold_hooks_fold_once_at_the_next_sync_point_only(
    replicas: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(A metric gives the store its fold hook at each update inside a replica. The next
    sync point calls each hook once, however often it was given, and drops it: a later run
    that updates nothing calls none and leaves the store settled, and optimizer steps skip
    the sync point. A run whose replicas use the variables themselves keeps the short sync
    point when it gave hooks. A failed run calls its hooks with ``discard``.)"""
    strategy = strategy_on(path, replicas)
    with strategy.scope():
        layer = nn.Linear(2, 1)
    store = strategy._store
    calls: list[tuple[str, bool]] = []
    closed: list[bool] = []  # what each short path's sync point did (False: the general one)
    close_alone = store.close_alone
    monkeypatch.setattr(store, "close_alone", lambda: closed.append(close_alone()) or closed[-1])

    class Hook:
        def __init__(self, name: str) -> None:
            self.name = name

        def fold(self, discard: bool) -> None:
            calls.append((self.name, discard))

    hooks = [Hook("first"), Hook("second")]

    def step(fail: bool = False) -> None:
        for hook in (*hooks, hooks[0]):
            store.fold_later(hook)
        layer(torch.ones(2)).sum().backward()
        if fail:
            raise ValueError("the step failed")

    for _ in range(2):  # the first run on the general path, the next (R = 1) on the short one
        run_on(path, strategy, step)
        assert sorted(calls) == [("first", False), ("second", False)]
        assert store.fold_hooks == {}
        calls.clear()
    # (the replicas on views of R = 2 fold at the general sync point, every run)
    assert closed == ([] if (replicas, path) == (2, "views") else [True, True])
    run_on(path, strategy, lambda: None)
    assert calls == [] and store.settled()
    with pytest.raises(ValueError, match="the step failed"):
        run_on(path, strategy, step, args=(True,))
    assert sorted(calls) == [("first", True), ("second", True)]
    assert store.fold_hooks == {} and store.settled()
