"""Running the replicas of one ``run``: one at a time, in order, threads when needed.

Replicas run one after another on the calling thread: deterministic and with no thread
hand-off. When replica 0 meets a rendezvous (``all_reduce``, ``all_gather``, ``merge_call``)
the others have not started, so they start on persistent replica threads; but still only one
replica runs at a time. The replicas pass a baton in replica order: each runs until it meets
the rendezvous (or returns), hands the baton to the next, and waits for it to come back; the
last to arrive hands it to replica 0, which combines the values and runs on. So every path
has the semantics of the sequential one: the replicas never race on module attributes, the
parameters' ``.grad`` or the random generators, and a ``Switch`` (the run's variables) puts
each replica's state in place when it gets the baton and takes it off when it hands it on.
CUDA kernels are asynchronous, so one replica issuing at a time still keeps several GPUs busy.

A replica that raises aborts the rendezvous: the others get the baton in turn and leave
(``ReplicaAborted``), so nobody waits forever; a replica that returns while others wait for it
is an error too. ``execute`` returns only once every replica thread has left the replica's
code, even when the calling thread is interrupted (``KeyboardInterrupt``): nothing a replica
computes can land after ``run`` has returned. Replica threads are stopped at interpreter
exit, before the interpreter tears down under them (a thread still inside a torch kernel then
aborts the process).
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch

from ._devices import CurrentStreams

# A replica body: runs replica ``i`` of ``state`` on the current thread.
Body = Callable[["RunState", int], None]


class ReplicaAborted(Exception):
    """Raised in a replica that waits in a rendezvous when another replica failed."""


class Switch(Protocol):
    """What changes hands with the baton: a replica's state (its views in the module slots,
    its gradients, its random generator) taken off when it waits in a rendezvous and put back
    when it runs on."""

    def suspend(self, replica: int) -> None: ...
    def resume(self, replica: int) -> None: ...


class _NoSwitch:
    def suspend(self, replica: int) -> None:
        pass

    def resume(self, replica: int) -> None:
        pass


_NO_SWITCH = _NoSwitch()


class Environment:
    """Thread-local torch state the calling thread had, re-established on replica threads:
    grad mode, inference mode, autocast, the current CUDA stream of each replica's GPU (so
    that replica threads are ordered with the caller's work) and the number of intra-op
    threads (replicas run one at a time, so each may use them all). Captured when every run
    begins, so the common case (CPU devices, no autocast) costs a few cheap queries;
    ``gpus`` are the replicas' GPUs, each once, whose current streams ``current`` finds and
    switches to (a strategy passes its own, which lives from run to run; without it, no GPU
    stream is applied)."""

    __slots__ = ("_current", "autocast", "grad_enabled", "inference", "streams", "threads")

    def __init__(
        self, gpus: Sequence[torch.device] = (), current: CurrentStreams | None = None
    ) -> None:
        self.threads = torch.get_num_threads()
        self._current, self.streams = current, list(map(current, gpus)) if current else []
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ] if torch._C._is_any_autocast_enabled() else []

    def applied(self) -> contextlib.AbstractContextManager[Any]:
        """The state in force on this thread until the context exits: in the common case
        (no inference mode, autocast or streams) grad mode alone, by torch's own context,
        which sets it at once; the rest through an ``ExitStack``."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if not (self.inference or self.autocast or self.streams):
            return torch.set_grad_enabled(self.grad_enabled)
        return self._all_applied()

    @contextlib.contextmanager
    def _all_applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            for stream in self.streams:  # (found by ``current``: never None here)
                stack.enter_context(cast(CurrentStreams, self._current).switch(stream))
            yield


