"""How a distributed iterator finds its place again in its source (docs/design.md §3.7.11).

A position is *where a pass began* (its origin) and *how many steps it has made*. Resuming
starts a fresh pass from the same origin and reads the steps already made again, discarding
them: the pipeline is deterministic once its random state at the origin is set, so the next
step is exactly the one the interrupted run would have made. Each kind of source says what
its origin is:

* a ``cs.Dataset``: the seed and pass count of each random stage (``shuffle``, ``random``,
  ``sample_from_datasets``), so unseeded shuffles resume too;
* a ``DataLoader``: its generators' states (the sampler's order is drawn from them), and
  torch's global generator when it has none of its own (borrowed while the pass is read
  again, then handed back); resuming reads the batches again and warns that it does;
* torchdata's ``StatefulDataLoader`` (or any source with ``state_dict()`` and
  ``load_state_dict()`` that give its position): its own state, taken after each step's
  elements, so nothing is read again;
* any other re-iterable: nothing; its passes must repeat themselves.
"""

from __future__ import annotations

import abc
import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, final

import torch

from ._base import DatasetBase


class Source(abc.ABC):
    """One kind of source, as the distributed iterator saves and restores positions in it."""

    kind: str

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source

    def origin(self) -> dict[str, Any]:
        """The state a pass starts from: taken just before ``iter(source)``."""
        return {}

    def current(self) -> dict[str, Any]:
        """The state now, to be set again after a resumed pass has caught up."""
        return {}

    def mark(self) -> Any:
        """The position after the elements pulled so far, for sources that know it."""
        return None

    def start(self, origin: dict[str, Any], mark: Any) -> Iterator[Any]:
        """A fresh pass from ``origin`` (or from ``mark``, for sources that have one)."""
        return iter(self.source)

    def settle(self, current: dict[str, Any], mark: Any) -> None:  # noqa: B027
        """Set the state a pass that had ended left behind (``current``, ``mark``), which
        the next pass starts from. (A pass read again evolves its state as the saved one did: its
        ``current``, taken while a prefetch thread may have been ahead, is not applied.)"""

    def finish(self) -> None:  # noqa: B027 (most sources: nothing)
        """After a pass was read again: hand back what ``start`` borrowed."""

    def replays(self) -> bool:
        """Whether resuming reads the elements of the steps already made again."""
        return True

    def skip(self, elements: Iterator[Any], count: int) -> None:
        """Read and discard ``count`` elements; ``ValueError`` when the source has fewer."""
        if count and self.replays() and self._warn_on_replay():
            warnings.warn(
                f"Restoring the position of a distributed iterator over a "
                f"{type(self.source).__name__} by reading and discarding the {count} element(s) "
                "it had already produced (fast-forward). Pass a "
                "torchdata.stateful_dataloader.StatefulDataLoader (pip install torchdata) to "
                "resume without reading them again.",
                UserWarning,
                stacklevel=4,
            )
        read = sum(1 for _ in itertools.islice(elements, count))
        if read < count:
            raise ValueError(
                f"Cannot restore the iterator's position: it had made steps from {count} "
                f"elements of its source, but a pass over the source now has only {read}. "
                "Restore into a pipeline built as the saved one was (same data, same "
                "transformations and batch sizes)."
            )

    def _warn_on_replay(self) -> bool:
        return False


@final
class DatasetSource(Source):
    """A ``cs.Dataset``: the random stages' seeds and pass counts."""

    kind = "Dataset"

    def __init__(self, source: DatasetBase) -> None:
        super().__init__(source)
        self._stages = source._random_stages()

    def origin(self) -> dict[str, Any]:
        return {"random_stages": [s.state() for s in self._stages]}

    def current(self) -> dict[str, Any]:
        return self.origin()

    def start(self, origin: dict[str, Any], mark: Any) -> Iterator[Any]:
        self.settle(origin, mark)
        return iter(self.source)

    def settle(self, current: dict[str, Any], mark: Any) -> None:
        states = current["random_stages"]
        if len(states) != len(self._stages):
            raise ValueError(
                f"Cannot restore the iterator's position: the saved pipeline had {len(states)} "
                f"random stage(s) (shuffle, random, sample_from_datasets), this one has "
                f"{len(self._stages)}. Restore into a pipeline built as the saved one was. "
                f"Received: {len(states)} saved random stage states"
            )
        for stage, state in zip(self._stages, states, strict=True):
            stage.set_state(state)


