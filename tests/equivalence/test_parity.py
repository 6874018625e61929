"""The parity matrix: plain-PyTorch idioms on every replica path (``paths.py``), each against
one device or against the other paths, bit for bit where the paths compute the same sums."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from idioms import PATTERNS, X, Y, mse_step
from paths import PATHS, each_path, run_on, step_on, strategy_on
from replicas import context, local, replica_id
from torch import nn

import centralstore as cs


def halves(t: torch.Tensor, replicas: int = 2) -> cs.PerReplica[torch.Tensor]:
    return cs.PerReplica(list(t.tensor_split(replicas)))


def build(strategy: cs.Strategy, make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with strategy.scope():
        return make()


def one_device_grads(make: Callable[[], nn.Module]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    (((model(X) - Y) ** 2).sum() / len(X)).backward()
    return [p.grad for p in model.parameters()]


# -- the rows of the parity table ----------------------------------------------------------


@each_path
@pytest.mark.parametrize("earlier_run", [False, True])
def test_inference_mode_runs_with_or_without_earlier_runs(path: str, earlier_run: bool) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    if earlier_run:
        run_on(path, strategy, lambda xs: model(xs).sum().backward(), (halves(X),))
    model.eval()
    with torch.inference_mode():
        out = run_on(path, strategy, lambda xs: model(xs), (halves(X),))
    torch.testing.assert_close(torch.cat(local(strategy, out)), model(X).detach())
    model.train()
    before = model[1].running_mean.clone()
    with torch.inference_mode():  # batch norm writes its running statistics in place
        run_on(path, strategy, lambda xs: model(xs), (halves(X),))
    assert not torch.equal(model[1].running_mean, before)


@each_path
def test_requires_grad_is_read_when_a_run_begins(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    step = step_on(path, lambda xs: model(xs).sum().backward())
    model.weight.requires_grad_(False)  # frozen
    strategy.run(step, args=(halves(X),))
    assert model.weight.grad is None and model.bias.grad is not None
    model.weight.requires_grad_(True)  # unfrozen
    strategy.run(step, args=(halves(X),))
    assert model.weight.grad is not None


@each_path
def test_tensor_hooks_run_on_every_replica_gradient(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    seen: list[torch.Size] = []
    model.weight.register_hook(lambda g: seen.append(g.shape) or g * 0)  # type: ignore[func-returns-value]
    run_on(path, strategy, lambda xs: model(xs).sum().backward(), (halves(X),))
    assert seen == [model.weight.shape] * 2
    assert model.weight.grad is not None and not model.weight.grad.any()
    assert model.bias.grad is not None and model.bias.grad.any()


@each_path
def test_post_accumulate_grad_hooks_fire_once_per_accumulation_into_grad(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    seen: list[torch.Tensor] = []
    model.bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for _ in range(2):  # accumulation over two runs: two accumulations
        run_on(path, strategy, mse_step(model), (halves(X), halves(Y)))
    assert len(seen) == 2
    full = one_device_grads(lambda: nn.Linear(4, 2))[1]
    torch.testing.assert_close(seen[0], full)  # the summed gradient, as one device's
    torch.testing.assert_close(seen[1], 2 * full)


@each_path
def test_an_optimizer_step_in_a_post_accumulate_hook_steps_once_per_run(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for p in model.parameters():  # the optimizer-in-backward idiom
        p.register_post_accumulate_grad_hook(
            lambda p: (optimizers[p].step(), optimizers[p].zero_grad())
        )
    run_on(path, strategy, mse_step(model), (halves(X), halves(Y)))
    torch.manual_seed(0)
    oracle = nn.Linear(4, 2)
    (((oracle(X) - Y) ** 2).sum() / len(X)).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@each_path
def test_functional_call_computes_with_each_replicas_own_tensors(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(1, 1, bias=False))
    weights = cs.PerReplica([torch.full((1, 1), 2.0), torch.full((1, 1), 3.0)])

    def step(w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, {"weight": w}, (torch.ones(1, 1),))

    out = run_on(path, strategy, step, (weights,))
    assert [float(t) for t in local(strategy, out)] == [2.0, 3.0]


class _MeetsInside(nn.Module):
    """A module whose forward meets the other replicas halfway (as SyncBatchNorm does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context().all_reduce("SUM", self.inner(x).detach())
        return self.inner(x)  # after the rendezvous: still this replica's weight


@pytest.mark.parametrize("path", ["direct", "views"])  # the rendezvous makes both threaded
def test_functional_call_across_a_rendezvous_keeps_each_replicas_tensors(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, _MeetsInside)
    weights = cs.PerReplica([torch.full((1, 1), 2.0), torch.full((1, 1), 3.0)])

    def step(w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, {"inner.weight": w}, (torch.ones(1, 1),))

    out = strategy.run(step, args=(weights,))
    assert [float(t) for t in local(strategy, out)] == [2.0, 3.0]
    assert model.inner.weight is next(model.parameters())  # the slots hold it again


@each_path
def test_legacy_weight_norm_pre_hook_sets_each_replicas_weight(path: str) -> None:
    strategy = strategy_on(path)
    with pytest.warns(FutureWarning):
        model = build(strategy, lambda: nn.utils.weight_norm(nn.Linear(4, 2)))
    for _ in range(3):
        run_on(path, strategy, mse_step(model), (halves(X), halves(Y)))
    with pytest.warns(FutureWarning):
        oracle = build(cs.OneDeviceStrategy("cpu"), lambda: nn.utils.weight_norm(nn.Linear(4, 2)))
    for _ in range(3):
        (((oracle(X) - Y) ** 2).sum() / len(X)).backward()
    for name in ("weight_g", "weight_v", "bias"):
        torch.testing.assert_close(getattr(model, name).grad, getattr(oracle, name).grad)


@each_path
def test_existing_grad_tensors_are_accumulated_in_place(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    model(X).sum().backward()
    model.zero_grad(set_to_none=False)
    held = [p.grad for p in model.parameters()]
    flat = torch.cat([g.view(-1) for g in held if g is not None])  # a copy: only values
    run_on(path, strategy, mse_step(model), (halves(X), halves(Y)))
    assert [p.grad for p in model.parameters()] == held  # the same tensors
    expected = one_device_grads(lambda: nn.Linear(4, 2))
    for grad, want in zip(held, expected, strict=True):
        torch.testing.assert_close(grad, want)
    assert not flat.any()


@each_path
def test_embedding_with_padding_idx_and_no_grad_writes_in_scope(path: str) -> None:
    strategy = strategy_on(path)
    with strategy.scope():
        embedding = nn.Embedding(10, 4, padding_idx=0)
        linear = nn.Linear(4, 2)
        with torch.no_grad():
            linear.weight[0].fill_(0)
    assert strategy.extended.variable_created_in_scope(embedding.weight)
    assert not embedding.weight[0].any() and not linear.weight[0].any()
    tokens = cs.PerReplica([torch.tensor([0, 1, 2]), torch.tensor([3, 0])])
    run_on(path, strategy, lambda t: linear(embedding(t)).sum().backward(), (tokens,))
    assert embedding.weight.grad is not None and not embedding.weight.grad[0].any()


@each_path
def test_a_write_to_a_shared_parameter_raises_naming_it(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))

    def clip() -> None:
        with torch.no_grad():
            model.weight.clamp_(-0.01, 0.01)

    with pytest.raises(ValueError, match="'weight'") as info:
        run_on(path, strategy, clip)
    assert "set_aggregation" in str(info.value)


@each_path
def test_a_write_with_gradients_on_is_refused_before_it_happens(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        run_on(path, strategy, lambda: model.weight.add_(1.0))
    assert torch.equal(model.weight.detach(), before)


# -- modules that are not central ---------------------------------------------------------


def _batch_norm_counts(path: str, strategy: cs.Strategy, modules: list[nn.Module]) -> list[int]:
    for module in modules:
        run_on(path, strategy, lambda xs, m=module: m(xs), (halves(X),))
    return [int(m[1].num_batches_tracked) for m in modules]


@each_path
def test_deepcopy_and_torch_load_inside_scope_are_central(path: str, tmp_path: Any) -> None:
    import copy

    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    torch.save(model, tmp_path / "model.pt")
    with strategy.scope():
        copied = copy.deepcopy(model)
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for module in (copied, loaded):
        assert all(
            strategy.extended.variable_created_in_scope(t)
            for t in [*module.parameters(), *module.buffers()]
        )
    assert _batch_norm_counts(path, strategy, [model, copied, loaded]) == [1, 1, 1]


@each_path
@pytest.mark.parametrize("built", ["before the strategy", "after the strategy", "compiled"])
def test_a_module_built_outside_scope_is_refused_at_its_first_call_in_run(
    path: str, built: str
) -> None:
    if built == "before the strategy":
        outside: nn.Module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        strategy = strategy_on(path)
    else:
        strategy = strategy_on(path)
        build(strategy, lambda: nn.Linear(4, 4))
        run_on(path, strategy, lambda: None)  # the first run's check has passed
        outside = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        if built == "compiled":
            outside = torch.compile(outside)
    refused = r"The Linear module .* 'weight' of shape \(3, 4\)"
    with pytest.raises(ValueError, match=refused) as info:
        run_on(path, strategy, lambda xs: outside(xs), (halves(X),))
    assert "strategy.scope()" in str(info.value)
    if built != "compiled":  # not a single update of the running statistics
        assert int(outside[1].num_batches_tracked) == 0


@each_path
def test_a_module_attached_in_scope_becomes_central_and_plain_ones_lose_the_check(
    path: str,
) -> None:
    strategy = strategy_on(path)
    build(strategy, lambda: nn.Linear(4, 4))
    run_on(path, strategy, lambda: None)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    plain = nn.Linear(4, 3)
    assert model[0]._forward_pre_hooks and plain._forward_pre_hooks  # checked at first call
    plain(X)  # outside run: a plain module, no longer checked
    assert not plain._forward_pre_hooks
    with strategy.scope():
        holder = nn.Module()
        holder.add_module("model", model)
    assert not model[0]._forward_pre_hooks
    assert _batch_norm_counts(path, strategy, [model]) == [1]


# -- randomness ---------------------------------------------------------------------------


def _dropout_program(path: str) -> list[torch.Tensor]:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)))
    torch.manual_seed(1234)
    outs = []
    for _ in range(2):
        out = run_on(path, strategy, lambda xs: model(xs), (halves(X),))
        outs.append(torch.cat(local(strategy, out)).detach())
    return outs


