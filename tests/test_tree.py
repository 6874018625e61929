"""``_tree``: the fast walks agree with torch's pytree."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from centralstore import _tree
from centralstore._values import PerReplica

Point = collections.namedtuple("Point", ["x", "y"])
t = torch.ones(2)
per_replica = PerReplica([t, t + 1])

TREES: list[Any] = [
    None,
    t,
    (),
    [],
    {},
    (t, per_replica),
    [1, [2, (3, 4)], {"b": 5, "a": 6}],
    {"z": per_replica, 3: [t, None], "a": (Point(1, 2),)},
    Point(x=[t], y={"k": per_replica}),
    ((), [[]], {"e": {}}),
]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_leaves_are_those_of_flatten_in_the_same_order(tree: Any) -> None:
    expected = _tree.flatten(tree)[0]
    found = _tree.leaves(tree)
    assert len(found) == len(expected)
    assert all(a is b for a, b in zip(found, expected))


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_contains_agrees_with_the_leaves(tree: Any) -> None:
    assert _tree.contains(tree, PerReplica) == any(
        isinstance(leaf, PerReplica) for leaf in _tree.flatten(tree)[0]
    )
