"""``Strategy``: everything a strategy does, given its compute and parameter devices.

Subclasses only choose the devices (``CentralStorageStrategy``, ``OneDeviceStrategy``) and,
for ``MultiWorkerCentralStorageStrategy``, the ``Workers``: what crosses process boundaries.
In one process R (``num_replicas_in_sync``) is the number of local replicas; with several
workers it counts the replicas of every worker, while ``run``, the views and the variable
store work on this process's local replicas.

The strategy is the one door to its state: it builds a ``Placement``, a ``VariableStore`` and
a pool of replica threads, and hands them (values, never itself) to what lies below.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from operator import is_not
from typing import Any

import numpy as np
import torch

from .. import _context, _integrations, _replicas, _tree
from .._devices import CurrentStreams
from .._placement import Placement
from .._random import ReplicaRandomness, Streams
from .._reduce import (
    Axis,
    ReduceOp,
    added_alike,
    concatenated_alike,
    gather_axis,
    mean_of,
    reduce_axes,
    reduce_plain,
)
from .._reduce import result_device as _result_device
from .._replica_context import ReplicaContext
from .._values import PerReplica, ValueContext, local_results, regroup, select, split_flat
from .._workers import OneProcess, Workers
from ..input import distributed as _distributed
from ..input.dataset import Dataset
from ..input.options import InputContext, InputOptions
from ..variables import views
from ..variables.runs import EMPTY, NOTHING, Run
from ..variables.store import VariableStore
from ..variables.unscoped import FirstUse
from .extended import StrategyExtended


def _cross_replica_only(call: str, stack: list[_context.Entry] | None = None) -> None:
    if _context.in_replica_of_strategy(stack):
        raise RuntimeError(
            f"strategy.{call} was called in replica context (inside strategy.run). It is a "
            f"cross-replica call: to run cross-replica code from a replica, use "
            f"get_replica_context().merge_call(fn)."
        )


def _is_value(leaf: Any) -> bool:
    """Whether ``leaf`` can be one replica's component of a reduction (a tensor, an array or
    a number)."""
    return isinstance(leaf, (torch.Tensor, np.ndarray, int, float, complex))


class Strategy(abc.ABC):
    """A distribution strategy: where variables live and where replicas compute.

    Abstract: use ``CentralStorageStrategy`` or ``OneDeviceStrategy``.
    """

    @abc.abstractmethod
    def __init__(
        self, compute_devices: Sequence[str], parameter_device: str, workers: Workers | None = None
    ) -> None:
        self._workers: Workers = OneProcess() if workers is None else workers
        self._placement = Placement.build(
            compute_devices, parameter_device, self._workers.num_workers,
            self._workers.worker_index,
        )
        # With one local replica among several workers, run returns plain values: they are
        # this worker's component in reduce and gather (as in TensorFlow's multi-worker).
        self._plain_is_local = (
            self._workers.num_workers > 1 and self._placement.local_replicas == 1
        )
        self._pool = _replicas.new_pool(self, type(self).__name__)
        # Each replica's GPU index, or None, and the GPUs once each: read once here, since
        # ``torch.device.type`` costs half a microsecond per access. A CUDA replica runs with
        # its GPU current (``torch.cuda.device``, given the index: a ``torch.device`` costs
        # torch 15 lines of Python more), as plain PyTorch code on one GPU does:
        # ``device="cuda"`` means its GPU, and a factory without a device creates on the CPU.
        # (A ``torch.device`` context would place those too, but it is a
        # ``TorchFunctionMode``: Python for every torch call of the replica.)
        gpus = [d if d.type == "cuda" else None for d in self._placement.storage_devices]
        self._gpus = tuple(None if d is None else d.index for d in gpus)
        self._distinct_gpus = tuple(dict.fromkeys(d for d in gpus if d is not None))
        self._current_streams = CurrentStreams()  # the GPUs' when a run begins, for threads
        # the streams of runs of several replicas (one replica draws from the global ones)
        self._randomness = ReplicaRandomness(self._placement)
        self._store = VariableStore(self._placement, self._workers)
        self._first_use = FirstUse(self._store.owned)
        # one replica in one process: from its second run, a run may take ``_run_alone``
        self._one_process = isinstance(self._workers, OneProcess)
        self._alone = self._one_process and self._placement.num_replicas == 1
        if self._alone:  # the run state and context entry of ``_run_alone``, reopened by each
            state = _replicas.RunState(1, self._pool, None)
            state.closed = True
            context = ReplicaContext(self, self._placement, self._workers, self._merge, 0, state)
            self._alone_entry = (state, _context.Entry(self, context, self._store))
        self._short = False  # whether runs may take ``_run_alone``: alone, first run passed
        self._merges = 0  # sync points made by merge_call, to explain an error after one
        self._extended = StrategyExtended(
            self._placement, self._store, self._workers, self.reduce
        )

    # -- properties ------------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """R, the number of replicas: one per compute device, on every worker."""
        return self._placement.num_replicas

    @property
    def compute_devices(self) -> tuple[str, ...]:
        """The canonical names of the compute devices, in replica order."""
        return self._placement.compute_devices

    @property
    def parameter_device(self) -> str:
        """The canonical name of the device that stores the variables."""
        return self._placement.parameter_device

    @property
    def extended(self) -> StrategyExtended:
        """Lower-level calls used by custom training code (``reduce_to``, ``update``, ...)."""
        return self._extended

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(compute_devices={list(self.compute_devices)}, "
            f"parameter_device={self.parameter_device!r}{self._workers.describe()})"
        )

    # -- scope -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Enter cross-replica context: tensors created here default to the parameter device,
        and module parameters, buffers and tensors made with ``requires_grad=True`` become
        central variables of this strategy.

        >>> import centralstore as cs
        >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     layer = torch.nn.Linear(2, 1)
        >>> strategy.extended.variable_created_in_scope(layer.weight)
        True
        """
        _cross_replica_only("scope()")
        entry = _context.current()
        if entry.strategy is not self and entry.strategy is not _context.default().strategy:
            raise RuntimeError(
                f"Mixing different strategies: {self!r}.scope() was entered inside the scope of "
                f"{entry.strategy!r}. Leave the outer scope first."
            )
        _context.push(_context.Entry(self, None, self._store))
        try:
            _integrations.activate()
            with torch.device(self._placement.parameter_storage), self._store.scope():
                yield self
            _integrations.activate()  # for a library first imported inside the scope
        finally:
            _context.pop()
        self._workers.share_variables(self._store)  # not reached when the block raised

    # -- run -------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once per replica and regroup the outputs.

        PerReplica values in ``args``/``kwargs`` give each replica its component. With one
        replica ``fn``'s output is returned as is; otherwise each leaf that differs between
        replicas becomes a ``PerReplica``. Gradients computed by the replicas are summed into
        the central variables' ``.grad`` before ``run`` returns.

        >>> import centralstore as cs
        >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> strategy.run(lambda: cs.get_replica_context().replica_id_in_sync_group)
        PerReplica({
          0: 0,
          1: 1
        })
        """
        stack = _context.stack()
        if stack:  # (empty outside every scope: the usual training loop)
            _cross_replica_only("run()", stack)
        if not isinstance(args, (list, tuple)):
            raise ValueError(
                f"args must be a list or a tuple of positional arguments for fn. Received: "
                f"args={args!r}"
            )
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise ValueError(f"kwargs must be a dict. Received: kwargs={kwargs!r}")
        local = self._placement.local_replicas
        inputs = split_flat(args, kwargs, local)
        if inputs is None:  # nested arguments, or a wrong count of components
            if _tree.contains(args, PerReplica) or _tree.contains(kwargs, PerReplica):
                self._check_components((args, kwargs), "run's arguments")
                inputs = [(select(args, r), select(kwargs, r)) for r in range(local)]
            else:
                inputs = [(args, kwargs)] * local
        store = self._store
        if self._short and (own := store.open_alone("strategy.run()")) is not None:
            return self._run_alone(own, fn, *inputs[0], stack)
        merges = self._merges
        store.claim("strategy.run()")
        try:
            self._workers.begin_run(store)
            outer = store.run  # a run inside merge_call: the run it is nested in
            run = store.open_run()
            checking = not self._first_use.passed  # (once passed, start and stop do nothing)
            if checking:
                self._first_use.start(store)
            try:
                if local == 1:  # on the calling thread, with no one to wait for in a rendezvous
                    state = _replicas.RunState(1, self._pool, None, run)
                    try:
                        self._run_replica(run, None, fn, inputs, None, state, 0)
                    finally:
                        state.closed = True
                else:  # one after another until a rendezvous, then each on a thread
                    streams = self._randomness.begin()
                    environment = _replicas.Environment(self._distinct_gpus, self._current_streams)
                    body = functools.partial(
                        self._run_replica, run, streams, fn, inputs, environment
                    )
                    state = _replicas.execute(local, self._pool, body, _Baton(run, streams))
            except BaseException as interrupt:  # on the calling thread, between replicas
                if checking:
                    self._first_use.stop(passed=False)
                self._end_run(interrupt, outer)
                raise
            error = (
                next(e for e in state.errors if e is not None) if state.any_failed else None
            )
            if checking:
                self._first_use.stop(passed=error is None)
                self._short = self._alone and self._first_use.passed
            # replicas that used the variables themselves, in one process, outside other runs:
            # the short path's sync point where it serves (``close_alone``)
            quiet = error is None and not run.uses_views and self._one_process and outer is EMPTY
            if not (quiet and store.close_alone()):
                self._end_run(error, outer)
        finally:
            store.release()
        if error is not None:
            raise self._noted(error, state.errors.index(error), merges != self._merges, run)
        if run.uses_views and any(map(is_not, state.outputs, repeat(None))):
            store.watch([t for t in _tree.leaves(state.outputs) if isinstance(t, torch.Tensor)])
        if local == 1:
            return state.outputs[0]
        return regroup(state.outputs)

    experimental_run_v2 = run

    def _run_alone(
        self, run: Run, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
        stack: list[_context.Entry],
    ) -> Any:
        """``run`` of one replica on the device of every variable, in one process, after the
        first run (which checks the modules it calls) and outside other runs: ``run``,
        opened by ``VariableStore.open_alone``, which claimed the store. ``fn`` is called on
        this thread in its replica context, inside the run's transaction (``OwnRun``), then
        the sync point, with none of the general path's dispatch between replicas, threads
        and modes.

        A run comes right after an optimizer step, whose sweep over the parameters and their
        state has pushed the run's code and data out of the CPU's caches, so each line and
        each object it touches costs several times its warm cost: the demo CNN's training
        step executed 190 lines more than plain PyTorch's through the general path, 148
        through this one when it came (1.04 of plain PyTorch's time against 1.02 in
        ``bench_models.py``'s turns), 118 now. For the same reason one run state and replica
        context serve every run of this path, reopened by each (making them took about 10 us
        right after a sweep through memory): a collective's backward checks that the run
        that made it is the one in progress (``RunState.meet``), and a context kept from
        one run works in a later one as that run's, the same object. And ``run`` reads the
        thread's context stack once (``stack``) for its check and this path's push and pop."""
        store = self._store
        merges = self._merges
        try:
            state, entry = self._alone_entry
            state.switch, state.closed = run, False
            stack.append(entry)
            error = None
            try:
                gpu = self._gpus[0]
                if gpu is None:
                    output = fn(*args, **kwargs)
                else:
                    with torch.cuda.device(gpu):
                        output = fn(*args, **kwargs)
            except BaseException as raised:
                error = raised
            finally:
                state.closed = True
                stack.pop()
            if error is not None or not store.close_alone():
                self._end_run(error, EMPTY)
        finally:
            store.release()
        if error is not None:
            raise self._noted(error, 0, merges != self._merges, run)
        return output

    def _noted(self, error: BaseException, replica: int, merged: bool, run: Run) -> BaseException:
        """``error``, raised by replica ``replica`` of ``run`` (``merged``: after a sync point
        of ``merge_call``), with notes that say where, once."""
        note = (
            f"(raised in replica {self._placement.replica_offset + replica} on device "
            f"{self.compute_devices[replica]})"
        )
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
            if merged and _SAVED_TENSOR_WRITTEN in str(error):
                error.add_note(_AFTER_MERGE)
            if run.uses_views and views.fullgraph_refused(error):
                error.add_note(views.FULLGRAPH_NOTE)
        return error

    def _check_components(self, value: Any, what: str) -> None:
        """Every PerReplica leaf of ``value`` has one component per local replica."""
        local = self._placement.local_replicas
        for leaf in _tree.leaves(value):
            if isinstance(leaf, PerReplica) and len(leaf) != local:
                raise ValueError(
                    f"{what} hold a PerReplica of {len(leaf)} components, but this strategy "
                    f"runs {local} local replicas: each PerReplica needs one "
                    "component per replica. Build it with strategy.run, a distributed "
                    "dataset or experimental_distribute_values_from_function. "
                    f"Received: {leaf!r}"
                )

    def _default_entry(self) -> _context.Entry:
        """The context entry of this strategy as the default one: cross-replica calls work,
        and its default replica context is replica 0 of no run."""
        context = ReplicaContext(self, self._placement, self._workers, self._merge, 0)
        return _context.Entry(self, context, self._store)

    def _run_replica(
        self,
        run: Run,
        streams: Streams | None,
        fn: Callable[..., Any],
        inputs: Sequence[tuple[Sequence[Any], dict[str, Any]]],
        environment: _replicas.Environment | None,
        state: _replicas.RunState,
        replica: int,
    ) -> None:
        """Replica ``replica`` of a run: ``fn`` on its own arguments, in its context. (The
        first five arguments are bound once per run: ``_replicas.execute`` calls the rest.)"""
        on_thread = replica > 0 and state.threaded
        context = ReplicaContext(
            self, self._placement, self._workers, self._merge, replica, state
        )
        _context.push(_context.Entry(self, context, self._store))
        if streams is not None:
            streams.enter(replica)
        args, kwargs = inputs[replica]
        try:
            scope = run.replica(replica)
            gpu = self._gpus[replica]
            if on_thread or gpu is not None:  # a replica thread, or a GPU to make current
                with (
                    environment.applied() if on_thread and environment is not None else NOTHING,
                    NOTHING if gpu is None else torch.cuda.device(gpu),
                    scope,
                ):
                    output = fn(*args, **kwargs)
            elif scope is NOTHING:  # one replica on its variables' device: nothing to enter
                output = fn(*args, **kwargs)
            else:
                with scope:
                    output = fn(*args, **kwargs)
        except _replicas.ReplicaAborted:
            pass
        except BaseException as error:
            state.failed(replica, error)
        else:
            state.returned(replica, output)
        finally:
            _context.pop()

    def _merge(
        self, merge_fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
        rendezvous: bool,
    ) -> Any:
        """``merge_fn(self, *args, **kwargs)`` once, in cross-replica context, after a sync
        point (``merge_call``); ``rendezvous``: several replicas wait for it, and it draws
        random numbers from a stream of its own (``ReplicaRandomness.merge``)."""
        _context.push(_context.Entry(self, None, self._store))
        self._merges += 1
        try:  # on the parameter device, as in scope(): optimizer state lands beside the weights
            if rendezvous:
                self._randomness.merge()
            store = self._store
            with torch.device(self._placement.parameter_storage), store.cross_replica():
                store.check_unseen()
                self._workers.sync(store, None)
                return merge_fn(self, *args, **kwargs)
        finally:
            _context.pop()

    def _end_run(self, error: BaseException | None, outer: Run) -> None:
        """The sync point at the end of ``run``: the run's work folded in, or discarded when
        a replica raised ``error``, which is then what ``run`` raises even if the sync point
        fails too (its error becomes a note). ``outer`` is the store's run before this one:
        it goes on (a run inside ``merge_call``) or is ``EMPTY``."""
        store = self._store
        try:
            found = store.close_run(error)
            self._workers.sync(store, found)
            if found is not error:
                raise found  # type: ignore[misc]
        except BaseException as sync_error:
            if error is None:
                raise
            if sync_error is not error:  # not merely re-raised by the other workers' verdict
                error.add_note(
                    f"(the sync point at the end of run then failed too: {sync_error})"
                )
        finally:
            store.run = outer
            store.in_run = outer is not EMPTY


    # -- reduce, gather, local results ----------------------------------------------------

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Axis = None) -> Any:
        """Reduce a PerReplica ``value`` to one value on the CPU (or the current
        ``torch.device`` context).

        SUM adds the components in replica order; MEAN divides by R, or with ``axis`` by the
        total number of elements along it over all replicas. Nested structures are reduced
        leaf by leaf. The autograd graph is kept.

        >>> import centralstore as cs
        >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> v = cs.PerReplica([torch.tensor([0., 1, 2, 3]), torch.tensor([4., 5])])
        >>> strategy.reduce("SUM", v, axis=0), strategy.reduce("MEAN", v, axis=0)
        (tensor(15.), tensor(2.5000))
        """
        _cross_replica_only("reduce()")
        op = ReduceOp.parse(reduce_op)
        reduce_axes(axis)  # checked here too, so that a plain or empty value gets the error
        if isinstance(value, PerReplica) and len(value) == self._placement.local_replicas:
            # the common case, without the pytree walk
            device = _result_device()
            if axis is None and self._one_process:  # and its usual values, one addition each
                total = added_alike(value.values, device)
                if total is not None:
                    return total if op is ReduceOp.SUM else mean_of(total, len(value))
            return self._workers.reduce(op, [value.values], axis, device)[0]
        if (
            type(value) is torch.Tensor and axis is None and not self._plain_is_local
            and (op is ReduceOp.MEAN or self._placement.num_replicas == 1)
        ):  # what run returns with one replica: the value itself, as ``reduce_plain`` gives
            return value
        self._check_components(value, "reduce's value")
        leaves, spec = _tree.flatten(value)
        where, parts = self._distributed_leaves(leaves)
        results = [
            leaf if i in where else reduce_plain(op, leaf, self.num_replicas_in_sync, axis)
            for i, leaf in enumerate(leaves)
        ]
        if parts:
            reduced = self._workers.reduce(op, parts, axis, _result_device())
            for i, total in zip(where, reduced, strict=True):
                results[i] = total
        return _tree.unflatten(results, spec)

    def _distributed_leaves(self, leaves: list[Any]) -> tuple[list[int], list[Sequence[Any]]]:
        """The positions and components of the leaves that reduce and gather combine over
        replicas: PerReplica values, and plain values when they are this worker's component
        (one local replica per worker)."""
        where: list[int] = []
        parts: list[Sequence[Any]] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, PerReplica):
                where.append(i)
                parts.append(leaf.values)
            elif self._plain_is_local and _is_value(leaf):
                where.append(i)
                parts.append((leaf,))
        return where, parts

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate a PerReplica ``value``'s components along ``axis`` (sizes along it may
        differ); a plain value is returned unchanged.

        >>> import centralstore as cs
        >>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> strategy.gather(cs.PerReplica([torch.tensor([1, 2]), torch.tensor([3])]), axis=0)
        tensor([1, 2, 3])
        """
        _cross_replica_only("gather()")
        axis = gather_axis(axis)
        if isinstance(value, PerReplica) and len(value) == self._placement.local_replicas:
            # the common case, without the pytree walk
            device = _result_device()
            if self._one_process:  # and its usual values, one concatenation
                joined = concatenated_alike(value.values, axis, device)
                if joined is not None:
                    return joined
            return self._workers.gather([value.values], axis, device)[0][0]
        self._check_components(value, "gather's value")
        leaves, spec = _tree.flatten(value)
        results = list(leaves)
        where, parts = self._distributed_leaves(leaves)
        if parts:
            gathered, _ = self._workers.gather(parts, axis, _result_device())
            for i, total in zip(where, gathered, strict=True):
                results[i] = total
        return _tree.unflatten(results, spec)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The local components of ``value``: a PerReplica's components; one copy per local
        replica of a nested structure (tuple, list, dict, ...), each PerReplica leaf replaced
        by that replica's component; ``(value,)`` for anything else (a tensor, a number).

        >>> import centralstore as cs
        >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> s.experimental_local_results(3), s.experimental_local_results([1, 2])
        ((3,), ([1, 2], [1, 2]))
        """
        return local_results(value, self._placement.local_replicas)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> PerReplica[Any]:
        """A PerReplica whose component i is ``value_fn(ValueContext(i, R))``, for the local
        replicas (i counts over all workers' replicas).

        >>> import centralstore as cs
        >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> s.experimental_distribute_values_from_function(
        ...     lambda ctx: ctx.replica_id_in_sync_group * 10).values
        (0, 10)
        """
        placement = self._placement
        return PerReplica(
            value_fn(ValueContext(placement.replica_offset + i, placement.num_replicas))
            for i in range(placement.local_replicas)
        )

    # -- input -----------------------------------------------------------------------------

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> _distributed.DistributedDataset:
        """Split each global batch of ``dataset`` over the replicas (TensorFlow's rule: slices
        of ceil(g/R), the last ones short or empty) and place each slice on its device.

        With several workers, every worker iterates the same global batches (give shuffling
        a seed) and keeps the slices of its own replicas (``AutoShardPolicy`` AUTO or DATA);
        with ``Options().experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF``
        (``dataset.with_options``) each worker splits every global batch over its own
        replicas.

        ``dataset`` is a ``cs.Dataset``, a ``DataLoader`` or any re-iterable of batches.

        >>> import centralstore as cs
        >>> s = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> [b.values for b in s.experimental_distribute_dataset(cs.Dataset.range(4).batch(4))]
        [(tensor([0, 1]), tensor([2, 3]))]
        """
        _cross_replica_only("experimental_distribute_dataset()")
        return _distributed.distribute_dataset(
            dataset, self.compute_devices, options,
            replica_offset=self._placement.replica_offset,
            global_replicas=self.num_replicas_in_sync,
        )

    def experimental_distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
    ) -> _distributed.DistributedDataset:
        """Call ``dataset_fn(InputContext)`` once (per worker) and deal its per-replica batches
        round-robin over the local replicas (element j to local replica j mod R_local); a final
        incomplete step is padded with empty batches. The ``InputContext`` says how many
        workers read input (``num_input_pipelines``) and which one this is, so ``dataset_fn``
        can shard: ``dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``.
        """
        _cross_replica_only("experimental_distribute_datasets_from_function()")
        workers = self._workers
        context = InputContext(
            workers.num_workers, workers.worker_index, self.num_replicas_in_sync
        )
        return _distributed.distribute_datasets_from_function(
            dataset_fn, self.compute_devices, options, input_context=context
        )

    distribute_datasets_from_function = experimental_distribute_datasets_from_function

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Dataset:
        """A ``Dataset`` of the slices of a numpy array (or a tuple/dict of arrays), on the host.

        >>> import centralstore as cs, numpy as np
        >>> ds = cs.CentralStorageStrategy(["cpu:0"]).experimental_make_numpy_dataset(
        ...     np.arange(3))
        >>> [int(x) for x in ds]
        [0, 1, 2]
        """
        return Dataset.from_tensor_slices(numpy_input)


# What autograd says when a tensor saved for backward was written since, and what to do when
# a sync point inside the run is what wrote it.
_SAVED_TENSOR_WRITTEN = "modified by an inplace operation"
_AFTER_MERGE = (
    "This run made a sync point (merge_call). If it came between a forward and its backward, "
    "it wrote variables that the backward needs as the forward saw them: the replicas' writes "
    "to buffers (batch norm's running statistics) and the replicas' own copies of the "
    "parameters. Call merge_call before the forward or after backward()."
)


class _Baton:
    """What changes hands when a replica of a run of several waits in a rendezvous
    (``_replicas.Switch``): its variables' state and its random streams. (One replica's
    switch is its run alone.)"""

    __slots__ = ("_run", "_streams")

    def __init__(self, run: Run, streams: Streams) -> None:
        self._run = run
        self._streams = streams

    def suspend(self, replica: int) -> None:
        self._run.suspend(replica)
        self._streams.suspend(replica)

    def resume(self, replica: int) -> None:
        self._streams.enter(replica)
        self._run.resume(replica)
