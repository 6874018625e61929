"""The hook into Keras' PyTorch backend: what it replaces, and how it is undone.

Keras' PyTorch trainer runs every step through ``model.train_function``,
``test_function`` and ``predict_function``, which its ``make_*_function`` methods build.
Those three are the seam: for a model whose variables belong to a strategy they build the
distributed steps of ``_steps.py``; for any other model they are Keras' own. Three smaller
replacements serve every Keras variable and input:

* ``Variable._initialize``: a variable created inside ``strategy.scope()`` is stored on the
  strategy's parameter device and becomes a central variable with its declared aggregation
  (``_variables.py``), as TensorFlow's variables do.
* ``Variable.assign_add`` / ``assign_sub``: Keras on PyTorch writes ``v.assign(v + x)``, a
  final value; TensorFlow's, and this, write the difference when a replica updates a
  central variable, so that SUM adds each replica's increment (metric counts) instead of
  R final values.
* ``data_adapters.get_data_adapter``: a ``cs.Dataset`` is an input (``_data.py``).

``install`` applies them once; ``uninstall`` restores Keras exactly as it was.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..input.dataset import Dataset
from ..strategies.context import get_replica_context, get_strategy, has_strategy
from . import _data, _steps, _variables
from ._backend import load
from ._batches import check_reductions

keras = load()
from keras.src.backend.common.stateless_scope import in_stateless_scope  # noqa: E402
from keras.src.backend.torch import core as _core  # noqa: E402
from keras.src.backend.torch import trainer as _trainer  # noqa: E402
from keras.src.trainers import data_adapters as _adapters  # noqa: E402

_MISSING = object()
# (owner, attribute, what the owner itself held before: restored by uninstall)
_applied: list[tuple[Any, str, Any]] = []
# What each replaced attribute resolved to before (inherited ones included): called by the
# replacements whenever they leave Keras to itself.
_original: dict[str, Callable[..., Any]] = {}
_jit_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def _maker(kind: str, step: type[_steps.Step]) -> Callable[..., Any]:
    name = f"make_{kind}_function"
    attribute = f"{kind}_function"

    def make(self: Any, force: bool = False) -> Any:
        if getattr(self, attribute) is not None and not force:
            return getattr(self, attribute)
        built = _original[name](self, force)  # Keras' checks (steps_per_execution) first
        strategy = _variables.strategy_of(self)
        if strategy is None:
            return built
        if kind == "train":
            _check_train_step(self)
            check_reductions(self)
        _variables.prepare(self, strategy)
        _warn_jit(self)
        setattr(self, attribute, step(self, strategy))
        return getattr(self, attribute)

    make.__name__ = name
    make.__doc__ = f"Keras' {name}, distributed when the model's variables are a strategy's."
    return make


def _check_train_step(model: Any) -> None:
    if type(model).train_step is not _trainer.TorchTrainer.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides train_step, which applies the optimizer inside "
            "the step; under a strategy, fit runs the forward and loss once per replica and "
            "applies the optimizer once, after the replicas' gradients are summed. Move the "
            "custom logic into compute_loss (or call(...)), or write the loop with "
            "strategy.run. Received: "
            f"{type(model).__module__}.{type(model).__qualname__}.train_step"
        )


def _warn_jit(model: Any) -> None:
    if model.jit_compile and model not in _jit_warned:
        _jit_warned.add(model)
        warnings.warn(
            f"jit_compile=True: under a strategy, model {model.name!r} runs eagerly: Keras "
            "layers read their weights through Keras variables, not module attributes, so a "
            "compiled replica step would run every weight read uncompiled between compiled "
            "pieces; each replica's forward and backward run eagerly instead (results are the "
            "same). Compile with jit_compile=False to silence this warning.",
            UserWarning,
            stacklevel=4,
        )


def _in_replica() -> bool:
    return has_strategy() and get_replica_context() is not None


def _initialize(self: Any, value: Any) -> None:
    strategy = _variables.scope_strategy()
    if strategy is None:
        _original["_initialize"](self, value)
        return
    with _core.device_scope(_storage(strategy.parameter_device)):
        _original["_initialize"](self, value)
    _variables.register(self, strategy)


def _storage(device_name: str) -> str:
    """Where tensors of a device live: "cpu" for every logical CPU device ("cpu:1"); for
    "cpu:0" too, since a tensor moved to "cpu:0" is a copy of one on "cpu"."""
    device = torch.device(device_name)
    return "cpu" if device.type == "cpu" else str(device)


def _delta(sign: float) -> Callable[[Any, Any], Any]:
    name = "assign_add" if sign > 0 else "assign_sub"

    def assign(self: Any, value: Any) -> Any:
        if in_stateless_scope() or not _in_replica():
            return _original[name](self, value)
        current = self.value
        if not get_strategy().extended.variable_created_in_scope(current):
            return _original[name](self, value)
        value = self._convert_to_tensor(value, dtype=self._dtype)
        with torch.no_grad():  # an in-place add: the replica's write is its increment
            current.add_(value, alpha=sign)
        return current

    assign.__name__ = name
    return assign


def _get_data_adapter(x: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(x, Dataset):
        names = ("y", "sample_weight", "batch_size", "steps_per_epoch", "shuffle")
        named = {**dict(zip(names, args)), **kwargs}
        return _data.adapter(
            x, named.get("y"), named.get("sample_weight"), named.get("class_weight")
        )
    return _original["get_data_adapter"](x, *args, **kwargs)


def _replacements() -> list[tuple[Any, str, Callable[..., Any]]]:
    return [
        (_trainer.TorchTrainer, "make_train_function", _maker("train", _steps.TrainStep)),
        (_trainer.TorchTrainer, "make_test_function", _maker("test", _steps.TestStep)),
        (_trainer.TorchTrainer, "make_predict_function", _maker("predict", _steps.PredictStep)),
        (_core.Variable, "_initialize", _initialize),
        (_core.Variable, "assign_add", _delta(1.0)),
        (_core.Variable, "assign_sub", _delta(-1.0)),
        (_adapters, "get_data_adapter", _get_data_adapter),
    ]


def install() -> None:
    """Apply the replacements (once)."""
    if _applied:
        return
    for owner, name, replacement in _replacements():
        _original[name] = getattr(owner, name)
        _applied.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, replacement)


def uninstall() -> None:
    """Restore what Keras held before ``install``."""
    while _applied:
        owner, name, before = _applied.pop()
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
    _original.clear()


def installed() -> bool:
    return bool(_applied)
