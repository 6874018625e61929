"""Training steps of small real models: centralstore against plain PyTorch doing the same work.

Models (no timm or torchvision here: PyPI's torchvision is a CUDA build that does not load
beside the CPU torch, so the vision transformer is transformers' ``ViTConfig``):
  gpt2   GPT-2 tiny (transformers' GPT2Config: 2 layers, d = 64, 4 heads), sequences of 16
  llama  Llama tiny (LlamaConfig: 2 layers, d = 64, 4 heads of which 2 for keys and values,
         feed-forward 128), sequences of 16: its rotary embedding's frequencies are floating
         buffers that are not running statistics
  bert   BERT tiny (BertConfig: 2 layers, d = 64, 4 heads, feed-forward 128), 10 classes
  vit    ViT tiny (ViTConfig: 32x32 images, patches of 8, 2 layers, d = 64), 10 classes
  cnn    the demo's CNN (``centralstore.demo.job.make_model``) on 8x8 digits
  bn     ten 3x3 convolutions of 8 channels, each with ``BatchNorm2d``, on 8x8 images: the
         running statistics and counters of a ResNet-like network (30 buffers)
each at P examples per replica, eager and with the forward and loss ``torch.compile``d
(static shapes, a code object per configuration, as in ``bench_train.py``). Configurations,
all with AdamW and the loss scaled by the global batch:
  plain    one device, a batch of P              (the baseline of cs R=1)
  plain again  a second instance of plain      (its ratio to plain is the run's noise)
  cs R=1   CentralStorageStrategy on cpu:0, a batch of P
  undo     plain, with what a one-replica run that can be undone must do at least (the
           baseline's floor, as ``apart`` is the halves'): when the step's pass begins,
           each parameter's and buffer's ``requires_grad`` read, the post-accumulate-grad
           hooks of those that require grad looked for and the gradients already in their
           ``.grad`` set aside, the buffers' bytes copied (the floating ones at every step,
           the integers when a version counter moved); after its backward, the gradients
           set aside added back. Passes in C, no strategy, no lock, no context, no checks
           (``_Undo``)
  whole    one device, one pass over 2P          (the floor's reference)
  halves   one device, two passes of P that accumulate gradients (the same work as two
           replicas: the baseline of cs R=2)
  apart    halves, each pass's gradients kept apart and summed at the end, in plain PyTorch:
           what two replicas that each find only their own gradients in ``.grad``, and whose
           run can be undone, must do at least (the gradients already in ``.grad`` set
           aside, the first pass's taken off before the second, the sums added after both
           passes: one ``_foreach_add_``, two onto gradients set aside; no strategy, no
           checks; the weights the halves reach, bit for bit)
  cs R=2   cpu:0 and cpu:1, P each
and, for GPT-2 tiny, gradient accumulation: 4 micro-batches per optimizer step, ``cs R=2 x4``
(four runs of two replicas) against ``halves x4`` (the same 8 half-batch passes, plain), and
``apart x4`` (the same passes kept apart two by two); ``cs R=2 x4 one run`` accumulates the
same micro-batches inside one run (each replica loops over its four, ``docs/porting.md``), so
that the run's fixed cost and its sum of the replicas come once per step.
Evaluation (``eval``, a group per model): each configuration's model in ``eval()`` mode, a
step a forward under ``torch.no_grad()`` and its loss, no backward and no optimizer: plain /
plain again / halves as above, and ``cs R=1`` / ``cs R=2`` running the forward in
``strategy.run`` and adding the replicas' losses with ``strategy.reduce`` (plain's halves add
theirs too), as a validation loop does. A forward alone is a short step, so the run's fixed
cost weighs more than in training; the issue's targets are for training steps, so these
rows carry none.
``halves / whole`` is what smaller batches cost by themselves: the part of the demo's gap to
one device that is not centralstore. ``apart / halves`` is what keeping each replica's
gradients to itself costs by itself: the sums run after backward, on memory gone cold,
where the halves add each gradient inside the engine as it is made. The line under ``cs R=2``
gives it against ``apart`` in the same rounds: about what centralstore's own bookkeeping costs;
the line under ``cs R=1`` gives the same against ``undo``.

The configurations take turns step by step, each step timed alone, in an order drawn afresh for
every step; each round after the first (which times the instances of the warm-up tail) builds
every eager configuration anew (models, optimizers, strategies, in a drawn order) and times it
after a few warm-up steps (``bench_train.take_turns``). A configuration's ratio is the median
over the rounds of its round's median over its baseline's, printed with the quartiles of the
rounds' ratios (how far the rounds stray: a target between them is a close call for the run).
(Timing each configuration's steps in a block of its own, as a first version did, let the
shared machine's drift between blocks move a ratio by 5-10% from run to run; keeping one
instance of each configuration for the whole run, in a fixed order reversed every round, as the
next did, read identical code in the cs rows at 0.976 to 1.039 of itself in four runs: where an
instance's memory lies, and which configuration runs before it, move a step by that much. With
fresh instances and drawn orders the same check read 0.995 to 1.020.) ``plain again`` states
each run's noise. A compiled configuration is built once (building it anew would compile
again). The warm-up tail column is the median of each configuration's first 50 steps after it
is first built (the first, compiling one, included; the configurations take turns there too)
over its steady median, and ``tail / its`` that tail over the tail of the configuration it is
compared with: the machine and torch warm up plain PyTorch as well (allocator, caches), so a
tail that centralstore adds shows as ``tail / its`` above 1. The machine is shared, so only
ratios within one run mean anything. One intra-op thread by default (``--threads``): with two
on the two shared cores, OpenMP's spinning threads made a GPT-2 tiny step take ten times as
long (200 ms instead of 20) and vary by as much from round to round. Times are the process's
CPU time by default (``--clock wall`` for wall-clock time): on a machine with several times
more runnable threads than cores, wall-clock time measures the neighbours.

The configurations without centralstore (``plain``, ``halves``, ``apart``, ...) step with
centralstore's global optimizer-step hooks taken out of torch's tables around each timed
step (``_bare``), as plain PyTorch steps in a process without centralstore; until the
fifty-second session they paid those hooks too, which hid them from every ratio (10 to 50
us a step right after the optimizer's sweep through memory, benchmarks/README.md).

``--block K`` makes each turn K consecutive steps of one configuration, the first untimed:
the steps of a training loop, each after a step of the same model. By default every timed
step follows another configuration's, on caches that step has filled, which a loop never
meets (on the development machine the two read the same verdicts, benchmarks/README.md).

    python benchmarks/bench_models.py [--rounds 10] [--steps 10] [--sizes 4]
        [--compiled-sizes 4] [--models gpt2 llama bert vit cnn bn]
        [--compiled-models gpt2 llama bert vit cnn bn] [--no-accumulation]
        [--no-evaluation] [--threads 1] [--clock cpu] [--block 1]

The defaults time 19 groups of configurations (six models eager, the six compiled, GPT-2
accumulating, the six evaluating), about 3.5 minutes once torch's compilation cache is warm;
``--sizes 2 8 --compiled-sizes 2 8`` covers more, at several times the runtime. (Only
GPT-2 was compiled by default until the forty-eighth session, whose run of the others found
three faults of the compiled path: benchmarks/README.md.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import operator
import statistics
import time
from collections.abc import Callable, Iterator
from itertools import compress, repeat
from typing import Any

import torch
import torch.nn.functional as F
from bench_train import (
    median_of_all,
    quartiles,
    round_ratios,
    take_turns,
)
from torch import nn
from torch.optim import optimizer as optim_hooks

import centralstore as cs
from centralstore.cli import at_least
from centralstore.demo.job import make_model as demo_cnn

SEQUENCE = 16
VOCAB = 512
FIRST = 50  # steps of the warm-up tail
MICRO_BATCHES = 4

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # per-example losses


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    ))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQUENCE, num_labels=10,
    ))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    ))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE,
    ))


def _batch_norm_cnn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(10):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def _token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(
        x.shape[0], -1
    ).mean(1)


def _class_loss(key: str) -> Loss:
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(**{key: x}).logits, y, reduction="none")

    return loss


def _cnn_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (n, SEQUENCE))
    return x, x  # a language model's labels are its inputs (the model shifts them)


def _classes(shape: tuple[int, ...], integer: bool = False) -> Callable[[int], Any]:
    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, VOCAB, (n, *shape)) if integer else torch.randn(n, *shape)
        return x, torch.randint(0, 10, (n,))

    return make


# name -> (build, inputs of n examples, per-example loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], Loss]] = {
    "gpt2": (_gpt2, _tokens, _token_loss),
    "llama": (_llama, _tokens, _token_loss),
    "bert": (_bert, _classes((SEQUENCE,), integer=True), _class_loss("input_ids")),
    "vit": (_vit, _classes((3, 32, 32)), _class_loss("pixel_values")),
    "cnn": (demo_cnn, _classes((1, 8, 8)), _cnn_loss),
    "bn": (_batch_norm_cnn, _classes((3, 8, 8)), _cnn_loss),
}
CONFIGS = ("plain", "plain again", "cs R=1", "undo", "whole", "halves", "apart", "cs R=2")
COMPILED = ("plain", "cs R=1", "halves", "cs R=2")  # each compiles: the floor's row is eager's
ACCUMULATED = ("halves x4", "apart x4", "cs R=2 x4", "cs R=2 x4 one run")
EVALUATED = ("plain", "plain again", "cs R=1", "halves", "cs R=2")


def compiled(fn: Callable[..., torch.Tensor], config: str) -> Callable[..., torch.Tensor]:
    """``fn`` compiled with static shapes and a code object of its own (see
    ``bench_train.compiled_if``: configurations must not check each other's guards)."""
    fn.__code__ = fn.__code__.replace(co_name=f"loss_{config.replace(' ', '_')}")
    return torch.compile(fn, dynamic=False)


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_VERSION = operator.attrgetter("_version")
_consume = collections.deque(maxlen=0).extend


def _grads(params: list[nn.Parameter]) -> list[Any]:
    return list(map(_GRAD, params))


def _some(values: list[Any]) -> bool:
    return any(value is not None for value in values)


def _set_grads(params: list[nn.Parameter], grads: list[Any]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad


class _Undo:
    """The ``undo`` configuration's record of one pass: what a one-replica run must do at
    least so that a failure could leave ``.grad`` and the buffers as before it, each pass
    over the tensors a ``map`` in C (centralstore's ``Undo`` keeps the same record)."""

    def __init__(self, model: nn.Module) -> None:
        buffers = list(model.buffers())
        self.tensors = [*model.parameters(), *buffers]
        floating = [buffer.is_floating_point() for buffer in buffers]
        views = [buffer.view(-1).view(torch.uint8) for buffer in buffers]  # made once
        self.floats = list(compress(views, floating))
        self.integers = [view for view, f in zip(views, floating, strict=True) if not f]
        self.versions: list[int] = []  # the integers' counters at their last copy
        self.kept: torch.Tensor | None = None
        self.learned: list[torch.Tensor] = []
        self.held: list[Any] | None = None  # the gradients set aside, if any

    def begin(self) -> None:
        """Before the pass: the record."""
        flags = list(map(_REQUIRES_GRAD, self.tensors))
        learned = self.tensors if all(flags) else list(compress(self.tensors, flags))
        held = list(map(_GRAD, learned))
        self.held = held if any(map(operator.is_not, held, repeat(None))) else None
        if self.held is not None:
            _consume(map(setattr, learned, repeat("grad"), repeat(None)))
        any(map(_HOOKS, learned))  # (hooks would be held until the record is committed)
        if self.floats:
            torch.cat(self.floats)
        if self.integers:
            versions = list(map(_VERSION, self.integers))
            if versions != self.versions or self.kept is None:
                self.kept, self.versions = torch.cat(self.integers), versions
        self.learned = learned

    def end(self) -> None:
        """After the pass's backward: the gradients set aside take the pass's added."""
        if self.held is not None:
            with torch.no_grad():
                torch._foreach_add_(self.held, list(map(_GRAD, self.learned)))
            _consume(map(setattr, self.learned, repeat("grad"), self.held))


def make_step(
    model_name: str, config: str, per_replica: int, compile_: bool, evaluate: bool = False
) -> Callable[[], None]:
    """One optimizer step of ``config`` on ``model_name``, ready to time (``evaluate``: one
    evaluation step instead, ``make_evaluation_step``)."""
    if evaluate:
        return make_evaluation_step(model_name, config, per_replica)
    build, inputs, per_example = MODELS[model_name]
    micro = MICRO_BATCHES if "x4" in config else 1
    replicas = 2 if config in ("whole", "halves", "apart", "cs R=2") or micro > 1 else 1
    torch.manual_seed(0)
    global_batch = per_replica * replicas * micro
    x, y = inputs(global_batch)
    slices = [
        (x[i * per_replica:(i + 1) * per_replica], y[i * per_replica:(i + 1) * per_replica])
        for i in range(replicas * micro)
    ]
    if not config.startswith("cs"):
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        parts = [(x, y)] if config == "whole" else slices

        def plain_loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return per_example(model, xs, ys).sum() / global_batch

        loss = compiled(plain_loss, config) if compile_ else plain_loss

        def plain_step() -> None:
            optimizer.zero_grad()
            for xs, ys in parts:
                loss(xs, ys).backward()
            optimizer.step()

        if config == "undo":
            undo = _Undo(model)

            def undo_step() -> None:
                optimizer.zero_grad()
                undo.begin()
                loss(x, y).backward()
                undo.end()
                optimizer.step()

            return _plain(undo_step)
        if not config.startswith("apart"):
            return _plain(plain_step)
        params = list(model.parameters())

        def apart_step() -> None:
            optimizer.zero_grad()
            for first, second in zip(parts[::2], parts[1::2], strict=True):  # a run of two
                held = _grads(params)
                if _some(held):
                    _set_grads(params, [None] * len(params))
                loss(*first).backward()
                own = _grads(params)
                _set_grads(params, [None] * len(params))
                loss(*second).backward()
                with torch.no_grad():
                    if _some(held):
                        torch._foreach_add_(held, own)
                        torch._foreach_add_(held, _grads(params))
                        _set_grads(params, held)
                    else:
                        torch._foreach_add_(_grads(params), own)
            optimizer.step()

        return _plain(apart_step)
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if replicas == 1:
        arguments = [slices[0]]
    elif config == "cs R=2 x4 one run":  # each replica's four micro-batches, in one run
        features, targets = (
            cs.PerReplica([torch.cat([slices[2 * k + r][i] for k in range(micro)]) for r in (0, 1)])
            for i in (0, 1)
        )
        arguments = [(features, targets)]
    else:
        arguments = [
            (cs.PerReplica([slices[2 * k][0], slices[2 * k + 1][0]]),
             cs.PerReplica([slices[2 * k][1], slices[2 * k + 1][1]]))
            for k in range(micro)
        ]

    def replica_loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return cs.compute_average_loss(per_example(model, xs, ys), global_batch_size=global_batch)

    replica = compiled(replica_loss, config) if compile_ else replica_loss

    def replica_step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        replica(xs, ys).backward()

    def micro_steps(xs: torch.Tensor, ys: torch.Tensor) -> None:
        for part_x, part_y in zip(xs.tensor_split(micro), ys.tensor_split(micro), strict=True):
            replica(part_x, part_y).backward()

    step_fn = micro_steps if config == "cs R=2 x4 one run" else replica_step

    def cs_step() -> None:
        optimizer.zero_grad()
        for args in arguments:
            strategy.run(step_fn, args=args)
        optimizer.step()

    return cs_step


def make_evaluation_step(model_name: str, config: str, per_replica: int) -> Callable[[], None]:
    """One evaluation step of ``config`` (``EVALUATED``) on ``model_name``: the loss of a
    forward under ``no_grad`` of a model in ``eval()`` mode, the replicas' or the passes'
    losses added up."""
    build, inputs, per_example = MODELS[model_name]
    replicas = 2 if config in ("halves", "cs R=2") else 1
    torch.manual_seed(0)
    global_batch = per_replica * replicas
    x, y = inputs(global_batch)
    slices = [
        (x[i * per_replica:(i + 1) * per_replica], y[i * per_replica:(i + 1) * per_replica])
        for i in range(replicas)
    ]
    if not config.startswith("cs"):
        model = build().eval()

        @torch.no_grad()
        def plain_step() -> None:
            total = per_example(model, *slices[0]).sum()
            for xs, ys in slices[1:]:
                total = total + per_example(model, xs, ys).sum()

        return _plain(plain_step)
    strategy = cs.CentralStorageStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = build().eval()
    arguments = slices[0] if replicas == 1 else tuple(
        cs.PerReplica([part[i] for part in slices]) for i in (0, 1)
    )

    @torch.no_grad()
    def replica_loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return per_example(model, xs, ys).sum()

    def cs_step() -> None:
        strategy.reduce("SUM", strategy.run(replica_loss, args=arguments), axis=None)

    return cs_step


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _time(step: Callable[[], None], steps: int) -> float:
    with _bare() if getattr(step, "plain", False) else contextlib.nullcontext():
        start = _clock()
        for _ in range(steps):
            step()
        return (_clock() - start) / steps * 1e3


@contextlib.contextmanager
def _bare() -> Iterator[None]:
    """Torch's global optimizer-step hooks without centralstore's, as in a process without
    it (torch keeps them in module-level tables: no public call takes one out for a
    while)."""
    tables = (optim_hooks._global_optimizer_pre_hooks, optim_hooks._global_optimizer_post_hooks)
    taken = [
        (table, {k: hook for k, hook in table.items() if _ours(hook)}) for table in tables
    ]
    for table, ours in taken:
        for k in ours:
            del table[k]
    try:
        yield
    finally:
        for table, ours in taken:
            table.update(ours)


def _ours(hook: Callable[..., Any]) -> bool:
    return getattr(hook, "__module__", "").startswith("centralstore.")


def _plain(step: Callable[[], None]) -> Callable[[], None]:
    """``step``, marked as one that ``_time`` runs without centralstore's hooks."""
    step.plain = True  # type: ignore[attr-defined]
    return step


def measure(
    model_name: str, configs: tuple[str, ...], per_replica: int, compile_: bool,
    rounds: int, steps: int, block: int = 1, evaluate: bool = False,
) -> dict[str, tuple[float, float, list[list[float]]]]:
    """config -> (steady median ms per step, the first 50 steps' median over it, each
    round's step times)."""

    def make(config: str) -> Callable[[], None]:
        return make_step(model_name, config, per_replica, compile_, evaluate)

    made = {config: make(config) for config in configs}
    early: dict[str, list[float]] = {config: [] for config in configs}
    for i in range(FIRST):  # taking turns too, so that every configuration's tail meets the
        for config in configs if i % 2 == 0 else tuple(reversed(configs)):  # same machine
            early[config].append(_time(made[config], 1))
    first = {config: statistics.median(v) for config, v in early.items()}
    timer = functools.partial(_time, steps=1)
    times = take_turns(
        make, configs, rounds, steps, timer, made, rebuild=not compile_, block=block
    )
    return {
        config: (median_of_all(v), first[config] / median_of_all(v), v)
        for config, v in times.items()
    }


RATIOS = {  # the ratio's row, its baseline, its target
    "plain again": ("plain", None),  # a second instance of the same code: the run's noise
    "cs R=1": ("plain", 1.02),
    "cs R=2": ("halves", 1.03),
    "halves": ("whole", None),
    "undo": ("plain", None),
    "apart": ("halves", None),
    "apart x4": ("halves x4", None),
    "cs R=2 x4": ("halves x4", 1.03),
    "cs R=2 x4 one run": ("halves x4", 1.03),
}
# a second ratio of these rows: against the least a run must do to ``.grad`` and the buffers
# (centralstore's own bookkeeping, measured in the same rounds)
BOOKKEEPING = {"cs R=1": "undo", "cs R=2": "apart", "cs R=2 x4": "apart x4"}


def _against(times: list[list[float]], baseline: list[list[float]]) -> str:
    """A ratio's columns: the median of its rounds' ratios, and their quartiles."""
    q1, median, q3 = quartiles(round_ratios(times, baseline))
    return f"{median:7.3f} {f'[{q1:.3f}, {q3:.3f}]':>15}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=10)
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps per round")
    parser.add_argument("--sizes", type=at_least(1), nargs="*", default=[4],
                        help="examples per replica, eager")
    parser.add_argument("--compiled-sizes", type=at_least(1), nargs="*", default=[4],
                        help="examples per replica, compiled")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--compiled-models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--no-accumulation", action="store_true",
                        help="skip GPT-2's four accumulated micro-batches")
    parser.add_argument("--no-evaluation", action="store_true",
                        help="skip the evaluation groups (forwards under no_grad, eval mode)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--block", type=at_least(1), default=1,
                        help="consecutive steps per turn, the first untimed (a training loop's)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    global _clock
    _clock = CLOCKS[options.clock]
    fixed = cs.keep_host_memory()
    turns = "step by step" if options.block == 1 else f"in blocks of {options.block}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{options.steps} steps x {options.rounds} rounds, turns {turns}, "
          f"medians of {options.clock} time, "
          f"mmap threshold "
          f"{'fixed' if fixed else 'dynamic'}; tail: first {FIRST} steps' median / steady\n")
    print(f"{'model':<6} {'mode':<8} {'P':>2} {'config':<17} {'ms/step':>8} {'ratio':>7} "
          f"{'quartiles':>15} {'against':<10} {'target':>6} {'tail':>6} {'tail / its':>10}")
    groups: list[tuple[str, str, int, tuple[str, ...]]] = []
    for model_name in options.models:
        for size in options.sizes:
            groups.append((model_name, "eager", size, CONFIGS))
        if model_name in options.compiled_models:
            for size in options.compiled_sizes:
                groups.append((model_name, "compiled", size, COMPILED))
    if "gpt2" in options.models and not options.no_accumulation:
        groups.append(("gpt2", "eager", 4, ACCUMULATED))
    if not options.no_evaluation:
        groups += [(model_name, "eval", size, EVALUATED)
                   for model_name in options.models for size in options.sizes]
    for model_name, mode, size, configs in groups:
        results = measure(
            model_name, configs, size, mode == "compiled", options.rounds, options.steps,
            options.block, evaluate=mode == "eval",
        )
        for config in configs:
            ms, tail, times = results[config]
            against, target = RATIOS.get(config, (None, None))
            if against not in results:  # the compiled groups have no eager floor's row
                against, target = None, None
            if mode == "eval":  # the targets are the training steps'
                target = None
            shown = _against(times, results[against][2]) if against else f"{'':23}"
            relative = f"{tail / results[against][1]:10.3f}" if against else f"{'':10}"
            goal = f"<={target:.2f}" if target else ""
            print(f"{model_name:<6} {mode:<8} {size:>2} {config:<17} {ms:8.2f} {shown} "
                  f"{against or '':<10} {goal:>6} {tail:6.3f} {relative}", flush=True)
            floor = BOOKKEEPING.get(config)
            if floor in results:  # the same rounds against the floor of the semantics
                print(f"{'':<6} {'':<8} {'':>2} {'':<17} {'':>8} "
                      f"{_against(times, results[floor][2])} {floor}", flush=True)


if __name__ == "__main__":
    main()
