"""reduce, gather and local results (docs/design.md 3.4, 3.8.3-4), against literal tables."""

from __future__ import annotations

import contextlib
import math
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import centralstore as cs
from centralstore._reduce import ReduceOp, element_count, mean_dtype, mean_of

SUM, MEAN = cs.ReduceOp.SUM, cs.ReduceOp.MEAN


def strategy_of(replicas: int) -> cs.CentralStorageStrategy:
    return cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])


def per_replica(*components: Any) -> cs.PerReplica[torch.Tensor]:
    return cs.PerReplica([torch.tensor(c, dtype=torch.float32) for c in components])


def same(actual: Any, expected: Any) -> None:
    """Equal in value, dtype and shape (nan equal to nan)."""
    expected = torch.as_tensor(expected)
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=1e-6)


# -- ReduceOp ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_op", "expected"),
    [
        (SUM, SUM), (MEAN, MEAN), ("SUM", SUM), ("sum", SUM), ("Sum", SUM), ("MEAN", MEAN),
        ("mean", MEAN), ("mEaN", MEAN),
    ],
)
def test_reduce_op_parsing(given_op: Any, expected: ReduceOp) -> None:
    assert ReduceOp.parse(given_op) is expected
    strategy = strategy_of(2)
    value = per_replica([1.0], [3.0])
    same(strategy.reduce(given_op, value), [4.0] if expected is SUM else [2.0])


@pytest.mark.parametrize(
    "bad", ["MAX", "min", "", " sum", 0, 1, None, cs.VariableAggregation.SUM,
            cs.VariableAggregation.MEAN, "ReduceOp.SUM"],
)
def test_anything_else_raises_listing_sum_and_mean(bad: Any) -> None:
    with pytest.raises(ValueError, match="SUM") as info:
        ReduceOp.parse(bad)
    assert "MEAN" in str(info.value)
    assert f"reduce_op={bad!r}" in str(info.value)
    with pytest.raises(ValueError, match="MEAN"):
        strategy_of(2).reduce(bad, per_replica([1.0], [2.0]))


def test_reduce_op_members() -> None:
    assert [op.name for op in cs.ReduceOp] == ["SUM", "MEAN"]
    assert cs.ReduceOp is ReduceOp


# -- the tables of 3.4 -------------------------------------------------------------------------

uneven = per_replica([0.0, 1, 2, 3], [4.0, 5])


@pytest.mark.parametrize(
    ("components", "op", "axis", "expected"),
    [
        ((([0.0, 1, 2, 3]), [4.0, 5]), SUM, 0, 15.0),
        ((([0.0, 1, 2, 3]), [4.0, 5]), MEAN, 0, 2.5),
        ((([0.0, 1, 2, 3]), [4.0, 5]), SUM, -1, 15.0),
        ((([0.0, 1, 2, 3]), [4.0, 5]), MEAN, (0,), 2.5),
        (([5.0], []), MEAN, 0, 5.0),
        (([5.0], []), SUM, 0, 5.0),
        (([], []), MEAN, 0, math.nan),
        (([], []), SUM, 0, 0.0),
        ((1.0, 2.0, 4.0), SUM, None, 7.0),
        ((1.0, 2.0, 4.0), MEAN, None, 7.0 / 3),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), SUM, 0, [9.0, 12]),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), MEAN, 0, [3.0, 4]),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), SUM, (0, 1), 21.0),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), MEAN, (-2, -1), 3.5),
        (([[1.0, 2], [3, 4]], [[5.0, 6], [7, 8]]), MEAN, 1, [3.5, 5.5]),
        (([[1.0, 2], [3, 4]], [[5.0, 6], [7, 8]]), MEAN, None, [[3.0, 4], [5, 6]]),
        (([[1.0, 2]], [[5.0, 6]]), MEAN, (), [[3.0, 4]]),
        (([[1.0, 2]], [[5.0, 6]]), SUM, [], [[6.0, 8]]),
    ],
)
def test_reduce_table(components: Any, op: ReduceOp, axis: Any, expected: Any) -> None:
    strategy = strategy_of(len(components))
    same(strategy.reduce(op, per_replica(*components), axis=axis), expected)


@pytest.mark.parametrize("op", [SUM, MEAN])
def test_axis_none_with_different_shapes_raises_naming_them(op: ReduceOp) -> None:
    with pytest.raises(ValueError, match=r"replica 0 has \(4,\) and replica 1 has \(2,\)"):
        strategy_of(2).reduce(op, uneven)


