"""What every dataset answers by reading its elements, and the error for what it lacks.

``Dataset``'s sources (``dataset.py``) and transformations (``_transforms.py``) build
pipelines; this base holds the calls that build none:
the cardinality and ``len``, reductions over the elements, ``element_spec`` and the
``Options`` the pipeline carries. An attribute that is a ``tf.data.Dataset`` method without
a counterpart here raises an ``AttributeError`` that says so and why.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from torch.utils.data import IterableDataset

from .. import _tree
from .components import to_components, to_numpy
from .data_options import Options, merged
from .spec import spec_of

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2

_README = "See the tf.data table in docs/data.md (section 'Porting from tf.data')."
_UNSUPPORTED = {
    "bucket_by_sequence_length": "bucketing by length is not built in; padded_batch pads "
    "each batch to its longest element",
    "distributed_save": "there is no tf.data service here",
    "fingerprint": "pipelines are Python objects without a graph to fingerprint",
    "group_by_reducer": "grouping by key is not built in",
    "group_by_window": "grouping by key is not built in",
    "ignore_errors": "a Python generator cannot resume after it raised; catch errors in map",
    "list_files": "there are no file-reading sources; list the files with glob and use "
    "from_tensor_slices",
    "load": "TensorFlow's snapshot format has no counterpart; use torch.save and torch.load",
    "ragged_batch": "torch has no ragged tensors; padded_batch pads to one shape",
    "rejection_resample": "resampling by class is not built in; use sample_from_datasets",
    "save": "TensorFlow's snapshot format has no counterpart; use torch.save and torch.load",
    "snapshot": "TensorFlow's snapshot format has no counterpart; use cache()",
    "sparse_batch": "torch's sparse tensors are not batched here; padded_batch pads",
    "window": "elements that are themselves datasets are not supported; batch consecutive "
    "elements with batch, or build windows in map",
}


class DatasetBase(IterableDataset[Any]):
    """The reading layer of ``Dataset``: see ``Dataset`` for the whole."""

    _cardinality: int = UNKNOWN_CARDINALITY
    _options: Options | None = None

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """A fresh iterator over the elements: every pass starts from the beginning."""

    def _random_stages(self) -> list[Any]:
        """The ``Seeds`` of every random stage of the pipeline, each once, in a fixed order
        (what a distributed iterator saves and restores)."""
        return []

    def cardinality(self) -> int:
        """The number of elements; -1 (``INFINITE_CARDINALITY``), or -2 when unknown.

        >>> import centralstore as cs
        >>> cs.Dataset.range(5).batch(2).cardinality(), cs.Dataset.range(1).repeat().cardinality()
        (3, -1)
        """
        return self._cardinality

    def __len__(self) -> int:
        n = self._cardinality
        if n < 0:
            why = "is infinite" if n == INFINITE_CARDINALITY else "is unknown (e.g. after filter)"
            raise TypeError(f"The dataset's length {why}, so it has no len(); see cardinality().")
        return n

    def options(self) -> Options:
        """The ``Options`` of the pipeline: those set with ``with_options`` on it or upstream.

        >>> import centralstore as cs
        >>> cs.Dataset.range(3).options()
        Options()
        """
        return merged(self._options)

    @property
    def element_spec(self) -> Any:
        """The structure of the elements with a ``TensorSpec`` for each component.

        Read off the first element of a separate pass (TensorFlow knows it statically), so
        its sizes are the first element's, where TensorFlow may have None.

        >>> import centralstore as cs
        >>> cs.Dataset.from_tensor_slices(([1, 2], ["a", "b"])).element_spec
        (TensorSpec(shape=(), dtype=torch.int64), TensorSpec(shape=(), dtype=str))
        """
        for element in self:
            return spec_of(element, batched=False)
        raise ValueError(
            "Dataset.element_spec is read off the first element, and this dataset has none. "
            "Inspect a dataset that has elements."
        )

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements with every tensor as a numpy array (0-d tensors as numpy scalars).

        Strings stay ``str`` (TensorFlow gives ``bytes``).

        >>> import centralstore as cs
        >>> [int(x) for x in cs.Dataset.range(2).as_numpy_iterator()]
        [0, 1]
        """
        return (_tree.map_leaves(to_numpy, element) for element in self)

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """The elements folded into one value: ``state = reduce_func(state, element)``.

        >>> import centralstore as cs
        >>> int(cs.Dataset.range(5).reduce(0, lambda state, x: state + x))
        10
        """
        state = to_components(initial_state, "Dataset.reduce(initial_state)")
        for element in self:
            state = reduce_func(state, element)
        return state

    def get_single_element(self) -> Any:
        """The one element of a dataset that has exactly one, else ``ValueError``.

        >>> import centralstore as cs
        >>> cs.Dataset.from_tensors([1, 2]).get_single_element().tolist()
        [1, 2]
        """
        iterator = iter(self)
        empty = object()
        element, second = next(iterator, empty), next(iterator, empty)
        if element is empty or second is not empty:
            what = "has no element" if element is empty else "has more than one element"
            raise ValueError(
                f"Dataset.get_single_element needs a dataset of exactly one element, but this "
                f"one {what}. Use take(1) for the first element, or batch the dataset."
            )
        return element

    def __repr__(self) -> str:
        return f"<{_public_name(self)} cardinality={self._cardinality}>"

    if not TYPE_CHECKING:  # keep attribute typos visible to type checkers

        def __getattr__(self, name: str) -> NoReturn:
            if name in _UNSUPPORTED:
                raise AttributeError(
                    f"cs.Dataset has no {name}(): tf.data.Dataset.{name} is not supported "
                    f"({_UNSUPPORTED[name]}). {_README}"
                )
            raise AttributeError(f"'{_public_name(self)}' object has no attribute {name!r}")


def _public_name(dataset: DatasetBase) -> str:
    """The class name users see: stages and sources are all ``Dataset`` to them."""
    kind = type(dataset).__name__
    return "Dataset" if kind.startswith("_") else kind
