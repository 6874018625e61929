"""``PerReplica``, the distributed value, and the two moves on it: select and regroup."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

from . import _tree

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

    def __init__(self, values: Iterable[T]) -> None:
        self._values = tuple(values)

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
    stays unwrapped. Replicas that return different structures raise ``ValueError``.
    """
    first = outputs[0]
    if all(out is first for out in outputs):
        return first
    leaves0, spec0 = _tree.flatten(first)
    columns = [leaves0]
    for replica, out in enumerate(outputs[1:], start=1):
        leaves, spec = _tree.flatten(out)
        if spec != spec0:
            raise ValueError(
                "Every replica must return the same structure, but replica 0 returned "
                f"{spec0} and replica {replica} returned {spec}."
            )
        columns.append(leaves)
    regrouped = [
        row[0] if all(x is row[0] for x in row) else PerReplica(row)
        for row in zip(*columns, strict=True)
    ]
    return _tree.unflatten(regrouped, spec0)


def local_results(value: Any, num_replicas: int) -> tuple[Any, ...]:
    """The local components: PerReplica -> its components, a plain value -> ``(value,)``,
    a nested structure with PerReplica leaves -> one copy per replica."""
    if isinstance(value, PerReplica):
        return value.values
    if not _tree.contains(value, PerReplica):
        return (value,)
    return tuple(select(value, replica) for replica in range(num_replicas))


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
