"""``DistributedIterator``: one pass over a distributed dataset, and ``Optional``.

The iterator takes its steps from a producer (a generator, or a ``PrefetchIterator`` that
runs it on a background thread) and runs each step's waits (CUDA events) before handing
the value over. ``element_spec`` looks at the next step without consuming it: that step is
kept and is what the following ``next`` returns.

Its position is the steps it has handed over, counted here on the consumer's side (a
prefetch thread may be ahead), and where its pass began; ``state_dict`` saves both and
``load_state_dict`` hands them to its ``Pass`` (``distributed.py``), which starts the pass
again at that step (``resume.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, final

from .errors import OutOfRangeError
from .spec import spec_of

# A value, the waits before using it, and the source's position after it (for sources that
# know theirs, e.g. a StatefulDataLoader; else None).
Step = tuple[Any, tuple[Callable[[], None], ...], Any]

_FORMAT = "centralstore.DistributedIterator/1"


class Steps(Protocol):
    def __next__(self) -> Step: ...

    def close(self) -> None: ...


class Pass(Protocol):
    """What an iterator needs from its dataset to save and restore its position."""

    kind: str  # the kind of source ("Dataset", "DataLoader", ...)
    elements_per_step: int  # source elements per step (local replicas for from_function)

    def origin(self) -> dict[str, Any]:
        """Where this pass began: the source's random state before its first element."""

    def current(self) -> dict[str, Any]:
        """The source's random state now."""

    def resume(self, state: Mapping[str, Any]) -> Steps:
        """Steps of a fresh pass that continue after the ``state``'s steps (none when the
        saved pass had ended)."""


class Exhausted:
    """The steps of a pass that has ended."""

    def __next__(self) -> Step:
        raise StopIteration

    def close(self) -> None:
        pass


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

    ``state_dict()`` and ``load_state_dict()`` save and restore its position, so that a
    ``cs.Checkpoint`` holding it resumes training at the next step (see ``load_state_dict``).
    """

    def __init__(self, steps: Steps, position: Pass | None = None) -> None:
        self._steps = steps
        self._peeked: Step | None = None
        self._spec: Any = None
        self._pass = position
        self._origin = position.origin() if position is not None else {}
        self._taken = 0  # steps handed over
        self._mark: Any = None  # the source's position after the last of them
        self._exhausted = False

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._peeked is None:
            try:
                value, waits, mark = next(self._steps)
            except StopIteration:
                self._exhausted = True
                raise
        else:
            (value, waits, mark), self._peeked = self._peeked, None
        self._taken += 1
        self._mark = mark
        for wait in waits:
            wait()
        return value

    def state_dict(self) -> dict[str, Any]:
        """The iterator's position: the steps it has handed over and where its pass began.

        Small (a few integers and random states, or a ``StatefulDataLoader``'s own state),
        and made only of tensors and plain Python values, so ``torch.save`` and
        ``cs.Checkpoint`` store it.

        >>> import torch
        >>> from centralstore.input.dataset import Dataset
        >>> from centralstore.input.distributed import distribute_dataset
        >>> iterator = iter(distribute_dataset(Dataset.range(6).batch(2), ("cpu:0",)))
        >>> next(iterator).tolist()
        [0, 1]
        >>> iterator.state_dict()["steps"]
        1
        """
        position = self._require_pass("state_dict")
        return {
            "format": _FORMAT,
            "source": position.kind,
            "steps": self._taken,
            "elements_per_step": position.elements_per_step,
            "exhausted": self._exhausted,
            "origin": self._origin,
            "current": position.current(),
            "mark": self._mark,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from the position that ``state_dict()`` saved: the next step is the one
        that came after it.

        The pass starts again where the saved one began and the steps already made are read
        again and discarded (here, not at the next ``next``): exact for a ``cs.Dataset``
        (random stages included, seeded or not: their seeds are saved) and for any source
        whose passes repeat themselves; a ``DataLoader`` is read again with a warning, and a
        ``StatefulDataLoader`` continues from its own state without reading. Restoring costs
        reading the current pass up to the position: one epoch at most when each epoch is a
        new iterator, everything since the iterator began over a ``repeat()``-ed dataset.

        Save and restore with the same number of replicas, or with another one: for
        ``experimental_distribute_dataset`` a step is one global batch whatever the replicas;
        for ``distribute_datasets_from_function`` the same number of steps is skipped, which
        is the same data when each replica's batch is the global batch over the replicas.

        >>> from centralstore.input.dataset import Dataset
        >>> from centralstore.input.distributed import distribute_dataset
        >>> dataset = distribute_dataset(Dataset.range(8).shuffle(8, seed=3).batch(2), ("cpu:0",))
        >>> first = iter(dataset)
        >>> _ = next(first)
        >>> saved = first.state_dict()
        >>> expected = [b.tolist() for b in first]
        >>> resumed = iter(dataset)
        >>> resumed.load_state_dict(saved)
        >>> [b.tolist() for b in resumed] == expected
        True
        """
        position = self._require_pass("load_state_dict")
        state = _checked(state_dict, position.kind)
        self.close()
        self._steps, self._peeked, self._spec = position.resume(state), None, None
        self._origin = state["origin"]
        self._taken = int(state["steps"])
        self._mark = state["mark"]
        self._exhausted = bool(state["exhausted"])

    def _require_pass(self, call: str) -> Pass:
        if self._pass is None:
            raise TypeError(
                f"DistributedIterator.{call}() needs an iterator made by iter() of a "
                "distributed dataset (strategy.experimental_distribute_dataset or "
                "distribute_datasets_from_function), which knows its source. Received: an "
                "iterator built directly on a sequence of steps"
            )
        return self._pass

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


_KEYS = ("format", "source", "steps", "elements_per_step", "exhausted", "origin", "current", "mark")


def _checked(state: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """``state`` when it is a ``DistributedIterator.state_dict()`` for a source of ``kind``."""
    if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            "DistributedIterator.load_state_dict() takes what DistributedIterator.state_dict() "
            f"returned (format {_FORMAT!r}). Received: format={found!r}"
        )
    missing = [key for key in _KEYS if key not in state]
    unexpected = [key for key in state if key not in _KEYS]
    if missing or unexpected:
        raise ValueError(
            "DistributedIterator.load_state_dict() got a state with missing key(s) "
            f"{missing} and unexpected key(s) {unexpected}. Pass the dict that state_dict() "
            f"returned, unchanged. Received: keys={sorted(state)}"
        )
    if state["source"] != kind:
        raise ValueError(
            f"Cannot restore the position of an iterator over a {state['source']} into one "
            f"over a {kind}: distribute the same kind of source as the saved run did. "
            f"Received: source={state['source']!r}"
        )
    return state