class RunState:
    """The shared state of one ``run``: outputs, errors, the rendezvous and the baton.

    Until ``threaded`` is set only the calling thread touches the state, so the sequential
    path takes no lock; the lock and the baton's fields are set up when the threads start
    (``_begin_threads``), so that a run without a rendezvous never builds them. From then on
    the replica holding the baton (``_turn``) is the only one running replica code. The
    baton passes through a gate per replica, a lock held until the replica's turn comes
    (``_hand_on`` releases it, the replica's ``_await_turn`` takes it), and the calling
    thread waits for the replica threads to leave at a gate of its own (``_done``): each
    hand-off is one release and one acquire in C, where a ``threading.Condition`` ran about
    40 lines of Python for its notify and its wait.
    A run of one replica never starts threads (its rendezvous meets at once): its caller
    runs the replica itself and gives no ``body``.
    """

    __slots__ = (
        "_aborted", "_alive", "_arrived", "_body", "_count", "_crew", "_done", "_gates",
        "_generation", "_lock", "_pool", "_results", "_returned", "_running_threads", "_turn",
        "_waiting",
        "any_failed", "closed", "errors", "num_replicas", "outputs", "switch", "threaded",
    )

    def __init__(
        self, num_replicas: int, pool: ThreadPool, body: Body | None, switch: Switch | None = None,
    ) -> None:
        self.num_replicas = num_replicas
        self.outputs: list[Any] = [None] * num_replicas
        self.errors: list[BaseException | None] = [None] * num_replicas
        self.any_failed = False
        self.threaded = False
        self.closed = False
        self._pool = pool
        self._body = body
        self.switch: Switch = _NO_SWITCH if switch is None else switch
        self._crew: int | None = None

    def _begin_threads(self) -> None:
        """(The first rendezvous, on the calling thread.) The baton starts with replica 0."""
        self._lock = threading.Lock()  # the state below, from here on
        self._gates = [_closed_gate() for _ in range(self.num_replicas)]
        self._done = _closed_gate()  # opened when the last replica thread leaves, if
        self._waiting = False  # the calling thread waits for that (``wait_for_threads``)
        self._aborted = False
        self._generation = 0
        self._arrived: list[tuple[str, Any] | None] = [None] * self.num_replicas
        self._count = 0
        self._results: Sequence[Any] = ()
        self._returned: set[int] = set()
        self._running_threads = 0
        self._alive = set(range(self.num_replicas))  # replicas that have not finished
        self._turn: int | None = 0  # the replica holding the baton
        self.threaded = True

    # -- called by replica bodies ------------------------------------------------------------

    def _blame_returned(self, early: int, kind: str, caller: int) -> None:
        """Replica ``early`` returned without calling ``kind``, which ``caller`` called: its
        error, whichever of the two came first, so that the same mistake reads the same."""
        self.errors[early] = RuntimeError(
            f"Replica {early} returned without calling {kind}, which replica {caller} called. "
            "Every replica must make the same collective calls (all_reduce, all_gather, "
            "merge_call) in the same order."
        )
        self.any_failed = True

    def returned(self, replica: int, output: Any) -> None:
        """Replica ``replica`` returned ``output``; waiting replicas can no longer meet it."""
        if not self.threaded:
            self.outputs[replica] = output
            return
        with self._lock:
            self.outputs[replica] = output
            self._returned.add(replica)
            if self._count and self._arrived[replica] is None and not self._aborted:
                caller, (kind, _) = next(
                    (r, a) for r, a in enumerate(self._arrived) if a is not None
                )
                self._blame_returned(replica, kind, caller)
                self._aborted = True

    def failed(self, replica: int, error: BaseException) -> None:
        if not self.threaded:
            self.errors[replica] = error
            self.any_failed = True
            return
        with self._lock:
            self.errors[replica] = error
            self.any_failed = True
            self._aborted = True

    def meet(
        self, replica: int, kind: str, value: Any, combine: Callable[[list[Any]], Sequence[Any]],
        switch: Switch | None = None,
    ) -> Any:
        """Arrive at a rendezvous with ``value``, hand the baton on, and wait until every
        replica has arrived; ``combine`` runs once, on replica 0's thread, with every
        replica's state off, and returns one result per replica. ``switch``: the one of the
        run that made the collective whose backward this is (a state serves every run of
        one replica on its variables' device: ``Strategy._run_alone``)."""
        if self.closed or (switch is not None and switch is not self.switch):
            raise RuntimeError(
                f"{kind} needs every replica of strategy.run, but run has already returned. "
                f"Call it (and backward through it) inside the function given to run."
            )
        if self.num_replicas == 1:  # nobody to wait for; the replica's state still comes off
            self.switch.suspend(replica)
            try:
                return combine([value])[0]
            finally:
                self.switch.resume(replica)
        starting = not self.threaded
        if starting and replica != 0:  # replicas 0..replica-1 ran one after another
            self._blame_returned(0, kind, replica)
            raise ReplicaAborted()
        self.switch.suspend(replica)  # may raise: then this replica fails, holding the baton
        if starting:
            self._begin_threads()
        with self._lock:
            if not self._aborted and self._returned:
                self._blame_returned(min(self._returned), kind, replica)
                self._aborted = True
            if not self._aborted:
                self._arrived[replica] = (kind, value)
                self._count += 1
            generation = self._generation
            self._hand_on(replica)
        if starting:
            self._start_threads()
        interrupt = self._await_turn(replica)
        try:
            if (
                replica == 0 and interrupt is None and not self._aborted
                and self._count == self.num_replicas
            ):
                self._combine(combine)
        finally:
            self.switch.resume(replica)
        if interrupt is not None:
            raise interrupt
        if self._generation == generation:  # released: another replica failed
            raise ReplicaAborted()
        return self._results[replica]

    def _combine(self, combine: Callable[[list[Any]], Sequence[Any]]) -> None:
        arrived = [a for a in self._arrived if a is not None]
        kinds = [k for k, _ in arrived]
        if len(set(kinds)) > 1:
            raise RuntimeError(
                f"Replicas met in different collective calls: {kinds}. Every "
                "replica must make the same collective calls in the same order."
            )
        results = combine([v for _, v in arrived])
        with self._lock:
            self._results = results
            self._arrived = [None] * self.num_replicas
            self._count = 0
            self._generation += 1

    def _hand_on(self, replica: int) -> None:
        """(Under the lock.) The baton goes to the next replica in order that has not
        finished: its gate opens, unless that replica holds the baton already and
        ``replica`` does not (the calling thread, after a failure that left the baton with
        a replica thread, finding it there)."""
        n = self.num_replicas
        holder = self._turn
        turn = self._turn = next(
            (r for r in ((replica + k) % n for k in range(1, n + 1)) if r in self._alive), None
        )
        if turn is not None and (turn != holder or holder == replica):
            self._gates[turn].release()

    def _await_turn(self, replica: int) -> BaseException | None:
        """Wait for the baton. An interrupt meanwhile (``KeyboardInterrupt`` on the calling
        thread) aborts the run but does not cut the wait short: another replica runs, and
        this one may only leave once it holds the baton. The interrupt is returned."""
        interrupt: BaseException | None = None
        gate = self._gates[replica]
        while True:
            try:
                gate.acquire()
                return interrupt
            except BaseException as error:
                interrupt = interrupt or error
                with self._lock:
                    self.any_failed = True
                    self._aborted = True
                    # The interrupt may have come just after the gate was taken: then it is
                    # this replica's turn and the gate, opened only for that, is shut again.
                    if self._turn == replica and gate.locked():
                        return interrupt

    # -- called by the driver ------------------------------------------------------------------

    def _start_threads(self) -> None:
        self._crew = self._pool.reserve()
        for replica in range(1, self.num_replicas):
            try:
                self._pool.submit(self._crew, replica, self._run_on_thread)
            except BaseException:  # the replicas without a thread are finished, unrun
                with self._lock:
                    self._aborted = self.any_failed = True
                    self._alive -= set(range(replica, self.num_replicas))
                raise
            # Counted once submitted, so a thread that fails to start leaves no one to wait for.
            with self._lock:
                self._running_threads += 1

    def _run_on_thread(self, replica: int) -> None:
        try:
            self._await_turn(replica)  # nothing can interrupt a replica thread
            if not self._aborted:
                cast(Body, self._body)(self, replica)  # None only for one replica: no threads
        except BaseException as error:  # the body records its own errors; never lose one
            self.failed(replica, error)
        finally:
            with self._lock:
                self._running_threads -= 1
                self._alive.discard(replica)
                self._hand_on(replica)
                if self._running_threads == 0 and self._waiting:
                    self._done.release()

    def interrupted(self) -> None:
        """The calling thread was interrupted outside a replica's code: release every replica
        from its rendezvous."""
        if not self.threaded:
            return
        with self._lock:
            self.any_failed = True
            self._aborted = True

    def wait_for_threads(self) -> None:
        """Hand the baton on from the calling thread's replica and wait until every replica
        thread has left the replica's code. A further interrupt meanwhile does not cut the wait
        short (a replica would finish after ``run`` raised and its gradients land in the next
        step); it is raised once the wait is over."""
        if not self.threaded:
            return
        interrupt: BaseException | None = None
        with self._lock:
            if 0 in self._alive:
                self._alive.discard(0)
                self._hand_on(0)
            # Every thread is counted by now (the count may have touched 0 before, between
            # one thread leaving and the next one's start): from here it falls to 0 once.
            waiting = self._waiting = self._running_threads > 0
        while waiting:
            try:
                self._done.acquire()
                break
            except BaseException as error:  # KeyboardInterrupt, or any other async signal
                interrupt = interrupt or error
                with self._lock:
                    self.any_failed = True
                    self._aborted = True
                    if self._running_threads == 0 and self._done.locked():  # (taken, as above)
                        break
        if interrupt is not None:
            raise interrupt

    def close(self) -> None:
        """No collective can meet any more; the crew is free for another run."""
        self.closed = True
        if self._crew is not None:
            self._pool.release(self._crew)
            self._crew = None


