"""What a torch call does on the fake GPUs: placement, CUDA's device rules, stream accesses.

``handle`` sees every torch call that receives a fake tensor (through ``FakeCudaTensor``'s
``__torch_function__``), and every torch call on a thread where the fake-GPU mode or a
``torch.device`` context is active (factories, host tensors moving to a fake device, pinned
memory). It

* runs the call on the CPU tensors inside, under the device's generator if it is random, and
  wraps the tensors it returns on the device (``_tensor.wrap``);
* raises as CUDA would when a call mixes devices (CUDA accepts a 0-dim CPU tensor);
* hands moves, copies, pinning and a few metadata calls to ``_moves``;
* records, on the thread's current stream of the device, which blocks the call reads and
  writes (a view reads nothing; a new result is allocated on that stream), and what the host
  reads and writes of pinned memory; blocking reads (``.item()``, printing, a copy to the host
  without ``non_blocking``) order the host after the stream.

Backward runs on the CPU tensors without passing here: the accesses of its kernels are not
recorded, except that a gradient accumulated into a fake leaf counts as written by the
device's current stream when its post-accumulate-grad hooks run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._pytree import tree_flatten, tree_map

from . import _cuda, _tensor
from ._blocks import device_block, host_block, pin, record_gradient_write, register, storage_key
from ._moves import DEFAULT, SPECIAL
from ._order import HOST
from ._tensor import FakeCudaTensor, index_of, inner_of, is_fake, unwrap, wrap

_RANDOM = frozenset({
    "dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout",
    "feature_alpha_dropout_", "feature_dropout", "feature_dropout_", "dropout1d", "dropout2d",
    "dropout3d", "native_dropout", "bernoulli", "bernoulli_", "normal", "normal_", "uniform_",
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "multinomial", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "poisson", "rrelu", "rrelu_", "gumbel_softmax",
})
# Calls that read the data on the host: CUDA waits for the stream first.
_SYNC = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__repr__", "__str__", "__format__", "equal", "allclose", "nonzero", "unique",
    "masked_select", "__reduce_ex__", "__array__", "numpy",
})
# Calls that may take tensors on several devices (or CPU index tensors) without raising.
_MIXING = frozenset({
    "to", "cuda", "cpu", "copy_", "__getitem__", "__setitem__", "backward", "grad",
    "__deepcopy__", "_has_compatible_shallow_copy_type", "register_hook",
    "register_post_accumulate_grad_hook", "is_same_size", "set_",
})
# Calls that read only the shapes of some arguments, which may be meta tensors (CUDA's
# ``unflatten_dense_tensors`` views the flat tensor as each template's sizes).
_SHAPES_ONLY = frozenset({"unflatten_dense_tensors"})
_IN_PLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__setitem__",
})
_AUTOGRAD = frozenset({"backward", "grad", "run_backward"})
_NATIVE_GETTERS = frozenset({"device", "is_cuda", "is_cpu"})


class _Local(threading.local):
    inside = False  # this thread is inside a call the handler is running on CPU tensors
    host_body = False  # ... inside a custom Function's forward or backward (``host_body``)


_local = _Local()


def name_of(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return str(getattr(owner, "__name__", ""))
    return str(getattr(func, "__name__", ""))


def _is_accessor(func: Any) -> str | None:
    """"get" or "set" for a tensor attribute's getter or setter, else None."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ != "getset_descriptor":
        return None
    return "get" if getattr(func, "__name__", "") == "__get__" else "set"


_ALLOWED_TF = {torch._C._disabled_torch_function_impl}
_FAKE_TF = FakeCudaTensor.__dict__["__torch_function__"].__func__


def _foreign(types: Any) -> bool:
    """Whether a tensor subclass with a ``__torch_function__`` of its own is among the
    arguments (``centralstore``'s central variables): it gets to handle the call first."""
    for cls in types or ():
        if cls is torch.Tensor or cls is FakeCudaTensor:
            continue
        tf = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        if tf not in _ALLOWED_TF and tf is not _FAKE_TF:
            return True
    return False


@contextlib.contextmanager
def _running_inside() -> Iterator[None]:
    previous, _local.inside = _local.inside, True
    try:
        yield
    finally:
        _local.inside = previous


@contextlib.contextmanager
def _outside() -> Iterator[None]:
    """A backward: the engine calls back into Python (hooks, ``queue_callback``) and those
    calls are user code on fake tensors, not calls on CPU tensors."""
    previous, _local.inside = _local.inside, False
    try:
        yield
    finally:
        _local.inside = previous


