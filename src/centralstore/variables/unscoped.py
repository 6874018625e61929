"""Modules whose tensors are not central variables, and what becomes of them.

The scope's registration hooks (``store.py``) make central what a module registers. Two kinds
of module register nothing in the scope:

* a module restored by unpickling (``copy.deepcopy(model)``, ``torch.load`` of a whole
  module) gets its tables back without registering them, and a conversion
  (``model.double()``, ``.half()``, ``.to(torch.bfloat16)``) puts new buffers in them:
  inside a scope, ``adopting`` takes each restored or converted module's tensors as the
  registration hooks would, so a copy made in the scope is central like the module it
  copies, and a model converted there stays central;
* a module built outside every scope (or restored there): each replica would use it as it
  is, so its buffers would take one update per replica (BatchNorm's ``num_batches_tracked``
  would count R per step). Such a module is refused at its first call in a run, naming it
  and the fix: the first run of a strategy checks every module it calls (``FirstUse``), and
  from the strategy's creation on, a module that registers a tensor outside every scope
  gets a forward pre-hook that checks it at its first call if that call is in a run; the
  hook then goes (also when a scope takes the module), so a plain module costs nothing from
  its second call on (nor is a hook made inside compiled code). Not seen: a module first
  called outside ``run`` and then in a later run, a module restored outside a scope (it
  registers nothing) first called after the first run, and a module built before the
  strategy and first called after a compilation started in the first run (``FirstUse``).

Inside a replica the same registration hooks refuse, at once, a new tensor in a slot that
holds a central variable (``module.steps = module.steps + 1``: write in place instead) and a
parameter or buffer registered there (variables are created in the scope).

>>> import torch
>>> import centralstore as cs
>>> strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
>>> outside = torch.nn.BatchNorm1d(3)
>>> strategy.run(outside, args=(torch.randn(4, 3),))
Traceback (most recent call last):
...
ValueError: The BatchNorm1d module called in replica 0 holds the parameter 'weight' ...
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.fx import GraphModule
from torch.nn.modules import module as _module

from .. import _context

_lock = threading.Lock()
_watching = False
# torch warns at each call of a compiled module while any global module hook exists. During a
# first run that hook is FirstUse's, which checks a compiled module as it checks any other:
# the warning (hooks that fire "an extra time") would send the user looking for hooks of theirs.
_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
_HOOKS_FILTER = ("ignore", re.compile(_HOOKS_WARNING, re.I), UserWarning, None, 0)
# modules that registered a tensor outside every scope, and their forward pre-hook
_watched: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _registered(module: torch.nn.Module, name: str, value: Any) -> None:
    if isinstance(module, GraphModule):
        return  # a traced program, assembled from existing tensors (torch.compile's, in run)
    if isinstance(value, torch.Tensor) or value is None:
        _refuse_in_replica(module, name, value)
    if value is None or torch.compiler.is_compiling() or module in _watched:
        # (compiled code is checked where it is called, and a hook made inside it breaks its
        # graph: Llama's ``self.layers[:n]`` makes a ModuleList of watched layers each call)
        return
    if isinstance(value, torch.nn.Module) and value not in _watched:
        return  # a container is watched when one of its modules is: a compiled model too
    entry = _context.current()
    if entry.replica_context is None and entry.strategy is not _context.default().strategy:
        return  # a scope takes it
    _watched[module] = module.register_forward_pre_hook(_first_call)


def _refuse_in_replica(module: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Inside a replica, a module takes no other tensor. The replicas run one after another
    on the same modules, so the next replica would find the tensor this one left: a slot
    that holds a central variable may not be assigned (the variable would leave the
    module), and a new parameter or buffer is no central variable (each replica would make
    its own, which no sync point combines). (``torch.func.functional_call`` swaps the tables'
    entries without this hook.)"""
    table = module._parameters if name in module._parameters else module._buffers
    if value is not None and table.get(name) is value:
        return  # the same tensor again: ``module.count += 1`` writes in place, then sets it
    entry = _context.current()
    if entry.replica_context is None or entry.strategy is _context.default().strategy:
        return
    parameter = name in module._parameters or isinstance(value, torch.nn.Parameter)
    kind = "parameter" if parameter else "buffer"
    replica = getattr(entry.replica_context, "replica_id_in_sync_group", 0)
    if table.get(name) is None:  # a new entry, or one registered empty (a lazy cache's)
        if value is None:
            return
        made = (
            f"registered a new {kind} {name!r} of shape" if name not in table
            else f"filled the empty {kind} {name!r} with a tensor of shape"
        )
        raise ValueError(
            f"Replica {replica} {made} {tuple(value.shape)} in {type(module).__name__} "
            "inside run: a variable is created in strategy.scope(), where it becomes a "
            f"central variable of {entry.strategy!r}; made by a replica, the next replica "
            "would find it and no sync point would combine it. Create it in the module's "
            "__init__, or, if the module creates it at its first call, call the module once "
            "inside `with strategy.scope():` before run."
        )
    owned = getattr(entry.store, "owned", None)
    if owned is None or (id(module), name) not in owned()[1]:
        return  # a module built outside every scope: its first call in a run says so
    given = "None" if value is None else f"a new tensor of shape {tuple(value.shape)}"
    raise ValueError(
        f"Replica {replica} assigned {given} to the {kind} {name!r} of "
        f"{type(module).__name__} (module.{name} = ...), which is a central variable of "
        f"{entry.strategy!r}: the replicas share the module, so the next replica would find "
        "this replica's tensor, and the variable would leave the module. Write it in place "
        f"instead (module.{name} += 1, module.{name}.copy_(value)): writes in place are "
        "combined at the end of run by the variable's aggregation. To replace the variable, "
        "do it outside run, inside strategy.scope()."
    )


