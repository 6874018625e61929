"""MultiWorkerCentralStorageStrategy: W gloo processes on loopback, R logical CPU replicas each.

Each launch runs ``tests/_mw_worker.py`` in W processes (under torchrun, or with torchrun's
variables set by hand) and compares what they observed with single-process twins: plain
PyTorch on the same global batches (training), and one ``CentralStorageStrategy`` holding
all W x R replicas (every cross-worker call, aggregated writes, batch norm). Every launch
has a subprocess timeout, so no test can hang.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import idioms
import pytest
import torch
from torch import nn

import centralstore as cs
from centralstore.strategies import multi_worker
from centralstore.strategies.multi_worker import MultiWorkerCentralStorageStrategy

WORKER = Path(__file__).with_name("_mw_worker.py")
_spec = importlib.util.spec_from_file_location("_mw_worker", WORKER)
assert _spec is not None and _spec.loader is not None
helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helper)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    tmp_path: Path, world: int, *args: str, torchrun: bool = False, timeout: float = 100,
    max_restarts: int = 0,
) -> list[dict[str, Any]]:
    """Run the worker script in ``world`` processes; every rank's results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if torchrun:
        commands = [[
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", str(WORKER), *args,
        ]]
        envs = [env]
    else:
        port = str(free_port())
        commands = [[sys.executable, str(WORKER), *args] for _ in range(world)]
        envs = [
            {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(world)
        ]
    logs = [tmp_path / f"log{i}.txt" for i in range(len(commands))]
    processes = [
        subprocess.Popen(command, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for command, e, log in zip(commands, envs, logs, strict=True)
    ]
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in processes]
    except subprocess.TimeoutExpired:
        codes = []
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = "\n".join(log.read_text()[-3000:] for log in logs)
    assert codes and all(code == 0 for code in codes), f"exit codes {codes}:\n{output}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def skip_without_gpus(placement: str) -> None:
    """Skip a test of ``_mw_worker.GPU_PLACEMENTS[placement]`` on real GPUs
    (``CENTRALSTORE_REAL_GPUS=1``) where there are fewer than it names; fake ones are made."""
    devices, _ = helper.GPU_PLACEMENTS[placement]
    gpus = 1 + max(torch.device(device).index or 0 for device in devices)
    if os.environ.get("CENTRALSTORE_REAL_GPUS") and torch.cuda.device_count() < gpus:
        pytest.skip(f"{placement} needs {gpus} GPUs")


def assert_state_close(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert list(actual) == list(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=1e-5, rtol=1e-5, msg=f"{what}: {name}")


def check_training(results: list[dict[str, Any]], replicas: int) -> None:
    """Identical weights everywhere; equal to one device (MLP) or to one process of R (BN)."""
    for name, make_optimizer in helper.OPTIMIZERS.items():
        initial = results[0][f"{name}/initial"]
        oracle = helper.mlp()
        oracle.load_state_dict(initial)
        helper.train_one_device(oracle, make_optimizer(list(oracle.parameters())))
        for rank, result in enumerate(results):
            if name != "adam":  # adam: worker 0 alone loads a checkpoint after the scope
                assert_state_close(result[f"{name}/initial"], initial, f"{name} rank {rank} init")
            assert_state_close(result[f"{name}/final"], oracle.state_dict(), f"{name} rank {rank}")
            for key, value in result[f"{name}/final"].items():  # identical, not only close
                assert torch.equal(value, results[0][f"{name}/final"][key]), (name, rank, key)
    for rank, result in enumerate(results):  # buckets left during backward, or after the fold
        for key, value in result["sgd/after fold"].items():
            assert torch.equal(value, result["sgd/final"][key]), (rank, key)
    twin = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    with twin.scope():
        model = helper.bn_model()
        model.load_state_dict(results[0]["bn/initial"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    helper.train_bn(twin, model, optimizer)
    for rank, result in enumerate(results):
        assert_state_close(result["bn/final"], model.state_dict(), f"batch norm rank {rank}")


def check_traffic(results: list[dict[str, Any]]) -> None:
    """Hierarchical reduction: one training ``run`` sends one agreement row (7 fields and
    the 8 words of the slot a small reduce fills) and one gradient per worker (here in 3
    buckets, each closed once it holds 64 bytes), whatever the number of local replicas;
    the buckets leave during the last local replica's backward, not at the sync point. The
    first batch-norm run adds one sum of the writes (the statistics' float32 and the batch
    count's int64 together, as float64), the next ones none: the written values travel in
    the agreement row. None adds per-variable flags: every worker's are the same, which the
    agreement shows. An integer beyond float64's exact range keeps its dtype, in a sum of
    its own, and its exact value, then travels in the agreement and keeps it too."""
    parameters = sum(p.numel() for p in helper.mlp().parameters())
    for result in results:
        assert result["step_traffic"] == {"collectives": 1 + 3, "bytes": 15 * 8 + 4 * parameters}
        buckets = result["bn_buckets"]
        assert result["bn_collectives"] == [1 + buckets + 1, 1 + buckets, 1 + buckets], result
        buckets = result["big_buckets"]
        assert result["big_collectives"] == [1 + buckets + 2, 1 + buckets], result
        assert result["big"] == (2**60 + 3, 2.0)  # the first replica's count; the replicas' mean
        *earlier, last = result["started_in_backward"]
        assert last == 3 and all(n == 0 for n in earlier), result["started_in_backward"]
        assert result["step_collectives"] == 0, result  # the step after run: none
        assert result["freed"]  # and the exchange holds central variables weakly


def check_hooks(results: list[dict[str, Any]], replicas: int) -> None:
    """Post-accumulate-grad hooks fire after the exchange, on every worker for the same
    parameters, even one whose replicas left it no gradient: an optimizer step in them
    trains as one process of all the replicas does."""
    twin = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    expected = helper.optimizer_in_backward(twin)
    assert expected["fired"].count("a.weight") == 3  # once per run, head a included
    for rank, result in enumerate(results):
        got = result["optimizer in backward"]
        assert got["fired"] == expected["fired"], rank
        assert_state_close(got["weights"], expected["weights"], f"rank {rank}")


def check_api(results: list[dict[str, Any]], workers: int, local: int) -> None:
    """Every cross-worker call matches one process holding all W x R replicas."""
    replicas = workers * local
    expected = helper.api(cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)]))
    for rank, result in enumerate(results):
        got = result["api"]
        mine = slice(rank * local, (rank + 1) * local)
        assert got["ids"] == expected["ids"][mine]
        assert got["num_replicas"] == replicas
        for key, value in expected["reduce"].items():
            torch.testing.assert_close(got["reduce"][key], value, msg=key)
        for key in ("reduce_large", "reduce_scalar"):
            for op, value in expected[key].items():
                torch.testing.assert_close(got[key][op], value, msg=f"{key} {op}")
        # a scalar's sum (and MEAN's count) travels in the agreement row's slot; 40 floats
        # in an all-reduce (MEAN's counts, int64, in a second one); a gather's sizes in the
        # slot, its values in an all-gather
        assert got["collectives"] == {
            "gather": 2, "large SUM": 2, "large MEAN": 3, "scalar SUM": 1 + 1,
            "scalar MEAN": 1 + 1,
        }, got["collectives"]
        torch.testing.assert_close(got["gather"], expected["gather"])
        for t_got, t_expected in zip(got["complex"], expected["complex"], strict=True):
            assert t_got.is_complex()
            torch.testing.assert_close(t_got, t_expected)
        for op_got, op_expected in zip(got["all_reduce"], expected["all_reduce"], strict=True):
            assert [float(t) for t in op_got] == [float(t) for t in op_expected[mine]]
        for t_got, t_expected in zip(got["all_gather"], expected["all_gather"][mine], strict=True):
            torch.testing.assert_close(t_got, t_expected)
        # merge_call's fn returned one object, which every replica gets: run returns it whole
        assert [float(t) for t in got["merge_call"]] == [float(t) for t in expected["merge_call"]]
        assert got["merge_calls"] == 1  # once per worker
        assert got["input_context"] == [(workers, rank, replicas)]
        assert got["grad_through_all_reduce"] == pytest.approx(expected["grad_through_all_reduce"])
        assert got["should_checkpoint"] == (rank == 0)
        assert got["slices"] == [s[mine] for s in expected["slices"]]
        assert got["writes"] == pytest.approx(expected["writes"])


def test_two_workers_of_two_replicas_under_torchrun(tmp_path: Path) -> None:
    results = launch(tmp_path, 2, "main", str(tmp_path), "2", "env", torchrun=True)
    check_training(results, replicas=4)
    check_api(results, workers=2, local=2)
    check_hooks(results, replicas=4)
    check_traffic(results)
    assert results[1]["repr"] == (
        "MultiWorkerCentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], "
        "parameter_device='cpu:0', worker 1 of 2)"
    )


def test_three_workers_of_one_replica_with_an_explicit_process_group(tmp_path: Path) -> None:
    results = launch(tmp_path, 3, "main", str(tmp_path), "1", "explicit")
    check_training(results, replicas=3)
    check_api(results, workers=3, local=1)
    check_hooks(results, replicas=3)
    check_traffic(results)


@pytest.mark.parametrize("local", [1, 2])
def test_sparse_gradients_stay_sparse_across_workers(tmp_path: Path, local: int) -> None:
    """A sparse gradient is exchanged as the entries of every worker, so that ``.grad`` is
    sparse as on one device (SparseAdam refuses a dense one), also on a worker that never
    used the table; a table whose gradient is dense on some worker sums densely, as sparse
    plus dense does on one device. Trained with SparseAdam beside Adam, two runs a step,
    the weights equal one device's. A wide table's runs move far less than the table
    across workers, but for the run that reads it densely on one worker. The per-variable
    flags travel while the workers' differ or the table is new; after that, each worker's
    number of entries comes with the agreement."""
    check_sparse(launch(tmp_path, 2, "sparse", str(tmp_path), str(local)))


@pytest.mark.parametrize("placement", list(helper.GPU_PLACEMENTS))
def test_sparse_gradients_stay_sparse_across_workers_on_gpus(
    tmp_path: Path, placement: str
) -> None:
    """The same on fake GPUs (``_mw_worker.on_gpus``), or real ones: the replicas' sparse
    gradients on their GPUs, their entries gathered on the host, beside dense buckets."""
    skip_without_gpus(placement)
    check_sparse(launch(tmp_path, 2, "sparse", str(tmp_path), "0", placement))


def check_sparse(results: list[dict[str, Any]]) -> None:
    """``test_sparse_gradients_stay_sparse_across_workers``'s checks of every worker's
    ``_mw_worker.sparse_scenario``, against one device."""
    torch.manual_seed(0)
    model = helper.SparseTables()
    model(helper.SPARSE_IDS).backward()
    for rank, result in enumerate(results):
        for name, expected in ((n, p.grad) for n, p in model.named_parameters()):
            got = result["grads"][name]
            assert expected is not None and got is not None, (rank, name)
            assert got.is_sparse == expected.is_sparse, (rank, name)
            torch.testing.assert_close(got.to_dense(), expected.to_dense(), msg=f"{rank} {name}")
    assert model.rare.weight.grad is not None and model.rare.weight.grad.is_sparse
    assert not model.mixed.weight.grad.is_sparse  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = helper.SparseTables()
    optimizer = model.optimizer()
    for _ in range(3):
        model(helper.SPARSE_IDS).backward()
        model(helper.SPARSE_IDS).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(results):
        assert_state_close(result["state"], model.state_dict(), f"rank {rank}")
    torch.manual_seed(1)
    wide = helper.WideTable()
    table_bytes = 4 * wide.table.weight.numel()
    for i, dense in enumerate(helper.WIDE_RUNS):
        wide(helper.SPARSE_IDS, dense).backward()
        for rank, result in enumerate(results):
            sent, grads = result["wide"][i]
            for name, p in wide.named_parameters():
                assert p.grad is not None and grads[name].is_sparse == p.grad.is_sparse
                torch.testing.assert_close(
                    grads[name].to_dense(), p.grad.to_dense(), msg=f"rank {rank}, run {i}"
                )
            # a sparse table travels as its entries, also in the runs whose buckets leave
            # during backward; dense on worker 1 it travels dense
            assert (sent >= table_bytes) == dense, (rank, i, sent)
        wide.zero_grad()
    flags = "sync point's flags"
    for result in results:  # new, dense on one worker, then known sparse
        assert [flags in names for names in result["wide_gathers"]] == [True, True, False]
        assert result["wide_gathers"][2].count("sparse gradients") == 1, result["wide_gathers"]


def test_everyday_patterns_train_like_one_device_on_two_workers(tmp_path: Path) -> None:
    """The parity matrix's idioms (fused optimizers, freezing, accumulation, clipping after
    run, tied weights, an LSTM, checkpointing, two backwards) on the path every GPU job of
    several workers takes: views and a gradient exchange."""
    check_patterns(launch(tmp_path, 2, "patterns", str(tmp_path)))


@pytest.mark.parametrize("placement", list(helper.GPU_PLACEMENTS))
def test_everyday_patterns_train_like_one_device_on_two_workers_on_gpus(
    tmp_path: Path, placement: str
) -> None:
    """The same on fake GPUs (``_mw_worker.on_gpus``), or real ones, on every placement:
    one GPU a worker with the variables on it or in host memory, and two replicas a worker
    (the batch's 6 rows then in slices of 2, 2, 1 and 1) on the GPU of the variables, on
    two GPUs, and on two GPUs with the variables in host memory (their buckets copied to the
    host and sent during backward)."""
    skip_without_gpus(placement)
    local = len(helper.GPU_PLACEMENTS[placement][0])
    results = launch(tmp_path, 2, "patterns", str(tmp_path), placement)
    check_patterns(results, even=len(idioms.X) % (2 * local) == 0)


def check_patterns(results: list[dict[str, Any]], even: bool = True) -> None:
    """Every worker's ``_mw_worker.patterns_scenario`` against one device; without
    ``even`` (the batch's slices are not all one size) those of ``idioms.BATCH_STATISTICS``
    only alike on every worker."""
    for name, spec in idioms.PATTERNS.items():
        if not even and name in idioms.BATCH_STATISTICS:
            for rank, result in enumerate(results):
                for key, value in result[name].items():
                    assert torch.equal(value, results[0][name][key]), (name, rank, key)
            continue
        torch.manual_seed(0)
        model = spec["make"]()
        optimizer = spec["optimizer_of"](model)
        step = spec.get("step_of", idioms.mse_step)(model)
        for _ in range(3):
            for _ in range(spec.get("runs_per_step", 1)):
                step(idioms.X, idioms.Y)
            idioms.step_optimizer(spec, model, optimizer)
            spec.get("after_step", lambda m, o: None)(model, optimizer)
            optimizer.zero_grad()
        for rank, result in enumerate(results):
            assert_state_close(result[name], model.state_dict(), f"{name}, rank {rank}")
    for rank, result in enumerate(results):
        if "rows" not in result:  # (taken with one replica a worker)
            continue
        rows = result["rows"]
        assert rows["frozen"] == [False, True, True, True], rank  # the frozen weight: none
        assert rows["hooked"] == (1, 0.0), rank  # the hook zeroed this worker's gradient
        twin = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
        twin.load_state_dict(rows["state"])
        torch.testing.assert_close(rows["inference"], twin(rows["input"]))
        for key, value in rows["state"].items():  # running statistics combined alike
            assert torch.equal(value, results[0]["rows"]["state"][key]), (rank, key)


@pytest.mark.parametrize("local", [1, 2])
def test_batch_norm_buffers_written_in_place_combine_like_views_bit_for_bit(
    tmp_path: Path, local: int
) -> None:
    """A worker's replicas compute where the variables live, so they write batch norm's
    running statistics and counters, and a small floating buffer, in place, as replicas in
    one process do: no buffer gets a view of its own, except a statistic that some replica
    left alone (``skip``'s last replica) or a buffer written through its counter (``add``).
    Every pattern of writes (``_mw_worker.statistics_after``) leaves the same bits as views
    would, on every worker, and what one process of all the replicas leaves (close: the
    workers' sums group the replicas' terms otherwise)."""
    results = launch(tmp_path, 2, "statistics", str(tmp_path), str(local))
    for write in helper.STATISTICS_WRITES:
        twin = helper.statistics_after(
            cs.CentralStorageStrategy([f"cpu:{i}" for i in range(2 * local)]), write
        )
        for rank, result in enumerate(results):
            got, views = result[write], result[f"{write}/views"]
            # 2 layers: 2 statistics and a counter each; the shift
            assert views["viewed"] == 7, (write, rank)
            assert got["viewed"] < views["viewed"], (write, rank)
            if write not in ("skip", "add"):
                assert got["viewed"] == 0, (write, rank)
            for name, value in views["state"].items():
                assert torch.equal(got["state"][name], value), (write, rank, name)
                assert torch.equal(value, results[0][write]["state"][name]), (write, rank, name)
                if write != "eval":  # (whose second step grows some weights past 1e4,
                    largest = max(1.0, float(value.abs().max()))  # and their rounding)
                    torch.testing.assert_close(
                        value, twin["state"][name], rtol=0, atol=1e-4 * largest,
                        msg=f"{write}, rank {rank}: {name}",
                    )


@pytest.mark.parametrize("placement", list(helper.GPU_PLACEMENTS))
def test_workers_on_gpus_combine_buffers_like_views_and_train_alike_in_scope(
    tmp_path: Path, placement: str
) -> None:
    """The sync point across workers whose replicas are on fake GPUs (tests/fakegpu; no
    stream hazard, or the worker fails), or with ``CENTRALSTORE_REAL_GPUS=1`` on real ones:
    every pattern of batch-norm writes leaves the same bits as views would on every worker,
    and what one process of all the replicas on logical CPU devices leaves. Replicas on
    the GPU that holds the parameters write the buffers in place (fake tensors count as
    plain ones, so the fake GPUs take that path too). ``run`` with a ``merge_call`` and
    ``reduce``, called inside ``scope()``, whose ``torch.device`` context is the parameter
    device's, train as they do outside it. A differentiable ``all_reduce`` beside that
    model gives the gradient one process of all the replicas gives."""
    skip_without_gpus(placement)
    devices, parameter_device = helper.GPU_PLACEMENTS[placement]
    on_storage = all(device == parameter_device for device in devices)
    local = len(devices)
    results = launch(tmp_path, 2, "gpus", str(tmp_path), placement)
    for write in helper.STATISTICS_WRITES:
        twin = helper.statistics_after(
            cs.CentralStorageStrategy([f"cpu:{i}" for i in range(2 * local)]), write
        )
        for rank, result in enumerate(results):
            got, views = result[write], result[f"{write}/views"]
            assert views["viewed"] == 7, (write, rank)
            if not on_storage:
                assert got["viewed"] == 7, (write, rank)
            elif write != "add" and not (write == "skip" and local > 1):
                assert got["viewed"] == 0, (write, rank)
            for name, value in views["state"].items():
                assert torch.equal(got["state"][name], value), (write, rank, name)
                assert torch.equal(value, results[0][write]["state"][name]), (write, rank, name)
                if write != "eval":  # (see the test above)
                    largest = max(1.0, float(value.abs().max()))
                    torch.testing.assert_close(
                        value, twin["state"][name], rtol=0, atol=1e-4 * largest,
                        msg=f"{write}, rank {rank}: {name}",
                    )
    twin_grad = helper.all_reduced_grad(
        cs.CentralStorageStrategy([f"cpu:{i}" for i in range(2 * local)])
    )
    for rank, result in enumerate(results):
        assert result["all_reduce grad"] == twin_grad, rank
        outside, inside = result["scope/False"], result["scope/True"]
        assert len(inside["losses"]) == 3, rank
        for before, after in zip(outside["losses"], inside["losses"], strict=True):
            assert torch.equal(before, after), rank
        for name, value in outside["state"].items():
            assert torch.equal(inside["state"][name], value), (rank, name)


def test_mistakes_are_reported_by_every_worker(tmp_path: Path) -> None:
    results = launch(tmp_path, 2, "errors", str(tmp_path))
    for result in results:
        assert result["replicas"].startswith(
            "ValueError: MultiWorkerCentralStorageStrategy requires the same number of local "
            "replicas"
        ), result
        assert "worker 0: 2, worker 1: 1" in result["replicas"], result
        assert result["shapes"].startswith(
            "ValueError: reduce(SUM, axis=None) requires the same"
        ), result
        assert "worker 0: [((2,), 'torch.float32')]" in result["shapes"], result
        assert result["out_of_step"].startswith("RuntimeError: The workers are out of step"), result
        assert "worker 0 in reduce" in result["out_of_step"], result
        assert "worker 1 in gather" in result["out_of_step"], result
        assert result["step_seconds"] < 10, result  # at the same sync point, not the timeout
        assert result["discarded"], result  # the failed run left .grad and writes as before
    assert results[1]["step"].startswith("ValueError: boom in the step of worker 1"), results
    assert results[0]["step"].startswith(
        "RuntimeError: strategy.run failed on worker(s) [1]"
    ), results
    assert "ValueError: boom in the step of worker 1" in results[0]["step"], results
    # worker 1 raised in its backward after one of the three buckets had left; worker 0's
    # backward had started all three: discarded on both
    assert results[1]["mid_backward"].startswith("ValueError: boom in the backward of worker 1")
    assert results[0]["mid_backward"].startswith("RuntimeError: strategy.run failed on worker")
    assert [r["mid_backward_started"] for r in results] == [[3], [1]]
    assert all(r["mid_backward_discarded"] for r in results), results
    # a backward after run on worker 0 alone: worker 0 raises at its optimizer step, worker 1
    # (which had nothing to exchange there) at its next collective, both naming the cause
    for result in results:
        assert result["lopsided"].startswith("The workers are out of step"), result
        assert "worker 0 in optimizer.step() with gradients pending" in result["lopsided"]
        assert "worker 1 in reduce" in result["lopsided"], result
        assert "A backward after run must happen on every worker" in result["lopsided"]


# Per run of AGAIN_PASSES: the collectives started after each backward (each replica's, one
# replica after the other), and the collectives of the run.
AGAIN_TRAFFIC = {
    # The 3 buckets leave after the first backward; stale at the sync point, they go again
    # after the agreement, and the next run of 2 sends them during its second backward. A
    # run of 1 sends them at its sync point, with the agreement. A run of 3 finds them stale
    # again (they left during its second) and teaches 3; the run of 4 finds them stale too:
    # twice in a row, so the last run's buckets wait for its sync point.
    1: ([[3, 3], [0, 3], [0], [0, 3, 3], [0, 0, 3, 3], [0, 0, 0, 0]], [7, 4, 4, 7, 7, 4]),
    # Two replicas: in the first run a bucket counts its gradients complete during replica
    # 0's second pass, before replica 1 has any, and waits for the sync point, where the
    # workers learn the two passes: the next run's buckets leave during replica 1's second.
    # A run of 3 then sends them during replica 1's first pass, stale again; so does the run
    # of 4 during replica 1's second, and the last run's wait for the sync point.
    2: (
        [[0, 0, 0, 0], [0, 0, 0, 3], [0, 0], [0, 0, 0, 3, 3, 3], [0, 0, 0, 0, 0, 3, 3, 3],
         [0] * 8],
        [4, 4, 4, 7, 7, 4],
    ),
}


@pytest.mark.parametrize("local", [1, 2])
def test_buckets_that_a_second_backward_changed_are_exchanged_again(
    tmp_path: Path, local: int
) -> None:
    """A run that accumulates several backward passes: its buckets leave during the last
    pass once the workers learnt how many a run makes, and the sums are those of one
    device over the same passes, the same bits on every worker."""
    results = launch(tmp_path, 2, "again", str(tmp_path), str(local))
    _assert_again_grads(results, local)
    sent, collectives = AGAIN_TRAFFIC[local]
    for result in results:
        assert result["after_each_backward"] == sent, result["after_each_backward"]
        assert result["collectives"] == collectives, result["collectives"]


def _assert_again_grads(results: list[dict[str, Any]], local: int) -> None:
    """Each run's gradients are the sums of one device over the same passes (every
    replica of both workers made them), to rounding, the same bits on every worker."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    for run, passes in enumerate(helper.AGAIN_PASSES):
        oracle = helper.mlp()
        oracle.load_state_dict(results[0]["initial"])
        for part in x.tensor_split(passes):
            oracle(part).sum().backward()
        expected = [2 * local * p.grad for p in oracle.parameters() if p.grad is not None]
        for result in results:
            grads = result["grads"][run]
            assert len(grads) == len(expected) == 4
            for got, want, first in zip(grads, expected, results[0]["grads"][run], strict=True):
                torch.testing.assert_close(got, want)
                assert torch.equal(got, first)


@pytest.mark.parametrize(  # (local 0: the placement's replicas)
    "local, placement", [(1, None), (2, None), (0, "two-gpus-params-on-host")]
)
def test_buckets_pack_into_the_buffers_of_the_step_before(
    tmp_path: Path, local: int, placement: str | None
) -> None:
    """Each run's buckets are packed into the flat buffers the run before packed into, once
    nothing holds those any more (``.grad`` set to None): the sums in ``.grad`` lie where
    they lay. Gradients kept from an earlier run are never written (the run packs into new
    buffers), and ``.grad`` zeroed in place receives the sums. Every run's gradients are one
    device's sums, the same bits on every worker."""
    if placement is not None:
        skip_without_gpus(placement)
    results = launch(
        tmp_path, 2, "buffers", str(tmp_path), str(local), *([placement] if placement else [])
    )
    replicas = local or len(helper.GPU_PLACEMENTS[str(placement)][0])
    for k in range(helper.BUFFER_RUNS):
        oracle = helper.mlp()
        oracle.load_state_dict(results[0]["initial"])
        for scale in (1, 2):
            oracle(helper.buffer_input(k) * scale).sum().backward()
        expected = [replicas * p.grad for p in oracle.parameters()]
        for result in results:
            for got, want, first in zip(
                result["grads"][k], expected, results[0]["grads"][k], strict=True
            ):
                torch.testing.assert_close(got, want)
                assert torch.equal(got, first)
    for rank, result in enumerate(results):
        pointers = result["pointers"]
        assert pointers[2] == pointers[1], rank  # run 1's buffers, let go
        assert not set(pointers[3]) & set(pointers[2]), rank  # run 2's are kept: new ones
        assert pointers[4] == pointers[3], rank
        assert pointers[5] == pointers[4], rank  # zeroed in place: the sums added to them
        for then, after in zip(result["kept then"], result["kept after"], strict=True):
            assert torch.equal(then, after), rank


@pytest.mark.parametrize("local", [1, 2])
def test_torchmetrics_across_workers_equal_one_device(tmp_path: Path, local: int) -> None:
    """torchmetrics metrics in the scope, updated in a training step on two workers
    (``_mw_worker.metrics_scenario``): each worker folds its replicas at its sync points, a
    collection forms its compute groups from the folded states, a forward caches this
    worker's batch's value for the step, and ``compute``, which torchmetrics synchronizes
    across the workers, equals one device's over both workers' batches."""
    pytest.importorskip("torchmetrics")
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision

    results = launch(tmp_path, 2, "metrics", str(tmp_path), str(local))
    collection = torchmetrics.MetricCollection({
        "accuracy": MulticlassAccuracy(3, average="macro"),
        "precision": MulticlassPrecision(3, average="macro"),
        "top 2": MulticlassAccuracy(3, top_k=2, average="micro"),
    })
    mean = torchmetrics.MeanMetric()
    for rank in range(2):
        for (scores, labels), step in zip(
            helper.metric_batches(rank), results[rank]["steps"], strict=True
        ):
            collection.update(scores, labels)
            torch.testing.assert_close(step, mean(scores.max(-1).values))
    for rank in range(2):
        torch.testing.assert_close(results[rank]["collection"], collection.compute())
        torch.testing.assert_close(results[rank]["mean"], mean.compute())
        assert results[rank]["groups"] == {0: ["accuracy", "precision"], 1: ["top 2"]}


@pytest.mark.parametrize(  # (local 0: the placement's replicas)
    "local, placement", [(1, None), (2, None), (0, "two-gpus-params-on-host")]
)
def test_variables_that_runs_leave_without_gradients_stay_out_of_the_buckets(
    tmp_path: Path, local: int, placement: str | None
) -> None:
    """An EMA copy of the model in the scope (``_mw_worker.idle_scenario``) never gets a
    gradient: after the first training run it no longer travels as zeros, nor holds back
    the buckets during backward. A spare head that joins the loss later travels at that
    run's sync point, then in the buckets. The sums, the training and the EMA are one
    device's, the same bits on every worker, and the EMA has no gradient."""
    if placement is not None:
        skip_without_gpus(placement)
    results = launch(
        tmp_path, 2, "idle", str(tmp_path), str(local), *([placement] if placement else [])
    )
    replicas = local or len(helper.GPU_PLACEMENTS[str(placement)][0])
    net, spare = helper.mlp(), nn.Linear(6, 1)
    net.load_state_dict(results[0]["initial"])
    spare.load_state_dict(results[0]["spare"])
    trained = [*net.parameters(), *spare.parameters()]
    ema = [p.detach().clone() for p in net.parameters()]
    optimizer = torch.optim.SGD(trained, lr=0.001)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    for k in range(helper.IDLE_RUNS):
        optimizer.zero_grad()
        for scale in (1, 2):  # each worker's input
            loss = net(x * scale).sum() + (spare(x * scale).sum() if k >= helper.IDLE_JOINS else 0)
            (replicas * loss).backward()
        for result in results:
            expected = [p.grad for p in trained]
            for got, want, first in zip(result["grads"][k], expected, results[0]["grads"][k]):
                assert (got is None) == (want is None), k
                if want is not None:
                    torch.testing.assert_close(got, want)
                    assert torch.equal(got, first)
        optimizer.step()
        with torch.no_grad():
            for average, p in zip(ema, net.parameters()):  # the first update copies
                average.copy_(p) if k == 0 else average.lerp_(p, 0.1)
    mlp_bytes = 4 * sum(p.numel() for p in net.parameters())
    spare_bytes = 4 * sum(p.numel() for p in spare.parameters())
    row = 15 * 8  # the agreement row (``check_traffic``)
    for result in results:
        for got, want in zip(result["final"], trained, strict=True):
            torch.testing.assert_close(got, want.detach())
        for got, want in zip(result["ema"], ema, strict=True):
            torch.testing.assert_close(got, want)
        assert all(grad is None for grad in result["ema grads"])
        assert result["bytes"] == [
            row + 2 * mlp_bytes + spare_bytes,  # planned at the no-op run: every variable
            row + mlp_bytes, row + mlp_bytes,  # the EMA and the spare head left out
            row + mlp_bytes + spare_bytes,  # the head's first gradient, at the sync point
            row + mlp_bytes + spare_bytes, row + mlp_bytes + spare_bytes,
        ], result["bytes"]
        # (buckets that left during backward, buckets planned): the EMA's buckets came first
        # in the plan of every variable; then the MLP's 3 (the spare head's joins the first)
        assert result["left"] == [(0, 6)] + [(3, 3)] * 5, result["left"]
        # the agreement and the buckets; the head's first gradient in a bucket of its own
        assert result["collectives"] == [1 + 6, 1 + 3, 1 + 3, 1 + 3 + 1, 1 + 3, 1 + 3], result


@pytest.mark.parametrize("local", [1, 2])
def test_a_compiled_model_across_workers_compiles_once_and_trains_like_one_device(
    tmp_path: Path, local: int
) -> None:
    """A loss ``torch.compile``d on two workers (``_mw_worker.compiled_scenario``): one
    graph from the first run on, no graph break, no recompilation (the replicas' views
    are plain tensors in the module slots, alike at every run and on every replica), and
    the training of one device on the same global batches, the same bits on every
    worker."""
    results = launch(tmp_path, 2, "compiled", str(tmp_path), str(local))
    oracle = helper.mlp()
    oracle.load_state_dict(results[0]["initial"])
    optimizer = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for k in range(helper.COMPILED_RUNS):
        ((x, y),) = helper.batches([8], 30 + k)
        optimizer.zero_grad()
        (nn.functional.cross_entropy(oracle(x), y, reduction="sum") / 8).backward()
        optimizer.step()
    for rank, result in enumerate(results):
        assert result["counts"] == [(1, 0)] * helper.COMPILED_RUNS, (rank, result["counts"])
        assert_state_close(result["final"], oracle.state_dict(), f"rank {rank}")
        for key, value in result["final"].items():
            assert torch.equal(value, results[0]["final"][key]), (rank, key)


@pytest.mark.parametrize("placement", list(helper.GPU_PLACEMENTS))
def test_runs_of_several_backward_passes_on_gpus_sum_like_one_device(
    tmp_path: Path, placement: str
) -> None:
    """The runs above on fake GPUs (or real ones): their replicas' passes, copied to the
    host or summed where the parameters are, and exchanged early or again from the fold,
    give one device's sums, the same bits on every worker."""
    skip_without_gpus(placement)
    results = launch(tmp_path, 2, "again", str(tmp_path), "0", placement)
    _assert_again_grads(results, len(helper.GPU_PLACEMENTS[placement][0]))


@pytest.mark.parametrize("placement", list(helper.GPU_PLACEMENTS))
def test_workers_train_like_one_device_on_gpus(tmp_path: Path, placement: str) -> None:
    """``_mw_worker.train`` (even, uneven and empty slices, accumulation over two runs, an
    optimizer step in ``merge_call``, a backward after ``run``) on fake GPUs, or real ones,
    with Adam and SGD: every worker ends where one device does on the same global batches,
    with the same bits as the other worker, and as when every bucket waits for the sync
    point. The buckets leave during backward at every sync point with gradients from the
    second run on, also the ``merge_call``'s inside a run, but where a replica computes on
    another GPU than the variables'."""
    skip_without_gpus(placement)
    results = launch(tmp_path, 2, "training", str(tmp_path), placement)
    # runs 2 and 3, the two accumulated runs, the merge_call; then nothing left to send at
    # the end of that run, and no backward in the last one. A replica on another GPU than
    # the variables' keeps its gradients there until the sync point: none leaves early.
    left = [0] * 7 if placement == "two-gpus" else [3, 3, 3, 3, 3, 0, 0]
    for name, make_optimizer in helper.OPTIMIZERS.items():
        oracle = helper.mlp()
        oracle.load_state_dict(results[0][name]["initial"])
        helper.train_one_device(oracle, make_optimizer(list(oracle.parameters())))
        for rank, result in enumerate(results):
            final = result[name]["final"]
            assert_state_close(final, oracle.state_dict(), f"{name} rank {rank}")
            for key, value in final.items():
                assert torch.equal(value, results[0][name]["final"][key]), (name, rank, key)
            assert result[name]["left"] == left, (name, rank)
    for rank, result in enumerate(results):
        assert result["sgd/after fold"]["left"] == [], rank
        for key, value in result["sgd/after fold"]["final"].items():
            assert torch.equal(value, result["sgd"]["final"][key]), (rank, key)


@pytest.mark.parametrize("pinned", [None, 64])
@pytest.mark.parametrize("placement", ["one-gpu-params-on-host", "two-gpus-params-on-host"])
def test_buckets_copied_from_gpus_leave_during_backward(
    tmp_path: Path, placement: str, pinned: int | None
) -> None:
    """GPU replicas of variables in host memory (``_mw_worker.copied_runs``): a bucket
    leaves during backward once its gradients' copies to the host are queued (a helper
    thread waits for them, sums them and starts it), with the sums of the exchange after the
    fold, bit for bit. With pinned buckets of 64 bytes (``pinned``), whose copies start as
    each fills, the last layer's bucket and the first layer's bias's have left before the
    first layer's weight gets its gradient (each gradient lands whole in a pinned bucket,
    so the bias shares none with the weight); with the usual 16 MiB, the one pinned
    bucket's copy, and so every bucket, starts with the last gradient. A run that fails on
    worker 1 after its backward leaves ``.grad`` as it was on both, whatever left. A run of
    two passes sends its buckets during the first, finds them stale and exchanges again;
    the plan then waits for two passes, and the next such run sends them during its second,
    as DDP under ``no_sync``: its first pass's gradients stay on the GPU
    (``GradientBuckets.holds``) and the second copies their sums into the pinned buckets,
    whose copies start as a one-pass run's do. Without the helper thread, backward still
    returns, and the sync point raises."""
    skip_without_gpus(placement)
    results = launch(
        tmp_path, 2, "copied", str(tmp_path), placement, "-" if pinned is None else str(pinned)
    )
    p = 0 if pinned is None else 2
    local = len(helper.GPU_PLACEMENTS[placement][0])
    # The runs: planned, early, failing on worker 1, two passes (stale), two passes, one
    # pass (waiting for two). Per replica that ran, the buckets that had left at the end of
    # its passes, and when the first layer's weight got its gradient in each pass; with two
    # GPUs, worker 1's failing run ends after its first replica.
    if placement == "one-gpu-params-on-host":
        after = [[0, 3, 3, 3, 3, 0]] * 2
        before_first = [[0, p, p, p, 3, 0, p, 0]] * 2
    else:
        after = [
            [0, 0, 0, 3, 0, 3, 0, 0, 0, 3, 0, 0], [0, 0, 0, 3, 0, 0, 0, 0, 3, 0, 0],
        ]
        before_first = [
            [0, 0, 0, p, 0, p, 0, 0, 0, 0, 0, 0, 0, p, 0, 0],
            [0, 0, 0, p, 0, 0, 0, 0, 0, 0, 0, 0, p, 0, 0],
        ]
    for rank, result in enumerate(results):
        early, late = result["early"], result["late"]
        assert early["after"] == after[rank], (rank, early["after"])
        assert early["before first"] == before_first[rank], (rank, early["before first"])
        assert not any(late["after"]) and not any(late["before first"]), rank
        raised = ["RuntimeError", "ValueError"][rank]  # worker 0: the others' failure
        assert early["errors"] == late["errors"] == [None, None, raised, None, None, None], rank
        assert all(bool((g == 7).all()) for g in early["grads"][2]), rank  # left as they were
        for run, (mine, after_fold, first) in enumerate(zip(
            early["grads"], late["grads"], results[0]["early"]["grads"], strict=True,
        )):
            for got, want, worker_0 in zip(mine, after_fold, first, strict=True):
                assert torch.equal(got, want), (rank, run)  # as after the fold, bit for bit
                assert torch.equal(got, worker_0), (rank, run)  # and alike on every worker
        # no helper thread to start the buckets: the backward passes return, and the sync
        # point raises what stopped them, on every worker before they agree
        assert result["early"]["helper gone returned"] == local, rank
        assert "cannot schedule new futures" in result["early"]["helper gone"], rank


def test_a_worker_that_dies_makes_the_others_raise_within_the_timeout(tmp_path: Path) -> None:
    timeout = 6.0
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "fault", str(tmp_path), str(timeout)],
            env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=60) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes[1] == 3  # the worker that died
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert codes[0] == 0, processes[0].stdout.read() if processes[0].stdout else ""
    assert result["error"] is not None
    assert "failed on worker 0 of 2 within timeout=6s" in result["error"]
    assert "Another worker most likely failed or exited" in result["error"]
    assert result["seconds"] < timeout + 5


