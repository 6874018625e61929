"""Replica threads: a run interrupted by Ctrl-C, and the process exiting after it."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

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