@each_path
def test_two_identical_programs_draw_identical_random_numbers(path: str) -> None:
    first, second = _dropout_program(path), _dropout_program(path)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_every_path_draws_the_same_random_numbers() -> None:
    results = [_dropout_program(path) for path in PATHS]
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@each_path
def test_replicas_draw_different_masks_and_runs_different_ones(path: str) -> None:
    strategy = strategy_on(path)
    torch.manual_seed(0)
    same = cs.PerReplica([torch.ones(64), torch.ones(64)])
    masks = [
        local(strategy, run_on(path, strategy, lambda x: nn.functional.dropout(x, 0.5), (same,)))
        for _ in range(2)
    ]
    assert not torch.equal(masks[0][0], masks[0][1])  # replica 0 and 1
    assert not torch.equal(masks[0][1], masks[1][1])  # replica 1 in two runs
    torch.manual_seed(0)  # replica 0: the global stream, as one device draws it
    assert torch.equal(masks[0][0], nn.functional.dropout(torch.ones(64), 0.5))


# -- one thread at a time -----------------------------------------------------------------


@each_path
def test_a_second_thread_is_refused_at_every_entry_naming_both_threads(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inside, release = threading.Event(), threading.Event()

    def step(xs: torch.Tensor) -> None:
        inside.set()
        release.wait(10)
        model(xs).sum().backward()

    trainer = threading.Thread(
        target=run_on, args=(path, strategy, step, (halves(X),)), name="the-trainer"
    )
    trainer.start()
    try:
        assert inside.wait(10)
        entries: list[Callable[[], Any]] = [
            lambda: strategy.run(lambda: None),
            optimizer.step,
            lambda: strategy.run(lambda: context().merge_call(lambda s: None)),
        ]
        for entry in entries:
            with pytest.raises(RuntimeError, match="the-trainer") as info:
                entry()
            assert threading.current_thread().name in str(info.value)
    finally:
        release.set()
        trainer.join(10)
    assert model.weight.grad is not None  # the trainer's run was not disturbed


# -- everyday patterns --------------------------------------------------------------------


def _train(
    path: str, make: Callable[[], nn.Module], steps: int,
    optimizer_of: Callable[[nn.Module], torch.optim.Optimizer],
    step_of: Callable[[nn.Module], Callable[..., Any]] = mse_step,
    after_step: Callable[[nn.Module, torch.optim.Optimizer], None] = lambda m, o: None,
    runs_per_step: int = 1,
    optimizer_step: Callable[[nn.Module, torch.optim.Optimizer], None] = lambda m, o: o.step(),
    compiled: bool = False,
) -> nn.Module:
    """``steps`` optimizer steps on the replicas of ``path`` (``one``: one device, on the
    whole batch; ``slices``: one device, a pass over each replica's slice in turn).
    ``compiled``: the step calls the model ``torch.compile``d (``aot_eager``: dynamo and
    AOTAutograd, without code generation)."""
    strategy: cs.Strategy = (
        cs.OneDeviceStrategy("cpu") if path in ("one", "slices") else strategy_on(path)
    )
    model = build(strategy, make)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    with strategy.scope():
        optimizer = optimizer_of(model)
    for _ in range(steps):
        for _ in range(runs_per_step):
            if path == "one":
                step_of(forward)(X, Y)
            elif path == "slices":
                for xs, ys in zip(X.tensor_split(2), Y.tensor_split(2), strict=True):
                    step_of(forward)(xs, ys)
            else:
                run_on(path, strategy, step_of(forward), (halves(X), halves(Y)))
        optimizer_step(model, optimizer)
        after_step(model, optimizer)
        optimizer.zero_grad()
    return model


def _assert_same(a: nn.Module, b: nn.Module, exact: bool = False) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, msg=name)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_everyday_patterns_train_like_one_device_and_alike_on_every_path(pattern: str) -> None:
    spec = PATTERNS[pattern]
    oracle = _train("one", steps=3, **spec)
    trained = {path: _train(path, steps=3, **spec) for path in PATHS}
    for path in PATHS:
        _assert_same(trained[path], oracle)
    _assert_same(trained["direct"], trained["threads"], exact=True)


