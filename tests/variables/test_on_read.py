"""Variables synchronized on read (``cs.VariableSynchronization.ON_READ``, docs/design.md
§3.6): one copy per replica, kept across runs; reads outside ``run`` see the copies reduced
by the aggregation; a write outside ``run`` sets every copy by TensorFlow's rule
(``on_read_assign_cross_replica``: for SUM, the value divided by the replicas). On every
path of the parity matrix (tests/paths.py)."""

from __future__ import annotations

import pytest
import torch
from paths import each_path, run_on, strategy_on
from replicas import context, local, replica_id

import centralstore as cs
from centralstore.variables import folding

ON_READ = cs.VariableSynchronization.ON_READ
# three runs in which replica r adds r + 1 to its copy by assign(var + x), from 0
AFTER_RUNS = {"SUM": 9.0, "MEAN": 4.5, "ONLY_FIRST_REPLICA": 3.0}
# then 10 assigned outside run, and one more such run
AFTER_ASSIGN = {"SUM": 13.0, "MEAN": 11.5, "ONLY_FIRST_REPLICA": 11.0}
COPIES_AFTER_ASSIGN = {"SUM": (5.0, 5.0), "MEAN": (10.0, 10.0), "ONLY_FIRST_REPLICA": (10.0, 10.0)}


def on_read(strategy: cs.Strategy, aggregation: str, value: object = 0.0) -> torch.Tensor:
    with strategy.scope():
        return cs.Variable(value, aggregation=aggregation, trainable=False,
                           synchronization=ON_READ)


def add_own(variable: torch.Tensor) -> torch.Tensor:
    """assign(var + x), as Keras' confusion-matrix metrics update; returns the copy read."""
    variable.copy_(variable + (replica_id() + 1.0))
    return variable.clone()


def copies_seen(path: str, strategy: cs.Strategy, variable: torch.Tensor) -> list[float]:
    """The value of ``variable`` that each replica reads in a run: its own copy."""
    seen = run_on(path, strategy, lambda: variable.clone())
    return [float(c) for c in local(strategy, seen)]


def add_own_then_fail(variable: torch.Tensor) -> None:
    """``add_own``, then replica 1 raises: the run fails after every replica wrote."""
    add_own(variable)
    if replica_id() == 1:
        raise RuntimeError("replica 1 fails")


@each_path
@pytest.mark.parametrize("aggregation", sorted(AFTER_RUNS))
def test_reads_outside_run_see_the_copies_reduced(path: str, aggregation: str) -> None:
    strategy = strategy_on(path)
    variable = on_read(strategy, aggregation)
    for _ in range(3):
        copies = run_on(path, strategy, lambda: add_own(variable))
    # each replica kept its own copy across the runs
    assert [float(c) for c in local(strategy, copies)] == [3.0, 6.0]
    assert float(variable) == AFTER_RUNS[aggregation]
    with torch.no_grad():
        variable.copy_(torch.tensor(10.0))  # cross-replica: every copy is set
    assert tuple(copies_seen(path, strategy, variable)) == COPIES_AFTER_ASSIGN[aggregation]
    run_on(path, strategy, lambda: add_own(variable))
    assert float(variable) == AFTER_ASSIGN[aggregation]


@each_path
def test_a_module_state_dict_shows_the_reduced_value_and_loading_resets_the_copies(
    path: str,
) -> None:
    strategy = strategy_on(path)
    counts = on_read(strategy, "SUM", torch.zeros(2))
    with strategy.scope():
        holder = torch.nn.Module()
        holder.register_buffer("counts", counts)
    for _ in range(2):
        run_on(path, strategy, lambda: counts.add_(replica_id() + 1.0))
    assert holder.state_dict()["counts"].tolist() == [6.0, 6.0]
    holder.load_state_dict({"counts": torch.tensor([4.0, 8.0])})
    seen = run_on(path, strategy, lambda: counts.clone())
    assert [c.tolist() for c in local(strategy, seen)] == [[2.0, 4.0], [2.0, 4.0]]
    run_on(path, strategy, lambda: counts.add_(1.0))
    assert counts.tolist() == [6.0, 10.0]


@each_path
def test_a_failed_run_leaves_the_copies_as_before(path: str) -> None:
    strategy = strategy_on(path)
    variable = on_read(strategy, "SUM")
    run_on(path, strategy, lambda: add_own(variable))

    with pytest.raises(RuntimeError, match="replica 1 fails"):
        run_on(path, strategy, lambda: add_own_then_fail(variable))
    assert float(variable) == 3.0
    assert copies_seen(path, strategy, variable) == [1.0, 2.0]


@each_path
def test_merge_call_sees_the_copies_reduced(path: str) -> None:
    strategy = strategy_on(path)
    variable = on_read(strategy, "SUM")

    def step() -> float:
        variable.add_(replica_id() + 1.0)
        seen: float = context().merge_call(lambda s: float(variable))
        variable.add_(1.0)
        return seen

    results = run_on(path, strategy, step)
    assert set(local(strategy, results)) == {3.0}
    assert float(variable) == 5.0