def _closed_gate() -> threading.Lock:
    """A lock taken already: the next ``acquire`` waits for a ``release``."""
    gate = threading.Lock()
    gate.acquire()
    return gate


_Tasks = queue.SimpleQueue[tuple[Callable[[int], None], int] | None]


class ThreadPool:
    """Persistent replica threads, started on first need: a crew of one thread per replica
    beyond the first.

    Usually one run at a time needs a crew. A run started while another run's crew waits at
    its barrier (``strategy.run`` inside ``merge_call``) gets a crew of its own: the waiting
    one could never take its replicas. The threads hold no reference to the strategy; they
    stop when the pool is closed: when the strategy is garbage collected, or at exit.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queues: dict[tuple[int, int], _Tasks] = {}
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        _pools.add(self)

    def reserve(self) -> int:
        """A crew that no run in flight uses; give it back with ``release``."""
        with self._lock:
            crew = 0
            while crew in self._busy:
                crew += 1
            self._busy.add(crew)
            return crew

    def release(self, crew: int) -> None:
        with self._lock:
            self._busy.discard(crew)

    def submit(self, crew: int, replica: int, task: Callable[[int], None]) -> None:
        with self._lock:
            tasks = self._queues.get((crew, replica))
            if tasks is None:
                tasks = queue.SimpleQueue()
                suffix = f"-crew-{crew}" if crew else ""
                thread = threading.Thread(
                    target=_thread_loop, args=(tasks,),
                    name=f"{self._name}-replica-{replica}{suffix}", daemon=True,
                )
                thread.start()
                with _started_lock:
                    _started[:] = [t for t in _started if t.is_alive()]
                    _started.append(thread)
                self._queues[crew, replica] = tasks
        tasks.put((task, replica))

    def close(self) -> None:
        with self._lock:
            for tasks in self._queues.values():
                tasks.put(None)
            self._queues.clear()


_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()
# Replica threads not yet seen to have ended, of every pool, collected or not: a thread whose
# pool was closed may still be winding down at exit.
_started: list[threading.Thread] = []
_started_lock = threading.Lock()
_EXIT_JOIN_S = 5.0


@atexit.register
def _stop_all() -> None:
    """At exit, stop every pool's threads while the interpreter is still whole. (A daemon
    thread that is still inside a torch call when the interpreter finalizes is killed there,
    and the C++ runtime aborts the process with SIGABRT.)"""
    for pool in list(_pools):
        pool.close()
    deadline = time.monotonic() + _EXIT_JOIN_S
    with _started_lock:
        started = list(_started)
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))


def _thread_loop(q: _Tasks) -> None:
    while (item := q.get()) is not None:
        task, replica = item
        task(replica)
        del item, task


def new_pool(owner: object, name: str) -> ThreadPool:
    """A pool whose threads stop when ``owner`` is garbage collected."""
    pool = ThreadPool(name)
    weakref.finalize(owner, pool.close)
    return pool


def execute(
    num_replicas: int, pool: ThreadPool, body: Body, switch: Switch | None = None,
) -> RunState:
    """Run ``body`` for every replica and return the finished state (the replicas' errors
    not raised); ``switch`` moves a replica's state in and out when it waits in a rendezvous.
    Whatever happens on the calling thread, every replica thread has left the replica's code
    when this returns or raises."""
    state = RunState(num_replicas, pool, body, switch)
    try:
        for replica in range(num_replicas):
            body(state, replica)
            if state.threaded or state.any_failed:
                break
    except BaseException:  # interrupted between replicas
        state.interrupted()
        raise
    finally:
        if state.threaded:
            try:
                state.wait_for_threads()
            finally:
                state.close()
        else:  # replicas one after another: no thread to wait for, no crew to free
            state.closed = True
    return state