def _first_call(module: torch.nn.Module, args: Any) -> None:
    """A watched module's first call: in a replica of a strategy, it must hold only central
    variables (it may have been attached in a scope since). Either way it is no longer
    watched, so that a plain module costs nothing from its second call on."""
    if torch.compiler.is_compiling():
        return  # checked where the compiled model is called (OptimizedModule)
    handle = _watched.pop(module, None)
    if handle is not None:
        handle.remove()
    entry = _context.current()
    if entry.replica_context is None or entry.strategy is _context.default().strategy:
        return
    owned = getattr(entry.store, "owned", None)
    if owned is not None:
        records, slots = owned()
        check(module, records, slots, entry)


def adopted(module: torch.nn.Module) -> None:
    """A scope took ``module``'s tensors: it is no longer watched."""
    handle = _watched.pop(module, None)
    if handle is not None:
        handle.remove()


def watch_registrations() -> None:
    """From now on (idempotent), each module that registers a tensor outside every scope is
    checked at its first call in a run."""
    global _watching
    with _lock:
        if not _watching:
            _module.register_module_parameter_registration_hook(_registered)
            _module.register_module_buffer_registration_hook(_registered)
            _module.register_module_module_registration_hook(_registered)
            _watching = True


# How torch.fx names the tensors a traced program creates (``torch.tensor([1.0, 2.0])`` in a
# compiled function): buffers of its GraphModule, which hold no state.
_CONSTANT = "_tensor_constant"


def check(
    module: torch.nn.Module,
    records: dict[int, Any],
    slots: set[tuple[int, str]],
    entry: _context.Entry,
) -> None:
    """Raise if ``module`` (the model of a compiled one: all its modules) holds a tensor that
    is neither a record nor in a slot of one."""
    original = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    for owner in original.modules() if isinstance(original, torch.nn.Module) else (module,):
        traced = isinstance(owner, GraphModule)
        for kind, table in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) not in records and (
                    (id(owner), name) not in slots
                ) and not (traced and name.startswith(_CONSTANT)):
                    _refuse(owner, kind, name, tensor, entry, _scoped(owner, slots))


def _scoped(module: torch.nn.Module, slots: set[tuple[int, str]]) -> bool:
    """Whether some slot of ``module`` or of its submodules holds a central variable: it was
    built in a scope."""
    return any(
        (id(part), name) in slots
        for part in module.modules() for name in (*part._parameters, *part._buffers)
    )


def _refuse(
    module: torch.nn.Module, kind: str, name: str, tensor: torch.Tensor,
    entry: _context.Entry, scoped: bool,
) -> None:
    replica = getattr(entry.replica_context, "replica_id_in_sync_group", 0)
    found = (
        f"The {type(module).__name__} module called in replica {replica} holds the {kind} "
        f"{name!r} of shape {tuple(tensor.shape)}, which is not a central variable of "
        f"{entry.strategy!r}"
    )
    if scoped:  # (``module.mask = torch.ones(2)`` after the scope)
        raise ValueError(
            f"{found}, although the module's other variables are: the {kind} was put there "
            "after strategy.scope() ended, so every replica would use it as it is, and a "
            f"buffer would take one update per replica. Assign the {kind} inside `with "
            "strategy.scope():`, or create it in the module's __init__."
        )
    raise ValueError(
        f"{found}: the module was built (or copied or loaded) outside "
        "strategy.scope(), so every replica would use it as it is, and a buffer would take "
        "one update per replica. Build or load it inside `with strategy.scope():` "
        "(attaching it there to a module built in the scope, or `copy.deepcopy` of it "
        "there, also makes it central)."
    )


Take = Callable[[torch.nn.Module], None]
_takers: list[Take] = []  # innermost last: the scopes that adopt what is restored
_original_setstate: Callable[[torch.nn.Module, Any], None] = torch.nn.Module.__setstate__


_original_apply: Callable[..., torch.nn.Module] = torch.nn.Module._apply