@contextlib.contextmanager
def host_body() -> Iterator[None]:
    """A custom Function's ``forward`` or ``backward``, which ``Function.apply`` runs on the
    CPU tensors its fake arguments hold: a call there that mixes those with fake tensors it
    reached otherwise (the layers a reentrant checkpoint calls) runs on the CPU tensors the
    fake ones hold and returns CPU tensors (unseen by the stream checker); the others run as
    anywhere. A ``backward`` runs inside the handled call that started the backward pass,
    where the fake-GPU mode is off: it is switched on again, so that a fake tensor of
    another class (a central variable, whose class centralstore lends) is still handled."""
    previous = _local.inside, _local.host_body
    _local.inside, _local.host_body = False, True
    active = any(isinstance(mode, Interceptor) for mode in _get_current_function_mode_stack())
    try:
        with contextlib.nullcontext() if active else Interceptor():
            yield
    finally:
        _local.inside, _local.host_body = previous


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Run user code called back from inside a handled call (a hook) with the fake-GPU
    mode active again on this thread."""
    previous = _local.inside, _local.host_body
    _local.inside = _local.host_body = False
    mode = Interceptor()
    try:
        with mode:
            yield
    finally:
        _local.inside, _local.host_body = previous


class Interceptor(TorchFunctionMode):
    """The fake-GPU mode: every torch call on this thread goes through ``handle``."""

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return handle(func, types, tuple(args), dict(kwargs or {}))


def device_context_torch_function(
    self: DeviceContext, func: Any, types: Any, args: Any = (), kwargs: Any = None
) -> Any:
    """``torch.device(d)``'s ``__torch_function__`` while the fake GPUs are active: factories
    get ``d`` (the CPU where the handler is running a call on CPU tensors), then ``handle``."""
    kwargs = dict(kwargs or {})
    if func in _device_constructors() and kwargs.get("device") is None:
        kwargs["device"] = "cpu" if _local.inside else self.device
    return handle(func, types, tuple(args), kwargs)


def _ambient_device() -> torch.device | None:
    for mode in reversed(_get_current_function_mode_stack()):  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def handle(func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one torch call on the fake GPUs (see the module docstring)."""
    rt = _cuda._runtime
    if _local.host_body and not _local.inside and _mixes((args, kwargs)):
        with _running_inside(), torch._C.DisableTorchFunctionSubclass():
            return func(*unwrap(args), **unwrap(kwargs))
    if _local.inside:  # a call made while running one on CPU tensors
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if torch._C._is_torch_function_enabled() and _foreign(types):
        return NotImplemented
    with _running_inside():
        if rt is None:  # after the context: fake tensors outliving it are forwarded
            if any(is_fake(x) for x in tree_flatten((args, kwargs))[0]):
                return _forward(func, args, kwargs, None)
            return func(*args, **kwargs)
        return Call(rt, func, args, kwargs).run()


def _mixes(tree: Any) -> bool:
    """Whether ``tree`` holds both fake tensors and host tensors of one dimension or more."""
    leaves = [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
    return any(map(is_fake, leaves)) and any(not is_fake(x) and x.dim() > 0 for x in leaves)


def _forward(func: Any, args: Any, kwargs: Any, index: int | None) -> Any:
    if _is_accessor(func) == "get" and name_of(func) in _NATIVE_GETTERS:
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)
    out = func(*unwrap(args), **unwrap(kwargs))
    if index is None:
        index = next((x._fakegpu_index for x in tree_flatten((args, kwargs))[0] if is_fake(x)), 0)
    return tree_map(lambda x: wrap(x, index) if isinstance(x, torch.Tensor) else x, out)


def _mixing_error(a: str, b: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{a} and {b}! (fakegpu)"
    )


def _numpy_error(index: int) -> TypeError:
    return TypeError(
        f"can't convert cuda:{index} device type tensor to numpy. Use Tensor.cpu() to copy "
        "the tensor to host memory first."
    )


def _parse_device(value: Any) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    return torch.device(value)


