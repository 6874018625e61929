"""``PrefetchIterator``: a source iterator run ahead on a background thread, bounded.

It feeds ``Dataset.prefetch`` and the steps of a ``DistributedIterator`` (on the host through
an ``OverlapIterator``, which starts it only once the consumer's steps take time). The background
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
import collections
import queue
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, final

_WORTH = 8  # move to a thread once the consumer is away 1/_WORTH of an item's making time
_WORTH_S = 1e-4  # and both take this long: two hand-offs cost tens of microseconds
_STREAK = 2  # in this many consecutive steps (one long pause, a collection, is not a step)
_TRIAL = 6  # steps made ahead, after the first, that decide whether making ahead paid
_KEPT = 8  # steps made on the calling thread that the trial is compared with
_GAIN = 2  # the trial must shorten the cycle by 1/_GAIN of the time an item took to make here
_WARM_UP = 8  # a dataset's first steps timed on the calling thread, not kept as a baseline
_RETRY = 64  # steps made on the calling thread after a failed trial before the next one
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
        self._back = threading.Event()  # the consumer takes the source back (hand_back)
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._items, self._room, stop, self._back),
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

    def hand_back(self) -> tuple[list[Any], _Signal | None]:
        """Stop making items ahead, and give the source back to the calling thread: the
        items made but not taken, and how the source ended meanwhile (None: it has not, and
        its next item is the calling thread's to make). The producer stops after the item
        it is making, which this waits for, as ``next`` would."""
        self._back.set()
        self._room.put(None)  # wake a producer waiting for room
        made: list[Any] = []
        ended: _Signal | None = None
        while True:
            item = self._items.get()
            if item is _HANDED_BACK:
                break
            if type(item) is _Signal:
                ended = item
                break
            made.append(item)
        self._done = True
        self._thread.join()
        self._halt.detach()
        _producers.pop(self._thread, None)
        return made, ended


@final
class OverlapVerdict:
    """Whether making items ahead paid, kept by the dataset across its passes.

    ``pays``: None before any trial (and while a check of a paying thread gathers its
    baseline); True once a trial has shown it, and later passes move without one; False after
    a trial that did not. Neither verdict is final, since one trial of a few steps can meet a
    moment of the machine's load: after a failed trial another may start once ``wait`` more
    steps have been made on the calling thread, and after one that paid the thread is checked
    again once ``wait`` steps have been made ahead. Each wait doubles the last of its kind
    (``failed``, ``passed``), so that trials, right or wrong, grow with the logarithm of the
    steps, not with them. ``warm_up``: how many of the dataset's first steps timed on the
    calling thread are still to come; they are not kept as a trial's baseline, since a
    program's first steps run slower than the rest (the demo's first took 13 ms, its next
    two 4.6 and 4.1, then about 3.8) and would make any trial after them look faster.
    """

    __slots__ = ("failed", "passed", "pays", "wait", "warm_up")

    def __init__(self) -> None:
        self.pays: bool | None = None
        self.failed = 0
        self.passed = 0
        self.wait = 0
        self.warm_up = _WARM_UP

    def fail(self) -> None:
        """A trial did not pay: the next waits twice as long as the last."""
        self.pays = False
        self.wait = _RETRY << self.failed
        self.failed += 1

    def succeed(self) -> None:
        """A trial paid: the thread stays, until a check twice as far off as the last."""
        self.pays = True
        self.wait = _RETRY << self.passed
        self.passed += 1


@final
class OverlapIterator(Iterator[Any]):
    """``source`` made on the calling thread until the consumer's steps take time, then run
    ahead by a ``PrefetchIterator`` for as long as that pays.

    Made on the calling thread an item costs only itself; made ahead, it also costs two
    thread hand-offs, which on a busy host can take longer than a small item, but it overlaps
    whatever the consumer does between two ``next`` calls. So the first items are made here,
    and each ``next`` compares the time the consumer was away since the last one with the time
    the item took to make: once the consumer has been away at least 1/8 of it, and both took
    at least 0.1 ms, in two steps in a row (and 8 steps have been timed here, after the
    dataset's first 8, the first time), the source moves to a background thread. A loop that
    only iterates never starts a thread, nor do items that cost less than the hand-offs.

    Overlap needs a step that lets go of the GIL: a sleep, I/O, a wait for a device. A step of
    many small torch calls takes turns with the thread instead, and waits for the GIL at
    every call, which can cost more than making the item did. So the move is a trial: the
    time from one ``next`` to the next over the first 6 steps made ahead (after the first) is
    compared with that over the last 8 steps made here (medians; not the dataset's first 8:
    ``OverlapVerdict.warm_up``), and unless it is shorter by at least half the time an item
    took to make here, the source comes back to the calling thread: a smaller gain cannot be
    told from the noise of six steps. ``verdict`` keeps the outcome for later passes: after a
    trial that paid they make every item ahead, from the first (waiting for two steps worth
    it again would leave each pass's first three steps without overlap); after one that did
    not, another trial may start once 64 steps have been made here, then 128, 256 and so on.
    A trial that paid is checked the same way: after 64 steps made ahead (then 128, 256, ...)
    the source comes back for a fresh baseline and a new trial. (A single trial can meet a
    moment of load that has nothing to do with the step, in either direction.)

    >>> it = OverlapIterator(iter(range(3)), buffer_size=1)
    >>> list(it), it.ahead
    ([0, 1, 2], False)
    """

    def __init__(
        self,
        source: Iterator[Any],
        buffer_size: int,
        clock: Callable[[], float] = time.perf_counter,
        verdict: OverlapVerdict | None = None,
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._clock = clock
        self._verdict = OverlapVerdict() if verdict is None else verdict
        self._ahead: PrefetchIterator | None = None
        self._returned: float | None = None  # when the consumer got the last item
        self._streak = 0
        self._here: collections.deque[float] = collections.deque(maxlen=_KEPT)  # cycles
        self._making: collections.deque[float] = collections.deque(maxlen=_KEPT)  # items' times
        self._trial: list[float] | None = None  # cycles since the move, while on trial
        self._made: collections.deque[Any] = collections.deque()  # handed back, not taken
        self._ended: _Signal | None = None  # how the source ended while it was made ahead

    @property
    def ahead(self) -> bool:
        """Whether the items are now made on a background thread."""
        return self._ahead is not None

    def __iter__(self) -> OverlapIterator:
        return self

    def __next__(self) -> Any:
        if self._ahead is not None:
            item = next(self._ahead)
            if self._trial is not None:
                self._judge()
            elif self._verdict.pays:  # since a trial that paid: checked again in time
                self._verdict.wait -= 1
                if self._verdict.wait <= 0:
                    self._take_back()
                    self._verdict.pays = None  # a fresh baseline here, then a trial
            return item
        if self._made:
            self._returned = self._clock()
            return self._made.popleft()
        if self._ended is not None:
            ended, self._ended = self._ended, None
            self._source = iter(())
            if ended.error is not None:
                raise ended.error
            raise StopIteration
        verdict = self._verdict
        if verdict.pays and self._returned is None:  # a pass after one where ahead paid
            self._ahead = PrefetchIterator(self._source, self._buffer_size)
            return self.__next__()
        clock = self._clock
        start = clock()
        item = next(self._source)
        made = clock()
        returned = self._returned
        away, making = (start - returned if returned is not None else 0.0), made - start
        if returned is not None:
            if verdict.warm_up:
                verdict.warm_up -= 1
            else:
                self._here.append(made - returned)
                self._making.append(making)
        if verdict.wait:
            verdict.wait -= 1
        if away * _WORTH >= making and min(away, making) >= _WORTH_S:
            self._streak += 1
            if self._streak >= _STREAK and (
                verdict.pays or (not verdict.wait and len(self._here) == _KEPT)  # a baseline
            ):
                self._ahead = PrefetchIterator(self._source, self._buffer_size)
                self._trial = None if verdict.pays else []
        else:
            self._streak = 0
        self._returned = made
        return item

    def _judge(self) -> None:
        """A step made ahead has been taken: note its cycle; after the trial's last, keep
        the thread if it shortened the cycle by half an item's making time, else take the
        source back."""
        now = self._clock()
        trial = self._trial
        assert trial is not None and self._ahead is not None
        if self._returned is not None:
            trial.append(now - self._returned)
        self._returned = now
        if len(trial) <= _TRIAL:  # the first includes the thread's start
            return
        self._trial = None
        saved = statistics.median(self._here) - statistics.median(trial[1:])
        if saved >= statistics.median(self._making) / _GAIN:
            self._verdict.succeed()
        else:
            self._verdict.fail()
            self._take_back()

    def _take_back(self) -> None:
        """The source comes back to the calling thread, with the items made ahead and not
        yet taken, in order; the cycles timed here start afresh, from the item the consumer
        takes now."""
        assert self._ahead is not None
        made, self._ended = self._ahead.hand_back()
        self._made.extend(made)
        self._ahead = None
        self._here.clear()
        self._making.clear()
        self._streak = 0
        self._returned = self._clock()

    def close(self) -> None:
        """Stop making items (and the background thread, if one makes them); ``next`` ends."""
        self._made.clear()
        self._ended = None
        if self._ahead is not None:
            self._ahead.close()
            return
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._source = iter(())


class _Signal:
    """The producer's last item: the end of the source, or the error it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


_HANDED_BACK = object()  # the producer's last item after ``hand_back``: the source is free


def _produce(
    source: Iterator[Any],
    items: queue.SimpleQueue[Any],
    room: queue.SimpleQueue[None],
    stop: threading.Event,
    back: threading.Event,
) -> None:
    end = _Signal(None)
    try:
        while _wait_for_room(room, stop):
            if back.is_set():
                items.put(_HANDED_BACK)
                return
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
