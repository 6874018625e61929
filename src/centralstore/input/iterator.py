"""``DistributedIterator``: one pass over a distributed dataset, and ``Optional``.

The iterator takes its steps from a producer (a generator, or a ``PrefetchIterator`` that
runs it on a background thread) and runs each step's waits (CUDA events) before handing
the value over. ``element_spec`` looks at the next step without consuming it: that step is
kept and is what the following ``next`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, final

from .errors import OutOfRangeError
from .spec import spec_of

Step = tuple[Any, tuple[Callable[[], None], ...]]  # a value, and the waits before using it


class Steps(Protocol):
    def __next__(self) -> Step: ...

    def close(self) -> None: ...


@final
class Optional:
    """A value that may be absent: what ``get_next_as_optional`` returns.

    TensorFlow's ``tf.experimental.Optional``: test ``has_value()`` before ``get_value()``.

    >>> Optional.from_value(3).get_value(), Optional.empty().has_value()
    (3, False)
    """

    __slots__ = ("_has_value", "_value")

    def __init__(self, value: Any, has_value: bool) -> None:
        self._value = value
        self._has_value = has_value

    @staticmethod
    def from_value(value: Any) -> Optional:
        """An ``Optional`` holding ``value``."""
        return Optional(value, True)

    @staticmethod
    def empty() -> Optional:
        """An ``Optional`` without a value."""
        return Optional(None, False)

    def has_value(self) -> bool:
        """Whether there is a value."""
        return self._has_value

    def get_value(self) -> Any:
        """The value; ``ValueError`` when there is none (the iterator was exhausted)."""
        if not self._has_value:
            raise ValueError(
                "Optional.get_value() found no value: the iterator that made this Optional was "
                "exhausted. Test optional.has_value() first, and stop when it is False. "
                "Received: an empty Optional"
            )
        return self._value

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self._has_value else "Optional.empty()"


@final
class DistributedIterator(Iterator[Any]):
    """One pass over a distributed dataset; each ``next`` is one step for every replica.

    ``get_next()`` is TensorFlow's name for ``next``; past the end it raises
    ``OutOfRangeError`` (``next`` raises ``StopIteration``), and ``get_next_as_optional()``
    returns an empty ``Optional``. ``close()`` stops the prefetch thread early; dropping the
    iterator does the same. On GPUs, a step's copies are ordered before the work queued on
    the stream that is current when ``next`` returns it.

    >>> import torch
    >>> from centralstore.input.distributed import distribute_dataset
    >>> iterator = iter(distribute_dataset([torch.arange(4)], ("cpu:0", "cpu:1")))
    >>> [s.tolist() for s in iterator.get_next()]
    [[0, 1], [2, 3]]
    >>> iterator.get_next_as_optional().has_value()
    False
    >>> iterator.close()
    """

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._peeked: Step | None = None
        self._spec: Any = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._peeked is None:
            value, waits = next(self._steps)
        else:
            (value, waits), self._peeked = self._peeked, None
        for wait in waits:
            wait()
        return value

    def get_next(self) -> Any:
        """The next step's value: the batch structure with one PerReplica leaf per leaf.

        Raises ``OutOfRangeError`` when the data is exhausted.
        """
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError(
                "End of sequence: the distributed dataset is exhausted, get_next() has no "
                "step left to return. Iterate with a for loop, or use get_next_as_optional() "
                "and stop when has_value() is False."
            ) from None

    def get_next_as_optional(self) -> Optional:
        """The next step's value as an ``Optional``, empty once the data is exhausted.

        >>> import torch
        >>> from centralstore.input.distributed import distribute_dataset
        >>> iterator = iter(distribute_dataset([torch.zeros(2)], ("cpu:0",)))
        >>> [iterator.get_next_as_optional().has_value() for _ in range(2)]
        [True, False]
        """
        try:
            return Optional.from_value(next(self))
        except StopIteration:
            return Optional.empty()

    @property
    def element_spec(self) -> Any:
        """The structure of a step with a ``TensorSpec`` per leaf (batch dimension None).

        Read off the next step, which stays in the iterator (nothing is skipped); with
        several replicas each spec describes one replica's slice. ``ValueError`` when the
        iterator is exhausted before any step was seen.

        >>> import torch
        >>> from centralstore.input.distributed import distribute_dataset
        >>> iterator = iter(distribute_dataset([torch.zeros(4, 3)], ("cpu:0", "cpu:1")))
        >>> iterator.element_spec
        TensorSpec(shape=(None, 3), dtype=torch.float32)
        >>> len(list(iterator))
        1
        """
        if self._spec is None:
            if self._peeked is None:
                try:
                    self._peeked = next(self._steps)
                except StopIteration:
                    raise ValueError(
                        "DistributedIterator.element_spec is read off the next step, and this "
                        "iterator is exhausted. Read the dataset's element_spec instead."
                    ) from None
            self._spec = spec_of(self._peeked[0], batched=True)
        return self._spec

    def close(self) -> None:
        """Stop producing steps; the background thread ends and ``next`` raises StopIteration."""
        self._peeked = None
        self._steps.close()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