# what dynamo cannot compile even on one device: a double backward through AOTAutograd
NOT_COMPILED = frozenset({"gradient penalty (WGAN-GP: an input gradient with create_graph)"})


def _compiled(path: str, spec: dict[str, Any]) -> tuple[nn.Module, int, int]:
    """The pattern trained with its model compiled on ``path``, and the graphs and graph
    breaks dynamo made for it (its caches emptied before, so nothing else counts)."""
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    model = _train(path, steps=3, compiled=True, **spec)
    return model, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p not in NOT_COMPILED])
def test_everyday_patterns_compiled_train_alike_and_compile_as_plain_pytorch_does(
    pattern: str,
) -> None:
    """Each pattern with its model ``torch.compile``d trains on every path as on one device,
    and dynamo makes as many graphs and graph breaks for it as for plain PyTorch making a
    pass over each replica's slice in turn: nothing of the run is traced, guarded on or
    compiled again. (The graphs are counted against passes over the slices, not one pass
    over the batch: a branch on the data, the recommender's, compiles once per distinct
    slice.)"""
    spec = PATTERNS[pattern]
    oracle, _, _ = _compiled("one", spec)
    _, graphs, breaks = _compiled("slices", spec)
    for path in PATHS:
        trained, path_graphs, path_breaks = _compiled(path, spec)
        _assert_same(trained, oracle)
        assert (path_graphs, path_breaks) == (graphs, breaks), path


