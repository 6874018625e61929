"""The hook into Keras' PyTorch backend: what it replaces, and how it is undone.

Keras' PyTorch trainer runs every step through ``model.train_function``,
``test_function`` and ``predict_function``, which its ``make_*_function`` methods build.
Those three are the seam: for a model whose variables belong to a strategy they build the
distributed steps of ``_steps.py`` (a model's own ``train_step`` runs per replica,
``CustomTrainStep``); for any other model they are Keras' own. Smaller replacements serve
every Keras variable, seed, optimizer and input:

* ``Variable._initialize``: a variable created inside ``strategy.scope()`` is stored on the
  strategy's parameter device and becomes a central variable with its declared aggregation
  (``_variables.py``), as TensorFlow's variables do.
* ``Variable.assign_add`` / ``assign_sub``: Keras on PyTorch writes ``v.assign(v + x)``, a
  final value; TensorFlow's, and this, write the difference when a replica updates a
  central variable, so that SUM adds each replica's increment (metric counts) instead of
  R final values.
* ``SeedGenerator.next``: inside replica r > 0 the seed it hands out moves by r strides, so
  that seeded random layers (``Dropout(seed=...)``, ``GaussianNoise``, ``RandomFlip``...) and
  ``keras.random.*`` draw each replica's own numbers, reproducibly; replica 0 draws what one
  device draws.
* ``optimizer.apply`` (``BaseOptimizer``, ``LossScaleOptimizer``, ``MultiOptimizer``): inside
  a replica of a custom ``train_step`` it is recorded, and applied once after the replicas
  to their summed gradients (``_steps._Updates``), as TensorFlow's ``apply`` in replica
  context merges the replicas' gradients.
* ``data_adapters.get_data_adapter``: a ``cs.Dataset`` is an input (``_data.py``).

``install`` applies them once; ``uninstall`` restores Keras exactly as it was.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._autograd import no_grad
from .._context import in_replica_of_strategy
from ..input.dataset import Dataset
from ..strategies.context import get_replica_context, get_strategy
from ..variables.views import write_in_place
from . import _data, _steps, _variables
from ._backend import load
from ._batches import check_reductions

keras = load()
from keras.src.backend.common.stateless_scope import in_stateless_scope  # noqa: E402
from keras.src.backend.torch import core as _core  # noqa: E402
from keras.src.backend.torch import trainer as _trainer  # noqa: E402
from keras.src.optimizers import base_optimizer as _base_optimizer  # noqa: E402
from keras.src.optimizers import loss_scale_optimizer as _loss_scale  # noqa: E402
from keras.src.random import seed_generator as _seed_generator  # noqa: E402
from keras.src.trainers import data_adapters as _adapters  # noqa: E402

try:  # Keras >= 3.13
    from keras.src.optimizers.multi_optimizer import MultiOptimizer as _MultiOptimizer
except ImportError:  # pragma: no cover
    _MultiOptimizer = None
# The optimizer classes that define ``apply`` themselves.
_OPTIMIZERS: tuple[Any, ...] = tuple(
    cls for cls in (
        _base_optimizer.BaseOptimizer, _loss_scale.LossScaleOptimizer, _MultiOptimizer
    ) if cls is not None
)

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
            check_reductions(self)
        _variables.prepare(self, strategy)
        _warn_jit(self)
        if kind == "train" and type(self).train_step is not _trainer.TorchTrainer.train_step:
            built_step: _steps.Step = _steps.CustomTrainStep(self, strategy, _apply_now)
        else:
            built_step = step(self, strategy)
        setattr(self, attribute, built_step)
        return getattr(self, attribute)

    make.__name__ = name
    make.__doc__ = f"Keras' {name}, distributed when the model's variables are a strategy's."
    return make


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
        if not in_replica_of_strategy() or in_stateless_scope():
            return _original[name](self, value)
        current = self.value
        increment = self._convert_to_tensor(value, dtype=self._dtype)
        add = functools.partial(torch.Tensor.add_, other=increment, alpha=sign)  # a C call
        with no_grad():  # an in-place add: the replica's write is its increment
            if write_in_place(current, add):  # on the replica's view of the variable
                return current
            if not get_strategy().extended.variable_created_in_scope(current):
                return _original[name](self, value)
            add(current)  # a replica that uses the variable itself
        return current

    assign.__name__ = name
    return assign


def _apply_now(optimizer: Any, grads: Any, variables: Any) -> Any:
    """The optimizer's ``apply``, once the replicas finished (nothing collects then)."""
    return optimizer.apply(grads, variables)


def _apply(key: str) -> Callable[..., Any]:
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        updates = _steps.collecting()
        if updates is None or not in_replica_of_strategy():
            return _original[key](self, grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        updates.add(self, grads, trainable_variables)
        return None

    apply.__name__ = "apply"
    apply.__doc__ = (
        "Keras' optimizer apply; inside a replica of a custom train_step under a strategy, "
        "recorded and applied once, after the replicas, to their summed gradients."
    )
    return apply


# A replica's draws differ from every other replica's by this much (mod 2**32) per
# replica id, far beyond any number of draws a seed generator makes in one program.
_REPLICA_SEED_STRIDE = 0x9E3779B9


def _next(self: Any, ordered: bool = True) -> Any:
    """``SeedGenerator.next``; inside replica r > 0 of a strategy, its seed moved by r
    strides, so that each replica draws its own numbers (a dropout mask, noise) while two
    identical programs still draw the same ones. Keras' torch backend seeds with the sum of
    the two seed values modulo 2**32, so the first one moves."""
    seed = _original["next"](self, ordered)
    if not in_replica_of_strategy():
        return seed
    replica = get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
    if not replica:
        return seed
    first = (int(seed[0]) + replica * _REPLICA_SEED_STRIDE) & 0xFFFFFFFF
    if seed.dtype == torch.int32:
        first = (first ^ 0x80000000) - 0x80000000
    moved = seed.clone()
    moved[0] = first
    return moved


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
        (_seed_generator.SeedGenerator, "next", _next),
        *(
            (owner, "apply", _apply(f"{owner.__name__}.apply"))
            for owner in _OPTIMIZERS
        ),
    ]


def install() -> None:
    """Apply the replacements (once)."""
    if _applied:
        return
    for owner, name, replacement in _replacements():
        _original[f"{owner.__name__}.{name}" if name == "apply" else name] = getattr(owner, name)
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
