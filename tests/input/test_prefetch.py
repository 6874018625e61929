"""PrefetchIterator on its own: order, how far ahead it runs, errors, stopping its thread."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest

from centralstore.input import prefetch
from centralstore.input.prefetch import OverlapIterator, OverlapVerdict, PrefetchIterator


class Counting:
    """An endless source that counts the items taken from it."""

    def __init__(self) -> None:
        self.made = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        self.made += 1
        return self.made


def input_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "centralstore-input" and t.is_alive()}


def wait_until(condition: Callable[[], bool], seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_items_come_in_order_and_then_the_iteration_ends() -> None:
    iterator = PrefetchIterator(iter(range(5)), buffer_size=2)
    assert list(iterator) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.parametrize("buffer_size", [1, 3])
def test_the_producer_makes_at_most_buffer_size_plus_one_items_ahead(buffer_size: int) -> None:
    source = Counting()
    iterator = PrefetchIterator(source, buffer_size)
    assert wait_until(lambda: source.made == buffer_size + 1)
    time.sleep(0.05)
    assert source.made == buffer_size + 1  # like queue.Queue(maxsize=buffer_size)
    assert next(iterator) == 1
    assert wait_until(lambda: source.made == buffer_size + 2)
    iterator.close()


def test_a_source_error_is_raised_by_next_as_the_same_object() -> None:
    error = OSError("disk went away")

    def flaky() -> Iterator[int]:
        yield 0
        raise error

    iterator = PrefetchIterator(flaky(), buffer_size=1)
    assert next(iterator) == 0
    with pytest.raises(OSError) as caught:
        next(iterator)
    assert caught.value is error
    with pytest.raises(StopIteration):
        next(iterator)


def test_close_stops_the_thread_and_ends_the_iteration() -> None:
    before = input_threads()
    source = Counting()
    iterator = PrefetchIterator(source, buffer_size=1)
    assert next(iterator) == 1
    iterator.close()
    assert wait_until(lambda: input_threads() <= before)
    made = source.made
    with pytest.raises(StopIteration):
        next(iterator)
    time.sleep(0.05)
    assert source.made == made


def test_dropping_the_iterator_stops_its_thread() -> None:
    before = input_threads()
    iterator = PrefetchIterator(Counting(), buffer_size=2)
    next(iterator)
    ref = weakref.ref(iterator)
    del iterator
    gc.collect()
    assert ref() is None
    assert wait_until(lambda: input_threads() <= before)


def test_producers_still_running_at_exit_are_stopped_and_joined() -> None:
    iterator = PrefetchIterator(Counting(), buffer_size=2)
    next(iterator)
    thread = iterator._thread
    prefetch._stop_producers()  # what atexit calls
    assert not thread.is_alive()


EXITS_WHILE_PRODUCING = """
import torch, centralstore as cs
def heavy(x):
    for _ in range(20):
        x = (torch.randn(200, 200) @ torch.randn(200, 200)).sum() + x
    return x
it = iter(cs.Dataset.range(10**9).map(heavy).prefetch(4))
next(it)
"""


def test_a_process_exiting_while_its_producer_computes_exits_cleanly() -> None:
    # Before producers were stopped at exit, this aborted in 6 runs of 6 with "terminate
    # called without an active exception" (the producer was inside a matmul).
    result = subprocess.run(
        [sys.executable, "-c", EXITS_WHILE_PRODUCING], capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr



SOURCE_TEARS_DOWN_AT_EXIT = """
import time, torch, centralstore as cs
def source():
    try:
        while True:
            yield torch.zeros(())
    finally:  # runs on the producer thread, after its last item, when it drops the source
        x = torch.randn(200, 200)
        for _ in range(300):  # long enough to span the exit, well under _EXIT_JOIN_S
            x = torch.tanh(x @ x)
