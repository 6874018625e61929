"""Tiny transformers models built from configs, their data, and the trainers compared."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from replicas import strategy_of
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    TrainingArguments,
)

import centralstore as cs
import centralstore.transformers

VOCAB, LENGTH, CLASSES = 128, 8, 3

# Measured: the weights of R replicas and of one device agree to 2.4e-14 after these runs in
# float64 (the models' own dtype here); the losses the Trainer logs are float32 (its running
# sum is), and agree to one float32 rounding step.
WEIGHTS = 1e-12
LOGGED = 5e-7


def gpt2(pad_token_id: int | None = None) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (d=32), no dropout (the replicas' dropout masks are not one
    device's), float64."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=1, eos_token_id=1, pad_token_id=pad_token_id,
    )
    return GPT2LMHeadModel(config).double()


def bert(pad_token_id: int | None = 0) -> BertForSequenceClassification:
    """A 2-layer BERT classifier (d=32), no dropout, float64. BertConfig's default
    ``pad_token_id=0`` gives its word embeddings ``padding_idx=0``."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=CLASSES, pad_token_id=pad_token_id,
    )
    return BertForSequenceClassification(config).double()


def lm_data(n: int = 14, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Causal LM examples whose labels ignore (-100) a different number of tokens each, so
    that the replicas' slices hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[i, : i % 5] = -100
    labels[3] = -100  # an example with no target at all
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels)]


def classification_data(n: int = 14, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Padded sequences with an attention mask; one label is -100 (ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g)
    for i in range(n):
        ids[i, LENGTH - i % 3 :] = 0
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    labels[4] = -100
    return [
        {"input_ids": x, "attention_mask": (x != 0).long(), "labels": y}
        for x, y in zip(ids, labels)
    ]


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    logits = prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    labels = prediction.label_ids
    keep = labels != -100
    return {"accuracy": float((logits.argmax(-1)[keep] == labels[keep]).mean())}


def arguments(directory: Path, batch: int, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        per_device_train_batch_size=batch, per_device_eval_batch_size=batch, max_steps=3,
        learning_rate=1e-2, logging_steps=1, seed=0, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_pin_memory=False,
    )
    settings.update(overrides)
    return TrainingArguments(str(directory), **settings)


def one_device(
    build: Callable[[], torch.nn.Module], directory: Path, batch: int, **kwargs: Any
) -> transformers.Trainer:
    """``transformers.Trainer`` on the CPU alone, global batches of ``batch`` rows."""
    overrides = kwargs.pop("overrides", {})
    return transformers.Trainer(
        model=build(), args=arguments(directory, batch, use_cpu=True, **overrides), **kwargs
    )


def replicated(
    build: Callable[[], torch.nn.Module], directory: Path, replicas: int, batch: int,
    views: bool = False, **kwargs: Any,
) -> cs.transformers.Trainer:
    """``cs.transformers.Trainer`` on ``replicas`` logical CPU devices, ``batch`` rows per
    replica, the model built inside the strategy's scope (``views``: its replicas see views
    of the parameters, as GPU replicas do)."""
    overrides = kwargs.pop("overrides", {})
    strategy = strategy_of(replicas, direct=not views)
    with strategy.scope():
        model = build()
    return cs.transformers.Trainer(
        model=model, args=arguments(directory, batch, **overrides), strategy=strategy, **kwargs
    )


def weight_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference between the two models' weights (a model compiled whole: its
    module's)."""
    sa, sb = (getattr(m, "_orig_mod", m).state_dict() for m in (a, b))
    assert sa.keys() == sb.keys()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def logged(trainer: transformers.Trainer, key: str) -> list[float]:
    return [float(entry[key]) for entry in trainer.state.log_history if key in entry]


def prediction_gap(a: Any, b: Any) -> float:
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    assert a.shape == b.shape
    return float(np.abs(a - b).max())