@each_path
def test_gan_two_models_two_optimizers_and_detach(path: str) -> None:
    def program(where: str) -> list[torch.Tensor]:
        strategy: cs.Strategy = (
            cs.OneDeviceStrategy("cpu") if where == "one" else strategy_on(where)
        )
        torch.manual_seed(0)
        with strategy.scope():
            generator, critic = nn.Linear(3, 4), nn.Linear(4, 1)
            g_opt = torch.optim.Adam(generator.parameters(), lr=0.01)
            c_opt = torch.optim.Adam(critic.parameters(), lr=0.01)
        noise = torch.randn(6, 3, generator=torch.Generator().manual_seed(5))
        for _ in range(2):
            def critic_step(z: torch.Tensor, real: torch.Tensor) -> None:
                fake = generator(z).detach()
                ((critic(fake) - critic(real)).sum() / len(X)).backward()

            def generator_step(z: torch.Tensor) -> None:
                (-critic(generator(z)).sum() / len(X)).backward()

            if where == "one":
                critic_step(noise, X)
            else:
                run_on(where, strategy, critic_step, (halves(noise), halves(X)))
            c_opt.step()
            c_opt.zero_grad()
            g_opt.zero_grad()
            if where == "one":
                generator_step(noise)
            else:
                run_on(where, strategy, generator_step, (halves(noise),))
            g_opt.step()
            g_opt.zero_grad()
            c_opt.zero_grad()
        return [p.detach().clone() for p in [*generator.parameters(), *critic.parameters()]]

    for got, want in zip(program(path), program("one"), strict=True):
        torch.testing.assert_close(got, want)


