"""Real models, built inside ``scope()``, trained by a hand-written loop at R = 2 and 3 on every
replica path (``paths.py``: direct, views, threads) and on two fake GPUs, against plain
PyTorch on the same global batches, in float64.

Hugging Face transformers' GPT-2, BERT, ViT, Llama (rotary positions, RMSNorm, grouped-query
attention), Llama with gradient checkpointing, Mixtral (a router choosing experts per token),
T5 (encoder-decoder, relative position biases), BART, DistilBERT and RoBERTa (position ids
made from the padding), tiny configs (no timm or torchvision, whose wheels here do not import
beside this torch), and a small ResNet-like CNN with BatchNorm2d. The loop is the README's:
``experimental_distribute_dataset`` over a DataLoader of global batches, ``strategy.run`` of a
step whose loss is divided by the global batch (or the global token count, summed across the
replicas by ``all_reduce`` on the threads path), one ``optimizer.step()`` per batch. The last
global batch is short, so at R = 3 a replica gets no row. Measured max weight gaps: 3.7e-15
(T5) to 3.2e-13 (ViT), for each model and R the same on every path and on the fake GPUs;
the CNN with BatchNorm 0.0 against its per-slice reference (0.04 against full-batch
BatchNorm). 1e-10 is asserted. GPT-2's and Llama's losses are also compiled
(``torch.compile``, first called inside ``run``) at R = 2 on each path, Llama's without a
graph break, as a plain Llama's beside the strategy. A dynamic rotary embedding, which replaces a
buffer in forward, is refused inside ``run`` and trains once grown in the scope.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from paths import FakePlacement, each_path, step_on, strategy_on
from torch import nn
from torch.utils.data import DataLoader

import centralstore as cs

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-10
VOCAB, LENGTH, CLASSES = 96, 8, 3
@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


# ---- models ------------------------------------------------------------------------------


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(config).double()


def bert(pad_token_id: int | None) -> Callable[[], nn.Module]:
    """BERT (d=32) whose word embeddings have ``padding_idx=pad_token_id``."""

    def build() -> nn.Module:
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=CLASSES, pad_token_id=pad_token_id,
        )
        return transformers.BertForSequenceClassification(config).double()

    return build


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=CLASSES,
    )
    return transformers.ViTForImageClassification(config).double()


def llama(reentrant: bool | None = None) -> Callable[[], nn.Module]:
    """Llama; with gradient checkpointing when ``reentrant`` is given (Hugging Face's default
    is the non-reentrant kind, ``torch.utils.checkpoint``'s older one reentrant)."""

    def build() -> nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
            bos_token_id=1, eos_token_id=1, pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(config).double()
        if reentrant is not None:  # each layer's forward runs again in backward
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        return model

    return build


def mixtral() -> nn.Module:
    # "eager" experts: the default grouped matrix product takes no float64
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
        num_local_experts=4, num_experts_per_tok=1, experts_implementation="eager",
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    return transformers.MixtralForCausalLM(config).double()


class Seq2Seq(nn.Module):
    """An encoder-decoder whose decoder reads the input ids, so that the causal LM loss fits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=input_ids).logits


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return Seq2Seq(transformers.T5ForConditionalGeneration(config).double())


def bart() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=LENGTH, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        decoder_start_token_id=1, forced_eos_token_id=None,
    )
    return Seq2Seq(transformers.BartForConditionalGeneration(config).double())


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=LENGTH, dropout=0.0, attention_dropout=0.0,
        seq_classif_dropout=0.0, num_labels=CLASSES, pad_token_id=0,
    )
    return transformers.DistilBertForSequenceClassification(config).double()


def roberta() -> nn.Module:
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH + 2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=CLASSES, pad_token_id=0,
    )
    return transformers.RobertaForSequenceClassification(config).double()


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm2d, and a shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        )
        self.blocks = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(pixel_values))
        return self.head(h.mean(dim=(2, 3)))


# ---- data and losses ---------------------------------------------------------------------


def token_batches(n: int, batch: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[i, : i % 5] = -100  # the slices hold different numbers of target tokens
    items = [{"input_ids": x, "labels": y} for x, y in zip(ids, labels)]
    return DataLoader(items, batch_size=batch)  # type: ignore[arg-type]


def sequence_batches(n: int, batch: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g)
    for i in range(n):
        ids[i, LENGTH - i % 3 :] = 0
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    items = [
        {"input_ids": x, "attention_mask": (x != 0).long(), "labels": y}
        for x, y in zip(ids, labels)
    ]
    return DataLoader(items, batch_size=batch)  # type: ignore[arg-type]


def image_batches(n: int, batch: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    items = [{"pixel_values": x, "labels": y} for x, y in zip(images, labels)]
    return DataLoader(items, batch_size=batch)  # type: ignore[arg-type]


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["labels"][:, 1:]


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor], tokens: Any) -> torch.Tensor:
    """Causal LM cross-entropy summed over the batch's target tokens, divided by ``tokens``
    (the global batch's count), in float64."""
    logits = logits_of(model, batch)[:, :-1]
    summed = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets(batch).reshape(-1), ignore_index=-100, reduction="sum"
    )
    return summed / tokens


def example_loss(model: nn.Module, batch: dict[str, torch.Tensor], size: Any) -> torch.Tensor:
    per_example = nn.functional.cross_entropy(
        logits_of(model, batch), batch["labels"], reduction="none"
    )
    return cs.compute_average_loss(per_example, global_batch_size=size)


# ---- training ----------------------------------------------------------------------------


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_plain(model: nn.Module, loader: DataLoader[Any], tokens: bool) -> None:
    model.train()
    optimizer = optimizer_for(model)
    for batch in loader:
        optimizer.zero_grad()
        if tokens:
            token_loss(model, batch, (targets(batch) != -100).sum()).backward()
        else:
            example_loss(model, batch, len(batch["labels"])).backward()
        optimizer.step()


def train_replicated(
    strategy: cs.CentralStorageStrategy, build: Callable[[], nn.Module], loader: DataLoader[Any],
    tokens: bool, path: str = "direct", backend: str | None = None,
) -> dict[str, torch.Tensor]:
    """The model's state on the host after ``strategy`` trained it from ``build``'s seeded
    initial state (drawn on the host: fake GPUs draw otherwise)."""
    torch.manual_seed(0)
    initial = build().state_dict()
    with strategy.scope():
        model = build()
        model.load_state_dict(initial)
        optimizer = optimizer_for(model)
    assert all(strategy.extended.variable_created_in_scope(p) for p in model.parameters())
    model.train()
    loss_of = token_loss if tokens else example_loss
    if backend is not None:  # first called, and so compiled, inside run
        loss_of = torch.compile(loss_of, backend=backend)

    def step(batch: dict[str, torch.Tensor], size: int, count: Any) -> torch.Tensor:
        context = cs.get_replica_context()
        assert context is not None
        if tokens:
            if path == "threads":  # the global token count from every replica's slice
                count = context.all_reduce(cs.ReduceOp.SUM, (targets(batch) != -100).sum())
            divisor = count
        else:
            divisor = size
        if len(batch["labels"]) == 0:  # a short last batch leaves this replica no row
            return torch.zeros((), dtype=torch.float64)
        loss = loss_of(model, batch, divisor)
        loss.backward()
        return loss.detach()

    for global_batch, batch in zip(loader, strategy.experimental_distribute_dataset(loader)):
        optimizer.zero_grad()
        count = int((targets(global_batch) != -100).sum()) if tokens else 0
        strategy.run(step_on(path, step), args=(batch, len(global_batch["labels"]), count))
        optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def gpu_strategy(placement: FakePlacement) -> cs.CentralStorageStrategy:
    return cs.CentralStorageStrategy(
        list(placement.compute_devices), parameter_device=placement.parameter_device
    )


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# 14 examples in global batches of 6: 6, 6, 2 (R = 3: slices 1 / 1 / 0 in the last step).
N, BATCH = 14, 6
# a model, its batches, and whether its loss is over tokens (the causal LM's)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], DataLoader[Any]], bool]] = {
    "gpt2": (gpt2, token_batches, True),
    "bert": (bert(0), sequence_batches, False),
    "vit": (vit, image_batches, False),
    "llama": (llama(), token_batches, True),
    "llama, gradient checkpointing": (llama(reentrant=False), token_batches, True),
    "llama, reentrant gradient checkpointing": (llama(reentrant=True), token_batches, True),
    "mixtral": (mixtral, token_batches, True),
    "t5": (t5, token_batches, True),
    "bart": (bart, token_batches, True),
    "distilbert": (distilbert, sequence_batches, False),
    "roberta": (roberta, sequence_batches, False),
}


