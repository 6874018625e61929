"""cs.transformers.Trainer at R = 2 and 3 against transformers.Trainer on one device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_models import (
    LOGGED,
    VOCAB,
    WEIGHTS,
    accuracy,
    arguments,
    bert,
    classification_data,
    gpt2,
    lm_data,
    logged,
    one_device,
    prediction_gap,
    replicated,
    weight_gap,
)

import centralstore as cs
import centralstore.transformers


def compare(one: transformers.Trainer, many: cs.transformers.Trainer, data: Any) -> None:
    """Train both, then compare weights, logs, evaluate() and predict()."""
    one.train()
    many.train()
    assert weight_gap(one.model, many.model) < WEIGHTS
    for key in ("loss", "grad_norm"):
        expected, got = logged(one, key), logged(many, key)
        assert len(got) == len(expected) == one.state.global_step
        assert got == pytest.approx(expected, rel=LOGGED)
    assert logged(many, "learning_rate") == logged(one, "learning_rate")
    expected, got = one.evaluate(data), many.evaluate(data)
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=LOGGED)
    if "eval_accuracy" in expected:
        assert got["eval_accuracy"] == expected["eval_accuracy"]
    first, second = one.predict(data), many.predict(data)
    assert prediction_gap(first.predictions, second.predictions) < WEIGHTS
    assert (first.label_ids == second.label_ids).all()


@pytest.mark.parametrize(
    ("replicas", "views"), [(1, False), (1, True), (2, False), (3, False), (2, True)]
)
def test_gpt2_matches_one_device(replicas: int, views: bool, tmp_path: Path) -> None:
    # 14 examples, global batches of 2R: the last step's batch is short (R = 3: 6, 6, 2, so
    # a replica gets no row), as is the last evaluation batch. Token-level loss divided by
    # num_items_in_batch: the slices hold different numbers of target tokens.
    data = lm_data()
    one = one_device(gpt2, tmp_path / "one", 2 * replicas, train_dataset=data)
    many = replicated(gpt2, tmp_path / "many", replicas, 2, views, train_dataset=data)
    compare(one, many, data)
    assert many.args.n_gpu <= 1 and many.model is many.model_wrapped


def test_gpt2_gradient_accumulation_and_evaluation_while_training(tmp_path: Path) -> None:
    data = lm_data()
    overrides = {
        "gradient_accumulation_steps": 2, "max_steps": 2, "eval_strategy": "steps", "eval_steps": 1,
    }
    kwargs: dict[str, Any] = {
        "train_dataset": data, "eval_dataset": data[:9], "overrides": overrides,
    }
    one = one_device(gpt2, tmp_path / "one", 4, **kwargs)
    many = replicated(gpt2, tmp_path / "many", 2, 2, **kwargs)
    one.train()
    many.train()
    assert weight_gap(one.model, many.model) < WEIGHTS
    assert logged(many, "loss") == pytest.approx(logged(one, "loss"), rel=LOGGED)
    assert len(logged(one, "eval_loss")) == 2
    assert logged(many, "eval_loss") == pytest.approx(logged(one, "eval_loss"), rel=LOGGED)


def test_a_compute_loss_func_dividing_by_num_items_in_batch(tmp_path: Path) -> None:
    # The user's loss, in float64: token cross-entropy summed, over the count it is handed
    # (the global one, on every replica), so the logged losses are float64 sums too.
    def token_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        summed = torch.nn.functional.cross_entropy(
            logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        return summed / num_items_in_batch

    data = lm_data()
    kwargs: dict[str, Any] = {"train_dataset": data, "compute_loss_func": token_loss}
    one = one_device(gpt2, tmp_path / "one", 6, **kwargs)
    many = replicated(gpt2, tmp_path / "many", 3, 2, **kwargs)
    compare(one, many, data)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_bert_matches_one_device(replicas: int, tmp_path: Path) -> None:
    # A mean loss that ignores num_items_in_batch, one label -100; the word embeddings have
    # padding_idx=0 (BertConfig's default pad_token_id).
    data = classification_data()
    kwargs: dict[str, Any] = {"train_dataset": data, "compute_metrics": accuracy}
    one = one_device(bert, tmp_path / "one", 2 * replicas, **kwargs)
    many = replicated(bert, tmp_path / "many", replicas, 2, **kwargs)
    compare(one, many, data)


def test_save_and_resume_give_one_device_checkpoints(tmp_path: Path) -> None:
    data = lm_data()
    overrides = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    many = replicated(gpt2, tmp_path / "many", 2, 2, train_dataset=data, overrides=overrides)
    many.train()
    checkpoint = tmp_path / "many" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file()

    # The saved model is a plain one: it loads without any strategy and equals the trained one.
    many.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert weight_gap(loaded, many.model) == 0.0

    # Resumed at R = 2 from step 2, it ends where the uninterrupted run ended.
    resumed = replicated(gpt2, tmp_path / "resumed", 2, 2, train_dataset=data, overrides=overrides)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert weight_gap(resumed.model, many.model) < WEIGHTS

    # One device resumes from the same checkpoint (R x the batch) and ends there too.
    alone = one_device(gpt2, tmp_path / "alone", 4, train_dataset=data, overrides=overrides)
    alone.train(resume_from_checkpoint=str(checkpoint))
    assert weight_gap(alone.model, many.model) < WEIGHTS
    assert logged(alone, "loss")[-2:] == pytest.approx(logged(many, "loss")[-2:], rel=LOGGED)


def test_model_init_builds_inside_the_scope(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    trainer = cs.transformers.Trainer(
        model_init=gpt2, args=arguments(tmp_path, 2, max_steps=1), train_dataset=lm_data(),
        strategy=strategy,
    )
    trainer.train()
    assert all(strategy.extended.variable_created_in_scope(p) for p in trainer.model.parameters())


def test_a_model_built_outside_the_scope_is_refused(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=r"inside `with strategy.scope\(\):`.*transformer\.wte"):
        cs.transformers.Trainer(model=gpt2(), args=arguments(tmp_path, 2), strategy=strategy)


def test_parameters_created_outside_the_scope_later_are_refused(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = gpt2()
    trainer = cs.transformers.Trainer(
        model=model, args=arguments(tmp_path, 2, max_steps=1), train_dataset=lm_data(),
        strategy=strategy,
    )
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=False).double()  # outside the scope
    with pytest.raises(ValueError, match=r"add any module to it there too.*lm_head\.weight"):
        trainer.train()
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        trainer.evaluate(lm_data())
    with strategy.scope():
        model.lm_head = torch.nn.Linear(32, VOCAB, bias=False).double()
    trainer.train()


def test_no_data_parallel_even_when_the_arguments_count_gpus(tmp_path: Path) -> None:
    # TrainingArguments set n_gpu to the visible GPUs (here faked as 4), and the Trainer
    # would wrap the model in nn.DataParallel and multiply the batch by it.
    args = arguments(tmp_path, 2, max_steps=1)
    args._setup_devices  # noqa: B018
    args._n_gpu = 4
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = gpt2()
    trainer = cs.transformers.Trainer(
        model=model, args=args, train_dataset=lm_data(), strategy=strategy
    )
    assert trainer.args.n_gpu == 1 and args.n_gpu == 4  # the caller's arguments are untouched
    assert trainer.get_train_dataloader().total_batch_size == 4  # R x 2, not 4 GPUs x 2
    trainer.train()
    assert not isinstance(trainer.model_wrapped, torch.nn.DataParallel)
    assert trainer.model_wrapped is model
    parameter_device = torch.device(strategy.parameter_device.split(":")[0])
    assert all(p.device == parameter_device for p in model.parameters())


def test_strategy_is_required(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="strategy="):
        cs.transformers.Trainer(model=gpt2(), args=arguments(tmp_path, 2), strategy=None)  # type: ignore[arg-type]


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from centralstore.transformers import _backend

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'centralstore\[transformers\]'"):
        _backend.load()


@pytest.mark.parametrize(("model", "how"), [("gpt2", "torch_compile"), ("bert", "compiled model")])
def test_a_model_compiled_whole_matches_one_device(
    model: str, how: str, tmp_path: Path
) -> None:
    # GPT-2's token loss divides by num_items_in_batch, BERT's mean loss does not: the first
    # step's uncompiled losses tell which, and the later steps' compiled losses are weighted
    # by it. Either weight for both would fail one of them. GPT-2 on the direct path, BERT
    # on the views path (GPU replicas').
    build, data = (gpt2, lm_data()) if model == "gpt2" else (bert, classification_data())

    def compiled() -> torch.nn.Module:
        return torch.compile(build(), backend="aot_eager")

    kwargs: dict[str, Any] = {"train_dataset": data}
    one = one_device(build, tmp_path / "one", 4, **kwargs)
    if how == "torch_compile":
        overrides = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
        many = replicated(build, tmp_path / "many", 2, 2, overrides=overrides, **kwargs)
    else:  # a compiled module hides its forward's arguments, by which the Trainer finds
        # the columns to keep and the labels (transformers.Trainer needs the same overrides)
        overrides = {"remove_unused_columns": False, "label_names": ["labels"]}
        many = replicated(compiled, tmp_path / "many", 2, 2, True, overrides=overrides, **kwargs)
    compare(one, many, data)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0


def test_a_compiled_module_whose_columns_were_removed_names_the_setting(tmp_path: Path) -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.compile(gpt2(), backend="aot_eager")
    trainer = cs.transformers.Trainer(
        model=model, args=arguments(tmp_path, 2), train_dataset=lm_data(), strategy=strategy
    )
    with pytest.raises(ValueError, match=r"batch is empty.*remove_unused_columns=False"):
        trainer.train()


def test_a_model_whose_body_is_compiled_matches_one_device(tmp_path: Path) -> None:
    # The loss, which receives num_items_in_batch as an ItemCount at every step, stays eager.
    # On the views path, as GPU replicas take it (the direct path's compile tests are
    # tests/variables/test_unscoped.py's and tests/equivalence/test_real_models.py's).
    def compiled_body() -> torch.nn.Module:
        model = gpt2()
        model.transformer = torch.compile(model.transformer, backend="aot_eager")
        return model

    data = lm_data()
    one = one_device(gpt2, tmp_path / "one", 4, train_dataset=data)
    many = replicated(compiled_body, tmp_path / "many", 2, 2, True, train_dataset=data)
    one.train()
    many.train()
    many.model.transformer = many.model.transformer._orig_mod  # the state dict's own names
    assert weight_gap(one.model, many.model) < WEIGHTS
    assert logged(many, "loss") == pytest.approx(logged(one, "loss"), rel=LOGGED)
