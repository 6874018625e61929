"""Pytree helpers: the one place that imports ``torch.utils._pytree``.

``PerReplica`` is not a registered node, so it is always a leaf. Tuples, lists, dicts,
namedtuples and whatever users register with torch's pytree (dataclasses) are containers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as _pytree

TreeSpec = _pytree.TreeSpec


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """The leaves of ``tree`` in order and the structure to rebuild it."""
    return _pytree.tree_flatten(tree)


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Rebuild a tree of the structure ``spec`` from ``leaves``."""
    return _pytree.tree_unflatten(leaves, spec)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``."""
    return _pytree.tree_map(fn, tree)


def contains(tree: Any, kind: type) -> bool:
    """Whether any leaf of ``tree`` is an instance of ``kind``.

    Plain tuples, lists and dicts are walked directly (the hot path of ``run``); other
    registered containers go through pytree.
    """
    if isinstance(tree, kind):
        return True
    cls = type(tree)
    if cls is tuple or cls is list:
        return any(contains(item, kind) for item in tree)
    if cls is dict:
        return any(contains(item, kind) for item in tree.values())
    if _pytree._is_leaf(tree):
        return False
    return any(isinstance(leaf, kind) for leaf in flatten(tree)[0])