@final
class LoaderSource(Source):
    """A ``DataLoader``: the generators its order is drawn from; resuming reads again."""

    kind = "DataLoader"

    def __init__(self, source: Iterable[Any]) -> None:
        super().__init__(source)
        self._kept: torch.Tensor | None = None  # the global generator's state, while borrowed

    def _generators(self) -> list[torch.Generator]:
        loader: Any = self.source
        found = [loader.generator, getattr(loader.sampler, "generator", None)]
        return [g for g in dict.fromkeys(found) if isinstance(g, torch.Generator)]

    def origin(self) -> dict[str, Any]:
        global_state = None if getattr(self.source, "generator", None) else torch.get_rng_state()
        return {"generators": [g.get_state() for g in self._generators()], "global": global_state}

    def current(self) -> dict[str, Any]:
        return {"generators": [g.get_state() for g in self._generators()], "global": None}

    def start(self, origin: dict[str, Any], mark: Any) -> Iterator[Any]:
        generators = self._generators()
        if len(origin["generators"]) != len(generators):
            raise ValueError(
                "Cannot restore the iterator's position: the saved DataLoader drew its order "
                f"from {len(origin['generators'])} generator(s), this one from "
                f"{len(generators)}. Build the DataLoader as the saved one was (generator=, "
                "sampler=)."
            )
        for generator, state in zip(generators, origin["generators"], strict=True):
            generator.set_state(state)
        if origin["global"] is None:
            return iter(self.source)
        # Without a generator of its own the loader draws from torch's global one: read the
        # pass again from the saved global state; finish() hands the global generator back.
        self._kept = torch.get_rng_state()
        torch.set_rng_state(origin["global"])
        try:
            return iter(self.source)
        except BaseException:
            self.finish()
            raise

    def settle(self, current: dict[str, Any], mark: Any) -> None:
        for generator, state in zip(self._generators(), current["generators"], strict=True):
            generator.set_state(state)

    def finish(self) -> None:
        if self._kept is not None:
            torch.set_rng_state(self._kept)
            self._kept = None

    def _warn_on_replay(self) -> bool:
        return True


@final
class StatefulLoaderSource(Source):
    """torchdata's ``StatefulDataLoader``: its own state after each step, nothing read again."""

    kind = "StatefulDataLoader"

    def mark(self) -> Any:
        return self.source.state_dict()  # type: ignore[attr-defined]

    def start(self, origin: dict[str, Any], mark: Any) -> Iterator[Any]:
        if mark is not None:
            self.source.load_state_dict(mark)  # type: ignore[attr-defined]
        return iter(self.source)

    def replays(self) -> bool:
        return False

    def settle(self, current: dict[str, Any], mark: Any) -> None:
        if mark is not None:  # its own state says where the next pass starts
            self.source.load_state_dict(mark)  # type: ignore[attr-defined]


@final
class OtherSource(Source):
    """Any other re-iterable (a list, a custom iterable): its passes must repeat themselves."""

    kind = "plain iterable"


def source_of(dataset: Iterable[Any]) -> Source:
    """The ``Source`` that knows how to find a place again in ``dataset``.

    >>> from centralstore.input.dataset import Dataset
    >>> source_of(Dataset.range(4).shuffle(4, seed=1)).origin()
    {'random_stages': [[1, 0]]}
    """
    if isinstance(dataset, DatasetBase):
        return DatasetSource(dataset)
    if callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    ):
        return StatefulLoaderSource(dataset)
    if isinstance(dataset, torch.utils.data.DataLoader):
        return LoaderSource(dataset)
    return OtherSource(dataset)