def _setstate(self: torch.nn.Module, state: Any) -> None:
    _original_setstate(self, state)
    if _takers:
        _takers[-1](self)


def _apply(self: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``Module._apply`` (under ``to``, ``double``, ``half``, ...), after which the module's
    tensors are taken: a conversion of dtype puts new buffers in its table, without
    registering them (each submodule's ``_apply`` takes its own)."""
    result = _original_apply(self, fn, *args, **kwargs)
    if _takers:
        _takers[-1](self)
    return result


@contextlib.contextmanager
def adopting(take: Take) -> Iterator[None]:
    """While the block runs, each module restored by unpickling (``copy.deepcopy``,
    ``torch.load``) is passed to ``take``, once its own tables are back (its submodules were
    restored before it), and each module converted (``Module._apply``), once converted."""
    with _lock:
        if not _takers:
            torch.nn.Module.__setstate__ = _setstate  # type: ignore[method-assign]
            torch.nn.Module._apply = _apply  # type: ignore[method-assign]
        _takers.append(take)
    try:
        yield
    finally:
        with _lock:
            _takers.remove(take)
            if not _takers:
                torch.nn.Module.__setstate__ = _original_setstate  # type: ignore[method-assign]
                torch.nn.Module._apply = _original_apply  # type: ignore[method-assign]


class FirstUse:
    """The first run of a strategy checks every module its replicas call (module docstring):
    ``start`` before the replicas run, ``stop`` after them; later runs check only the
    modules watched since they registered a tensor outside every scope. ``owned`` gives the
    store's records (by tensor id) and module slots (by module id and name).

    The check is a global forward pre-hook, which ``torch.compile`` guards on: code compiled
    while it is in place would compile again at the next run, without it. So a compilation
    that starts during a first run ends that run's check (``_compiling``): the compiled code
    is checked where it is called anyway, and the modules the rest of the run calls first
    are not checked (a module built before the strategy and first called after a
    compilation in its first run is used as it is)."""

    __slots__ = ("__weakref__", "_depth", "_first", "_handle", "_owned", "passed")

    def __init__(
        self, owned: Callable[[], tuple[dict[int, Any], set[tuple[int, str]]]]
    ) -> None:
        watch_registrations()
        self._owned = owned
        self.passed = False  # whether a run has checked every module it called
        self._first = False  # whether the run in progress is a first run
        self._handle: Any = None  # the global hook of the run in progress, until withdrawn
        self._depth = 0  # runs in progress: one, or one inside another's merge_call

    def start(self, store: object) -> None:
        """A run of ``store`` begins (a run inside ``merge_call`` is checked by its outer
        one; the default strategy, whose scope is everywhere, is not checked)."""
        self._depth += 1
        if self._depth > 1 or self.passed or _context.default().store is store:
            return
        records, slots = self._owned()
        seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

        def before_call(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling() or module in seen:
                return  # a compiled model: checked where it is called (OptimizedModule)
            entry = _context.current()
            if entry.replica_context is None or entry.store is not store:
                return  # cross-replica code, or a module called by another strategy
            check(module, records, slots, entry)
            seen.add(module)

        self._first = True
        self._handle = _module.register_module_forward_pre_hook(before_call)
        warnings.filterwarnings("ignore", _HOOKS_WARNING, UserWarning)  # == _HOOKS_FILTER
        _watch_compilations()
        with _lock:
            _checking.add(self)

    def stop(self, passed: bool) -> None:
        """The replicas are done (``passed``: none raised)."""
        self._depth -= 1
        if self._depth == 0 and self._first:
            self._first = False
            self.passed = passed
            self.withdraw()

    def withdraw(self) -> None:
        """The run in progress checks no more modules: its global hook goes."""
        with _lock:
            _checking.discard(self)
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
            with contextlib.suppress(ValueError):  # a filter list the user replaced meanwhile
                cast(list[Any], warnings.filters).remove(_HOOKS_FILTER)  # a list, typed Sequence


_checking: weakref.WeakSet[FirstUse] = weakref.WeakSet()  # first runs with their hook in place


def _compiling(*_: object) -> None:
    """``torch.compile`` starts compiling (dynamo's start callback): the first runs in
    progress withdraw their global hook before it is traced and guarded on."""
    with _lock:
        checks = list(_checking)
    for first_use in checks:
        first_use.withdraw()


def _watch_compilations() -> None:
    """Have ``_compiling`` called at each compilation's start, once dynamo is imported (a
    program that imports it only inside its first run compiles that code again at the
    second run, as before). Asked at each first run: ``torch._dynamo.reset()`` forgets the
    callbacks. ``torch._dynamo.callback`` is private: on a torch without it nothing is
    watched."""
    handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
    callbacks = getattr(handler, "start_callbacks", None)
    if handler is None or not isinstance(callbacks, list):
        return
    with _lock:
        if _compiling not in callbacks:
            handler.register_start_callback(_compiling)
