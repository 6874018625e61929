"""``PerReplica``, the distributed value, and the two moves on it: select and regroup."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from operator import is_
from typing import Any, Generic, NoReturn, TypeVar, overload

import torch

from . import _tree

_Tensor = torch.Tensor
# the leaves that ``split_flat`` hands every replica as they are: tensors, and the Python
# scalars a step often takes beside them (the global batch size, a step number, a flag)
_SHARED_LEAVES = frozenset((_Tensor, int, float, bool, str, type(None)))
_shared_leaf = _SHARED_LEAVES.__contains__
_set_slot = object.__setattr__

T = TypeVar("T")


class PerReplica(Sequence[T], Generic[T]):
    """A value that differs per replica: an immutable sequence of one component per replica.

    ``strategy.run`` returns these when replicas return different values, and
    ``experimental_local_results`` opens them.

    >>> v = PerReplica([1, 2])
    >>> len(v), v[1], v.values
    (2, 2, (1, 2))
    """

    __slots__ = ("_values",)
    _values: tuple[T, ...]

    def __init__(self, values: Iterable[T]) -> None:
        # object's own setter, past the read-only guard's Python: a step's input makes one
        # PerReplica per tensor
        _set_slot(self, "_values", tuple(values))

    @property
    def values(self) -> tuple[T, ...]:
        """The components, in replica order."""
        return self._values

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...
    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        return self._values[index]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[T]:
        return iter(self._values)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_values" or hasattr(self, "_values"):
            raise AttributeError("PerReplica is read-only")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        inner = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"PerReplica({{\n{inner}\n}})"


def split_flat(
    args: Sequence[Any], kwargs: dict[str, Any], replicas: int
) -> list[tuple[Sequence[Any], dict[str, Any]]] | None:
    """Each replica's ``(args, kwargs)`` in one pass, for the arguments of nearly every
    ``run``: positional and keyword arguments that are ``PerReplica``s of ``replicas``
    components each, tensors, or Python scalars (``int``, ``float``, ``bool``, ``str``,
    None), which every replica sees as they are. None otherwise (containers, other leaves,
    another count): the general walk (``select``) takes those, and its check names a wrong
    count.

    >>> split_flat((PerReplica([1, 2]), 64), {}, 2)
    [((1, 64), {}), ((2, 64), {})]
    >>> split_flat((), {"x": PerReplica([1, 2]), "training": True}, 2)
    [((), {'x': 1, 'training': True}), ((), {'x': 2, 'training': True})]
    """
    leaves = (*args, *kwargs.values()) if kwargs else args
    kinds = list(map(type, leaves))
    if PerReplica not in kinds:
        if all(map(_shared_leaf, kinds)):  # (in C)
            return [(args, kwargs)] * replicas
        return None
    columns: list[Sequence[Any]] = []
    for leaf, kind in zip(leaves, kinds):
        if kind is PerReplica:
            if len(leaf._values) != replicas:
                return None
            columns.append(leaf._values)
        elif kind in _SHARED_LEAVES:
            columns.append((leaf,) * replicas)
        else:
            return None
    if not kwargs:
        return [(row, kwargs) for row in zip(*columns)]
    positional, names = len(args), list(kwargs)
    return [
        (row[:positional], dict(zip(names, row[positional:]))) for row in zip(*columns)
    ]


def select(tree: Any, replica: int) -> Any:
    """``tree`` as replica ``replica`` sees it: each PerReplica leaf becomes its component."""
    cls = type(tree)
    if cls is PerReplica:
        return tree.values[replica]
    if not _tree.contains(tree, PerReplica):
        return tree
    if cls is tuple or cls is list:  # run's args: a flat tuple is the common case
        return cls(select(item, replica) for item in tree)
    if cls is dict:
        return {key: select(item, replica) for key, item in tree.items()}
    return _tree.map_leaves(
        lambda leaf: leaf.values[replica] if isinstance(leaf, PerReplica) else leaf, tree
    )


def regroup(outputs: Sequence[Any]) -> Any:
    """One structure from the replicas' outputs, with PerReplica leaves where they differ.

    The structure of replica 0 is kept; a leaf that every replica returned as the same object
    stays unwrapped. Replicas that return different structures raise ``ValueError``, and so
    does ``None`` from some replicas where others return a value (TensorFlow would build a
    PerReplica that mixes them, and the ``None`` would fail later, far from its cause).
    """
    first = outputs[0]
    if all(map(is_, outputs, repeat(first))):  # the same object from all (None): in C
        return first
    try:
        return _regroup_plain(outputs)
    except _NotPlain:  # other containers, or structures that differ: the general walk
        pass
    leaves0, spec0 = _tree.flatten(first)
    columns = [leaves0]
    for replica, out in enumerate(outputs[1:], start=1):
        leaves, spec = _tree.flatten(out)
        if spec != spec0:
            _different_structures(outputs, replica)
        columns.append(leaves)
    regrouped = []
    for row in zip(*columns, strict=True):
        head = row[0]
        if all(x is head for x in row):
            regrouped.append(head)
            continue
        for replica, x in enumerate(row):
            if (x is None) != (head is None):
                _different_structures(outputs, replica)
        regrouped.append(PerReplica(row))
    return _tree.unflatten(regrouped, spec0)


class _NotPlain(Exception):
    """``_regroup_plain`` met something that only the general walk may judge."""


def _regroup_plain(row: Sequence[Any]) -> Any:
    """``regroup`` of one position of the replicas' outputs, where they are plain tuples,
    lists and dicts of leaves, walked directly: torch's pytree takes 5 to 20 us to flatten
    and rebuild a step's ``(loss, metrics)`` or ``merge_call``'s ``(args, kwargs)`` (a
    run's own bookkeeping costs about 10). Raises ``_NotPlain`` at anything else: another
    registered container, or structures that differ (the general walk explains those)."""
    head = row[0]
    cls = type(head)
    if cls is tuple or cls is list:
        size = len(head)
        for other in row:
            if type(other) is not cls or len(other) != size:
                raise _NotPlain
        return cls(map(_regroup_plain, zip(*row)))
    if cls is dict:
        keys = list(head)
        for other in row:
            if type(other) is not dict or list(other) != keys:
                raise _NotPlain
        return {key: _regroup_plain([other[key] for other in row]) for key in keys}
    if cls is torch.Tensor and all(map(is_, map(type, row), repeat(cls))):  # leaves, in C
        return head if all(map(is_, row, repeat(head))) else PerReplica(row)
    if not all(map(_tree.is_leaf, row)):
        raise _NotPlain
    if all(map(is_, row, repeat(head))):
        return head
    if head is None or any(map(is_, row, repeat(None))):
        raise _NotPlain
    return PerReplica(row)


class _Leaf:
    """A leaf in a structure's description: its type name, or ``None``."""

    __slots__ = ("_name",)

    def __init__(self, leaf: Any) -> None:
        self._name = "None" if leaf is None else type(leaf).__name__

    def __repr__(self) -> str:
        return self._name


def _describe(tree: Any) -> str:
    """``tree`` with each leaf shown as its type: ``(Tensor, None)``, ``{'loss': float}``."""
    return repr(_tree.map_leaves(_Leaf, tree))


def _different_structures(outputs: Sequence[Any], replica: int) -> NoReturn:
    first, other = _describe(outputs[0]), _describe(outputs[replica])
    if first == other:  # a registered container whose repr hides its structure
        first, other = str(_tree.flatten(outputs[0])[1]), str(_tree.flatten(outputs[replica])[1])
    raise ValueError(
        f"Every replica must return the same structure, but replica 0 returned {first} and "
        f"replica {replica} returned {other}. Return the same kind of value from every "
        "replica (for example an empty or zero tensor rather than None)."
    )


def local_results(value: Any, num_replicas: int) -> tuple[Any, ...]:
    """The local components of ``value``, as TensorFlow: a PerReplica gives its components; a
    nested structure gives one copy per replica, each PerReplica leaf replaced by that
    replica's component (a structure without PerReplica leaves is copied as it is); any other
    value (a tensor, a number, ``None``, a central variable) gives ``(value,)``.

    >>> local_results([PerReplica([1, 2]), 0], 2)
    ([1, 0], [2, 0])
    >>> local_results([1, 2], 2), local_results(3, 2)
    (([1, 2], [1, 2]), (3,))
    """
    if isinstance(value, PerReplica):
        return value.values
    leaves, spec = _tree.flatten(value)
    if value is None or (len(leaves) == 1 and leaves[0] is value):  # not a container
        return (value,)
    return tuple(
        _tree.unflatten(
            [leaf.values[replica] if isinstance(leaf, PerReplica) else leaf for leaf in leaves],
            spec,
        )
        for replica in range(num_replicas)
    )


class ValueContext:
    """What ``experimental_distribute_values_from_function`` passes to its ``value_fn``."""

    __slots__ = ("_num_replicas", "_replica_id")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._replica_id = replica_id_in_sync_group
        self._num_replicas = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self._num_replicas})"
        )
