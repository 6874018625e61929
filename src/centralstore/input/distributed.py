"""Distributed datasets: global batches cut or dealt over replicas, placed, prefetched.

Three stages. A *cut* turns source elements into steps of per-replica slices:
``split_steps`` applies the split rule to global batches (``split.Split``), ``dealt_steps``
deals whole elements round-robin (``split.deal_steps``). A ``_Mover`` puts each slice on its
replica's device. A batch of tensors in plain tuples, lists and dicts, the usual
``DataLoader`` and ``cs.Dataset`` batch, is cut and placed in one walk that rebuilds its
structure as it goes; any other batch goes through pytree's flatten and unflatten. When
replicas compute on GPUs, a ``PrefetchIterator`` (``prefetch.py``) runs both ahead of the
training loop on a background thread with a bounded queue, so that the host-to-device copies
overlap the step; the thread holds the source iterator and the stages, never the
``DistributedIterator`` the user holds, so dropping that stops it. On the host the first
steps are made on the calling thread, and an ``OverlapIterator`` hands the rest of the pass
to that thread once the loop's steps take time, so that making a batch overlaps the step,
and takes it back when that made the loop slower (a step of small torch calls waits for the
GIL the thread holds); a loop that does nothing else never starts it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, final

import torch

from .. import _tree
from .._devices import CurrentStreams, storage_device
from .._values import PerReplica
from ._base import DatasetBase
from .data_options import AutoShardPolicy
from .iterator import DistributedIterator, Exhausted, Step, Steps
from .options import InputContext, InputOptions
from .prefetch import OverlapIterator, OverlapVerdict, PrefetchIterator
from .resume import Source, source_of
from .spec import spec_of
from .split import Columns, Split, deal_steps

# A pass's elements, the placement and the source's mark -> the pass's steps.
Cut = Callable[[Iterator[Any], "_Mover", Callable[[], Any]], Generator[Step, None, None]]


# The placement: per-replica slices -> values on the replicas' devices.


class _Target(Protocol):
    def put(self, leaf: Any) -> Any: ...


class _Copy:
    """A device without streams (the host CPU, MPS): a leaf elsewhere is copied, else kept;
    the copy is done when ``put`` returns, so a step has nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def put(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device == self._device:
            return leaf
        return leaf.to(self._device)


class _CudaCopy:
    """A GPU: copies from pinned host memory on a side stream, ready behind a CUDA event.

    The copies run on this target's own stream, so they overlap the training step. A slice
    already in pinned memory belongs to its source (a ``DataLoader(pin_memory=True)``, or one
    that refills a pinned buffer): the producer waits for the step's copies before it takes
    the next element. The consumer's current stream waits for the event before it uses the
    tensors, and
    ``record_stream`` keeps the caching allocator from reusing their memory (allocated on the
    side stream) while the consumer's kernels may still read it.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._current = CurrentStreams()  # the streams current on the GPUs, by their handles
        self._copied: list[torch.Tensor] = []
        self._borrowed = False  # a step copies from pinned memory that its source owns

    def put(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device == self._device:
            return leaf
        if leaf.device.type == "cpu":
            if leaf.is_pinned():
                self._borrowed = True
            else:
                leaf = leaf.pin_memory()
        else:  # another GPU: copy after the work that produced the leaf, and keep it alive
            self._stream.wait_stream(self._current(leaf.device))
            leaf.record_stream(self._stream)
        with self._current.switch(self._stream):
            copy = leaf.to(self._device, non_blocking=True)
        self._copied.append(copy)
        return copy

    def finish(self) -> Callable[[], None] | None:
        if not self._copied:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        if self._borrowed:  # the source may refill its buffer for the next element: not
            self._borrowed = False  # before the copies have read it
            event.synchronize()
        ready = _CudaReady(self._device, event, self._copied, self._current)
        self._copied = []
        return ready


class _CudaReady:
    """Run by the consumer: order its current stream after the copies of one step."""

    __slots__ = ("_current", "_device", "_event", "_tensors")

    def __init__(
        self, device: torch.device, event: torch.cuda.Event, tensors: list[Any],
        current: CurrentStreams,
    ) -> None:
        self._device = device
        self._event = event
        self._tensors = tensors
        self._current = current

    def __call__(self) -> None:
        stream = self._current(self._device)
        stream.wait_event(self._event)
        for tensor in self._tensors:
            tensor.record_stream(stream)


class _Mover:
    """Puts each local replica's slices on its device and builds the step's value.

    Slices of a host tensor stay where they are when every replica is on the host (the
    usual CPU case): the check is one ``is_cpu`` per leaf, not one per slice.
    """

    def __init__(self, devices: tuple[str, ...], fetch_to_device: bool) -> None:
        targets: dict[str, _Target] = {}
        for name in devices if fetch_to_device else ():
            if name not in targets:
                device = storage_device(name)
                targets[name] = _CudaCopy(device) if device.type == "cuda" else _Copy(device)
        self._targets = [targets[name] for name in devices] if fetch_to_device else None
        self._streamed = [t for t in targets.values() if isinstance(t, _CudaCopy)]
        self._host = all(storage_device(name).type == "cpu" for name in devices)
        self._per_replica = len(devices) > 1

    def leaf(self, leaf: torch.Tensor, slices: Sequence[torch.Tensor]) -> Any:
        """One leaf of the step: ``leaf``'s slices, placed, as a PerReplica (R >= 2)."""
        targets = self._targets
        if targets is not None and not (self._host and leaf.is_cpu):
            slices = [t.put(piece) for t, piece in zip(targets, slices, strict=True)]
        return PerReplica(slices) if self._per_replica else slices[0]

    def value(self, columns: Columns, spec: _tree.TreeSpec) -> Any:
        """The step of any batch in the column layout (``split.py``)."""
        targets = self._targets
        if targets is not None:
            columns = [
                [t.put(leaf) for t, leaf in zip(targets, column, strict=True)] for column in columns
            ]
        if self._per_replica:
            leaves: list[Any] = [PerReplica(column) for column in columns]
        else:
            leaves = [column[0] for column in columns]
        if spec.is_leaf():
            return leaves[0]
        return _tree.unflatten(leaves, spec)

    def waits(self) -> tuple[Callable[[], None], ...]:
        """What the consumer runs before using the slices placed since the last call: the
        GPUs' (a host copy is done when ``put`` returns)."""
        if not self._streamed:
            return ()
        finished = (target.finish() for target in self._streamed)
        return tuple(wait for wait in finished if wait is not None)


class _NotPlain(Exception):
    """A batch that ``_plain_step`` does not walk: ``Split.leaves`` cuts it instead."""


def _plain_step(node: Any, split: Split, place: _Mover) -> Any:
    """The step of a batch of tensors in plain tuples, lists and dicts, built in one walk.

    The structure is rebuilt as it is read, without pytree's flatten and unflatten, which
    cost more than the rest of a step; dicts keep their order, as pytree's do. Anything else
    (namedtuples, numpy arrays, strings, registered containers) raises ``_NotPlain``.
    """
    cls = type(node)
    if cls is tuple or cls is list:
        return cls([_plain_step(item, split, place) for item in node])
    if cls is dict:
        return {key: _plain_step(item, split, place) for key, item in node.items()}
    if isinstance(node, torch.Tensor):
        return place.leaf(node, split.tensor(node))
    raise _NotPlain


def split_steps(
    batches: Iterator[Any], place: _Mover, mark: Callable[[], Any], *, split: Split
) -> Generator[Step, None, None]:
    """The steps of one pass of ``experimental_distribute_dataset``: a global batch each.

    ``mark()``, called once a step's elements are pulled (by the prefetch thread, if any),
    is the source's position after them. Batches of tensors in plain containers take the
    one-walk path; the first batch that does not switches the pass to the general one.
    """
    plain = True
    for batch in batches:
        if plain:
            try:
                value = _plain_step(batch, split, place)
            except _NotPlain:
                plain = False
                place.waits()  # forget what the walk placed before it stopped
        if not plain:
            value = place.value(*split.leaves(batch))
        yield value, place.waits(), mark()


def dealt_steps(
    elements: Iterator[Any], place: _Mover, mark: Callable[[], Any], *, num_replicas: int
) -> Generator[Step, None, None]:
    """The steps of one pass of ``distribute_datasets_from_function``: R elements each."""
    for columns, spec in deal_steps(elements, num_replicas):
        yield place.value(columns, spec), place.waits(), mark()


# The public face: the dataset (its iterator is in iterator.py).


class DistributedDataset:
    """A re-iterable dataset whose elements are steps: per-replica batches on their devices.

    Built by ``strategy.experimental_distribute_dataset`` and
    ``strategy.distribute_datasets_from_function``. Each ``iter`` is one pass over the source.
    With one replica the values are the plain batches; with several, every leaf of the batch
    structure is a ``PerReplica``. It has ``len`` when its source has.

    ``element_spec`` is read off the first step of a separate pass over the source (made
    once, on the host, and kept): TensorFlow knows it statically.
    """

    def __init__(
        self,
        source: Iterable[Any],
        cut: Cut,
        elements_per_step: int,
        devices: tuple[str, ...],
        options: InputOptions,
    ) -> None:
        self._source = source
        self._cut = cut
        self._elements_per_step = elements_per_step
        self._devices = devices
        self._options = options
        # Prefetch from the first step where there is a copy to overlap with the step. On the
        # host a thread pays two hand-offs a step, and gains only where the loop's step
        # leaves time to make the next one: an OverlapIterator starts it once it does.
        self._to_gpu = any(storage_device(d).type == "cuda" for d in devices)
        self._overlap = OverlapVerdict()  # whether making steps ahead paid, for every pass
        self._spec: Any = None
        self._position = source_of(source)

    def __iter__(self) -> DistributedIterator:
        position = _Pass(self._position, self._elements_per_step, self._make_steps)  # first
        return DistributedIterator(self._make_steps(iter(self._source)), position)

    def _make_steps(self, elements: Iterator[Any]) -> Steps:
        options = self._options
        # A pipeline placed on the device puts its steps there too, only without prefetching.
        fetch = options.experimental_fetch_to_device or options.experimental_place_dataset_on_device
        place = _Mover(self._devices, fetch)
        steps = self._cut(elements, place, self._position.mark)
        ahead = options.experimental_per_replica_buffer_size
        if options.experimental_place_dataset_on_device:
            return steps
        if fetch and self._to_gpu:
            return PrefetchIterator(steps, ahead)
        return OverlapIterator(steps, ahead, verdict=self._overlap)

    @property
    def element_spec(self) -> Any:
        """The structure of a step with a ``TensorSpec`` per leaf, the batch dimension None.

        With several replicas each spec describes one replica's slice (TensorFlow gives a
        ``PerReplicaSpec`` of them). ``ValueError`` when the source has no element.

        >>> import numpy as np
        >>> from centralstore.input.dataset import Dataset
        >>> ds = Dataset.from_tensor_slices((np.zeros((4, 3)), ["a", "b", "c", "d"])).batch(4)
        >>> distribute_dataset(ds, ("cpu:0", "cpu:1")).element_spec
        (TensorSpec(shape=(None, 3), dtype=torch.float64), TensorSpec(shape=(None,), dtype=str))
        """
        if self._spec is None:
            place = _Mover(self._devices, False)
            steps = self._cut(iter(self._source), place, lambda: None)
            first = next(steps, None)
            steps.close()
            if first is None:
                raise ValueError(
                    "element_spec is read off the first step, and this distributed dataset's "
                    "source has no element. Distribute a dataset that has elements."
                )
            self._spec = spec_of(first[0], batched=True)
        return self._spec

    def __len__(self) -> int:
        try:
            source_length = len(self._source)  # type: ignore[arg-type]
        except TypeError:
            source = self._source
            kind = "Dataset" if isinstance(source, DatasetBase) else type(source).__name__
            raise TypeError(
                f"This distributed dataset has no len(): its source, a {kind}, has none (it may "
                "be infinite or of unknown length)."
            ) from None
        return -(-source_length // self._elements_per_step)


@final
class _Pass:
    """One iterator's pass over the source, as its ``state_dict`` needs it (``iterator.Pass``):
    where it began, and how to start it again at a saved step."""

    def __init__(
        self,
        source: Source,
        elements_per_step: int,
        make_steps: Callable[[Iterator[Any]], Steps],
    ) -> None:
        self._source = source
        self.kind = source.kind
        self.elements_per_step = elements_per_step
        self._make_steps = make_steps
        self._origin = source.origin()  # made before the pass's first element is drawn

    def origin(self) -> dict[str, Any]:
        return self._origin

    def current(self) -> dict[str, Any]:
        return self._source.current()

    def resume(self, state: Mapping[str, Any]) -> Steps:
        source = self._source
        if state["exhausted"]:
            source.settle(state["current"], state["mark"])
            return Exhausted()
        elements = source.start(state["origin"], state["mark"])
        try:
            if source.replays():
                source.skip(elements, int(state["steps"]) * self.elements_per_step)
        finally:
            source.finish()
        return self._make_steps(elements)


def distribute_dataset(
    dataset: Iterable[Any],
    devices: tuple[str, ...],
    options: InputOptions | None = None,
    *,
    replica_offset: int = 0,
    global_replicas: int | None = None,
) -> DistributedDataset:
    """Split each global batch of ``dataset`` over the replicas on ``devices``.

    ``dataset`` is a ``Dataset``, a ``DataLoader`` or any re-iterable of global batches.
    With ``global_replicas`` (a job of several workers), the dataset's
    ``Options().experimental_distribute.auto_shard_policy`` decides what this worker keeps:
    with ``AUTO`` or ``DATA`` each global batch is split over all ``global_replicas`` and this
    worker keeps replicas ``[replica_offset, replica_offset + len(devices))``, so every
    example is seen by one replica, as TensorFlow's ``DATA``; with ``OFF`` each global batch
    is split over this worker's replicas only, so every worker sees all the data.

    >>> from centralstore.input.dataset import Dataset
    >>> dist = distribute_dataset(Dataset.range(5).batch(4), ("cpu:0", "cpu:1"))
    >>> [[s.tolist() for s in step] for step in dist]
    [[[0, 1], [2, 3]], [[4], []]]
    """
    call = "experimental_distribute_dataset"
    devices = _check_devices(devices)
    options = _check_options(options)
    _check_source(dataset, call, "dataset")
    if global_replicas is None:
        global_replicas = len(devices)
    if replica_offset < 0 or replica_offset + len(devices) > global_replicas:
        raise ValueError(
            "The local replicas must lie within the replicas in sync: 0 <= replica_offset "
            "and replica_offset + len(devices) <= global_replicas, but got "
            f"replica_offset == {replica_offset}, len(devices) == {len(devices)} and "
            f"global_replicas == {global_replicas}."
        )
    if _auto_shard_policy(dataset) is AutoShardPolicy.OFF:
        global_replicas, replica_offset = len(devices), 0  # every worker sees all the data
    split = Split(global_replicas, replica_offset, len(devices))
    cut = functools.partial(split_steps, split=split)
    return DistributedDataset(dataset, cut, 1, devices, options)


def distribute_datasets_from_function(
    dataset_fn: Callable[[InputContext], Iterable[Any]],
    devices: tuple[str, ...],
    options: InputOptions | None = None,
    *,
    input_context: InputContext | None = None,
) -> DistributedDataset:
    """Deal the elements of ``dataset_fn(input_context)`` round-robin over the replicas.

    ``dataset_fn`` is called once, here; its elements are per-replica batches, element j
    going to replica j mod R unsplit. The last incomplete step is padded with empty batches.

    >>> from centralstore.input.dataset import Dataset
    >>> dist = distribute_datasets_from_function(
    ...     lambda ctx: Dataset.range(7).batch(3), ("cpu:0", "cpu:1"))
    >>> [[s.tolist() for s in step] for step in dist]
    [[[0, 1, 2], [3, 4, 5]], [[6], []]]
    """
    devices = _check_devices(devices)
    options = _check_options(options)
    call = "distribute_datasets_from_function"
    if not callable(dataset_fn):
        raise TypeError(
            f"{call}(dataset_fn) must be a function of an InputContext that returns a dataset. "
            f"Received: dataset_fn={dataset_fn!r}"
        )
    if input_context is None:
        input_context = InputContext(1, 0, len(devices))
    elif not isinstance(input_context, InputContext):
        raise TypeError(
            f"input_context must be an InputContext. Received: input_context={input_context!r}"
        )
    dataset = dataset_fn(input_context)
    _check_source(dataset, call, "dataset_fn's result")
    cut = functools.partial(dealt_steps, num_replicas=len(devices))
    return DistributedDataset(dataset, cut, len(devices), devices, options)


def _check_devices(devices: Sequence[str]) -> tuple[str, ...]:
    if isinstance(devices, str) or not all(isinstance(d, str) for d in devices) or not devices:
        raise TypeError(
            "devices must be a non-empty tuple of canonical device names, e.g. "
            f"('cpu:0', 'cpu:1'). Received: devices={devices!r}"
        )
    return tuple(devices)


def _check_options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be an InputOptions or None. Received: options={options!r}")
    return options


def _check_source(dataset: Any, call: str, argument: str) -> None:
    if isinstance(dataset, Iterator):
        raise TypeError(
            f"{call}({argument}) is a one-shot iterator ({type(dataset).__name__}), but a "
            "distributed dataset is iterated once per epoch. Pass a re-iterable: a Dataset, a "
            "DataLoader, a list, or an object whose __iter__ starts a fresh generator. "
            f"Received: {argument}={dataset!r}"
        )
    if not isinstance(dataset, Iterable) and not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"{call}({argument}) must be iterable (a Dataset, a DataLoader or a list of global "
            f"batches), but got a {type(dataset).__name__}. Received: {argument}={dataset!r}"
        )


def _auto_shard_policy(dataset: Any) -> AutoShardPolicy:
    """The dataset's ``auto_shard_policy`` (``AUTO`` for sources other than a ``Dataset``)."""
    if not isinstance(dataset, DatasetBase):
        return AutoShardPolicy.AUTO
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy in (AutoShardPolicy.FILE, AutoShardPolicy.HINT):
        raise ValueError(
            f"experimental_distribute_dataset(dataset) does not support the auto_shard_policy "
            f"AutoShardPolicy.{policy.name}: there are no file-reading sources or sharding "
            "hints here. Use AutoShardPolicy.DATA (each worker keeps its replicas' slices of "
            "every global batch) or OFF (each worker splits all the data over its own "
            "replicas), or shard by file in the dataset_fn of distribute_datasets_from_function. "
            f"Received: auto_shard_policy=AutoShardPolicy.{policy.name}"
        )
    return policy
