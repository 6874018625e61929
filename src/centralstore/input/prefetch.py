"""``PrefetchIterator``: a source iterator run ahead on a background thread, bounded.

It feeds ``Dataset.prefetch`` and the steps of a ``DistributedIterator``. The background
thread holds only the source iterator and its queues, never the iterator object the user
holds: dropping that object (a ``break``, garbage collection) sets the stop event through
``weakref.finalize``, and the thread, which waits for room only with a timeout, ends
promptly. At interpreter exit every producer thread that has not ended is stopped and joined
while the interpreter is whole: a daemon thread still inside a torch call when it finalizes (a
``map`` over tensors, a batch being stacked, or the source's own teardown, which runs on that
thread after its last item) aborts the process ("terminate called without an active
exception").
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

_POLL_S = 0.1  # how often a producer waiting for room checks the stop event
_JOIN_S = 1.0  # how long close() waits for the producer thread
_EXIT_JOIN_S = 10.0  # how long the exit waits for all of them together

# Producer threads not yet seen to have ended, with what stops each: its room queue and stop
# event. A thread is dropped from here only once it is dead: after its target returns it still
# releases the source, whose teardown may call torch.
_producers: dict[threading.Thread, tuple[queue.SimpleQueue[None], threading.Event]] = {}


class PrefetchIterator(Iterator[Any]):
    """``source`` run ahead by a background thread, at most ``buffer_size`` items ahead.

    Exceptions raised by ``source`` are re-raised by ``next`` (the same object). Dropping the
    iterator or calling ``close()`` stops the thread.

    As with a ``queue.Queue(maxsize=buffer_size)``, up to ``buffer_size`` items wait while
    the next one is made. The hand-off is two C-level ``SimpleQueue``s instead: one carries
    the items, the other ``buffer_size + 1`` tokens of room, which the producer takes before
    it makes an item and the consumer gives back when it takes one. Both blocking calls
    release the GIL; a ``queue.Queue``'s Python-level conditions cost more than the rest of
    the step.

    >>> it = PrefetchIterator(iter(range(3)), buffer_size=1)
    >>> list(it)
    [0, 1, 2]
    """

    def __init__(self, source: Iterator[Any], buffer_size: int) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(buffer_size + 1):
            self._room.put(None)
        self._done = False
        stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._items, self._room, stop),
            name="centralstore-input",
            daemon=True,
        )
        self._halt = weakref.finalize(self, _halt, self._room, stop)
        for thread in list(_producers):  # a copy: iterators may be made on several threads
            if not thread.is_alive():
                _producers.pop(thread, None)
        _producers[self._thread] = (self._room, stop)
        self._thread.start()

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if type(item) is _Signal:
            self._done = True
            self._thread.join(_JOIN_S)
            if item.error is not None:
                raise item.error
            raise StopIteration
        self._room.put(None)
        return item

    def close(self) -> None:
        """Stop the background thread and wait for it briefly; ``next`` then ends."""
        self._done = True
        self._halt()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)


class _Signal:
    """The producer's last item: the end of the source, or the error it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def _produce(
    source: Iterator[Any],
    items: queue.SimpleQueue[Any],
    room: queue.SimpleQueue[None],
    stop: threading.Event,
) -> None:
    end = _Signal(None)
    try:
        while _wait_for_room(room, stop):
            item = next(source, end)
            items.put(item)
            if item is end:
                return
    except BaseException as error:  # every failure belongs to the consumer
        items.put(_Signal(error))
    finally:
        if stop.is_set():  # wake a consumer that may still wait for an item
            items.put(end)


def _wait_for_room(room: queue.SimpleQueue[None], stop: threading.Event) -> bool:
    """Take a token of room; False when the consumer has gone (the stop event is set)."""
    while not stop.is_set():
        try:
            room.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        return not stop.is_set()
    return False


def _halt(room: queue.SimpleQueue[None], stop: threading.Event) -> None:
    """Tell the producer to stop, and wake it if it waits for room."""
    stop.set()
    room.put(None)


@atexit.register
def _stop_producers() -> None:
    """Stop every producer thread that has not ended, and wait for them (at most
    ``_EXIT_JOIN_S`` seconds in all: a source blocked for good must not hang the exit)."""
    producers = list(_producers.items())
    for room, stop in (entry for _, entry in producers):
        _halt(room, stop)
    deadline = time.monotonic() + _EXIT_JOIN_S
    for thread, _ in producers:
        thread.join(max(0.0, deadline - time.monotonic()))
