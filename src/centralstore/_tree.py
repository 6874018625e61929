"""Pytree helpers: the one place that imports ``torch.utils._pytree``.

``PerReplica`` is not a registered node, so it is always a leaf. Tuples, lists, dicts,
namedtuples and whatever users register with torch's pytree (dataclasses) are containers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as _pytree

TreeSpec = _pytree.TreeSpec

# Whether pytree treats a value as a leaf (no registered container). ``tree_is_leaf`` is the
# public name since torch 2.3; older releases only have ``_is_leaf``.
is_leaf: Callable[[Any], bool] = getattr(_pytree, "tree_is_leaf", None) or _pytree._is_leaf


def flatten(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], TreeSpec]:
    """The leaves of ``tree`` in order and the structure to rebuild it; ``is_leaf`` stops the
    walk at the nodes it accepts (a batch of strings, say)."""
    return _pytree.tree_flatten(tree, is_leaf=is_leaf)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in order, as ``flatten`` gives them. Plain tuples, lists and
    dicts are walked directly (``run`` takes the leaves of its arguments and outputs at every
    call); other registered containers go through pytree."""
    cls = type(tree)
    if cls is tuple or cls is list:
        return [leaf for item in tree for leaf in leaves(item)]
    if cls is dict:
        return [leaf for item in tree.values() for leaf in leaves(item)]
    if is_leaf(tree):
        return [tree]
    return flatten(tree)[0]


def unflatten(values: list[Any], spec: TreeSpec) -> Any:
    """Rebuild a tree of the structure ``spec`` from its leaves, ``values``."""
    return _pytree.tree_unflatten(values, spec)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``."""
    return _pytree.tree_map(fn, tree)


def contains(tree: Any, kind: type) -> bool:
    """Whether any leaf of ``tree`` is an instance of ``kind``.

    Plain tuples, lists and dicts are walked directly (the hot path of ``run`` checks its
    ``args`` and ``kwargs`` once per replica, usually small or empty); other registered
    containers go through pytree.
    """
    cls = type(tree)
    if cls is tuple or cls is list:
        return bool(tree) and any(contains(item, kind) for item in tree)
    if cls is dict:
        return bool(tree) and any(contains(item, kind) for item in tree.values())
    if isinstance(tree, kind):
        return True
    if is_leaf(tree):
        return False
    return any(isinstance(leaf, kind) for leaf in flatten(tree)[0])
