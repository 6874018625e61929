"""``FakeGPUs``: switch the fake GPUs on for a block, and leave torch as it was after.

Entering installs, and leaving removes, in reverse order and also when the block raises:

* the ``torch.cuda`` stand-ins (``_cuda.Runtime.namespace``);
* the fake-GPU ``TorchFunctionMode`` on the entering thread (``_ops.Interceptor``);
* ``torch.device(d)``'s ``__torch_function__``, so that factories under a ``torch.device``
  context on any thread (centralstore's replica threads enter one) reach the handler;
* ``Tensor.to``, ``.cuda``, ``.pin_memory``, ``.is_pinned``, ``.record_stream`` and the
  factories that take a device (``torch.empty``, ...), so that a host tensor sent to a fake
  GPU, or pinned, or a tensor created there, on a thread without the mode (an input-prefetch
  thread) is seen too (a factory imported by name before activation is not);
* ``threading.Thread.run``, so that threads started meanwhile (input prefetching, replica
  threads) run with the mode, which does nothing once the context has ended;
* ``torch.autograd.Function.apply``, so that a custom Function (and the full backward hooks
  torch builds on one) records its node on the CPU tensors, as every other call does, and
  the layers its body calls (a reentrant checkpoint's) compute on their CPU tensors too;
* the centralstore adapter (``_centralstore``), when centralstore is importable.

One ``FakeGPUs`` may be active at a time in a process; nesting raises.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from . import _centralstore, _cuda, _ops, _tensor
from ._order import Hazard
from ._pinned import PinnedPool

_MISSING = object()
_METHODS = ("to", "cuda", "pin_memory", "is_pinned", "record_stream")
# Factories that take a device or pin_memory: reached on threads without the mode too.
_FACTORIES = (
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
    "eye", "linspace", "logspace", "tensor", "as_tensor", "asarray", "empty_strided",
    "scalar_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
    "randn_like", "randint_like",
)
# Methods whose C++ argument parser rejects a fake stream before any __torch_function__.
_DIRECT = frozenset({"record_stream"})


class HazardError(AssertionError):
    """Raised by ``FakeGPUs.check`` when accesses were not ordered as CUDA needs."""


class _Patches:
    """Attribute and dict-item replacements, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(
            owner, name, _MISSING
        )
        setattr(owner, name, value)

        def undo() -> None:
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

        self._undo.append(undo)

    def setitem(self, mapping: dict[Any, Any], key: Any, value: Any) -> None:
        old = mapping.get(key, _MISSING)
        mapping[key] = value

        def undo() -> None:
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _host_method(orig: Any) -> Any:
    """``Tensor.<name>`` that reaches the handler on threads without the fake-GPU mode."""
    direct = orig.__name__ in _DIRECT

    @functools.wraps(orig)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _ops._local.inside or _cuda._runtime is None or (
            not direct and torch._C._is_torch_function_mode_enabled()
        ):
            return orig(self, *args, **kwargs)
        return _ops.handle(orig, (), (self, *args), kwargs)

    return method


def _host_function(orig: Any) -> Any:
    """``torch.<factory>`` that reaches the handler on threads without the fake-GPU mode."""

    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _ops._local.inside or _cuda._runtime is None or (
            torch._C._is_torch_function_mode_enabled()
        ):
            return orig(*args, **kwargs)
        return _ops.handle(orig, (), args, kwargs)

    return factory


class _Forwarded(threading.local):
    """The fake devices of the tensors the last hosted ``forward`` on this thread returned
    (None for a host tensor), leaf by leaf."""

    indices: list[int | None] | None = None


_forwarded = _Forwarded()


def _function_apply(orig: Any) -> Any:
    """``torch.autograd.Function.apply`` that runs a custom Function on the CPU tensors the
    fake ones hold, so that autograd records its node there as for every other call (given
    the wrappers, which never require grad, it would record none), and wraps the outputs
    back: each on the fake device it had in ``forward`` (a replica collective returns its
    result on the replica's GPU), a host tensor on the inputs' device. Its ``forward`` and
    ``backward`` run as host code (``_ops.host_body``): a fake tensor they reach by other
    ways than their arguments (the layers a reentrant ``torch.utils.checkpoint`` calls)
    stands for the CPU tensor it holds, and the fake tensors they return are handed to
    autograd as the CPU tensors they hold (a fake one there aborts a CPU build)."""

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        index = next(
            (i for i in map(_tensor.index_of, tree_leaves((args, kwargs))) if i is not None),
            None,
        )
        if index is None:
            return orig.__func__(cls, *args, **kwargs)
        _forwarded.indices = None
        out = orig.__func__(_on_host(cls), *_tensor.unwrap(args), **_tensor.unwrap(kwargs))
        leaves, spec = tree_flatten(out)
        indices = _forwarded.indices
        if indices is None or len(indices) != len(leaves):
            indices = [None] * len(leaves)
        return tree_unflatten([
            _tensor.wrap(x, index if where is None else where)
            if isinstance(x, torch.Tensor) else x
            for x, where in zip(leaves, indices, strict=True)
        ], spec)

    return classmethod(functools.wraps(orig.__func__)(apply))