def test_with_an_axis_the_per_replica_sums_must_agree() -> None:
    value = per_replica([[1.0, 2]], [[1.0, 2, 3]])
    with pytest.raises(ValueError, match=r"axis=0.*\(2,\).*\(3,\)"):
        strategy_of(2).reduce(SUM, value, axis=0)


def test_a_plain_tensor() -> None:
    strategy = strategy_of(2)
    tensor = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="ambiguous") as info:
        strategy.reduce(SUM, tensor)
    assert "2 replicas" in str(info.value)
    assert strategy.reduce(MEAN, tensor) is tensor
    same(strategy.reduce(SUM, tensor, axis=0), 6.0)
    same(strategy.reduce(MEAN, tensor, axis=0), 1.5)
    same(strategy.reduce(SUM, np.array([1.0, 2.0]), axis=0), torch.tensor(6.0, dtype=torch.float64))
    same(strategy_of(3).reduce(SUM, torch.tensor([[1.0, 2.0]]), axis=(0, 1)), 9.0)


def test_one_replica_sum_of_a_plain_value_returns_it_unchanged() -> None:
    tensor = torch.ones(3)
    assert strategy_of(1).reduce(SUM, tensor) is tensor
    assert strategy_of(1).reduce(MEAN, tensor) is tensor
    marker = object()
    assert cs.OneDeviceStrategy("cpu").reduce("sum", marker) is marker