spec = cs.data.TensorSpec((), torch.float32)
it = iter(cs.Dataset.from_generator(source, output_signature=spec).prefetch(2))
next(it)
del it  # the producer stops at once, then tears the source down
time.sleep(0.01)
"""


def test_a_process_exiting_while_a_stopped_producer_tears_its_source_down_exits_cleanly() -> None:
    # While the producer left the registry on its last item, this aborted in 3 runs of 3: the
    # source's teardown was still inside a matmul when the interpreter finalized.
    result = subprocess.run(
        [sys.executable, "-c", SOURCE_TEARS_DOWN_AT_EXIT], capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# OverlapIterator: on the calling thread until the consumer's steps take time.


class Clock:
    """A clock that a test moves: each ``next`` of an OverlapIterator reads it twice (before
    and after making the item)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A source whose items take ``make`` seconds of the test's clock to make."""

    def __init__(self, clock: Clock, make: float, count: int = 100) -> None:
        self.clock, self.make, self.count = clock, make, count
        self.threads: list[threading.Thread] = []

    def __iter__(self) -> Iterator[int]:
        for i in range(self.count):
            self.threads.append(threading.current_thread())
            self.clock.now += self.make
            yield i


def paid() -> OverlapVerdict:
    """The verdict of a dataset whose earlier pass found making ahead worth it (no trial)."""
    verdict = OverlapVerdict()
    verdict.succeed()
    return verdict


def warm() -> OverlapVerdict:
    """The verdict of a dataset past its first steps: a baseline is the next 8 timed."""
    verdict = OverlapVerdict()
    verdict.warm_up = 0
    return verdict


def overlap_steps(
    away: list[float], make: float = 1.0, verdict: OverlapVerdict | None = None
) -> tuple[OverlapIterator, Timed]:
    """An OverlapIterator whose consumer is away ``away[i]`` after taking item ``i``."""
    clock = Clock()
    source = Timed(clock, make)
    verdict = warm() if verdict is None else verdict
    iterator = OverlapIterator(iter(source), buffer_size=1, clock=clock, verdict=verdict)
    for seconds in away:
        next(iterator)
        clock.now += seconds
    return iterator, source


def test_a_consumer_that_only_iterates_never_starts_a_thread() -> None:
    iterator, source = overlap_steps([0.1] * 20)  # away 1/10 of the making time: not worth it
    assert not iterator.ahead
    assert set(source.threads) == {threading.current_thread()}


def test_two_steps_in_a_row_worth_overlapping_move_the_source_to_a_thread() -> None:
    before = input_threads()
    iterator, _ = overlap_steps([0.0] * 7 + [0.125, 0.125])  # 1/8 of making, twice
    assert not iterator.ahead  # the baseline's 8 cycles, and one step worth it
    assert next(iterator) == 9
    assert iterator.ahead
    assert [next(iterator) for _ in range(3)] == [10, 11, 12]
    assert len(input_threads() - before) == 1
    iterator.close()
    assert wait_until(lambda: input_threads() <= before)


def test_a_pass_after_one_where_making_ahead_paid_makes_every_item_ahead() -> None:
    before = input_threads()
    clock = Clock()
    source = Timed(clock, 1.0, count=6)
    iterator = OverlapIterator(iter(source), buffer_size=1, clock=clock, verdict=paid())
    assert next(iterator) == 0
    assert iterator.ahead  # from the pass's first item: the first steps overlap too
    assert list(iterator) == [1, 2, 3, 4, 5]
    assert threading.current_thread() not in source.threads
    assert wait_until(lambda: input_threads() <= before)


def test_items_cheaper_than_the_hand_offs_are_never_made_ahead() -> None:
    iterator, _ = overlap_steps([1.0] * 10, make=5e-5)  # 50 us an item, 1 s a step
    assert not iterator.ahead


def test_one_long_pause_alone_does_not_start_a_thread() -> None:
    iterator, _ = overlap_steps([0.0, 5.0, 0.0, 5.0, 0.0, 5.0, 0.0])
    assert not iterator.ahead