@functools.cache
def one_device(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``name``'s initial state and its state after plain PyTorch trained it on all N."""
    build, batches, tokens = MODELS[name]
    torch.manual_seed(0)
    model = build()
    initial = copy.deepcopy(model.state_dict())
    train_plain(model, batches(N, BATCH), tokens)
    return initial, model.state_dict()


def check(name: str, strategy: cs.CentralStorageStrategy, path: str = "direct",
          backend: str | None = None) -> None:
    build, batches, tokens = MODELS[name]
    initial, trained = one_device(name)
    got = train_replicated(strategy, build, batches(N, BATCH), tokens, path, backend)
    assert gap(initial, trained) > 1e-3  # it trained
    assert gap(got, trained) < TOLERANCE


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("replicas", [2, 3])
@each_path
def test_trains_like_one_device(name: str, replicas: int, path: str) -> None:
    check(name, strategy_on(path, replicas), path)


@pytest.mark.parametrize("name", MODELS)
def test_trains_like_one_device_on_two_gpus(
    name: str, fake_gpu_placement: FakePlacement
) -> None:
    check(name, gpu_strategy(fake_gpu_placement))


@each_path
def test_gpt2_compiled_inside_run(path: str) -> None:
    # torch.compile's graph modules are built in the replica that first calls the loss; its
    # constants are their buffers (aot_eager: the joint graph, without inductor's codegen)
    check("gpt2", strategy_on(path), path, backend="aot_eager")


@each_path
def test_llama_compiles_whole_inside_run_and_beside_it(path: str) -> None:
    # Llama calls self.layers[:n], a new ModuleList at every forward: a hook made inside the
    # traced code (the strategy's watch of modules built outside its scope) would break the
    # graph at every call, of the model in the scope and of a plain one beside the strategy.
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    try:
        check("llama", strategy_on(path), path, backend="aot_eager")
        build, batches, _ = MODELS["llama"]
        plain = build()  # outside the scope: watched until its first eager call
        batch = next(iter(batches(N, BATCH)))
        loss = torch.compile(token_loss, backend="aot_eager")
        loss(plain, batch, (targets(batch) != -100).sum()).backward()
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] > 0
    finally:
        torch._dynamo.reset()


