"""ReplicaContext (docs/design.md §3.5, §3.8.1-3): properties, all_reduce, all_gather and
merge_call."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from replicas import context, local, replica_id, strategy_of

import centralstore as cs

SUM, MEAN = cs.ReduceOp.SUM, cs.ReduceOp.MEAN


# -- properties --------------------------------------------------------------------------------


def test_properties() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:2", "CPU:1", "cpu:0"])
    out = local(strategy, strategy.run(context))
    assert [type(rc.replica_id_in_sync_group) for rc in out] == [int, int, int]
    assert [rc.replica_id_in_sync_group for rc in out] == [0, 1, 2]
    assert [rc.num_replicas_in_sync for rc in out] == [3, 3, 3]
    assert [rc.device for rc in out] == [
        torch.device("cpu", 2), torch.device("cpu", 1), torch.device("cpu", 0),
    ]
    assert all(isinstance(rc.device, torch.device) for rc in out)
    assert all(rc.strategy is strategy for rc in out)
    assert repr(out[1]) == (
        "ReplicaContext(replica_id_in_sync_group=1, num_replicas_in_sync=3, device=cpu:1)"
    )


def test_properties_of_the_default_replica_context() -> None:
    rc = context()
    assert rc.replica_id_in_sync_group == 0
    assert rc.num_replicas_in_sync == 1
    assert rc.device == torch.device("cpu", 0)
    assert rc.strategy is cs.get_strategy()


# -- all_reduce --------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "expected"), [(SUM, 6.0), (MEAN, 2.0), ("sum", 6.0)])
def test_all_reduce_gives_every_replica_the_result_in_its_own_tensor(
    op: Any, expected: float
) -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        value = torch.tensor(float(replica_id() + 1))
        result = context().all_reduce(op, value)
        return result, result.device, result is value

    results, devices, aliased = strategy.run(step)
    results = local(strategy, results)
    assert [float(t) for t in results] == [expected] * 3
    assert len({id(t) for t in results}) == 3
    assert len({t.data_ptr() for t in results}) == 3
    assert local(strategy, devices) == (torch.device("cpu"),) * 3
    assert aliased is False


def test_all_reduce_of_numbers_and_numpy_arrays_gives_tensors() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        r = replica_id()
        return context().all_reduce(SUM, {"n": r + 1, "f": 0.5, "a": np.array([r, 2 * r])})

    out = strategy.run(step)
    for replica_out in local(strategy, out):
        assert isinstance(replica_out["n"], torch.Tensor)
        assert replica_out["n"].dtype == torch.int64 and int(replica_out["n"]) == 3
        assert float(replica_out["f"]) == 1.0
        assert isinstance(replica_out["a"], torch.Tensor)
        assert replica_out["a"].tolist() == [1, 2]


def test_all_reduce_mean_of_integers_is_floating() -> None:
    out = strategy_of(2).run(lambda: context().all_reduce(MEAN, replica_id()))
    assert [t.dtype for t in out.values] == [torch.get_default_dtype()] * 2
    assert [float(t) for t in out.values] == [0.5, 0.5]


def test_all_reduce_of_nested_structures() -> None:
    strategy = strategy_of(2)
    Pair = namedtuple("Pair", "a b")

    def step() -> Any:
        r = float(replica_id())
        return context().all_reduce(
            MEAN, {"x": [torch.tensor([r, 1.0])], "p": Pair(torch.tensor(r), torch.ones(2, 2) * r)}
        )

    out = strategy.run(step)
    assert isinstance(out["p"], Pair) and isinstance(out["x"], list)
    for replica_out in local(strategy, out):
        assert replica_out["x"][0].tolist() == [0.5, 1.0]
        assert float(replica_out["p"].a) == 0.5
        assert replica_out["p"].b.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_all_reduce_with_different_shapes_raises() -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match=r"replica 0 has \(1,\) and replica 1 has \(2,\)"):
        strategy.run(lambda: context().all_reduce(SUM, torch.ones(replica_id() + 1)))


def test_all_reduce_with_different_structures_raises() -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match="same structure on every replica"):
        strategy.run(lambda: context().all_reduce(SUM, [1.0] * (replica_id() + 1)))


def test_all_reduce_with_a_bad_op_raises() -> None:
    with pytest.raises(ValueError, match="MAX"):
        strategy_of(2).run(lambda: context().all_reduce("MAX", 1.0))


def test_all_reduce_in_the_default_replica_context() -> None:
    tensor = torch.tensor([1.0, 2.0])
    assert context().all_reduce(SUM, tensor).tolist() == [1.0, 2.0]
    assert context().all_reduce("mean", 3).tolist() == 3.0
    assert context().all_gather(tensor, 0).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize(("op", "scale"), [(SUM, 1.0), (MEAN, None)])
def test_the_gradient_of_all_reduce(replicas: int, op: cs.ReduceOp, scale: float | None) -> None:
    """Replica r: x_r = w_r * c_r, y = all_reduce(op, x_r), (y * d_r).backward().

    Then w_r.grad = c_r * sum(d) for SUM and c_r * sum(d) / R for MEAN."""
    strategy = strategy_of(replicas)
    c = [2.0, 3.0, 5.0][:replicas]
    d = [7.0, 11.0, 13.0][:replicas]

    def step() -> Any:
        r = replica_id()
        w = torch.ones(2, requires_grad=True)
        y = context().all_reduce(op, w * c[r])
        (y * d[r]).sum().backward()
        return y.detach(), w.grad

    values, grads = strategy.run(step)
    factor = 1.0 if scale is not None else 1.0 / replicas
    for r, (value, grad) in enumerate(zip(local(strategy, values), local(strategy, grads),
                                          strict=True)):
        assert value.tolist() == pytest.approx([sum(c) * factor] * 2)
        assert grad.tolist() == pytest.approx([c[r] * sum(d) * factor] * 2)


def test_a_gradient_flows_through_several_outputs_of_one_all_reduce() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        r = replica_id()
        a = torch.tensor(1.0, requires_grad=True)
        b = torch.tensor(1.0, requires_grad=True)
        ya, yb = context().all_reduce(SUM, (a * (r + 1), b * (r + 2)))
        (ya * 10 + yb * (r + 1)).backward()
        return a.grad, b.grad

    a_grads, b_grads = strategy.run(step)
    assert [float(g) for g in local(strategy, a_grads)] == [20.0, 40.0]  # (r+1) * (10+10)
    assert [float(g) for g in local(strategy, b_grads)] == [6.0, 9.0]  # (r+2) * (1+2)


# -- all_gather --------------------------------------------------------------------------------


def test_all_gather_with_uneven_sizes() -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        r = replica_id()
        value = torch.full((r + 1, 2), float(r))
        return context().all_gather(value, 0)

    out = local(strategy, strategy.run(step))
    expected = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    assert [t.tolist() for t in out] == [expected] * 3
    assert len({t.data_ptr() for t in out}) == 3


def test_all_gather_along_a_negative_axis_of_a_structure() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        r = replica_id()
        return context().all_gather({"v": torch.full((1, r + 1), r)}, -1)

    out = strategy.run(step)
    assert [t.tolist() for t in local(strategy, out["v"])] == [[[0, 1, 1]], [[0, 1, 1]]]


def test_all_gather_of_scalars_raises() -> None:
    with pytest.raises(ValueError, match="scalar"):
        strategy_of(2).run(lambda: context().all_gather(torch.tensor(1.0), 0))


def test_the_gradient_of_all_gather() -> None:
    """Replica r gathers x_r = w_r * c_r (length r + 1) and backpropagates g * d_r; w_r.grad is
    c_r times its slice of sum(d)."""
    strategy = strategy_of(3)
    c = [2.0, 3.0, 5.0]
    d = [torch.arange(6.0), torch.ones(6), torch.full((6,), 10.0)]
    total = d[0] + d[1] + d[2]

    def step() -> Any:
        r = replica_id()
        w = torch.ones(r + 1, requires_grad=True)
        gathered = context().all_gather(w * c[r], 0)
        (gathered * d[r]).sum().backward()
        return w.grad

    grads = local(strategy, strategy.run(step))
    starts = [0, 1, 3]
    for r, grad in enumerate(grads):
        assert grad.tolist() == (c[r] * total[starts[r] : starts[r] + r + 1]).tolist()


# -- merge_call --------------------------------------------------------------------------------


def test_merge_call_runs_once_in_cross_replica_context_with_per_replica_args() -> None:
    strategy = strategy_of(3)
    calls: list[Any] = []
    shared = object()

    def merge(s: cs.Strategy, value: Any, same: object, *, key: Any) -> Any:
        calls.append((s, value, same, key, cs.in_cross_replica_context(), cs.get_strategy()))
        return "done"

    def step() -> Any:
        r = replica_id()
        return context().merge_call(merge, args=(r, shared), kwargs={"key": [r * 10]})

    assert strategy.run(step) == "done"
    assert len(calls) == 1
    s, value, same, key, cross, current = calls[0]
    assert s is strategy and current is strategy and cross is True
    assert isinstance(value, cs.PerReplica) and value.values == (0, 1, 2)
    assert same is shared
    assert isinstance(key, list) and key[0].values == (0, 10, 20)


def test_a_per_replica_result_gives_each_replica_its_component() -> None:
    strategy = strategy_of(3)

    def step() -> Any:
        out = context().merge_call(lambda s: {"r": cs.PerReplica(["a", "b", "c"]), "n": 1})
        return out["r"], out["n"]

    letters, number = strategy.run(step)
    assert letters.values == ("a", "b", "c")
    assert number == 1


def test_other_results_reach_every_replica_as_the_same_object() -> None:
    strategy = strategy_of(3)
    result = {"big": torch.ones(3)}
    out = strategy.run(lambda: context().merge_call(lambda s: result))
    assert out is result  # every replica returned the very same object


def test_merge_call_can_reduce_the_replicas_values() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        value = torch.tensor(float(replica_id() + 1))
        return context().merge_call(lambda s, v: s.reduce(SUM, v), args=(value,))

    assert float(strategy.run(step)) == 3.0


def test_merge_call_with_one_replica_passes_args_unwrapped() -> None:
    strategy = strategy_of(1)
    seen: list[Any] = []

    def step() -> Any:
        return context().merge_call(
            lambda s, v: seen.append(v) or cs.PerReplica([v + 1]), args=(1,)
        )

    assert strategy.run(step) == 2
    assert seen == [1]


def test_merge_call_in_the_default_replica_context() -> None:
    seen: list[Any] = []

    def merge(s: cs.Strategy, value: int) -> int:
        seen.append((s, cs.in_cross_replica_context(), cs.get_replica_context()))
        return value * 2

    assert context().merge_call(merge, args=(4,)) == 8
    assert seen == [(cs.get_strategy(), True, None)]
    assert not cs.in_cross_replica_context()


def test_an_error_in_merge_fn_is_raised_by_replica_zero() -> None:
    strategy = strategy_of(3)

    def merge(s: cs.Strategy) -> None:
        raise LookupError("in merge")

    with pytest.raises(LookupError, match="in merge") as info:
        strategy.run(lambda: context().merge_call(merge))
    assert info.value.__notes__ == ["(raised in replica 0 on device cpu:0)"]
    assert strategy.run(lambda: context().merge_call(lambda s: 5)) == 5


def test_merge_call_with_differing_argument_structures_raises() -> None:
    strategy = strategy_of(2)
    with pytest.raises(ValueError, match="same structure"):
        strategy.run(
            lambda: context().merge_call(lambda s, *a: None, args=(1,) * (replica_id() + 1))
        )


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_merge_call_is_a_sync_point_so_an_optimizer_step_inside_works(replicas: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    oracle = torch.nn.Linear(3, 1)
    initial = {k: v.clone() for k, v in oracle.state_dict().items()}
    torch.nn.functional.mse_loss(oracle(x), y).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()

    strategy = strategy_of(replicas)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> Any:
        (((model(xs) - ys) ** 2).sum() / len(x)).backward()
        context().merge_call(lambda s: optimizer.step())
        return model.weight.detach().clone()

    split = (lambda t: cs.PerReplica(list(t.chunk(replicas)))) if replicas > 1 else (lambda t: t)
    seen = strategy.run(step, args=(split(x), split(y)))
    torch.testing.assert_close(model.weight, oracle.weight)
    torch.testing.assert_close(model.bias, oracle.bias)
    for weight in local(strategy, seen):  # every replica reads the updated variable
        torch.testing.assert_close(weight, oracle.weight)