@each_path
def test_a_kernel_write_behind_the_version_counter_counts(path: str) -> None:
    """Batch norm's kernel writes its running mean without moving the version counter: the
    replica's copy is still counted as written."""
    strategy = strategy_on(path)
    mean = on_read(strategy, "SUM", torch.zeros(2))

    def step() -> None:
        x = torch.full((4, 2), replica_id() + 1.0)
        torch.nn.functional.batch_norm(x, mean, torch.ones(2), training=True, momentum=1.0)

    run_on(path, strategy, step)
    assert mean.tolist() == [3.0, 3.0]  # replica 0's copy 1, replica 1's 2


@each_path
@pytest.mark.parametrize("call", ["out", "list"])
def test_a_write_through_a_keyword_or_a_list_reaches_the_copy(path: str, call: str) -> None:
    """A central variable given as ``out=`` or inside a list argument is swapped for the
    replica's copy like one given first."""
    strategy = strategy_on(path)
    variable = on_read(strategy, "MEAN", torch.zeros(2))

    def step() -> None:
        own = torch.full((2,), replica_id() + 1.0)
        if call == "out":
            torch.add(variable, own, out=variable)
        else:
            torch._foreach_add_([variable], [own])

    run_on(path, strategy, step)
    assert variable.tolist() == [1.5, 1.5]  # the copies 1 and 2, averaged


@each_path
def test_copies_count_from_their_last_sync_point_over_failures_and_merges(path: str) -> None:
    """A copy's start is kept from one epoch to the next while it equals the copy (the
    copy's version counter has not moved since the sync point that folded it): each change
    still counts once, after a failed run and across a merge's sync point."""
    strategy = strategy_on(path)
    variable = on_read(strategy, "SUM")
    for _ in range(2):
        run_on(path, strategy, lambda: add_own(variable))
    assert float(variable) == 6.0  # copies 2 and 4

    with pytest.raises(RuntimeError, match="replica 1 fails"):
        run_on(path, strategy, lambda: add_own_then_fail(variable))
    run_on(path, strategy, lambda: add_own(variable))
    assert float(variable) == 9.0  # copies 3 and 6

    def merged() -> float:
        add_own(variable)  # copies 4 and 8: folded by the merge's sync point
        seen: float = context().merge_call(lambda s: float(variable))
        add_own(variable)  # copies 5 and 10
        return seen

    assert set(local(strategy, run_on(path, strategy, merged))) == {12.0}
    assert float(variable) == 15.0
    assert copies_seen(path, strategy, variable) == [5.0, 10.0]


@each_path
def test_a_kernel_write_in_a_later_run_counts_from_the_copy_folded_before(path: str) -> None:
    strategy = strategy_on(path)
    mean = on_read(strategy, "SUM", torch.zeros(2))

    def step(scale: float) -> None:
        x = torch.full((4, 2), scale * (replica_id() + 1.0))
        torch.nn.functional.batch_norm(x, mean, torch.ones(2), training=True, momentum=1.0)

    run_on(path, strategy, lambda: step(1.0))
    run_on(path, strategy, lambda: step(2.0))
    assert mean.tolist() == [6.0, 6.0]  # copies 2 and 4, each written behind its counter


@each_path
@pytest.mark.parametrize("aggregation", ["SUM", "MEAN"])
def test_metrics_written_alike_reduce_to_the_bits_of_one_variable_at_a_time(
    path: str, aggregation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas that write the same ON_READ variables in the same order (a Keras model's
    metrics) have their copies reduced together (``folding._reduce_aligned``): the same
    arithmetic, bit for bit, as the reduction of one variable at a time."""
    generator = torch.Generator().manual_seed(0)
    increments = torch.rand(4, 2, 3, generator=generator)  # (run, replica, variable)

    def reduced() -> list[float]:
        strategy = strategy_on(path)
        variables = [on_read(strategy, aggregation, 0.1 * k) for k in range(3)]

        def step(run: int) -> None:
            for k, variable in enumerate(variables):
                variable.add_(increments[run, replica_id(), k])

        for run in range(4):
            run_on(path, strategy, step, args=(run,))
        return [float(v) for v in variables]

    together = reduced()
    monkeypatch.setattr(folding, "_reduce_aligned", lambda *args: False)
    assert reduced() == together


def test_an_integer_sum_splits_exactly_over_three_replicas() -> None:
    strategy = strategy_on("direct", 3)
    variable = on_read(strategy, "SUM", 7)
    seen = strategy.run(lambda: variable.clone())
    assert [int(c) for c in local(strategy, seen)] == [3, 2, 2]  # TensorFlow truncates to 2s
    strategy.run(lambda: variable.add_(1))
    assert int(variable) == 10


def test_on_read_needs_an_aggregation() -> None:
    with strategy_on("direct").scope(), pytest.raises(ValueError, match="SUM, MEAN or ONLY"):
        cs.Variable(0.0, synchronization="ON_READ")
    with pytest.raises(ValueError, match="synchronization must be one of"):
        cs.VariableSynchronization.parse("sometimes")