def test_a_plain_tensor_that_reduces_to_itself_skips_the_structure_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``run`` returns with one replica, reduced at every step of a loop written for
    any number of replicas, comes back without walking it as a structure (about 10 us
    right after a forward); every other plain value still takes the walk."""
    from centralstore import _tree

    def walk(value: Any) -> Any:
        raise AssertionError("walked")

    monkeypatch.setattr(_tree, "flatten", walk)
    tensor = torch.ones(3)
    assert strategy_of(1).reduce(SUM, tensor) is tensor
    assert strategy_of(2).reduce(MEAN, tensor) is tensor
    for strategy, op, value, axis in [
        (strategy_of(1), SUM, tensor, 0),
        (strategy_of(1), SUM, torch.nn.Parameter(tensor), None),
        (strategy_of(1), SUM, [tensor], None),
        (strategy_of(2), SUM, tensor, None),
    ]:
        with pytest.raises(AssertionError, match="walked"):
            strategy.reduce(op, value, axis=axis)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("axis", [None, 0])
def test_mean_of_integers_is_the_default_float_dtype(dtype: torch.dtype, axis: Any) -> None:
    value = cs.PerReplica([torch.tensor([1, 0], dtype=dtype), torch.tensor([0, 0], dtype=dtype)])
    result = strategy_of(2).reduce(MEAN, value, axis=axis)
    assert result.dtype == torch.get_default_dtype()
    same(result, [0.5, 0.0] if axis is None else 0.25)


def test_mean_of_integers_follows_the_default_dtype() -> None:
    value = cs.PerReplica([torch.tensor(1), torch.tensor(2)])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        same(strategy_of(2).reduce(MEAN, value), torch.tensor(1.5, dtype=torch.float64))
    finally:
        torch.set_default_dtype(previous)


def test_sum_of_integers_stays_integer() -> None:
    value = cs.PerReplica([torch.tensor([1, 2]), torch.tensor([3, 4])])
    same(strategy_of(2).reduce(SUM, value), torch.tensor([4, 6]))


@pytest.mark.parametrize("op", [SUM, MEAN])
def test_components_add_in_replica_order_whatever_their_form(op: ReduceOp) -> None:
    # float32: (1 + 1e8) - 1e8 is 0, (-1e8 + 1e8) + 1 is 1: tensors, numpy numbers, tensor
    # subclasses and a mix of them all add in replica order
    values = [1.0, 1e8, -1e8]
    forms: list[list[Any]] = [
        [torch.tensor(v) for v in values],
        [np.float32(v) for v in values],
        [torch.nn.Parameter(torch.tensor(v), requires_grad=False) for v in values],
        [torch.tensor(values[0]), np.float32(values[1]), torch.tensor(values[2])],
    ]
    strategy = strategy_of(3)
    for components in forms:
        same(strategy.reduce(op, cs.PerReplica(components)), 0.0)


@pytest.mark.parametrize(
    ("components", "axis", "match"),
    [
        ((1.0, 2.0), 0, r"replica 0 with shape \(\)"),
        (([1.0], 2.0), 0, r"replica 1 with shape \(\)"),
        (([1.0], [2.0]), 1, r"axis 1 is out of range"),
        (([1.0], [2.0]), -2, r"axis -2 is out of range"),
        (([[1.0]], [2.0]), (0, 1), r"replica 1 with shape \(1,\)"),
        (([[1.0]], [[2.0]]), (0, -2), r"names the same dimension twice"),
    ],
)
def test_axis_errors(components: Any, axis: Any, match: str) -> None:
    value = per_replica(*components)
    for op in (SUM, MEAN):
        with pytest.raises(ValueError, match=match):
            strategy_of(2).reduce(op, value, axis=axis)


def test_axis_errors_for_a_plain_scalar() -> None:
    with pytest.raises(ValueError, match="out of range"):
        strategy_of(2).reduce(SUM, torch.tensor(1.0), axis=0)


def test_nested_structures_are_reduced_leaf_by_leaf() -> None:
    strategy = strategy_of(2)
    Pair = namedtuple("Pair", "a b")
    value = {
        "x": per_replica(1.0, 2.0),
        "y": [Pair(per_replica([1.0, 2], [3.0]), torch.tensor([4.0]))],
    }
    reduced = strategy.reduce(MEAN, {"x": value["x"], "p": Pair(value["x"], "plain")})
    assert set(reduced) == {"x", "p"} and isinstance(reduced["p"], Pair)
    same(reduced["x"], 1.5)
    same(reduced["p"].a, 1.5)
    assert reduced["p"].b == "plain"  # MEAN of a plain value returns it
    summed = strategy.reduce(SUM, value["y"], axis=0)
    same(summed[0].a, 6.0)
    same(summed[0].b, 8.0)  # a plain tensor counts once per replica with an axis


def test_the_result_lands_on_the_cpu_or_the_current_device_context() -> None:
    strategy = strategy_of(2)
    value = cs.PerReplica([torch.ones(2), torch.ones(2)])
    assert strategy.reduce(SUM, value).device == torch.device("cpu")
    assert strategy.gather(value, 0).device == torch.device("cpu")
    with torch.device("meta"):
        assert strategy.reduce(SUM, value).device == torch.device("meta")
        assert strategy.reduce(MEAN, value, axis=0).device == torch.device("meta")
        assert strategy.gather(value, 0).device == torch.device("meta")


def test_reduce_keeps_the_autograd_graph() -> None:
    strategy = strategy_of(2)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    value = cs.PerReplica([w * 2, w[:1] * 3])
    strategy.reduce(MEAN, value, axis=0).backward()
    # mean over 3 elements of [2w0, 2w1, 3w0]
    same(w.grad, [5.0 / 3, 2.0 / 3])
    w.grad = None
    strategy.reduce(SUM, cs.PerReplica([w * 2, w * 3])).sum().backward()
    same(w.grad, [5.0, 5.0])


def general_calls(
    strategy: cs.CentralStorageStrategy, name: str, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """The calls that reach the general path of ``strategy``'s ``name`` (``reduce`` or
    ``gather`` of its workers), recorded while they go on to it."""
    calls: list[Any] = []
    general = getattr(type(strategy._workers), name)

    def counted(*args: Any) -> Any:
        calls.append(args)
        return general(*args)

    monkeypatch.setattr(type(strategy._workers), name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("op", [SUM, MEAN])
def test_alike_tensors_skip_the_general_path_with_the_same_bits(
    dtype: torch.dtype, op: ReduceOp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain tensors of one dtype and shape on the result's device add up in replica order
    without the general path (``added_alike``), to the bits it gives; anything else still
    takes it."""
    generator = torch.Generator().manual_seed(0)
    parts = [(torch.randn(5, 3, generator=generator) * 100).to(dtype) for _ in range(3)]
    value = cs.PerReplica(parts)
    strategy = strategy_of(3)
    expected = strategy._workers.reduce(op, [parts], None, torch.device("cpu"))[0]
    general = general_calls(strategy, "reduce", monkeypatch)
    result = strategy.reduce(op, value, axis=None)
    assert result.dtype == expected.dtype and torch.equal(result, expected)
    assert general == []
    for other in (  # a bool, a subclass, another shape or dtype, a number: the general path
        [part.bool() for part in parts],
        [torch.nn.Parameter(part.double()) for part in parts],
        [parts[0], parts[1], parts[2].reshape(3, 5)],
        [*parts[:2], parts[2].to(torch.int64 if dtype.is_floating_point else torch.float32)],
        [1, parts[1], parts[2]],
    ):
        general.clear()
        with contextlib.suppress(ValueError, TypeError):  # (different dtypes raise there)
            strategy.reduce(op, cs.PerReplica(other), axis=None)
        assert len(general) == 1


