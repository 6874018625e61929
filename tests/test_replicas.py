"""Replica threads: a run interrupted by Ctrl-C, the process exiting after it, and the
baton's gates when an interrupt comes just after one was taken."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import pytest
import torch

from centralstore import _replicas

SCRIPT = textwrap.dedent(
    """
    import signal, threading, torch
    import centralstore as cs

    # Python's own handler, even when started with SIGINT ignored (as a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    x = torch.randn(512, 512)

    sent, left = threading.Event(), threading.Event()

    def interrupt():
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        sent.set()

    def step():
        cs.get_replica_context().all_reduce("sum", 1.0)  # the replica threads start
        if cs.get_replica_context().replica_id_in_sync_group:
            while not sent.is_set():  # inside torch kernels when the interrupt arrives
                x @ x
            for _ in range(100):
                x @ x
            left.set()

    threading.Timer(0.3, interrupt).start()
    try:
        strategy.run(step)
    finally:
        print("replica threads had left:", left.is_set())
    # the KeyboardInterrupt ends the process here, replica threads idle
    """
)


@pytest.mark.parametrize("attempt", range(3))
def test_exiting_on_an_interrupted_run_never_aborts(attempt: int) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    # Python ends on an uncaught KeyboardInterrupt by re-raising SIGINT on itself.
    assert result.returncode == -signal.SIGINT, result.stderr
    assert "KeyboardInterrupt" in result.stderr
    assert "replica threads had left: True" in result.stdout
    assert "terminate called" not in result.stderr


def test_at_exit_threads_of_a_collected_pool_are_joined_too() -> None:
    """A pool closed and collected while one of its threads still works: the exit waits for
    that thread as well (a daemon thread inside a torch call at finalization aborts)."""
    pool = _replicas.ThreadPool("test-collected")
    release, entered = threading.Event(), threading.Event()

    def work(replica: int) -> None:
        entered.set()
        release.wait(10)

    pool.submit(0, 1, work)
    assert entered.wait(10)
    thread = next(t for t in threading.enumerate() if t.name == "test-collected-replica-1")
    pool.close()
    del pool
    gc.collect()
    assert not any(p._name == "test-collected" for p in _replicas._pools)
    threading.Timer(0.2, release.set).start()
    _replicas._stop_all()  # what atexit calls
    assert not thread.is_alive()


class _TakenThenInterrupted:
    """A gate whose first ``acquire`` takes the lock and then raises ``KeyboardInterrupt``,
    as a signal handled just after the lock was taken does."""

    def __init__(self, gate: threading.Lock) -> None:
        self._gate = gate
        self.interrupted = False

    def acquire(self) -> bool:
        self._gate.acquire()
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return True

    def release(self) -> None:
        self._gate.release()

    def locked(self) -> bool:
        return self._gate.locked()


def _in_thread(call: Callable[[], object]) -> list[object]:
    """``call``'s result or error, from a thread given 10 s: a wait that never ends fails."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the wait never ended: the baton was lost"
    return outcome


def _threaded_state(replicas: int) -> _replicas.RunState:
    state = _replicas.RunState(replicas, _replicas.ThreadPool("test-gates"), None)
    state._begin_threads()
    return state


def test_an_interrupt_just_after_a_replica_took_its_gate_keeps_the_turn() -> None:
    state = _threaded_state(2)
    gate = _TakenThenInterrupted(state._gates[1])
    state._gates[1] = gate  # type: ignore[call-overload]
    with state._lock:
        state._hand_on(0)  # replica 1's turn: its gate opens
    [interrupt] = _in_thread(lambda: state._await_turn(1))
    assert gate.interrupted and isinstance(interrupt, KeyboardInterrupt)
    assert state._turn == 1 and state.any_failed  # the run is aborted, replica 1 runs on
    with state._lock:
        state._hand_on(1)
    assert state._turn == 0 and not state._gates[0].locked()  # the baton went on, once


def test_an_interrupt_while_a_replica_waits_for_its_turn_leaves_it_waiting() -> None:
    state = _threaded_state(2)
    taken = threading.Event()
    interrupted = threading.Event()

    class Interrupted:  # the wait interrupted before the gate opened
        def __init__(self, gate: threading.Lock) -> None:
            self._gate = gate

        def acquire(self) -> bool:
            if not interrupted.is_set():
                interrupted.set()
                raise KeyboardInterrupt
            self._gate.acquire()
            taken.set()
            return True

        def release(self) -> None:
            self._gate.release()

        def locked(self) -> bool:
            return self._gate.locked()

    state._gates[1] = Interrupted(state._gates[1])  # type: ignore[call-overload]

    def open_later() -> None:
        interrupted.wait(10)
        with state._lock:
            state._hand_on(0)

    threading.Thread(target=open_later, daemon=True).start()
    [interrupt] = _in_thread(lambda: state._await_turn(1))
    assert isinstance(interrupt, KeyboardInterrupt) and taken.is_set() and state._turn == 1


def test_an_interrupt_just_after_the_last_thread_left_ends_the_wait_for_threads() -> None:
    state = _threaded_state(2)
    state._running_threads = 1
    done = _TakenThenInterrupted(state._done)
    state._done = done  # type: ignore[assignment]

    def leave() -> None:  # replica 1's thread leaves, as ``_run_on_thread`` does
        with state._lock:
            state._running_threads -= 1
            state._alive.discard(1)
            state._done.release()

    threading.Timer(0.1, leave).start()
    [error] = _in_thread(state.wait_for_threads)
    assert isinstance(error, KeyboardInterrupt) and done.interrupted and state.any_failed


def test_the_common_environment_of_a_replica_thread_is_grad_mode_alone() -> None:
    """No inference mode, autocast or CUDA streams to carry over: a replica thread enters
    torch's grad-mode context and nothing else (an ``ExitStack`` ran about 40 lines of Python
    each time a replica thread entered it)."""
    with torch.no_grad():
        environment = _replicas.Environment()
    assert torch.is_grad_enabled()
    applied = environment.applied()
    assert isinstance(applied, torch.set_grad_enabled)
    with applied:
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    with torch.inference_mode():
        inference = _replicas.Environment()
    with inference.applied():  # the general path keeps every part
        assert torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()
