"""Running the replicas of one ``run``: in order on the calling thread, threads when needed.

Replicas run one after another on the calling thread: deterministic and with no thread
hand-off. When replica 0 meets a rendezvous (``all_reduce``, ``all_gather``, ``merge_call``)
the others have not started, so they start on persistent worker threads and every replica
from then on meets at a generation-counted barrier. A replica that raises aborts the barrier,
so nobody waits forever; a replica that returns while others wait for it is an error too.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# A replica body: runs replica ``i`` of ``state`` on the current thread.
Body = Callable[["RunState", int], None]


class ReplicaAborted(Exception):
    """Raised in a replica that waits in a rendezvous when another replica failed."""


class Environment:
    """Thread-local torch state the calling thread had, re-established on worker threads."""

    __slots__ = ("autocast", "grad_enabled")

    def __init__(self) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


class RunState:
    """The shared state of one ``run``: outputs, errors and the rendezvous barrier."""

    def __init__(self, num_replicas: int, pool: WorkerPool, body: Body) -> None:
        self.num_replicas = num_replicas
        self.outputs: list[Any] = [None] * num_replicas
        self.errors: list[BaseException | None] = [None] * num_replicas
        self.threaded = False
        self.closed = False
        self._pool = pool
        self._body = body
        self._cond = threading.Condition()
        self._aborted = False
        self._generation = 0
        self._arrived: list[tuple[str, Any] | None] = [None] * num_replicas
        self._count = 0
        self._results: Sequence[Any] = ()
        self._returned: set[int] = set()
        self._running_workers = 0

    # -- called by replica bodies ------------------------------------------------------------

    def returned(self, replica: int, output: Any) -> None:
        """Replica ``replica`` returned ``output``; waiting replicas can no longer meet it."""
        with self._cond:
            self.outputs[replica] = output
            self._returned.add(replica)
            if self._count and self._arrived[replica] is None and not self._aborted:
                kind = next(a for a in self._arrived if a is not None)[0]
                self.errors[replica] = RuntimeError(
                    f"Replica {replica} returned without calling {kind}, which other replicas "
                    "are waiting in. Every replica must make the same collective calls "
                    "(all_reduce, all_gather, merge_call) in the same order."
                )
                self._abort()

    def failed(self, replica: int, error: BaseException) -> None:
        with self._cond:
            self.errors[replica] = error
            self._abort()

    def meet(self, replica: int, kind: str, value: Any, combine: Callable[[list[Any]], Sequence[Any]]) -> Any:
        """Wait for every replica to arrive with its ``value``; ``combine`` runs once, on
        replica 0's thread, and returns one result per replica."""
        if self.closed:
            raise RuntimeError(
                f"{kind} needs every replica of strategy.run, but run has already returned. "
                f"Call it (and backward through it) inside the function given to run."
            )
        with self._cond:
            if self._aborted:
                raise ReplicaAborted()
            if not self.threaded:
                if replica != 0:
                    raise RuntimeError(
                        f"Replica {replica} called {kind}, but replicas 0..{replica - 1} "
                        "returned without calling it. Every replica must make the same "
                        "collective calls (all_reduce, all_gather, merge_call) in the same order."
                    )
                self._start_workers()
            if self._returned:
                raise RuntimeError(
                    f"Replica {replica} called {kind}, but replica(s) {sorted(self._returned)} "
                    "already returned without calling it. Every replica must make the same "
                    "collective calls in the same order."
                )
            self._arrived[replica] = (kind, value)
            self._count += 1
            generation = self._generation
            self._cond.notify_all()
            if replica != 0:
                self._cond.wait_for(lambda: self._generation != generation or self._aborted)
                if self._generation == generation:
                    raise ReplicaAborted()
                return self._results[replica]
            self._cond.wait_for(lambda: self._count == self.num_replicas or self._aborted)
            if self._aborted:
                raise ReplicaAborted()
            arrived = [a for a in self._arrived if a is not None]
        kinds = {k for k, _ in arrived}
        if len(kinds) > 1:
            raise RuntimeError(
                f"Replicas met in different collective calls: {[k for k, _ in arrived]}. Every "
                "replica must make the same collective calls in the same order."
            )
        results = combine([v for _, v in arrived])
        with self._cond:
            self._results = results
            self._arrived = [None] * self.num_replicas
            self._count = 0
            self._generation += 1
            self._cond.notify_all()
        return results[0]

    # -- called by the driver ------------------------------------------------------------------

    def _abort(self) -> None:
        self._aborted = True
        self._cond.notify_all()

    def _start_workers(self) -> None:
        self.threaded = True
        self._running_workers = self.num_replicas - 1
        for replica in range(1, self.num_replicas):
            self._pool.submit(replica, self._run_on_worker)

    def _run_on_worker(self, replica: int) -> None:
        try:
            self._body(self, replica)
        finally:
            with self._cond:
                self._running_workers -= 1
                self._cond.notify_all()

    def wait_for_workers(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._running_workers == 0)


class WorkerPool:
    """Persistent worker threads, one per replica beyond the first, started on first need.

    The threads hold no reference to the strategy; they stop when the pool is closed (when
    the strategy is garbage collected).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queues: dict[int, queue.SimpleQueue[tuple[Callable[[int], None], int] | None]] = {}
        self._lock = threading.Lock()

    def submit(self, replica: int, task: Callable[[int], None]) -> None:
        with self._lock:
            if replica not in self._queues:
                q: queue.SimpleQueue[tuple[Callable[[int], None], int] | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=_worker_loop, args=(q,), name=f"{self._name}-replica-{replica}",
                    daemon=True,
                )
                thread.start()
                self._queues[replica] = q
        self._queues[replica].put((task, replica))

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.put(None)
            self._queues.clear()


def _worker_loop(q: queue.SimpleQueue[tuple[Callable[[int], None], int] | None]) -> None:
    while (item := q.get()) is not None:
        task, replica = item
        task(replica)
        del item, task


def new_pool(owner: object, name: str) -> WorkerPool:
    """A pool whose threads stop when ``owner`` is garbage collected."""
    pool = WorkerPool(name)
    weakref.finalize(owner, pool.close)
    return pool


def execute(num_replicas: int, pool: WorkerPool, body: Body) -> RunState:
    """Run ``body`` for every replica and return the finished state (errors not raised)."""
    state = RunState(num_replicas, pool, body)
    try:
        for replica in range(num_replicas):
            body(state, replica)
            if state.threaded or any(e is not None for e in state.errors):
                break
        if state.threaded:
            state.wait_for_workers()
    finally:
        state.closed = True
    return state