def test_items_made_ahead_continue_the_source_in_order_and_end_it() -> None:
    clock = Clock()
    source = Timed(clock, 1.0, count=6)
    iterator = OverlapIterator(iter(source), buffer_size=2, clock=clock, verdict=paid())
    taken = []
    for item in iterator:
        taken.append(item)
        clock.now += 1.0
    assert taken == list(range(6))
    assert iterator.ahead
    assert source.threads[-1] is not threading.current_thread()
    with pytest.raises(StopIteration):
        next(iterator)


def test_an_error_after_the_move_reaches_the_consumer_as_the_same_object() -> None:
    error = OSError("disk went away")
    clock = Clock()

    def flaky() -> Iterator[int]:
        for i in range(4):
            clock.now += 1.0
            yield i
        raise error

    iterator = OverlapIterator(flaky(), buffer_size=1, clock=clock, verdict=paid())
    taken = []
    with pytest.raises(OSError) as caught:
        for item in iterator:
            taken.append(item)
            clock.now += 1.0
    assert caught.value is error
    assert taken == [0, 1, 2, 3]
    assert iterator.ahead


def test_close_before_the_move_closes_the_source() -> None:
    closed = []

    def source() -> Iterator[int]:
        try:
            yield from range(10)
        finally:
            closed.append(True)

    iterator = OverlapIterator(source(), buffer_size=1)
    assert next(iterator) == 0
    iterator.close()
    assert closed == [True]
    with pytest.raises(StopIteration):
        next(iterator)


def test_dropping_an_iterator_that_moved_stops_its_thread() -> None:
    before = input_threads()
    iterator, _ = overlap_steps([1.0, 1.0, 1.0], verdict=paid())
    assert iterator.ahead
    del iterator
    gc.collect()
    assert wait_until(lambda: input_threads() <= before)


# The trial: the first move of a dataset's passes is kept only if it shortened the cycle.


class CallingThreadSource:
    """Items that take ``make`` seconds of the test's clock when made on the calling thread,
    and none of it on the producer thread (where making them overlaps the consumer)."""

    def __init__(self, clock: Clock, make: float, count: int, error: Exception | None = None):
        self.clock, self.make, self.count, self.error = clock, make, count, error
        self.main = threading.current_thread()
        self.threads: list[threading.Thread] = []

    def __iter__(self) -> Iterator[int]:
        for i in range(self.count):
            self.threads.append(threading.current_thread())
            if threading.current_thread() is self.main:
                self.clock.now += self.make
            yield i
        if self.error is not None:
            raise self.error


def trial(
    away_here: float, away_ahead: float, count: int = 40, verdict: OverlapVerdict | None = None,
    error: Exception | None = None,
) -> tuple[list[int], OverlapIterator, CallingThreadSource, OverlapVerdict]:
    """A pass whose consumer is away ``away_here`` after an item made on the calling thread,
    ``away_ahead`` while items are made ahead (a step slowed by the thread, or not)."""
    clock = Clock()
    source = CallingThreadSource(clock, 1.0, count, error)
    verdict = warm() if verdict is None else verdict
    iterator = OverlapIterator(iter(source), buffer_size=1, clock=clock, verdict=verdict)
    taken = []
    for item in iterator:
        taken.append(item)
        clock.now += away_ahead if iterator.ahead else away_here
    return taken, iterator, source, verdict


def test_the_first_move_waits_for_eight_steps_timed_on_the_calling_thread() -> None:
    iterator, _ = overlap_steps([1.0] * 8)
    assert not iterator.ahead  # 7 cycles timed so far
    next(iterator)
    assert iterator.ahead


def test_a_thread_that_shortens_the_cycle_stays_and_the_verdict_says_so() -> None:
    taken, iterator, source, verdict = trial(away_here=1.0, away_ahead=1.0)
    assert taken == list(range(40))
    assert iterator.ahead and verdict.pays is True
    assert source.threads[-1] is not threading.current_thread()