@each_path
def test_an_optimizer_that_runs_its_closure_several_times_trains_like_one_device(
    path: str,
) -> None:
    """L-BFGS calls its closure several times inside ``step``: each call is a whole run
    whose loss ``reduce`` sums, and the line search reads ``.grad`` after each."""

    def program(where: str) -> list[torch.Tensor]:
        strategy: cs.Strategy = (
            cs.OneDeviceStrategy("cpu") if where == "one" else strategy_on(where)
        )
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            if where == "one":
                return mse_step(model)(X, Y)
            losses = run_on(where, strategy, mse_step(model), (halves(X), halves(Y)))
            return strategy.reduce("SUM", losses)

        for _ in range(3):
            optimizer.step(closure)
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(program(path), program("one"), strict=True):
        torch.testing.assert_close(got, want)


@each_path
def test_ema_of_the_weights_outside_run(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )
    for _ in range(3):
        run_on(path, strategy, mse_step(model), (halves(X), halves(Y)))
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
    out = run_on(path, strategy, lambda xs: ema(xs), (halves(X),))
    torch.testing.assert_close(torch.cat(local(strategy, out)), ema(X))
    assert not torch.equal(ema.module.weight, model.weight)


@each_path
@pytest.mark.parametrize("kind", ["frozen", "mask", "count"])
def test_frozen_parameters_and_buffers_written_in_place_between_runs(
    path: str, kind: str
) -> None:
    """A frozen parameter (an EMA's), a floating buffer or an integer buffer, written in
    place under ``torch.no_grad()`` between runs, is what every replica reads next, also
    where the replicas write the integer buffer first (docs/porting.md; the GPU path's twin
    is in test_gpu_paths.py). Each alone, so that the direct path shares what it can."""
    strategy = strategy_on(path)
    with strategy.scope():
        holder = nn.Module()
        holder.weight = nn.Parameter(torch.zeros(1))  # (a run of buffers alone takes views)
        if kind == "frozen":
            holder.value = nn.Parameter(torch.zeros(3), requires_grad=False)
        else:
            dtype = torch.long if kind == "count" else None
            holder.register_buffer("value", torch.zeros(3, dtype=dtype))

    def read() -> float:
        if kind == "count":
            holder.value.add_(1)  # each replica's own write; the first replica's is kept
        return float(holder.value.sum())

    counted = kind == "count"
    assert list(local(strategy, run_on(path, strategy, read))) == [3.0 if counted else 0.0] * 2
    with torch.no_grad():
        holder.value.add_(2)
    assert list(local(strategy, run_on(path, strategy, read))) == [12.0 if counted else 6.0] * 2


@each_path
def test_evaluation_under_no_grad_and_eval_mode(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    run_on(path, strategy, lambda xs: model(xs).sum().backward(), (halves(X),))
    stats = model[1].running_mean.clone()
    model.eval()
    with torch.no_grad():
        out = run_on(path, strategy, lambda xs: (model(xs), replica_id()), (halves(X),))
    assert torch.equal(model[1].running_mean, stats)
    parts = [part for part, _ in local(strategy, out)]
    torch.testing.assert_close(torch.cat(parts), model(X).detach())


@each_path
def test_merge_call_optimizer_step_then_more_backward(path: str) -> None:
    strategy = strategy_on(path)
    model = build(strategy, lambda: nn.Linear(4, 2))
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        mse_step(model)(xs, ys)
        context().merge_call(lambda s: (optimizer.step(), optimizer.zero_grad()))
        mse_step(model)(xs, ys)  # on the updated weights

    run_on(path, strategy, step, (halves(X), halves(Y)))
    torch.manual_seed(0)
    oracle = nn.Linear(4, 2)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mse_step(oracle)(X, Y)
    oracle_opt.step()
    oracle_opt.zero_grad()
    mse_step(oracle)(X, Y)
    for p, q in zip(model.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(p.grad, q.grad)