def test_reduce_accepts_numbers_and_numpy_components() -> None:
    value = cs.PerReplica([1, np.array(2), torch.tensor(3)])
    same(strategy_of(3).reduce(SUM, value), torch.tensor(6))
    same(strategy_of(2).reduce(MEAN, cs.PerReplica([1, 2])), 1.5)
    same(strategy_of(2).reduce(SUM, cs.PerReplica([np.float64(1.5), np.array(2.0)])),
         torch.tensor(3.5, dtype=torch.float64))


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["x", "0", 0.0, 1.5, True, (0, "a"), (0.0,), (True,), {0},
                                  torch.tensor(0)])
def test_an_axis_of_the_wrong_type_raises_type_error(axis: Any) -> None:
    strategy = strategy_of(2)
    value = per_replica([1.0, 2.0], [3.0])
    for reduced in (value, {"a": value}, torch.ones(2)):  # the fast path, a nest, a plain value
        for op in (SUM, MEAN):
            with pytest.raises(TypeError, match=r"strategy\.reduce\(axis=\.\.\.\)") as info:
                strategy.reduce(op, reduced, axis=axis)
            assert str(info.value).endswith(f"Received: axis={axis!r}")
            assert "tuple of ints" in str(info.value)


@pytest.mark.parametrize("axis", [None, "0", 0.0, True, (0,), [0]])
def test_a_gather_axis_that_is_not_an_int_raises_type_error(axis: Any) -> None:
    with pytest.raises(TypeError, match=r"strategy\.gather\(axis=\.\.\.\) must be an int") as info:
        strategy_of(2).gather(per_replica([1.0], [2.0, 3.0]), axis)
    assert str(info.value).endswith(f"Received: axis={axis!r}")


def test_numpy_integer_axes_are_accepted() -> None:
    value = per_replica([[1.0, 2.0]], [[3.0, 4.0]])
    same(strategy_of(2).reduce(SUM, value, axis=np.int64(1)), [10.0])  # type: ignore[arg-type]
    same(strategy_of(2).reduce(MEAN, value, axis=(np.int32(0), -1)), 2.5)  # type: ignore[arg-type]
    same(strategy_of(2).gather(value, np.int64(-1)), [[1.0, 2.0, 3.0, 4.0]])  # type: ignore[arg-type]


@pytest.mark.parametrize("components", [("a", "b"), (torch.ones(1), "b"), (None, None),
                                        (np.array(["a"]), np.array(["b"])), (object(), 1)])
def test_reducing_values_without_a_tensor_form_raises_type_error(components: Any) -> None:
    bad = next(i for i, c in enumerate(components) if not isinstance(c, torch.Tensor))
    kind = type(components[bad]).__name__
    for op in (SUM, MEAN):
        for axis in (None, 0):
            with pytest.raises(TypeError, match="strategy.reduce takes tensors, numpy arrays or "
                               f"numbers, but the value of replica {bad} is a {kind}"):
                strategy_of(2).reduce(op, cs.PerReplica(components), axis=axis)
    with pytest.raises(TypeError, match=rf"strategy\.gather takes tensors.*replica {bad}"):
        strategy_of(2).gather(cs.PerReplica(components), 0)
    with pytest.raises(TypeError, match=r"strategy\.reduce takes tensors.*got a str"):
        strategy_of(2).reduce(SUM, "text", axis=0)


dtypes = [torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.bool, torch.complex64]


@settings(max_examples=40, deadline=None, database=None)
@given(chosen=st.lists(st.sampled_from(dtypes), min_size=2, max_size=4),
       op=st.sampled_from([SUM, MEAN]), axis=st.sampled_from([None, 0]))