def test_a_thread_that_hides_less_than_half_an_items_making_hands_the_source_back() -> None:
    # made here a cycle is 2.0 (away 1.0, making 1.0); ahead it is what the consumer is away
    for away_ahead, kept in [(1.7, False), (1.5, True), (1.2, True)]:
        before = input_threads()
        taken, iterator, source, verdict = trial(away_here=1.0, away_ahead=away_ahead)
        assert taken == list(range(40)), away_ahead
        assert verdict.pays is kept and iterator.ahead is kept, away_ahead
        assert (source.threads[-1] is threading.current_thread()) is not kept, away_ahead
        assert wait_until(lambda before=before: input_threads() <= before)


def test_a_datasets_first_eight_steps_are_no_baseline() -> None:
    iterator, _ = overlap_steps([1.0] * 16, verdict=OverlapVerdict())
    assert not iterator.ahead  # 15 cycles timed: 8 of warm-up, 7 of the baseline
    next(iterator)
    assert iterator.ahead
    verdict = OverlapVerdict()
    for _ in range(2):  # the warm-up goes on across passes: 5 cycles timed in each
        iterator, _ = overlap_steps([1.0] * 6, verdict=verdict)
        assert not iterator.ahead
    assert verdict.warm_up == 0
    iterator, _ = overlap_steps([1.0] * 9, verdict=verdict)
    assert iterator.ahead


def test_slow_first_steps_do_not_make_a_thread_that_saves_nothing_look_faster() -> None:
    # a program's first steps are slower: here the first five cycles (11, then four of 3;
    # then 2), which as a baseline would read 3.0 against the 2.05 of a thread that slows
    # the step by what it hides of the making (the consumer away 2.05, not 1.0): no gain
    clock = Clock()
    source = CallingThreadSource(clock, 1.0, 40)
    verdict = OverlapVerdict()
    iterator = OverlapIterator(iter(source), buffer_size=1, clock=clock, verdict=verdict)
    warm_up = [10.0, 2.0, 2.0, 2.0, 2.0]
    for step, _ in enumerate(iterator):
        clock.now += 2.05 if iterator.ahead else warm_up[step] if step < 5 else 1.0
    assert verdict.pays is False and not iterator.ahead
    assert source.threads[-1] is threading.current_thread()


def test_a_thread_that_slows_the_step_hands_the_source_back_in_order() -> None:
    for count in range(14, 30):  # the source ends before, during and after the hand-back
        before = input_threads()
        taken, iterator, source, verdict = trial(away_here=1.0, away_ahead=3.0, count=count)
        assert taken == list(range(count)), count
        if count > 18:  # the trial's 7 steps ahead were taken
            assert verdict.pays is False and not iterator.ahead, count
            assert source.threads[-1] is threading.current_thread(), count
        assert wait_until(lambda before=before: input_threads() <= before)


def test_after_a_failed_trial_the_next_waits_64_steps_made_here() -> None:
    verdict = OverlapVerdict()
    verdict.fail()
    assert (verdict.pays, verdict.wait) == (False, 64)
    taken, iterator, source, _ = trial(away_here=1.0, away_ahead=1.0, verdict=verdict)
    assert taken == list(range(40)) and not iterator.ahead  # 40 steps: still waiting
    assert set(source.threads) == {threading.current_thread()}
    assert verdict.wait == 64 - 40
    taken, iterator, source, _ = trial(away_here=1.0, away_ahead=1.0, verdict=verdict)
    assert taken == list(range(40))  # the next pass tries again, and it pays now
    assert iterator.ahead and verdict.pays is True
    assert source.threads.index(threading.current_thread()) == 0
    assert source.threads[24:] == [source.threads[-1]] * 16  # moved at step 24 of this pass
    assert source.threads[-1] is not threading.current_thread()