def dynamic_llama() -> nn.Module:
    """Llama whose rotary embedding registers a new ``inv_freq`` in forward once a sequence is
    longer than ``max_position_embeddings`` (here half of ``LENGTH``)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH // 2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).double()


def train_dynamic(
    path: str, initial: dict[str, torch.Tensor], grown: bool
) -> dict[str, torch.Tensor]:
    """``dynamic_llama`` trained from ``initial`` on ``path``, after one call in the scope
    with the longest sequence if ``grown``."""
    strategy = strategy_on(path)
    with strategy.scope():
        model = dynamic_llama()
        model.load_state_dict(initial)
        optimizer = optimizer_for(model)
        if grown:
            with torch.no_grad():
                model(input_ids=torch.ones(1, LENGTH, dtype=torch.long))

    def step(batch: dict[str, torch.Tensor], count: int) -> None:
        token_loss(model, batch, count).backward()

    loader = token_batches(N, BATCH)
    for global_batch, batch in zip(loader, strategy.experimental_distribute_dataset(loader)):
        optimizer.zero_grad()
        count = int((targets(global_batch) != -100).sum())
        strategy.run(step_on(path, step), args=(batch, count))
        optimizer.step()
    return model.state_dict()


@each_path
def test_a_dynamic_rotary_embedding_grows_in_scope_not_in_run(path: str) -> None:
    """Inside run its new ``inv_freq`` is refused, naming the buffer (the next replica would
    find the length cached and compute with its own old frequencies); grown by one call in
    the scope, the model trains like plain PyTorch, which grows it at its first step."""
    torch.manual_seed(0)
    model = dynamic_llama()
    initial = copy.deepcopy(model.state_dict())
    train_plain(model, token_batches(N, BATCH), tokens=True)
    with pytest.raises(ValueError, match=r"assigned a new tensor .* buffer 'inv_freq'"):
        train_dynamic(path, initial, grown=False)
    assert gap(initial, model.state_dict()) > 1e-3
    assert gap(train_dynamic(path, initial, grown=True), model.state_dict()) < TOLERANCE


# ---- BatchNorm ---------------------------------------------------------------------------


def train_plain_per_slice(model: ResNet, loader: DataLoader[Any], replicas: int) -> None:
    """What R replicas compute, by hand: each slice normalized by its own statistics, the
    slices' gradients summed (each loss over the global batch), and every floating buffer
    the mean of the slices' updates of it, num_batches_tracked one more per step."""
    model.train()
    optimizer = optimizer_for(model)
    buffers = dict(model.named_buffers())
    for batch in loader:
        optimizer.zero_grad()
        size = len(batch["labels"])
        chunk = -(-size // replicas)
        before = {k: v.clone() for k, v in buffers.items()}
        written: dict[str, list[torch.Tensor]] = {k: [] for k in buffers}
        for start in range(0, size, chunk):
            piece = {k: v[start : start + chunk] for k, v in batch.items()}
            with torch.no_grad():
                for k, v in buffers.items():
                    v.copy_(before[k])
            example_loss(model, piece, size).backward()
            for k, v in buffers.items():
                written[k].append(v.clone())
        with torch.no_grad():
            for k, v in buffers.items():
                if v.is_floating_point():
                    v.copy_(torch.stack(written[k]).mean(0))
                else:
                    v.copy_(before[k] + 1)
        optimizer.step()


def check_batch_norm(strategy: cs.CentralStorageStrategy, replicas: int, path: str) -> None:
    # 16 examples in global batches of 8: R = 3 cuts 3 / 3 / 2, no slice empty (BatchNorm in
    # training mode needs rows).
    loader = image_batches(16, 8)
    torch.manual_seed(0)
    model = ResNet().double()
    start = copy.deepcopy(model.state_dict())
    train_plain_per_slice(model, loader, replicas)
    trained = model.state_dict()
    got = train_replicated(strategy, lambda: ResNet().double(), loader, False, path)
    assert gap(got, trained) < TOLERANCE  # parameters and buffers (state_dict holds both)
    moved = max(float((trained[k] - v).abs().max()) for k, v in start.items() if "running" in k)
    assert moved > 1e-3  # the running statistics did change
    assert all(int(v) == 2 for k, v in got.items() if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("replicas", [2, 3])
@each_path
def test_resnet_with_batchnorm(replicas: int, path: str) -> None:
    check_batch_norm(strategy_on(path, replicas), replicas, path)


def test_resnet_with_batchnorm_on_two_gpus(fake_gpu_placement: FakePlacement) -> None:
    check_batch_norm(gpu_strategy(fake_gpu_placement), 2, "direct")
