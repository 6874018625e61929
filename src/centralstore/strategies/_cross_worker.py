"""Across worker processes: the ``torch.distributed`` side of the multi-worker strategy.

Every cross-worker operation starts with an *agreement*: a fixed-size all-gather of one
row per worker naming the operation, whether the worker failed locally, and a signature
of the layout it is about to send (shapes, dtypes). Every worker then holds the same
table, so all take the same decision: run the data collectives (whose sizes now match),
or raise the same error. A worker that failed says so in its row instead of leaving the
others waiting, and workers that are out of step (one in ``reduce``, another at the end
of ``run``) are told so instead of exchanging mismatched buffers.

Every collective waits at most ``timeout``. After one fails, the group is marked broken
and every later call raises at once: the process should exit, and torchrun restarts it.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import hashlib
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from .._aggregation import sum_in_order
from .._autograd import no_grad
from .._reduce import (
    Axis,
    ReduceOp,
    as_tensor,
    element_count,
    gather_components,
    mean_of,
    reduce_components,
)
from .._workers import Workers
from ._flat import as_bytes, is_real, pack, padded, unflatten

if TYPE_CHECKING:
    from ..variables.records import Central
    from ..variables.store import VariableStore

# An agreement row (``agree``): its fields (kind, failed, signature, a to d), a slot in
# which a small reduce's sums travel (``reduce``), then the carried words (``carry_words``).
# Where agreement rows and other host-side words are made, whatever ``torch.device``
# context the sync point runs in: a merge's (the parameter device), ``scope()``'s, a user's.
HOST = torch.device("cpu")
AGREEMENT_FIELDS = 7
SMALL_WORDS = 8
CARRIED_AT = AGREEMENT_FIELDS + SMALL_WORDS
_TEXT_BYTES = 2048  # how much of an error message travels to the other workers


class Kind(enum.IntEnum):
    CONSTRUCTION = 1
    BROADCAST = 2
    SYNC = 3
    REDUCE = 4
    GATHER = 5
    STEP = 6


_KIND_NAMES = {
    Kind.CONSTRUCTION: "the strategy's construction",
    Kind.BROADCAST: "the broadcast of new central variables (scope exit or run start)",
    Kind.SYNC: "a sync point (end of run or merge_call)",
    Kind.STEP: "optimizer.step() with gradients pending from a backward after run",
    Kind.REDUCE: "reduce / all_reduce",
    Kind.GATHER: "gather / all_gather",
}


def signature(layout: object) -> int:
    """A 62-bit digest of ``layout``'s repr, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _exit_on_uncaught_error() -> None:
    """At exit after a broken collective, when an uncaught error ends the process: flush,
    then leave with status 1 before the interpreter's teardown. (With a dead or hung peer,
    torch's teardown of gloo can abort the survivor with SIGABRT, status 134, which hides
    the Python error from torchrun and from the user.)"""
    if getattr(sys, "last_value", None) is None:  # a normal exit: normal teardown
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def _real(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as a backend takes it: a complex tensor as the real tensor of its parts."""
    return torch.view_as_real(flat) if flat.is_complex() else flat


def _gradient_group(group: Any, num_workers: int, timeout: timedelta) -> Any:
    """A new process group of the same workers for gradient buckets, or None (one worker,
    or a ``group`` of only some processes: creating a group needs every process)."""
    if num_workers == 1 or num_workers != dist.get_world_size():
        return None
    ranks = list(range(num_workers)) if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks, timeout=timeout, backend=str(dist.get_backend(group)))


class _Through(torch.autograd.Function):
    """The global value forward, the local term's gradient backward: a backward through
    ``reduce`` reaches this worker's replicas; the other workers' terms are constants."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return total.view_as(total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Collectives(Workers):
    """The workers of one ``torch.distributed`` process group: the collectives over it.

    Abstract: its sync points are ``ProcessGroup``'s (``_exchange.py``).

    ``group`` is a process group, or None for the default one. ``device`` is where collective
    buffers live (the CPU for gloo, the GPU for NCCL); ``bucket_bytes`` caps one gradient
    all-reduce, so that the next bucket is packed while the previous one travels.
    ``gradient_group``: a second group of the same workers, where gradient buckets travel
    (``_buckets.py``: buckets that leave during backward must never interleave with other
    collectives differently on different workers); None for one worker, or when ``group``
    spans only some of the processes (then buckets travel in ``group``, after the agreement).
    ``traffic`` counts what this worker gave to collectives: their number and payload bytes.
    """

    def __init__(
        self, group: Any, timeout: timedelta, bucket_bytes: int, device: torch.device
    ) -> None:
        # None is the default group. No reference to it is kept: a process group object that
        # outlives destroy_process_group() can abort the interpreter at exit.
        self.group = group
        self.num_workers = dist.get_world_size(group)
        self.worker_index = dist.get_rank(group)
        self.timeout = timeout
        self.traffic = {"collectives": 0, "bytes": 0}
        self._counting = threading.Lock()
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.broken: str | None = None
        self._shared: list[Central] = []  # the central variables already broadcast
        self._ran = False
        # int64 words every agreement row carries after its slot (``ProcessGroup``: the
        # values of the variables written at the last sync point that wrote any, and the
        # numbers of entries of the sparse gradients); it changes only after a sync point
        # every worker passed, so every worker's rows stay one size
        self.carry_words = 0
        self.gradient_group = _gradient_group(group, self.num_workers, timeout)

    def describe(self) -> str:
        return f", worker {self.worker_index} of {self.num_workers}"

    def mark_broken(self, reason: str) -> None:
        """This process group is out of step for ``reason``: every later collective raises,
        and a process that ends on an uncaught error exits with status 1 without the C++
        teardown (see ``_exit_on_uncaught_error``)."""
        if self.broken is None:
            atexit.register(_exit_on_uncaught_error)
        self.broken = reason

    # -- the collectives ---------------------------------------------------------------------

    def _start(
        self, what: str, start: Callable[[], Any], payload: torch.Tensor
    ) -> Callable[[], None]:
        """Start a collective; the returned function waits for it (at most ``timeout``)."""
        if self.broken is not None:
            raise RuntimeError(
                f"Cannot run the cross-worker {what}: an earlier cross-worker step failed "
                f"({self.broken}), so this process group is out of step. Let the process "
                "exit; torchrun (--max-restarts) restarts every worker from the last checkpoint."
            )
        with self._counting:  # (a helper thread starts the buckets copied from GPUs)
            self.traffic["collectives"] += 1
            self.traffic["bytes"] += payload.numel() * payload.element_size()
        try:
            works = [start()]
        except Exception as error:
            self._fail(what, error)

        def wait() -> None:
            try:
                works.pop().wait(self.timeout)  # and drop it (see __init__)
            except Exception as error:
                self._fail(what, error)

        return wait

    def _fail(self, what: str, error: Exception) -> NoReturn:
        self.mark_broken(f"{what} on worker {self.worker_index}: {error}")
        raise RuntimeError(
            f"The cross-worker {what} failed on worker {self.worker_index} of "
            f"{self.num_workers} within timeout={self.timeout.total_seconds():g}s: "
            f"{error}. Another worker most likely failed or exited (its log says why), "
            "or has not reached the same step in time. This process group can no longer "
            "be used: let the process exit, and let torchrun restart the workers from "
            "the last checkpoint (or raise the strategy's timeout for slow steps)."
        ) from error

    def _wait(self, what: str, start: Callable[[], Any], payload: torch.Tensor) -> None:
        self._start(what, start, payload)()

    def _process_group(self) -> Any:
        """The ``ProcessGroup`` object of ``group``, looked up at each collective (see
        ``__init__``). Collectives go to it directly, as DDP's reducer sends its buckets,
        past ``torch.distributed``'s argument checks: this class makes its buffers itself,
        dense, contiguous and of one size on every worker (a start costs 35 to 45 us here
        against 60 to 100 through ``dist.all_reduce`` or ``dist.all_gather_single``)."""
        return dist.group.WORLD if self.group is None else self.group

    def start_all_reduce(self, what: str, flat: torch.Tensor) -> Callable[[], None]:
        """Start a SUM all-reduce of ``flat`` in place; call the result to wait for it."""
        return self._start(
            what, lambda: self._process_group().allreduce([_real(flat)]), flat
        )

    def start_gradient_all_reduce(self, what: str, flat: torch.Tensor) -> Callable[[], None]:
        """``start_all_reduce`` in the process group of gradient buckets (``group``'s when
        there is none)."""
        group = self.gradient_group
        if group is None:
            return self.start_all_reduce(what, flat)
        return self._start(what, lambda: group.allreduce([flat]), flat)

    def all_reduce(self, what: str, flat: torch.Tensor) -> None:
        self.start_all_reduce(what, flat)()

    def all_gather(self, what: str, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (1-D, the same size everywhere) from every worker: a [W, n] tensor."""
        out = flat.new_empty(self.num_workers * flat.numel())
        self._wait(
            what,
            lambda: self._process_group()._allgather_base(_real(out), _real(flat)),
            flat,
        )
        return out.view(self.num_workers, -1)

    def _broadcast(self, what: str, flat: torch.Tensor) -> None:
        self._wait(
            what,
            lambda: dist.broadcast(flat, group=self.group, group_src=0, async_op=True),
            flat,
        )

    def sum_across(
        self, what: str, tensors: Sequence[torch.Tensor], widen: bool = False
    ) -> list[torch.Tensor]:
        """Element-wise sums over the workers, one flat all-reduce per dtype, each group of a
        dtype and device packed and unpacked in one C call. With ``widen`` (the caller knows
        every sum to be exact in float64, the same on every worker), the real floating and
        integer tensors travel together as float64, in one all-reduce, and come back in
        their own dtypes."""
        results: list[torch.Tensor] = list(tensors)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, tensor in enumerate(tensors):
            groups.setdefault((tensor.dtype, tensor.device), []).append(i)
        carried: dict[torch.dtype, list[tuple[torch.dtype, torch.device]]] = {}
        for dtype, device in groups:
            wide = widen and is_real(dtype)
            carried.setdefault(torch.float64 if wide else dtype, []).append((dtype, device))
        with no_grad():
            for carrier, keys in carried.items():
                flats = [
                    pack([tensors[i] for i in groups[key]]).to(self.device, carrier)
                    for key in keys
                ]
                flat = flats[0] if len(flats) == 1 else torch.cat(flats)
                self.all_reduce(what, flat)
                offset = 0
                for (dtype, device), part in zip(keys, flats, strict=True):
                    back = flat[offset : offset + part.numel()].to(device, dtype)
                    offset += part.numel()
                    members = groups[(dtype, device)]
                    for i, piece in zip(
                        members, unflatten(back, [tensors[i] for i in members]), strict=True
                    ):
                        results[i] = piece
        return results

    def texts(self, text: str) -> list[str]:
        """``text`` (truncated) from every worker, in rank order."""
        data = text.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        table = self.all_gather("exchange of error messages", buffer).cpu()
        return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in table]

    # -- agreements --------------------------------------------------------------------------

    def agree(
        self, kind: Kind, signature: int = 0, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
        failed: bool = False, small: torch.Tensor | None = None,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every worker's row for the operation ``kind`` (a [W, CARRIED_AT + carry_words]
        int64 tensor on the CPU: ``kind``, ``failed``, ``signature``, ``a`` to ``d``, the
        ``small`` slot's ``SMALL_WORDS``, then the ``carried`` words; zeros for those not
        given); raises when the workers are in different operations. Every agreement has
        the slot and the carried words, whatever its kind, so that workers out of step still
        send rows of one size: a gather of rows of different sizes aborts the process
        (gloo) instead of raising."""
        row = torch.tensor(
            [int(kind), int(failed), signature, a, b, c, d, *[0] * SMALL_WORDS],
            dtype=torch.int64, device=HOST,
        )
        if small is not None:
            row[AGREEMENT_FIELDS:CARRIED_AT] = small
        if self.carry_words:
            words = row.new_zeros(self.carry_words) if carried is None else carried.cpu()
            row = torch.cat([row, words])
        row = row.to(self.device)
        table = self.all_gather(f"agreement on {_KIND_NAMES[kind]}", row).cpu()
        kinds = table[:, 0].tolist()
        if any(k != kind for k in kinds):
            where = ", ".join(
                f"worker {rank} in {_KIND_NAMES.get(k, f'operation {k}')}"
                for rank, k in enumerate(kinds)
            )
            self.mark_broken(f"the workers were out of step ({where})")
            hint = (
                " A backward after run must happen on every worker or on none (a loss reduced "
                "with strategy.reduce has the same value on every worker), since a worker "
                "without gradients pending at optimizer.step() does not exchange; or call "
                "backward inside run."
                if Kind.STEP in kinds else ""
            )
            raise RuntimeError(
                f"The workers are out of step: {where}. Every worker must make the same "
                "strategy calls (scope, run, reduce, gather, merge_call, optimizer.step) in "
                f"the same order, on central variables created the same way.{hint}"
            )
        return table

    def raise_failures(
        self, table: torch.Tensor, what: str, error: BaseException | None
    ) -> None:
        """When some worker failed locally (said so in ``table``): raise this worker's own
        ``error``, or one that names the failed workers and their errors."""
        failed = [rank for rank, flag in enumerate(table[:, 1].tolist()) if flag]
        if not failed:
            return
        texts = self.texts("" if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        details = "; ".join(f"worker {rank}: {texts[rank]}" for rank in failed)
        raise RuntimeError(
            f"{what} failed on worker(s) {failed} ({details}). This worker "
            f"({self.worker_index}) raises too, so that no worker waits for the others."
        )

    def check_signatures(self, table: torch.Tensor, what: str, mine: str) -> None:
        signatures = table[:, 2].tolist()
        if all(s == signatures[0] for s in signatures):
            return
        texts = self.texts(mine)
        details = "; ".join(f"worker {rank}: {text}" for rank, text in enumerate(texts))
        raise ValueError(
            f"{what} requires the same structure, shapes and dtypes on every worker, but "
            f"they differ ({details}). Give every worker values of the same shapes."
        )

    def check_local_replicas(self, devices: Sequence[str]) -> None:
        """Every worker must run the same number of replicas (the split rule assumes it)."""
        table = self.agree(Kind.CONSTRUCTION, a=len(devices))
        counts = table[:, 3].tolist()
        if any(n != counts[0] for n in counts):
            listing = ", ".join(f"worker {rank}: {n}" for rank, n in enumerate(counts))
            raise ValueError(
                "MultiWorkerCentralStorageStrategy requires the same number of local replicas "
                f"(compute devices) on every worker, but got {listing} (this worker has "
                f"compute_devices={list(devices)}). Give every worker the same number of "
                "compute devices."
            )

    # -- reduce and gather -------------------------------------------------------------------

    def reduce(
        self, op: ReduceOp, parts: Sequence[Sequence[Any]], axis: Axis, device: torch.device
    ) -> list[torch.Tensor]:
        try:
            sums = [reduce_components(ReduceOp.SUM, p, axis, device) for p in parts]
            counts = [element_count(p, axis) for p in parts]
        except Exception as error:
            self.raise_failures(self.agree(Kind.REDUCE, failed=True), "reduce", error)
            raise  # unreachable: raise_failures raised the local error
        layout = [(tuple(s.shape), str(s.dtype)) for s in sums]
        extra = [torch.tensor(counts, device=device)] if op is ReduceOp.MEAN else []
        small = _small_words([*sums, *extra])
        table = self.agree(
            Kind.REDUCE, signature((op, axis, layout)), len(parts), small=small
        )
        self.raise_failures(table, "reduce", None)
        self.check_signatures(table, f"reduce({op.name}, axis={axis})", repr(layout))
        if small is not None:  # the same layout everywhere: every worker's fit the slot
            summed = _small_sums(table[:, AGREEMENT_FIELDS:CARRIED_AT], [*sums, *extra])
        else:
            summed = self.sum_across(f"reduce({op.name})", [*sums, *extra])
        totals = summed[: len(sums)]
        results = [
            _Through.apply(s, t) if s.requires_grad else t  # type: ignore[no-untyped-call]
            for s, t in zip(sums, totals, strict=True)
        ]
        if op is ReduceOp.MEAN:
            divisors = summed[-1].tolist()
            results = [mean_of(r, n) for r, n in zip(results, divisors, strict=True)]
        return results

    def gather(
        self, parts: Sequence[Sequence[Any]], axis: int, device: torch.device
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        try:
            locals_ = [gather_components(p, axis, device) for p in parts]
            dims = [axis % t.dim() for t in locals_]
            sizes = [[int(as_tensor(c).shape[d]) for c in p] for p, d in zip(parts, dims)]
        except Exception as error:
            self.raise_failures(self.agree(Kind.GATHER, failed=True), "gather", error)
            raise
        layout = [
            (d, [s for i, s in enumerate(t.shape) if i != d], str(t.dtype))
            for t, d in zip(locals_, dims, strict=True)
        ]
        local_replicas = len(parts[0]) if parts else 0
        flat_sizes = torch.tensor(
            [s for row in sizes for s in row], dtype=torch.int64, device=HOST
        )
        small = _small_words([flat_sizes])  # the sizes travel in the agreement's slot if they fit
        table = self.agree(
            Kind.GATHER, signature(layout), len(parts), local_replicas, small=small
        )
        self.raise_failures(table, "gather", None)
        self.check_signatures(table, f"gather(axis={axis})", repr(layout))
        if small is not None:  # every worker's: the same number of parts and replicas
            size_table = table[:, AGREEMENT_FIELDS : AGREEMENT_FIELDS + flat_sizes.numel()]
        else:
            size_table = self.all_gather("gather's sizes", flat_sizes.to(self.device)).cpu()
        size_table = size_table.reshape(self.num_workers, len(parts), local_replicas)
        gathered, global_sizes = [], []
        for k, (mine, dim) in enumerate(zip(locals_, dims, strict=True)):
            per_worker = size_table[:, k, :].sum(dim=1).tolist()
            other = math.prod(s for i, s in enumerate(mine.shape) if i != dim)
            longest = max(per_worker) * other
            flat = torch.zeros(longest, dtype=mine.dtype, device=self.device)
            flat[: mine.numel()] = mine.detach().reshape(-1)
            table_k = self.all_gather(f"gather(axis={axis})", flat)
            pieces = []
            for rank, length in enumerate(per_worker):
                if rank == self.worker_index:
                    pieces.append(mine)  # keeps the local autograd graph
                    continue
                shape = list(mine.shape)
                shape[dim] = length
                pieces.append(table_k[rank, : length * other].view(shape).to(device))
            gathered.append(torch.cat(pieces, dim=dim))
            global_sizes.append(size_table[:, k, :].reshape(-1).tolist())
        return gathered, global_sizes

    # -- central variables -------------------------------------------------------------------

    def share_variables(self, store: VariableStore) -> None:
        """Broadcast the central variables registered since the last call from worker 0."""
        records = list(store.records.values())
        if records == self._shared:  # identity comparison: nothing new (the common case)
            return
        known = {id(r) for r in self._shared}
        self._shared = records
        self._broadcast_variables([r for r in records if id(r) not in known])

    def begin_run(self, store: VariableStore) -> None:
        """The first ``run`` broadcasts every central variable once more (so a checkpoint
        loaded after the scope, even by worker 0 alone, reaches every worker); later runs only
        the variables created since."""
        if self._ran:
            self.share_variables(store)
            return
        self._ran = True
        self._shared = list(store.records.values())
        self._broadcast_variables(self._shared)

    def _broadcast_variables(self, records: list[Central]) -> None:
        tensors = [t for r in records if (t := r.ref()) is not None]
        if not tensors:
            return
        layout = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        table = self.agree(Kind.BROADCAST, signature(layout), len(tensors))
        try:
            self.check_signatures(table, "Creating central variables", repr(layout))
        except ValueError:
            self.mark_broken("the workers created different central variables")
            raise
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with no_grad():
            for group in groups.values():
                flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
                self._broadcast("broadcast of central variables", flat)
                if self.worker_index != 0:
                    for t, piece in zip(group, torch.split(flat, [t.numel() for t in group])):
                        t.copy_(piece.view(t.shape))


def _small_words(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (real numbers) as the ``SMALL_WORDS`` int64 words of an agreement's slot,
    each one's bytes padded to 8; None when they do not fit (then they are summed in an
    all-reduce). A training step's reduced loss takes one word, two with MEAN's count."""
    if not all(is_real(t.dtype) for t in tensors) or sum(
        padded(t.numel() * t.element_size()) for t in tensors
    ) > 8 * SMALL_WORDS:
        return None
    data = torch.cat([
        *(as_bytes(t.detach().reshape(-1).cpu()) for t in tensors),
        torch.zeros(8 * SMALL_WORDS, dtype=torch.uint8, device=HOST),
    ])
    return data[: 8 * SMALL_WORDS].view(torch.int64)


def _small_sums(rows: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sums over the workers of the tensors ``like`` from every worker's slot
    (``rows``, [W, SMALL_WORDS]), added in worker order: the same values on every worker."""
    raw = rows.contiguous().view(torch.uint8)
    sums, offset = [], 0
    for tensor in like:
        size = tensor.numel() * tensor.element_size()
        every = raw[:, offset : offset + size].view(tensor.dtype)
        offset += padded(size)
        sums.append(sum_in_order(list(every)).reshape(tensor.shape).to(tensor.device))
    return sums