def moves_of(
    ahead_cost: Callable[[int], float], count: int
) -> tuple[list[tuple[int, str]], OverlapVerdict, CallingThreadSource]:
    """The steps at which a pass of ``count`` items moved ahead and back, when the consumer
    is away 1.0 after an item made here (which costs 1.0) and ``ahead_cost(step)`` after one
    made ahead (which costs it nothing)."""
    moves: list[tuple[int, str]] = []
    verdict = warm()
    clock = Clock()
    source = CallingThreadSource(clock, 1.0, count)
    iterator = OverlapIterator(iter(source), buffer_size=1, clock=clock, verdict=verdict)
    for step, _ in enumerate(iterator):
        if iterator.ahead and (not moves or moves[-1][1] != "ahead"):
            moves.append((step, "ahead"))
        elif not iterator.ahead and moves and moves[-1][1] == "ahead":
            moves.append((step, "here"))
        clock.now += ahead_cost(step) if iterator.ahead else 1.0
    return moves, verdict, source


def test_a_step_the_thread_always_slows_meets_trials_ever_further_apart() -> None:
    moves, verdict, source = moves_of(lambda step: 3.0, 2_000)
    # each trial: 7 steps made ahead, then 64, 128, 256, 512 steps made here before the next
    assert moves == [
        (8, "ahead"), (15, "here"), (80, "ahead"), (87, "here"), (216, "ahead"),
        (223, "here"), (480, "ahead"), (487, "here"), (1000, "ahead"), (1007, "here"),
    ]
    assert verdict.failed == 5 and 0 < verdict.wait <= 1024
    assert source.threads[-1] is threading.current_thread()


def test_a_thread_that_pays_is_checked_again_ever_further_apart() -> None:
    moves, verdict, _ = moves_of(lambda step: 1.0, 1_000)
    # trials pass at steps 15, 95, 239: checked again 64, 128, 256 steps made ahead later,
    # each check a fresh baseline of 8 steps made here before the trial
    assert moves == [
        (8, "ahead"), (79, "here"), (88, "ahead"), (223, "here"), (232, "ahead"),
        (495, "here"), (504, "ahead"),
    ]
    assert verdict.pays is True and verdict.passed == 4 and verdict.failed == 0


def test_a_thread_that_stops_paying_is_found_out_at_its_next_check() -> None:
    # the thread shortens the cycle until step 60, then slows the step (a trial that met a
    # quiet moment, or a step that changed): the check at step 79 takes the source back
    moves, verdict, _ = moves_of(lambda step: 1.0 if step < 60 else 3.0, 400)
    assert moves == [
        (8, "ahead"), (79, "here"), (88, "ahead"), (95, "here"), (160, "ahead"),
        (167, "here"), (296, "ahead"), (303, "here"),
    ]
    assert verdict.pays is False and (verdict.passed, verdict.failed) == (1, 3)


def test_a_check_hands_the_items_back_in_order() -> None:
    main = threading.current_thread()
    for count in range(60, 100):  # the source ends before, during and after the check
        before = input_threads()
        clock = Clock()
        source = CallingThreadSource(clock, 1.0, count)
        iterator = OverlapIterator(iter(source), buffer_size=2, clock=clock, verdict=paid())
        taken = []
        for item in iterator:
            taken.append(item)
            clock.now += 1.0
        assert taken == list(range(count)), count
        made_by = ["here" if thread is main else "ahead" for thread in source.threads]
        if count >= 74:  # moved at once, checked 64 steps made ahead later: a baseline here
            first = made_by.index("ahead")
            assert made_by[first:first + 60] == ["ahead"] * 60, count
            assert made_by[first + 66:first + 70] == ["here"] * 4, count
        assert wait_until(lambda before=before: input_threads() <= before)


def test_an_error_around_the_hand_back_reaches_the_consumer_as_the_same_object() -> None:
    for count in range(14, 26):
        error = OSError(f"disk went away after {count}")
        with pytest.raises(OSError) as caught:
            trial(away_here=1.0, away_ahead=3.0, count=count, error=error)
        assert caught.value is error
