"""Replica randomness (``_random.py``, docs/design.md §5.9): each replica's stream is its own
whatever runs between its draws, and the generators after a run go on from the last
replica's stream."""

from __future__ import annotations

import fakegpu
import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import context, local, strategy_of

import centralstore as cs


def _draws_around_a_merge(nested: bool, replicas: int) -> list[torch.Tensor]:
    """Each replica's draws before and after a ``merge_call`` whose function runs a nested
    ``strategy.run`` that draws too (``nested``), or does nothing."""
    strategy = strategy_of(replicas)

    def merge(s: cs.Strategy) -> None:
        if nested:
            s.run(lambda: torch.rand(5))
            torch.rand(7)  # and the merge's own code draws

    def step() -> torch.Tensor:
        before = torch.rand(3)
        context().merge_call(merge)
        return torch.cat([before, torch.rand(3)])

    torch.manual_seed(0)
    return list(local(strategy, strategy.run(step)))


@pytest.mark.parametrize("replicas", [2, 3])
def test_what_runs_while_replicas_wait_in_a_merge_leaves_their_streams_alone(
    replicas: int,
) -> None:
    quiet = _draws_around_a_merge(nested=False, replicas=replicas)
    busy = _draws_around_a_merge(nested=True, replicas=replicas)
    for a, b in zip(quiet, busy, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(quiet[0], quiet[1])


@pytest.mark.parametrize("rendezvous", [False, True])
def test_after_a_run_the_generator_goes_on_from_the_last_replicas_stream(
    rendezvous: bool,
) -> None:
    """Not restored to where it was before the run (that costs a copy of its state per
    replica), but the same on every path: a second run, or a draw after the run, repeats
    after the same seed."""
    strategy = strategy_of(2)

    def step() -> torch.Tensor:
        if rendezvous:
            context().all_reduce("sum", torch.zeros(()))
        return torch.rand(4)

    def program() -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(3)
        first = local(strategy, strategy.run(step))
        return [*first, *local(strategy, strategy.run(step))], torch.rand(4)

    (runs, after), (runs_again, after_again) = program(), program()
    for a, b in zip(runs, runs_again, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(after, after_again)
    sequential = strategy_of(2)
    torch.manual_seed(3)
    sequential.run(lambda: torch.rand(4))
    sequential.run(lambda: torch.rand(4))
    assert torch.equal(torch.rand(4), after)  # every path leaves the same stream


@each_path
def test_successive_runs_draw_new_numbers_on_every_replica(path: str) -> None:
    strategy = strategy_on(path, replicas=3)
    torch.manual_seed(0)
    first = local(strategy, run_on(path, strategy, lambda: torch.rand(4)))
    second = local(strategy, run_on(path, strategy, lambda: torch.rand(4)))
    for a, b in zip(first, second, strict=True):
        assert not torch.equal(a, b)


@each_path
def test_a_restored_generator_state_repeats_the_next_run(path: str) -> None:
    """The streams derive from the seed the generator holds, which its state carries: a
    training resumed from a checkpoint of the generators draws what it would have."""
    strategy = strategy_on(path)
    torch.manual_seed(0)
    run_on(path, strategy, lambda: torch.rand(4))
    saved = torch.get_rng_state()
    first = local(strategy, run_on(path, strategy, lambda: torch.rand(4)))
    torch.set_rng_state(saved)
    again = local(strategy, run_on(path, strategy, lambda: torch.rand(4)))
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("views", [False, True])
def test_a_merge_function_and_a_run_inside_it_draw_what_no_replica_draws(views: bool) -> None:
    """While the replicas wait in ``merge_call``, the generators hold the last replica's
    saved stream: the merge function draws from a stream of its own, so that neither its
    numbers nor those of a run inside it (whose base is read from the generator) are what
    the last replica, or the next run, draws. (A merge is a rendezvous: the replicas run
    on threads, seeing the parameters directly or through views.)"""
    strategy = strategy_of(3, direct=not views)
    merged: list[torch.Tensor] = []
    nested: list[list[torch.Tensor]] = []

    def merge(s: cs.Strategy) -> None:
        merged.append(torch.rand(5))
        nested.append(local(s, s.run(lambda: torch.rand(5))))

    def step() -> torch.Tensor:
        context().merge_call(merge)
        return torch.rand(5)

    torch.manual_seed(0)
    after_merge = local(strategy, strategy.run(step))
    next_run = local(strategy, strategy.run(lambda: torch.rand(5)))
    drawn = [merged[0], *nested[0], *after_merge, *next_run]
    for i, a in enumerate(drawn):
        for b in drawn[i + 1:]:
            assert not torch.equal(a, b)


def test_a_strategy_built_before_any_cuda_call_draws_on_each_gpu(
    fake_gpus: fakegpu.FakeGPUs,
) -> None:
    """CUDA fills ``torch.cuda.default_generators`` only when it initializes, lazily, at its
    first call: a strategy built first initializes it (on an H200 its constructor raised
    IndexError), and its GPU replicas then draw, each its own numbers. (That each draws from
    its own GPU's generator is ``test_gpu_paths``' case.)"""
    assert not torch.cuda.is_initialized()
    strategy = cs.CentralStorageStrategy(["cuda:0", "cuda:1"], parameter_device="cpu")
    assert torch.cuda.is_initialized()
    torch.manual_seed(0)
    draws = local(strategy, strategy.run(lambda: torch.rand(4, device="cuda").cpu()))
    assert not torch.equal(draws[0], draws[1])