def test_replicas_of_different_dtypes_raise_naming_each(
    chosen: list[torch.dtype], op: ReduceOp, axis: Any
) -> None:
    value = cs.PerReplica([torch.ones(2, dtype=d) for d in chosen])
    strategy = strategy_of(len(chosen))
    if len(set(chosen)) == 1:
        assert strategy.reduce(op, value, axis=axis).shape == ((2,) if axis is None else ())
        return
    with pytest.raises(ValueError, match="same dtype") as info:
        strategy.reduce(op, value, axis=axis)
    listing = ", ".join(f"replica {r}: {d}" for r, d in enumerate(chosen))
    assert f"({listing})" in str(info.value)


def test_int64_and_float32_replicas_raise_instead_of_promoting() -> None:
    value = cs.PerReplica([torch.tensor([1]), torch.tensor([1.5])])
    with pytest.raises(ValueError, match=r"replica 0: torch.int64, replica 1: torch.float32"):
        strategy_of(2).reduce(SUM, value)
    with pytest.raises(ValueError, match="same dtype"):
        strategy_of(2).reduce(MEAN, cs.PerReplica([1, 2.5]))


def test_all_reduce_of_different_dtypes_raises() -> None:
    strategy = strategy_of(2)

    def step() -> Any:
        replica = cs.get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
        return cs.get_replica_context().all_reduce(  # type: ignore[union-attr]
            SUM, torch.tensor([1]) if replica == 0 else torch.tensor([1.0])
        )

    with pytest.raises(ValueError, match=r"replica 0: torch.int64, replica 1: torch.float32"):
        strategy.run(step)


@pytest.mark.parametrize("axis", [None, 0])
def test_bools_add_as_integers(axis: Any) -> None:
    value = cs.PerReplica([torch.tensor([True, True]), torch.tensor([True, False])])
    strategy = strategy_of(2)
    same(strategy.reduce(MEAN, value, axis=axis), [1.0, 0.5] if axis is None else 0.75)
    same(strategy.reduce(SUM, value, axis=axis), torch.tensor([2, 1] if axis is None else 3))


# -- gather ------------------------------------------------------------------------------------


def test_gather_concatenates_along_the_axis_with_uneven_and_empty_components() -> None:
    strategy = strategy_of(3)
    value = cs.PerReplica([torch.tensor([[1, 2]]), torch.zeros(0, 2, dtype=torch.int64),
                           torch.tensor([[3, 4], [5, 6]])])
    same(strategy.gather(value, 0), [[1, 2], [3, 4], [5, 6]])
    columns = cs.PerReplica([torch.tensor([[1], [2]]), torch.tensor([[3, 4], [5, 6]])])
    same(strategy_of(2).gather(columns, 1), [[1, 3, 4], [2, 5, 6]])
    same(strategy_of(2).gather(columns, -1), [[1, 3, 4], [2, 5, 6]])
    empty = cs.PerReplica([torch.zeros(0), torch.zeros(0)])
    assert strategy_of(2).gather(empty, 0).shape == (0,)