@pytest.mark.parametrize("peer", ["dead", "hung"])
def test_the_survivor_of_a_dead_or_hung_peer_exits_with_its_python_error(
    tmp_path: Path, peer: str
) -> None:
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "survivor", str(tmp_path), peer],
            env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        output, _ = processes[0].communicate(timeout=60)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert processes[0].returncode == 1, output  # not 134 (SIGABRT in torch's teardown)
    assert "RuntimeError: The cross-worker" in output
    assert "terminate called" not in output


def test_a_worker_killed_mid_training_is_restarted_by_torchrun_and_resumes(
    tmp_path: Path,
) -> None:
    """torchrun --max-restarts 1: worker 1 SIGKILLs itself after step 4 (the last checkpoint
    is from step 3); torchrun restarts both workers, whose new process group meets in the
    same store as the dead attempt's, and they resume from the latest checkpoint: the weights
    end as an uninterrupted run's, one device on the same global batches."""
    results = launch(tmp_path, 2, "restart", str(tmp_path), torchrun=True, max_restarts=1,
                     timeout=150)
    assert [r["attempt"] for r in results] == [1, 1]
    assert [Path(r["restored"]).name for r in results] == ["ckpt-2", "ckpt-2"]  # steps 1, 3
    oracle = helper.mlp()
    oracle.load_state_dict(torch.load(tmp_path / "initial.pt", weights_only=True))
    optimizer = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    batches = iter(helper.restart_data())
    for _ in range(helper.RESTART_STEPS):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(oracle(x), y).backward()
        optimizer.step()
    for result in results:
        assert_state_close(result["final"], oracle.state_dict(), "resumed under torchrun")


