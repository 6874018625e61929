"""``Dataset``: the lazy, re-iterable subset of ``tf.data.Dataset`` that ported code needs.

Built on ``torch.utils.data.IterableDataset`` so that it also feeds a ``DataLoader``. The
class is three layers, one concept each: reading (``_base.py``: cardinality, reductions,
``element_spec``), transforming (``_transforms.py``) and, here, the sources and the one
kind of dataset they all build: a ``_Stage``, a module-level generator function with its
arguments (so that datasets pickle into DataLoader workers; a closure would not), which
carries the ``Options`` of its inputs. ``from_tensor_slices`` is the one other kind: it
cuts whole batches as views, which ``batch`` uses instead of stacking rows one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import _tree
from . import _batching, _stages
from ._arguments import check_datasets, seed_or_draw
from ._base import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, DatasetBase
from ._transforms import Generate, Transformations
from .components import to_components
from .data_options import AUTOTUNE, Options, merged
from .options import as_int
from .spec import TensorSpec, as_shape
from .strings import Strings, num_rows

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset"]


class Dataset(Transformations["Dataset"]):
    """A lazy, re-iterable pipeline of elements: tensors, strings, or structures of them.

    TensorFlow's names and conventions (``cardinality()`` is -1 for infinite, -2 for
    unknown); ``tf.data`` examples run after renaming ``tf.data.Dataset`` to ``cs.Dataset``.
    As with every ``IterableDataset``, each ``DataLoader`` worker iterates the whole dataset:
    ``shard`` it by ``torch.utils.data.get_worker_info()`` when using ``num_workers > 0``.

    >>> [b.tolist() for b in Dataset.range(5).batch(2)]
    [[0, 1], [2, 3], [4]]
    """

    def _stage(
        self, generate: Generate, args: tuple[Any, ...], n: int, options: Options | None = None
    ) -> Dataset:
        return _Stage(generate, args, n, options)

    # Sources.

    @staticmethod
    def range(*args: int, output_type: torch.dtype = torch.int64) -> Dataset:
        """The integers of ``range(start, stop, step)`` as scalar tensors (int64 by default).

        >>> [int(x) for x in Dataset.range(1, 8, 3)]
        [1, 4, 7]
        """
        if not 1 <= len(args) <= 3:
            raise TypeError(
                f"Dataset.range takes 1 to 3 ints (start, stop, step). Received: args={args}"
            )
        values = range(*(as_int("args", a, "Dataset.range") for a in args))
        return _Stage(_stages.ranged, (values, output_type), len(values))

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: torch.dtype = torch.int64) -> Dataset:
        """``start``, ``start + step``, ... forever, as scalar tensors.

        >>> [int(x) for x in Dataset.counter(5, 2).take(3)]
        [5, 7, 9]
        """
        start = as_int("start", start, "Dataset.counter")
        step = as_int("step", step, "Dataset.counter")
        return _Stage(_stages.counted, (start, step, dtype), INFINITE_CARDINALITY)

    @staticmethod
    def random(seed: int | None = None, rerandomize_each_iteration: bool | None = None) -> Dataset:
        """Random non-negative int64 scalars forever (other values than TensorFlow's).

        With a ``seed`` every pass repeats the sequence unless ``rerandomize_each_iteration``.

        >>> a, b = (Dataset.random(seed=1).take(2) for _ in "ab")
        >>> [int(x) for x in a] == [int(x) for x in b]
        True
        """
        seed = seed_or_draw("Dataset.random", seed)
        seeds = _stages.Seeds(seed, bool(rerandomize_each_iteration))
        return _Stage(_stages.random_integers, (seeds,), INFINITE_CARDINALITY)

    @staticmethod
    def from_tensors(element: Any) -> Dataset:
        """A dataset of one element, ``element`` (numpy arrays shared, lists made tensors).

        >>> [x.tolist() for x in Dataset.from_tensors([[1.0]]).repeat(2)]
        [[[1.0]], [[1.0]]]
        """
        element = to_components(element, "Dataset.from_tensors")
        return _Slices(_tree.map_leaves(_one_row, element), 1)

    @staticmethod
    def from_tensor_slices(element: Any) -> Dataset:
        """A dataset of the slices of ``element`` along its first dimension, leaf by leaf.

        numpy arrays are wrapped with ``torch.from_numpy`` (no copy) and stay on the host;
        a list of strings gives ``str`` elements.

        >>> [(int(x), y["s"]) for x, y in Dataset.from_tensor_slices(([1, 2], {"s": ["a", "b"]}))]
        [(1, 'a'), (2, 'b')]
        """
        leaves, spec = _tree.flatten(to_components(element, "Dataset.from_tensor_slices"))
        sizes = [num_rows(leaf) for leaf in leaves]
        if not leaves or None in sizes or len(set(sizes)) > 1:
            raise ValueError(
                "Dataset.from_tensor_slices needs components that share their first dimension "
                "(the one sliced); use Dataset.from_tensors for a single element. "
                f"Received: sizes={sizes}"
            )
        return _Slices(_tree.unflatten(leaves, spec), sizes[0] or 0)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: Sequence[Any] | None = None,
        output_signature: Any = None,
    ) -> Dataset:
        """The elements that ``generator(*args)`` yields, calling it afresh for every pass.

        ``output_signature`` (a structure of ``TensorSpec``), or TensorFlow's older
        ``output_types`` and ``output_shapes``, converts and checks every component; without
        them elements are read as ``from_tensors`` reads its argument.

        >>> ds = Dataset.from_generator(lambda: iter([[1], [2, 3]]),
        ...                             output_signature=TensorSpec([None], torch.int32))
        >>> [x.tolist() for x in ds]
        [[1], [2, 3]]
        """
        if not callable(generator):
            raise TypeError(
                "Dataset.from_generator(generator) must be a function that returns an iterator "
                "(it is called once per pass); pass the generator function itself, not its "
                f"result. Received: generator={generator!r}"
            )
        signature = _signature(output_types, output_shapes, output_signature)
        arguments = () if args is None else tuple(args)
        return _Stage(_stages.generated, (generator, arguments, signature), UNKNOWN_CARDINALITY)

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> Dataset:
        """Elements of several datasets side by side, stopping with the shortest.

        Takes a tuple (or dict) of datasets as TensorFlow does, or the datasets as arguments.

        >>> [(int(x), int(y)) for x, y in Dataset.zip((Dataset.range(3), Dataset.range(7, 9)))]
        [(0, 7), (1, 8)]
        """
        if (datasets is None) == (not args):
            raise TypeError(
                "Dataset.zip takes the datasets as one structure, as arguments, or as "
                f"datasets=: exactly one of them. Received: args={args}, datasets={datasets}"
            )
        if datasets is None:
            datasets = args[0] if len(args) == 1 else args
        members = check_datasets("Dataset.zip", "datasets", _tree.flatten(datasets)[0], datasets)
        counts = [m.cardinality() for m in members]
        finite = [n for n in counts if n >= 0]
        n = UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in counts else INFINITE_CARDINALITY
        return _Stage(_stages.zipped, (datasets,), min(finite) if finite and n == -1 else n)

    @staticmethod
    def choose_from_datasets(
        datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
    ) -> Dataset:
        """The next element of ``datasets[i]`` for each index ``i`` of ``choice_dataset``.

        >>> choices = Dataset.from_tensor_slices([0, 1, 0])
        >>> ds = Dataset.choose_from_datasets([Dataset.range(3), Dataset.range(7, 9)], choices)
        >>> [int(x) for x in ds]
        [0, 7, 1]
        """
        call = "Dataset.choose_from_datasets"
        datasets = check_datasets(call, "datasets", datasets, datasets)
        check_datasets(call, "choice_dataset", [choice_dataset], choice_dataset)
        arguments = (datasets, choice_dataset, bool(stop_on_empty_dataset))
        return _Stage(_stages.chosen, arguments, UNKNOWN_CARDINALITY)

    @staticmethod
    def sample_from_datasets(
        datasets: Sequence[Dataset],
        weights: Sequence[float] | None = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset:
        """Elements drawn at random from ``datasets``, dataset i with probability ``weights[i]``.

        >>> ds = Dataset.sample_from_datasets([Dataset.range(3), Dataset.range(3, 5)], seed=0)
        >>> sorted(int(x) for x in ds)
        [0, 1, 2, 3, 4]
        """
        datasets = check_datasets("Dataset.sample_from_datasets", "datasets", datasets, datasets)
        weights = [1.0] * len(datasets) if weights is None else [float(w) for w in weights]
        if len(weights) != len(datasets) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                "Dataset.sample_from_datasets(weights) needs one non-negative weight per dataset, "
                f"not all zero ({len(datasets)} datasets). Received: weights={weights}"
            )
        call = "Dataset.sample_from_datasets"
        seeds = _stages.Seeds(seed_or_draw(call, seed), bool(rerandomize_each_iteration))
        arguments = (datasets, weights, seeds, bool(stop_on_empty_dataset))
        return _Stage(_stages.sampled, arguments, UNKNOWN_CARDINALITY)



class _Stage(Dataset):
    """A source or transformation: ``generate(*args)`` makes a fresh iterator per pass."""

    def __init__(
        self,
        generate: Callable[..., Iterator[Any]],
        args: tuple[Any, ...],
        n: int,
        options: Options | None = None,
    ) -> None:
        self._generate = generate
        self._args = args
        self._cardinality = n
        inputs = [a for a in _tree.leaves(args) if isinstance(a, DatasetBase)]
        self._options = merged(*(d._options for d in inputs), options)

    def __iter__(self) -> Iterator[Any]:
        return self._generate(*self._args)

    def _random_stages(self) -> list[Any]:
        found: dict[int, Any] = {}
        for leaf in _tree.leaves(self._args):
            inner = leaf._random_stages() if isinstance(leaf, DatasetBase) else [leaf]
            found.update((id(s), s) for s in inner if isinstance(s, _stages.Seeds))
        return list(found.values())


class _Slices(Dataset):
    """``from_tensor_slices`` (and ``from_tensors``): the rows of the leaves, as views."""

    def __init__(self, rows: Any, n: int) -> None:
        self._leaves, self._spec = _tree.flatten(rows)
        self._cardinality = n

    def __reduce__(self) -> tuple[Any, ...]:  # pickle the structure, not torch's TreeSpec
        return _Slices, (_tree.unflatten(self._leaves, self._spec), self._cardinality)

    def __iter__(self) -> Iterator[Any]:
        leaves, spec = self._leaves, self._spec
        for row in range(self._cardinality):
            yield _tree.unflatten([leaf[row] for leaf in leaves], spec)

    def _batcher(self, batch_size: int, drop_remainder: bool) -> tuple[Generate, tuple[Any, ...]]:
        n = self._cardinality
        return _batching.batched_slices, (self._leaves, self._spec, n, batch_size, drop_remainder)


# What the sources share.


def _one_row(leaf: Any) -> Any:
    """A batch of one row holding ``leaf``: a view for tensors."""
    return leaf.unsqueeze(0) if isinstance(leaf, torch.Tensor) else Strings([leaf])


def _signature(output_types: Any, output_shapes: Any, output_signature: Any) -> Any:
    """``from_generator``'s signature: ``output_signature``, or built from types and shapes."""
    call = "Dataset.from_generator"
    if output_signature is not None:
        if output_types is not None or output_shapes is not None:
            raise TypeError(
                f"{call} takes output_signature or the older output_types and output_shapes, "
                f"not both. Received: output_types={output_types!r}"
            )
        specs = _tree.flatten(output_signature)[0]
        if not specs or not all(isinstance(s, TensorSpec) for s in specs):
            raise TypeError(
                f"{call}(output_signature) must be a structure of cs.data.TensorSpec. "
                f"Received: output_signature={output_signature!r}"
            )
        return output_signature
    if output_types is None:
        if output_shapes is not None:
            raise TypeError(
                f"{call}(output_shapes) needs output_types too. "
                f"Received: output_shapes={output_shapes!r}"
            )
        return None
    dtypes, structure = _tree.flatten(output_types)
    try:
        shapes = [None] * len(dtypes) if output_shapes is None else structure.flatten_up_to(
            output_shapes
        )
    except (TypeError, ValueError):
        raise ValueError(
            f"{call}(output_shapes) must have the structure of output_types, {structure}, with "
            f"a shape for each component. Received: output_shapes={output_shapes!r}"
        ) from None
    return _tree.unflatten(
        [
            TensorSpec(None if s is None else as_shape(call, "output_shapes", s), d)
            for d, s in zip(dtypes, shapes, strict=True)
        ],
        structure,
    )