class Call:
    """One torch call being handled."""

    def __init__(self, rt: _cuda.Runtime, func: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.rt = rt
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.name = name_of(func)
        self.flat = tree_flatten((args, kwargs))[0]
        self.fakes = [x for x in self.flat if is_fake(x)]

    # -- entry -------------------------------------------------------------------------

    def run(self) -> Any:
        accessor = _is_accessor(self.func)
        if accessor is not None:
            return self._accessor(accessor)
        special = SPECIAL.get(self.name)
        if special is not None:
            result = special(self)
            if result is not DEFAULT:
                return result
        placed = self._placed_factory()
        if placed is not DEFAULT:
            return placed
        if not self.fakes:
            return self._host_call()
        return self._device_call()

    # -- attributes --------------------------------------------------------------------

    def _accessor(self, kind: str) -> Any:
        owner = self.args[0]
        if not is_fake(owner):
            if kind == "set" and self.name == "data" and is_fake(self.args[1]):
                raise NotImplementedError("fakegpu: host_tensor.data = fake_gpu_tensor")
            return self.func(*self.args)
        index = owner._fakegpu_index
        if kind == "get":
            if self.name in _NATIVE_GETTERS:
                with torch._C.DisableTorchFunction():
                    return self.func(owner)
            value = self.func(owner._fakegpu_inner)
            return wrap(value, index) if isinstance(value, torch.Tensor) else value
        value = self.args[1]
        moved = isinstance(value, torch.Tensor) and index_of(value) != index
        if self.name in ("grad", "data") and moved:
            where = "cpu" if index_of(value) is None else f"cuda:{index_of(value)}"
            raise RuntimeError(
                f"assigned {self.name} has data located on {where}, different from the "
                f"tensor's device cuda:{index} (fakegpu)"
            )
        return self.func(owner._fakegpu_inner, inner_of(value))

    # -- factories ---------------------------------------------------------------------

    def _placed_factory(self) -> Any:
        """A call that names a device (or runs under a ``torch.device`` context) and
        creates a tensor there, or pins host memory; DEFAULT for every other call."""
        func, kwargs = self.func, self.kwargs
        constructor = func in _device_constructors()
        device = kwargs.get("device")
        if device is None and constructor:
            device = _ambient_device()
        pinned = bool(kwargs.get("pin_memory"))
        if device is None and not pinned:
            return DEFAULT
        target = _parse_device(device) if device is not None else None
        if target is not None and target.type == "cuda":
            index = self.rt.index(target)
            if pinned:
                raise RuntimeError("Only dense CPU tensors can be pinned (fakegpu)")
            call_kwargs = dict(kwargs, device="cpu")
            call_kwargs.pop("pin_memory", None)
            out = self._call(index, unwrap(self.args), unwrap(call_kwargs))
            return self.place_outputs(out, index, reads=[])
        if target is not None and target.type not in ("cpu", "cuda"):
            return DEFAULT
        if not pinned:
            if not self.fakes:
                return self._host_call()
            return self.func(*unwrap(self.args), **unwrap(kwargs))  # e.g. zeros_like(x, "cpu")
        call_kwargs = dict(kwargs)
        call_kwargs.pop("pin_memory")
        out = self.func(*unwrap(self.args), **unwrap(call_kwargs))
        pin(self.rt, out)
        return out

    def _call(self, index: int | None, args: Any, kwargs: Any) -> Any:
        if self.name in _AUTOGRAD:
            with _outside():
                return self.func(*args, **kwargs)
        if index is not None and self.name in _RANDOM:
            with self.rt.rng(index):
                return self.func(*args, **kwargs)
        return self.func(*args, **kwargs)

    def place_outputs(self, out: Any, index: int, reads: list[Any]) -> Any:
        """Wrap the tensors of ``out`` on device ``index``; new storage is allocated and
        written on the current stream."""
        rt = self.rt
        stream = rt.current_stream(index)
        rt.tally("kernel", stream)
        rt.order.launch(stream)
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        for fake in reads:
            block = device_block(rt, fake)
            if block is not None:
                rt.order.access(stream, block, False, self.label())
        for inner in outputs:
            if not is_fake(inner):
                block = register(rt, inner, f"cuda:{index}", stream)
                if block is not None:
                    rt.order.access(stream, block, True, self.label())
        return tree_map(lambda x: wrap(x, index) if isinstance(x, torch.Tensor) else x, out)

    def label(self) -> str:
        return self.name or repr(self.func)

    # -- ordinary calls ----------------------------------------------------------------

    def _written(self) -> list[Any]:
        """The arguments this call writes: the first for an in-place call, ``out=``."""
        written: list[Any] = []
        name = self.name
        in_place = name in _IN_PLACE_DUNDERS or (
            name.endswith("_") and not name.endswith("__")
        )
        if in_place and self.args:
            first = self.args[0]
            written += list(first) if isinstance(first, (list, tuple)) else [first]
        out = self.kwargs.get("out")
        if out is not None:
            written += list(out) if isinstance(out, (list, tuple)) else [out]
        return [t for t in written if isinstance(t, torch.Tensor)]

    def _host_call(self) -> Any:
        """A call on host tensors only: pinned blocks it touches are host accesses."""
        rt = self.rt
        if rt.order.blocks:
            tensors = [x for x in self.flat if isinstance(x, torch.Tensor)]
            if tensors:
                written = {id(t) for t in self._written()}
                out = self._call(None, self.args, self.kwargs)
                self._host_accesses(tensors, written, out)
                return out
        return self._call(None, self.args, self.kwargs)

    def _host_accesses(self, tensors: list[torch.Tensor], written: set[int], out: Any) -> None:
        rt = self.rt
        keys = {storage_key(x) for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)}
        for t in tensors:
            block = host_block(rt, t)
            if block is None:
                continue
            write = id(t) in written
            if not write and storage_key(t) in keys and self.name not in _SYNC:
                continue  # a view: no data is read
            rt.order.access(HOST, block, write, self.label())

    def _check_devices(self) -> int:
        devices = {f._fakegpu_index for f in self.fakes}
        first = min(devices)
        if self.name in _MIXING:
            return int(self.fakes[0]._fakegpu_index)
        if len(devices) > 1:
            a, b = sorted(devices)[:2]
            raise _mixing_error(f"cuda:{a}", f"cuda:{b}")
        for x in self.flat:
            if isinstance(x, torch.Tensor) and not is_fake(x) and x.dim() > 0:
                if x.is_meta and self.name in _SHAPES_ONLY:
                    continue
                raise _mixing_error(f"cuda:{first}", str(x.device))
        return int(first)

    def _device_call(self) -> Any:
        rt = self.rt
        index = self._check_devices()
        stream = rt.current_stream(index)
        args, kwargs = self.args, self.kwargs
        if self.name in ("register_hook", "register_post_accumulate_grad_hook"):
            args = (args[0], _hook(self.name, args[1], args[0]._fakegpu_index), *args[2:])
        if self.name in ("numpy", "__array__"):
            raise _numpy_error(index)
        written = self._written()
        in_args = [x for x in self.flat if isinstance(x, torch.Tensor)]
        out = self._call(index, unwrap(args), unwrap(kwargs))
        if self.name in ("backward", "grad", "register_hook",
                         "register_post_accumulate_grad_hook"):
            return self._wrap_autograd(out)
        rt.order.launch(stream)
        in_keys = {storage_key(inner_of(t)) for t in in_args}
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        out_keys = {storage_key(x) for x in outputs}
        written_ids = {id(t) for t in written}
        sync = self.name in _SYNC
        # a view, a factory shaped like its argument, or a query of metadata (``data_ptr``,
        # ``is_contiguous``): no tensor out, none written and no value read back
        view_only = (bool(outputs) and out_keys <= in_keys and not written) or (
            self.name.endswith("_like") or self.name.startswith("new_")
        ) or (not outputs and not written and not sync)
        if not view_only or sync:
            rt.tally("copy to host" if sync else "kernel", stream)
        label = self.label()
        for t in in_args:
            write = id(t) in written_ids
            if view_only and not write and not sync:
                continue
            if isinstance(t, FakeCudaTensor):
                block = device_block(rt, t)
                if block is not None:
                    rt.order.access(stream, block, write, label)
            else:
                block = host_block(rt, t)
                if block is not None:
                    rt.order.access(HOST, block, write, label)
        for inner in outputs:
            key = storage_key(inner)
            if key is not None and key not in in_keys:
                block = register(rt, inner, f"cuda:{index}", stream)
                if block is not None:
                    rt.order.access(stream, block, True, label)
        if sync:
            rt.order.join(HOST, stream)
        if self.name in ("__repr__", "__str__"):
            return _device_repr(out, index)
        if self.name in ("__reduce_ex__", "tolist", "item"):
            return out
        return tree_map(lambda x: wrap(x, index) if isinstance(x, torch.Tensor) else x, out)

    def _wrap_autograd(self, out: Any) -> Any:
        if self.name == "grad":  # torch.autograd.grad: each gradient on its input's device
            inputs = self.kwargs.get("inputs", self.args[1] if len(self.args) > 1 else ())
            inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            return tuple(
                g if g is None or index_of(x) is None else wrap(g, index_of(x))  # type: ignore[arg-type]
                for g, x in zip(out, inputs, strict=True)
            )
        return out


def _hook(kind: str, fn: Callable[..., Any], index: int) -> Callable[..., Any]:
    """A hook on a CPU tensor that calls ``fn`` with the fake tensors, the mode active."""
    if kind == "register_post_accumulate_grad_hook":

        def post(inner: torch.Tensor) -> None:
            leaf = wrap(inner, index)
            rt = _cuda._runtime
            if rt is not None:
                record_gradient_write(rt, leaf)
            with user_code():
                fn(leaf)

        return post

    def hook(grad: torch.Tensor) -> Any:
        with user_code():
            result = fn(wrap(grad, index))
        return inner_of(result)

    return hook


def _device_repr(text: str, index: int) -> str:
    marks = [text.find(m) for m in (", size=", ", dtype=", ", grad_fn=", ", requires_grad=")]
    found = [m for m in marks if m >= 0]
    cut = min(found) if found else len(text) - 1
    return f"{text[:cut]}, device='cuda:{index}'{text[cut:]}"


_tensor.handler = handle