@pytest.mark.parametrize(
    ("components", "axis", "match"),
    [
        ((torch.tensor(1.0), torch.tensor(2.0)), 0, "replica 0 gave a scalar"),
        ((torch.ones(1), torch.tensor(2.0)), 0, "replica 1 gave a scalar"),
        ((torch.ones(1, 2), torch.ones(2)), 0, r"equal rank.*\(1, 2\).*\(2,\)"),
        # (torch.cat would skip an empty vector beside matrices: the rank check comes first)
        ((torch.ones(1, 2), torch.zeros(0)), 0, r"equal rank.*\(1, 2\).*\(0,\)"),
        ((torch.ones(1, 2), torch.ones(1, 3)), 0, r"equal sizes on the other axes"),
        ((torch.ones(1, 2), torch.ones(1, 2)), 2, "out of range"),
        ((torch.ones(1, 2), torch.ones(1, 2)), -3, "out of range"),
    ],
)
def test_gather_errors(components: Any, axis: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        strategy_of(2).gather(cs.PerReplica(components), axis)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_of_tensors_alike_skips_the_general_path_with_the_same_result(
    axis: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain tensors of one rank on the result's device are concatenated without the
    general path (``concatenated_alike``), as it concatenates them; anything else, and
    components ``torch.cat`` refuses, still take it, which names what differs."""
    generator = torch.Generator().manual_seed(0)
    sizes = [(2, 3), (1, 3), (4, 3)] if axis == 0 else [(2, 1), (2, 3), (2, 2)]
    parts = [torch.randn(*size, generator=generator) for size in sizes]
    parts[1] = parts[1].double()  # (torch.cat promotes, on either path)
    strategy = strategy_of(3)
    expected = strategy._workers.gather([parts], axis, torch.device("cpu"))[0][0]
    general = general_calls(strategy, "gather", monkeypatch)
    result = strategy.gather(cs.PerReplica(parts), axis=axis)
    assert result.dtype == expected.dtype and torch.equal(result, expected)
    assert general == []
    for other, error in (
        ([torch.tensor(1.0)] * 3, "at least one dimension"),
        ([parts[0], parts[1], parts[2].reshape(-1)], "equal rank"),
        ([parts[0], parts[1], torch.ones(5, 5)], "equal sizes on the other axes"),
        ([torch.nn.Parameter(part) for part in parts], None),
        ([np.ones(sizes[0]), parts[1], parts[2]], None),
    ):
        general.clear()
        if error is None:
            strategy.gather(cs.PerReplica(other), axis=axis)
        else:
            with pytest.raises(ValueError, match=error):
                strategy.gather(cs.PerReplica(other), axis=axis)
        assert len(general) == 1


def test_gather_returns_a_plain_value_unchanged_and_walks_structures() -> None:
    strategy = strategy_of(2)
    tensor = torch.ones(2)
    assert strategy.gather(tensor, 0) is tensor
    out = strategy.gather({"a": cs.PerReplica([torch.ones(1), torch.zeros(2)]), "b": tensor}, 0)
    same(out["a"], [1.0, 0.0, 0.0])
    assert out["b"] is tensor


def test_gather_keeps_the_autograd_graph() -> None:
    w = torch.ones(2, requires_grad=True)
    out = strategy_of(2).gather(cs.PerReplica([w * 2, w[:1] * 3]), 0)
    (out * torch.tensor([1.0, 10.0, 100.0])).sum().backward()
    same(w.grad, [302.0, 20.0])


# -- local results and values from a function --------------------------------------------------


def test_experimental_local_results() -> None:
    strategy = strategy_of(2)
    a, b = torch.ones(1), torch.zeros(1)
    assert strategy.experimental_local_results(cs.PerReplica([a, b])) == (a, b)
    assert strategy.experimental_local_results(a)[0] is a
    assert len(strategy.experimental_local_results(a)) == 1
    assert strategy.experimental_local_results(None) == (None,)
    assert strategy.experimental_local_results(3) == (3,)
    nested = {"x": cs.PerReplica([1, 2]), "y": [a, cs.PerReplica(["p", "q"])]}
    first, second = strategy.experimental_local_results(nested)
    assert first == {"x": 1, "y": [a, "p"]}
    assert second == {"x": 2, "y": [a, "q"]}
    assert first["y"][0] is a and second["y"][0] is a


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_local_results_of_a_nest_without_per_replica_give_one_copy_per_replica(
    replicas: int,
) -> None:
    strategy = strategy_of(replicas)
    a = torch.ones(1)
    results = strategy.experimental_local_results([1, 2])
    assert results == ([1, 2],) * replicas
    nested = {"x": (a, None), "y": []}
    copies = strategy.experimental_local_results(nested)
    assert copies == (nested,) * replicas
    assert all(copy["x"][0] is a for copy in copies)  # the leaves are shared, not copied


def test_experimental_local_results_of_a_central_variable() -> None:
    strategy = strategy_of(2)
    with strategy.scope():
        variable = cs.Variable([1.0, 2.0])
    results = strategy.experimental_local_results(variable)
    assert len(results) == 1 and results[0] is variable


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_values_from_function_always_give_a_per_replica(replicas: int) -> None:
    strategy = strategy_of(replicas)
    seen: list[cs.ValueContext] = []

    def value_fn(ctx: cs.ValueContext) -> Any:
        seen.append(ctx)
        return torch.full((1,), ctx.replica_id_in_sync_group)

    value = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(value, cs.PerReplica)
    assert [int(t) for t in value] == list(range(replicas))
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [
        (r, replicas) for r in range(replicas)
    ]
    doubled = strategy.run(lambda t: t * 2, args=(value,))
    assert [int(t) for t in strategy.experimental_local_results(doubled)] == [
        2 * r for r in range(replicas)
    ]


# -- properties --------------------------------------------------------------------------------

sizes = st.lists(st.integers(0, 5), min_size=1, max_size=4)


def components_of(lengths: list[int], seed: int, width: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (lambda n: (n, width)) if width else (lambda n: (n,))
    return [torch.randn(shape(n), generator=generator, dtype=torch.float64) for n in lengths]


@settings(max_examples=60, deadline=None, database=None)
@given(lengths=sizes, seed=st.integers(0, 2**16), width=st.integers(0, 3))
def test_sum_over_axis_zero_is_the_sum_of_the_concatenation(
    lengths: list[int], seed: int, width: int
) -> None:
    parts = components_of(lengths, seed, width)
    result = strategy_of(len(parts)).reduce(SUM, cs.PerReplica(parts), axis=0)
    torch.testing.assert_close(result, torch.cat(parts).sum(0))


@settings(max_examples=60, deadline=None, database=None)
@given(lengths=sizes, seed=st.integers(0, 2**16), width=st.integers(0, 3))
def test_mean_over_axis_zero_is_the_mean_of_the_concatenation(
    lengths: list[int], seed: int, width: int
) -> None:
    parts = components_of(lengths, seed, width)
    result = strategy_of(len(parts)).reduce(MEAN, cs.PerReplica(parts), axis=0)
    torch.testing.assert_close(result, torch.cat(parts).mean(0), equal_nan=True)


@settings(max_examples=60, deadline=None, database=None)
@given(lengths=sizes, seed=st.integers(0, 2**16), width=st.integers(1, 3))
def test_gather_then_split_gives_back_the_components(
    lengths: list[int], seed: int, width: int
) -> None:
    parts = components_of(lengths, seed, width)
    gathered = strategy_of(len(parts)).gather(cs.PerReplica(parts), 0)
    for original, piece in zip(parts, torch.split(gathered, lengths), strict=True):
        assert torch.equal(original, piece)
    columns = [p.T for p in parts]
    gathered = strategy_of(len(parts)).gather(cs.PerReplica(columns), 1)
    for original, piece in zip(columns, torch.split(gathered, lengths, dim=1), strict=True):
        assert torch.equal(original, piece)


def test_as_tensor_moves_only_when_the_device_differs() -> None:
    from centralstore._reduce import as_tensor

    tensor = torch.ones(2)
    assert as_tensor(tensor) is tensor
    assert as_tensor(tensor, torch.device("cpu")) is tensor  # no copy on the host
    assert as_tensor(tensor, torch.device("meta")).device == torch.device("meta")
    converted = as_tensor(np.arange(3), torch.device("cpu"))
    assert converted.tolist() == [0, 1, 2] and converted.dtype == torch.int64
    assert as_tensor(2.5).dtype == torch.float32


# -- the MEAN arithmetic as pure functions -----------------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(lengths=sizes, width=st.integers(1, 3),
       axis=st.sampled_from([None, 0, 1, -1, (0, 1), ()]))
def test_element_count_is_the_divisor_of_a_global_mean(
    lengths: list[int], width: int, axis: Any
) -> None:
    parts = [torch.ones(n, width) for n in lengths]
    if axis is None:
        expected = len(parts)
    else:
        axes = (axis,) if isinstance(axis, int) else axis
        expected = sum(math.prod(p.shape[a] for a in axes) for p in parts)
    assert element_count(parts, axis) == expected
    assert element_count([p.numpy() for p in parts], axis) == expected


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.int8, torch.float32), (torch.int64, torch.float32), (torch.bool, torch.float32),
     (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64),
     (torch.complex128, torch.complex128)],
)
def test_mean_dtype_and_mean_of(dtype: torch.dtype, expected: torch.dtype) -> None:
    assert mean_dtype(dtype) is expected
    result = mean_of(torch.ones(3, dtype=dtype), 2)
    assert result.dtype is expected
    assert result.tolist() == [0.5, 0.5, 0.5] or result.real.tolist() == [0.5, 0.5, 0.5]


def test_gather_of_a_perreplica_with_the_wrong_number_of_components_raises() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    three = cs.PerReplica([torch.tensor([1]), torch.tensor([2]), torch.tensor([3])])
    with pytest.raises(ValueError, match=r"PerReplica of 3 components.*2 local replicas"):
        strategy.gather(three, axis=0)
    with pytest.raises(ValueError, match="PerReplica of 3 components"):
        strategy.gather({"x": three}, axis=0)
