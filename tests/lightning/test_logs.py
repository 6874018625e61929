"""The recorder that stands for ``LightningModule.log`` while replicas run."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch

from centralstore.lightning._logs import LogRecorder, LogSignature

SIGNATURE = LogSignature(pl.LightningModule.log)


def _recorded(*args: Any, **kwargs: Any) -> tuple[str, Any, dict[str, Any]]:
    recorder = LogRecorder(1, SIGNATURE)
    recorder.log(*args, **kwargs)
    (call,) = recorder.calls[0]
    return call


def _bound(*args: Any, **kwargs: Any) -> tuple[str, Any, dict[str, Any]]:
    """What binding Lightning's own signature gives: the recorder's reference."""
    bound = SIGNATURE.signature.bind(*args, **kwargs).arguments
    return bound.pop("name"), bound.pop("value"), dict(bound)


@pytest.mark.parametrize("args, kwargs", [
    (("loss", 1.0), {}),  # the usual call, read without binding
    (("loss", 1.0), {"prog_bar": True, "reduce_fx": "sum", "batch_size": 3}),
    (("loss",), {"value": 2.0, "on_epoch": True}),  # the value by keyword: bound
    ((), {"name": "loss", "value": 2.0}),
    (("loss", 1.0, True), {"on_step": False}),  # prog_bar by position: bound
])
def test_every_call_shape_records_what_binding_gives(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert _recorded(*args, **kwargs) == _bound(*args, **kwargs)


def test_the_options_are_log_keywords() -> None:
    assert {"prog_bar", "on_step", "on_epoch", "reduce_fx", "batch_size"} <= SIGNATURE.options
    assert not {"self", "name", "value"} & SIGNATURE.options


@pytest.mark.parametrize("args, kwargs", [
    (("loss", 1.0), {"no_such_option": 1}),  # an unknown keyword: binding raises
    (("loss", 1.0), {"name": "again"}),
    (("loss",), {}),
])
def test_wrong_calls_raise_as_log_does(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        _recorded(*args, **kwargs)


def test_the_value_is_kept_as_given() -> None:
    value = torch.tensor(3.0)
    name, recorded, options = _recorded("loss", value, on_epoch=True)
    assert (name, options) == ("loss", {"on_epoch": True})
    assert recorded is value