# -- in this process: construction errors and defaults ----------------------------------------


def test_without_torchrun_or_a_process_group_construction_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a default process group exists in this process")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not "
                                           r"set. Launch the script with `torchrun"):
        MultiWorkerCentralStorageStrategy(["cpu:0"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"timeout": 0}, "timeout must be positive"),
     ({"timeout": -1.0}, "timeout must be positive"),
     ({"bucket_cap_mb": 0}, "bucket_cap_mb must be positive")],
)
def test_invalid_settings_raise_before_any_communication(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MultiWorkerCentralStorageStrategy(["cpu:0"], **kwargs)


def test_default_compute_devices_share_the_gpus_between_local_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = tuple(f"cuda:{i}" for i in range(4))
    monkeypatch.setattr(multi_worker._devices, "default_compute_devices", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert multi_worker._local_compute_devices(None) == ("cuda:2", "cuda:3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="Cannot share 4 visible GPUs equally"):
        multi_worker._local_compute_devices(None)
    monkeypatch.setattr(multi_worker._devices, "default_compute_devices", lambda: ("cpu:0",))
    assert multi_worker._local_compute_devices(None) == ("cpu:0",)
    assert multi_worker._local_compute_devices(["CPU:1", "cpu"]) == ("cpu:1", "cpu:0")


@pytest.mark.parametrize("seed", range(4))
def test_gradient_buckets_are_cut_as_ddp_cuts_them(seed: int) -> None:
    """``bucket_indices`` against DDP's own assignment (``_compute_bucket_assignment_by_size``,
    which its reducer applies to the gradients in the order they become ready) given the
    tensors last first: the same buckets, the first capped at its smaller size."""
    import torch.distributed as dist

    from centralstore.strategies._buckets import bucket_indices

    sizes = torch.randint(1, 5000, (30,), generator=torch.Generator().manual_seed(seed))
    tensors = [torch.zeros(int(n)) for n in sizes]
    first, cap = 4096, 20_000
    ours = bucket_indices(tensors, [True] * len(tensors), first, cap)
    order = list(reversed(range(len(tensors))))
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], [first, cap]
    )
    assert ours == [[order[j] for j in bucket] for bucket in theirs]
    assert len(ours) > 3  # several buckets, so the rule is exercised


def test_a_plan_leaves_the_sparse_variables_out_of_its_buckets() -> None:
    """Variables whose sums stayed sparse travel as entries at the sync point: the plan's
    buckets and the gradients it waits for during backward hold only the others."""
    from types import SimpleNamespace

    from centralstore.strategies._buckets import BucketPlan

    tensors = [torch.zeros(n) for n in (300, 10, 200, 5)]
    records: Any = [SimpleNamespace(key=k) for k in "abcd"]
    plan = BucketPlan(records, [True] * 4, tensors, 512, 512, sparse=frozenset({0, 2}))
    assert plan.buckets == [[3, 1]]
    assert plan.bucket_of == {"d": 0, "b": 0}
    every = BucketPlan(records, [True] * 4, tensors, 512, 512)
    assert every.buckets == [[3, 2], [1, 0]] and len(every.bucket_of) == 4
    assert every.left_out == frozenset() and every.members == [3, 2, 1, 0]


def test_a_plan_leaves_the_idle_variables_out_of_its_buckets() -> None:
    """Variables that no run gave a gradient when the plan was learnt stay out of its
    buckets, beside the sparse ones: a bucket leaves only once all its gradients came."""
    from types import SimpleNamespace

    from centralstore.strategies._buckets import BucketPlan

    tensors = [torch.zeros(n) for n in (300, 10, 200, 5)]
    records: Any = [SimpleNamespace(key=k) for k in "abcd"]
    plan = BucketPlan(
        records, [True] * 4, tensors, 512, 512, sparse=frozenset({0}), idle=frozenset({3})
    )
    assert plan.buckets == [[2], [1]] and plan.members == [2, 1]
    assert plan.bucket_of == {"c": 0, "b": 1} and plan.left_out == frozenset({0, 3})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sparse_entries_travel_as_bytes_of_every_dtype(dtype: torch.dtype) -> None:
    """The indices and values of tables of several dtypes and odd row sizes share one
    gathered byte buffer: each comes back whole, as two workers holding the same entries
    add up on one device."""
    from types import SimpleNamespace

    from centralstore.strategies._exchange import _exchange_sparse

    tables = [torch.zeros(7, 3, dtype=dtype), torch.zeros(5, 1, dtype=torch.float32),
              torch.zeros(4, 5, dtype=dtype)]
    grads = [
        torch.sparse_coo_tensor(
            torch.tensor([[1, 6, 1]]), torch.arange(-4.0, 5.0).reshape(3, 3).to(dtype), (7, 3),
            check_invariants=True,
        ),
        torch.sparse_coo_tensor(torch.tensor([[4]]), torch.ones(1, 1), (5, 1),
                                check_invariants=True),
        None,  # this worker has no entries for it; the other, none either
    ]
    two_alike: Any = SimpleNamespace(
        device=torch.device("cpu"), all_gather=lambda what, flat: torch.stack([flat, flat])
    )
    kept = {0: (1, [3, 3]), 1: (1, [1, 1]), 2: (1, [0, 0])}
    sums = _exchange_sparse(two_alike, tables, grads, kept)
    for j in (0, 1):
        expected = grads[j]
        assert expected is not None and sums[j].dtype == tables[j].dtype
        torch.testing.assert_close(sums[j].to_dense(), 2 * expected.to_dense())
    assert sums[2].is_sparse and sums[2]._nnz() == 0
