"""PerReplica and the two moves on it: select and regroup."""

from __future__ import annotations

import copy
import operator
import pickle
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import centralstore as cs
from centralstore import _values


def test_per_replica_is_an_immutable_sequence() -> None:
    value = cs.PerReplica(iter([1, 2, 3]))
    assert isinstance(value, Sequence)
    assert len(value) == 3
    assert value[0] == 1 and value[-1] == 3
    assert value[1:] == (2, 3)
    assert list(value) == [1, 2, 3]
    assert value.values == (1, 2, 3)
    assert 2 in value and 5 not in value
    assert value.index(3) == 2


def test_per_replica_is_read_only() -> None:
    value = cs.PerReplica([1, 2])
    with pytest.raises(AttributeError, match="read-only"):
        value._values = (3, 4)  # type: ignore[misc]
    with pytest.raises(AttributeError, match="read-only"):
        value.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        value[0] = 5  # type: ignore[index]
    with pytest.raises(AttributeError):
        value.values = (1,)  # type: ignore[misc]
    assert value.values == (1, 2)
    assert not hasattr(value, "__dict__")


@pytest.mark.parametrize(
    "duplicate", [copy.copy, copy.deepcopy, lambda v: pickle.loads(pickle.dumps(v))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_a_copied_per_replica_is_equal_and_still_read_only(
    duplicate: Callable[[Any], Any],
) -> None:
    """The constructor sets the slot past the guard; copying and unpickling set it through
    the guard, once, which it allows: the copy holds the components and refuses a second
    write."""
    value: cs.PerReplica[Any] = cs.PerReplica([torch.tensor([1.0]), 2])
    twin = duplicate(value)
    assert type(twin) is cs.PerReplica and twin is not value
    assert len(twin) == 2 and torch.equal(twin[0], value[0]) and twin[1] == 2
    with pytest.raises(AttributeError, match="read-only"):
        twin._values = (3, 4)


def test_per_replica_copies_its_components() -> None:
    components = [1, 2]
    value = cs.PerReplica(components)
    components.append(3)
    assert value.values == (1, 2)


def test_repr() -> None:
    assert repr(cs.PerReplica([1, "a"])) == "PerReplica({\n  0: 1,\n  1: 'a'\n})"
    assert repr(cs.PerReplica([torch.tensor(1)])) == "PerReplica({\n  0: tensor(1)\n})"


def test_per_replica_is_a_pytree_leaf() -> None:
    value = cs.PerReplica([1, 2])
    leaves, _ = torch.utils._pytree.tree_flatten({"a": value})
    assert leaves == [value]


def test_select_replaces_per_replica_leaves_with_a_component() -> None:
    Pair = namedtuple("Pair", "a b")
    plain = torch.ones(1)
    tree = {"x": cs.PerReplica([1, 2]), "y": [Pair(cs.PerReplica(["p", "q"]), plain)]}
    assert _values.select(tree, 0) == {"x": 1, "y": [Pair("p", plain)]}
    selected = _values.select(tree, 1)
    assert selected == {"x": 2, "y": [Pair("q", plain)]}
    assert selected["y"][0].b is plain
    assert _values.select(cs.PerReplica([1, 2]), 1) == 2


def test_select_returns_a_tree_without_per_replica_unchanged() -> None:
    tree = (1, [torch.ones(1)], {"a": None})
    assert _values.select(tree, 0) is tree
    assert _values.select((), 3) == ()


def test_split_flat_gives_each_replica_its_components_in_one_pass() -> None:
    x, t = torch.zeros(2), torch.ones(1)
    parts = _values.split_flat((cs.PerReplica([x, t]), t), {}, 2)
    assert parts is not None
    assert [len(args) for args, _ in parts] == [2, 2]
    assert parts[0][0][0] is x and parts[1][0][0] is t and parts[1][0][1] is t
    plain = (t, x)
    assert _values.split_flat(plain, {}, 3) == [(plain, {})] * 3


@pytest.mark.parametrize("scalar", [64, 0.5, True, "train", None])
def test_split_flat_hands_every_replica_a_python_scalar_as_it_is(scalar: object) -> None:
    """A step's global batch size, step number or flag beside its per-replica batch: each
    replica gets the scalar itself, as ``select`` would give it."""
    x, t = torch.zeros(2), torch.ones(1)
    per_replica = cs.PerReplica([x, t])
    parts = _values.split_flat((per_replica, scalar), {}, 2)
    assert parts == [(tuple(_values.select((per_replica, scalar), r)), {}) for r in (0, 1)]
    assert parts is not None and parts[1][0][0] is t and parts[1][0][1] is scalar
    assert _values.split_flat((t, scalar), {}, 2) == [((t, scalar), {})] * 2


def test_split_flat_gives_each_replica_its_keyword_arguments_as_select_does() -> None:
    """``run(fn, args=..., kwargs=...)``: each replica's keyword arguments hold its own
    components and the scalars and tensors every replica shares, positional ones as before;
    without a ``PerReplica`` every replica gets the very same dictionary."""
    x, t = torch.zeros(2), torch.ones(1)
    args = (cs.PerReplica([x, t]),)
    kwargs = {"labels": cs.PerReplica([t, x]), "training": True, "mask": t}
    parts = _values.split_flat(args, kwargs, 2)
    assert parts == [
        (tuple(_values.select(args, r)), _values.select(kwargs, r)) for r in (0, 1)
    ]
    assert parts is not None and parts[1][1]["labels"] is x and parts[1][1]["mask"] is t
    shared = {"training": False, "mask": t}
    split = _values.split_flat((x,), shared, 2)
    assert split is not None and all(own is shared for _, own in split)


_Point = namedtuple("_Point", "x y")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((cs.PerReplica([1, 2, 3]),), {}),  # a wrong count: the general walk's check names it
        (([cs.PerReplica([1, 2])],), {}),  # nested
        ((cs.PerReplica([1, 2]), 3 + 0j), {}),  # a leaf that is neither tensor nor scalar
        ((cs.PerReplica([1, 2]), torch.nn.Parameter(torch.ones(1))), {}),  # a subclass
        ((torch.ones(1), _Point(cs.PerReplica([1, 2]), 3)), {}),  # a namedtuple (a container)
        ((), {"x": [cs.PerReplica([1, 2])]}),  # a keyword argument holding a container
        ((torch.ones(1),), {"x": cs.PerReplica([1, 2, 3])}),  # a keyword's wrong count
    ],
)
def test_split_flat_leaves_everything_else_to_the_general_walk(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    assert _values.split_flat(args, kwargs, 2) is None


def test_regroup_keeps_replica_zeros_structure_and_wraps_differing_leaves() -> None:
    Point = namedtuple("Point", "x y")
    shared = torch.zeros(1)
    out = _values.regroup([Point(0, shared), Point(1, shared), Point(2, shared)])
    assert isinstance(out, Point)
    assert isinstance(out.x, cs.PerReplica) and out.x.values == (0, 1, 2)
    assert out.y is shared


def test_regroup_of_the_same_object_returns_it() -> None:
    shared = {"a": [1]}
    assert _values.regroup([shared, shared]) is shared


def test_regroup_of_different_structures_raises_naming_both() -> None:
    with pytest.raises(ValueError, match="replica 2 returned") as info:
        _values.regroup([(1, 2), (3, 4), (5,)])
    assert "replica 0 returned" in str(info.value)


def test_regroup_of_none_and_a_value_in_one_place_raises_naming_both() -> None:
    tensor = torch.ones(1)
    with pytest.raises(ValueError, match="Every replica must return the same structure") as info:
        _values.regroup([(None, tensor), (torch.zeros(1), tensor)])
    message = str(info.value)
    assert "replica 0 returned (None, Tensor) and replica 1 returned (Tensor, Tensor)" in message
    with pytest.raises(ValueError, match="replica 2 returned None"):
        _values.regroup([tensor, torch.zeros(1), None])
    match = r"\{'loss': float\} and replica 1 returned \{'loss': None\}"
    with pytest.raises(ValueError, match=match):
        _values.regroup([{"loss": 1.0}, {"loss": None}])


def test_regroup_keeps_none_that_every_replica_returned() -> None:
    out = _values.regroup([(None, 1), (None, 2)])
    assert out[0] is None and out[1].values == (1, 2)


def _same_tree(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same structure of the same containers' types, with the
    same leaves (by identity) and the same ``PerReplica`` components."""
    if type(a) is not type(b):
        return False
    if isinstance(a, cs.PerReplica):
        return len(a) == len(b) and all(map(operator.is_, a.values, b.values))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same_tree, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    return a is b


_X, _Y, _S = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
_SHARED_LIST = [_S]
_Pair = namedtuple("_Pair", "a b")


@pytest.mark.parametrize(
    "outputs",
    [
        [_X, _Y],
        [(_X, 1.0), (_Y, 1.5)],
        [
            {"loss": _X, "metrics": {"acc": 0.5, "n": [1, _S]}},
            {"loss": _Y, "metrics": {"acc": 0.7, "n": [2, _S]}},
        ],
        [((), {}), ((), {})],  # merge_call's arguments
        [((_X,), {"k": _S}), ((_Y,), {"k": _S})],
        [(None, _X), (None, _Y)],
        [(_SHARED_LIST, _X), (_SHARED_LIST, _Y)],  # a container every replica shares
        [(_Pair(_X, 1), _S), (_Pair(_Y, 2), _S)],  # a registered container: the general walk
        [[_X, (_S, {})], [_Y, (_S, {})], [_S, (_S, {})]],
    ],
)
def test_regroup_of_plain_containers_gives_what_the_general_walk_gives(
    outputs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _values.regroup(outputs)

    def refuse(row: Sequence[Any]) -> Any:
        raise _values._NotPlain

    monkeypatch.setattr(_values, "_regroup_plain", refuse)
    assert _same_tree(fast, _values.regroup(outputs))


@pytest.mark.parametrize(
    "outputs",
    [
        [{"a": 1, "b": 2}, {"b": 3, "a": 4}],  # the same keys in another order
        [(1, 2), [3, 4]],
        [(_X,), (_X, _Y)],
        [{"loss": _X}, {"loss": None}],
        [(_X, [1]), (_Y, 1)],
    ],
)
def test_regroup_of_differing_plain_structures_raises_as_the_general_walk_does(
    outputs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="Every replica must return the same structure") as fast:
        _values.regroup(outputs)

    def refuse(row: Sequence[Any]) -> Any:
        raise _values._NotPlain

    monkeypatch.setattr(_values, "_regroup_plain", refuse)
    with pytest.raises(ValueError) as general:
        _values.regroup(outputs)
    assert str(fast.value) == str(general.value)


def test_regroup_walks_plain_outputs_without_torchs_pytree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's ``(loss, {metrics})`` and ``merge_call``'s ``(args, kwargs)`` are regrouped at
    every run; torch's pytree took 5 to 20 us a time for them."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch's pytree walked a plain structure")

    monkeypatch.setattr(_values._tree, "flatten", refuse)
    monkeypatch.setattr(_values._tree, "unflatten", refuse)
    out = _values.regroup([(_X, {"acc": 1}), (_Y, {"acc": 2})])
    assert out[0].values == (_X, _Y) and out[1]["acc"].values == (1, 2)
    assert _values.regroup([((), {}), ((), {})]) == ((), {})
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    merged = strategy.run(
        lambda: cs.get_replica_context().merge_call(  # type: ignore[union-attr]
            lambda _, x: x, args=(cs.get_replica_context().replica_id_in_sync_group,)  # type: ignore[union-attr]
        )
    )
    assert merged.values == (0, 1)


def test_regroup_tells_plain_tensors_for_leaves_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's loss, a plain tensor from each replica, is a leaf by its type, without
    asking torch's pytree for each (a Python call a leaf)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch's pytree was asked about a plain tensor")

    monkeypatch.setattr(_values._tree, "is_leaf", refuse)
    assert _values.regroup([_X, _Y]).values == (_X, _Y)
    loss, shared = _values.regroup([(_X, _S), (_Y, _S)])
    assert loss.values == (_X, _Y) and shared is _S


def test_run_with_none_from_one_replica_raises() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])

    def step() -> torch.Tensor | None:
        replica = cs.get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
        return None if replica == 0 else torch.ones(1)

    with pytest.raises(ValueError, match="replica 0 returned None and replica 1 returned Tensor"):
        strategy.run(step)


def test_select_then_regroup_round_trips() -> None:
    tree = {"x": cs.PerReplica([1, 2, 3]), "y": ("same", cs.PerReplica([4, 5, 6]))}
    back = _values.regroup([_values.select(tree, r) for r in range(3)])
    assert back["x"].values == (1, 2, 3)
    assert back["y"][0] == "same"
    assert back["y"][1].values == (4, 5, 6)


def test_local_results() -> None:
    value = cs.PerReplica([1, 2])
    assert _values.local_results(value, 2) == (1, 2)
    assert _values.local_results(7, 2) == (7,)
    assert _values.local_results(None, 2) == (None,)
    assert _values.local_results([value, 0], 2) == ([1, 0], [2, 0])


def test_local_results_of_a_nest_without_per_replica_is_one_copy_per_replica() -> None:
    assert _values.local_results([1, 2], 2) == ([1, 2], [1, 2])
    assert _values.local_results((), 3) == ((), (), ())
    Pair = namedtuple("Pair", "a b")
    first, second = _values.local_results(Pair(1, [2]), 2)
    assert first == second == Pair(1, [2]) and isinstance(first, Pair)
    assert first.b is not second.b  # fresh containers, as TensorFlow's map_structure


def test_value_context() -> None:
    ctx = cs.ValueContext(1, 4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (1, 4)
    assert repr(ctx) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)"
    default = cs.ValueContext()
    assert (default.replica_id_in_sync_group, default.num_replicas_in_sync) == (0, 1)