@functools.cache
def _on_host(cls: Any) -> Any:
    """``cls`` with its ``forward`` and ``backward`` run as host code, returning the CPU
    tensors of the fake ones (``forward`` noting their devices for ``apply``)."""

    def hosted(method: Callable[..., Any], forward: bool) -> Any:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            with _ops.host_body():
                out = method(*args, **kwargs)
            if forward:
                _forwarded.indices = [
                    _tensor.index_of(x) if isinstance(x, torch.Tensor) else None
                    for x in tree_leaves(out)
                ]
            return _tensor.unwrap(out)

        return staticmethod(run)

    return type(cls.__name__, (cls,), {
        "forward": hosted(cls.forward, True), "backward": hosted(cls.backward, False),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
    })


def _thread_run(orig: Any) -> Any:
    """``Thread.run`` with the fake-GPU mode active on the new thread while it runs (it is
    inert once the context has ended)."""

    @functools.wraps(orig)
    def run(self: threading.Thread) -> None:
        if _cuda._runtime is None:
            orig(self)
            return
        with _ops.Interceptor():
            orig(self)

    return run


class FakeGPUs:
    """``count`` fake CUDA devices while active (``with FakeGPUs(2) as gpus: ...``)."""

    def __init__(self, count: int = 2) -> None:
        if count < 1:
            raise ValueError(f"fakegpu needs at least one device, not {count}")
        self.count = count
        self._runtime: _cuda.Runtime | None = None
        self._patches = _Patches()
        self._mode: _ops.Interceptor | None = None

    # -- activation --------------------------------------------------------------------

    def __enter__(self) -> FakeGPUs:
        if _cuda._runtime is not None:
            raise RuntimeError("fakegpu: fake GPUs are already active in this process")
        rt = self._runtime = _cuda.Runtime(self.count)
        patches = self._patches
        try:
            _cuda.set_runtime(rt)
            rt.start()
            for name, value in rt.namespace().items():
                patches.setattr(torch.cuda, name, value)
            patches.setattr(torch._C, "_cuda_getCurrentRawStream", rt.raw_stream)
            patches.setattr(DeviceContext, "__torch_function__", _ops.device_context_torch_function)
            for name in _METHODS:
                patches.setattr(torch.Tensor, name, _host_method(getattr(torch.Tensor, name)))
            _device_constructors()  # cached now, with torch's own factories in it
            for name in _FACTORIES:
                patches.setattr(torch, name, _host_function(getattr(torch, name)))
            patches.setattr(threading.Thread, "run", _thread_run(threading.Thread.run))
            patches.setattr(
                torch.autograd.Function, "apply",
                _function_apply(torch.autograd.Function.__dict__["apply"]),
            )
            _centralstore.install(patches)
            self._mode = _ops.Interceptor()
            _push_mode(self._mode)  # type: ignore[no-untyped-call]
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._leave()

    def _leave(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            above = []
            while _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
                top = _pop_mode()  # type: ignore[no-untyped-call]
                if top is mode:
                    break
                above.append(top)
            for other in reversed(above):
                _push_mode(other)  # type: ignore[no-untyped-call]
        self._patches.undo()
        _cuda.set_runtime(None)

    # -- results -----------------------------------------------------------------------

    @property
    def runtime(self) -> _cuda.Runtime:
        assert self._runtime is not None, "fakegpu: FakeGPUs was never entered"
        return self._runtime

    @property
    def hazards(self) -> list[Hazard]:
        """The hazards found so far, in order."""
        return list(self.runtime.order.hazards)

    @property
    def calls(self) -> Counter[tuple[str, Any]]:
        """The CUDA runtime calls made so far: (what, the stream or ``"host"``) -> count."""
        return self.runtime.calls

    @property
    def moved(self) -> Counter[str]:
        """The bytes copied so far, by kind: "copy to device", "copy to host", "copy between
        devices" (a real GPU's transfers, which a fake one makes on the host)."""
        return self.runtime.moved

    @property
    def pinned(self) -> PinnedPool:
        """The pinned host memory that torch's caching host allocator would hold."""
        return self.runtime.pinned

    def take_hazards(self) -> list[Hazard]:
        """The hazards found so far, cleared: a test that expects them takes them."""
        with self.runtime.order.lock:
            found = list(self.runtime.order.hazards)
            self.runtime.order.hazards.clear()
        return found

    def report(self) -> str:
        hazards = self.hazards
        if not hazards:
            return "fakegpu: no hazards"
        lines = [f"fakegpu: {len(hazards)} stream hazard(s):"]
        lines += [f"  {i + 1}. {h}" for i, h in enumerate(hazards)]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise ``HazardError`` with the report if any hazard was recorded."""
        if self.runtime.order.hazards:
            raise HazardError(self.report())

    # -- mutation testing --------------------------------------------------------------

    @contextlib.contextmanager
    def skipping(self, primitive: str, owner: Any, name: str) -> Iterator[None]:
        """Within calls of ``owner.name``, on the thread that makes them, ``primitive`` does
        nothing: ``"Event.record"``, ``"Event.synchronize"``, ``"Stream.wait_event"``,
        ``"Stream.wait_stream"``, ``"Stream.synchronize"``, ``"synchronize"`` or
        ``"record_stream"``. A test removes one synchronization this way and asserts that
        the harness then reports a hazard."""
        original = getattr(owner, name)
        runtime = self.runtime

        @functools.wraps(original)
        def without(*args: Any, **kwargs: Any) -> Any:
            skipping = runtime.current.skipping
            added = primitive not in skipping
            skipping.add(primitive)
            try:
                return original(*args, **kwargs)
            finally:
                if added:
                    skipping.discard(primitive)

        patches = _Patches()
        patches.setattr(owner, name, without)
        try:
            yield
        finally:
            patches.undo()
