"""Calls with a meaning of their own on the fake GPUs: moves, copies, pinning, metadata.

Each takes the ``_ops`` call being handled and returns its result, or ``DEFAULT`` to let the
ordinary handling run. A move between devices is always a real copy, ordered as CUDA orders
it: a copy to a device runs on that device's current stream (reading pinned host memory
there, asynchronously, when ``non_blocking``; the host waits otherwise); a copy to the host
without ``non_blocking`` waits for the stream; ``.to("cpu", non_blocking=True)`` puts its
result in pinned memory and does not wait, as torch does; a copy between devices waits for
both devices' current streams.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._blocks import PINNED, device_block, host_block, is_pinned, pin, register
from ._order import HOST
from ._tensor import FakeCudaTensor, index_of, inner_of, is_fake, unwrap, wrap

if TYPE_CHECKING:
    from ._ops import Call

DEFAULT = object()


def _move(call: Call, source: torch.Tensor, target: torch.device | None, dtype: Any,
          non_blocking: bool, copy: bool, memory_format: Any) -> Any:
    """``source.to(target, dtype)``: across devices always a copy, with CUDA's ordering."""
    rt = call.rt
    src_index = index_of(source)
    if target is None:
        dst_index = src_index
    elif target.type == "cuda":
        dst_index = rt.index(target)
    elif target.type == "cpu":
        dst_index = None
    else:
        raise NotImplementedError(f"fakegpu: .to({target})")
    inner = inner_of(source)
    options: dict[str, Any] = {"dtype": dtype or inner.dtype}
    if memory_format is not None:
        options["memory_format"] = memory_format
    label = call.label()
    if dst_index == src_index:
        out = torch._C.TensorBase.to(inner, copy=copy, **options)
        if out is inner or src_index is None:
            return source if out is inner else out
        return call.place_outputs(out, src_index, reads=[source])
    out = torch._C.TensorBase.to(inner, copy=True, **options)
    if src_index is None:  # host to device
        assert dst_index is not None
        return _host_to_device(call, inner, out, dst_index, non_blocking, label)
    assert isinstance(source, FakeCudaTensor)
    if dst_index is None:  # device to host
        stream = rt.current_stream(src_index)
        rt.tally("copy to host", stream, _nbytes(out))
        rt.order.launch(stream)
        block = device_block(rt, source)
        if block is not None:
            rt.order.access(stream, block, False, label)
        if non_blocking:  # torch puts the result in pinned memory and does not wait
            pinned = register(rt, out, PINNED, None)
            if pinned is not None:
                rt.order.access(stream, pinned, True, label)
        else:
            rt.order.join(HOST, stream)
        return out
    return _device_to_device(call, source, out, dst_index, label)


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes a copy of ``tensor`` moves (a sparse one's indices and values)."""
    if tensor.is_sparse:
        return _nbytes(tensor._indices()) + _nbytes(tensor._values())
    return tensor.numel() * tensor.element_size()


def _host_to_device(call: Call, src: torch.Tensor, dst_inner: torch.Tensor, index: int,
                    non_blocking: bool, label: str, dst: Any = None) -> Any:
    rt = call.rt
    stream = rt.current_stream(index)
    rt.tally("copy to device", stream, _nbytes(dst_inner))
    rt.order.launch(stream)
    block = host_block(rt, src)
    async_read = non_blocking and block is not None and block.device == PINNED
    if block is not None:
        rt.order.access(stream if async_read else HOST, block, False, label)
    target = device_block(rt, dst) if dst is not None else register(
        rt, dst_inner, f"cuda:{index}", stream
    )
    if target is not None:
        rt.order.access(stream, target, True, label)
    if not non_blocking:
        rt.order.join(HOST, stream)
    return dst if dst is not None else wrap(dst_inner, index)


def _device_to_device(call: Call, source: FakeCudaTensor, dst_inner: torch.Tensor,
                      index: int, label: str, dst: Any = None) -> Any:
    rt = call.rt
    src_stream = rt.current_stream(source._fakegpu_index)
    dst_stream = rt.current_stream(index)
    rt.tally("copy between devices", src_stream, _nbytes(dst_inner))
    rt.order.launch(src_stream)
    rt.order.launch(dst_stream)
    rt.order.join(src_stream, dst_stream)
    block = device_block(rt, source)
    if block is not None:
        rt.order.access(src_stream, block, False, label)
    target = device_block(rt, dst) if dst is not None else register(
        rt, dst_inner, f"cuda:{index}", dst_stream
    )
    if target is not None:
        rt.order.access(src_stream, target, True, label)
    rt.order.join(dst_stream, src_stream)
    return dst if dst is not None else wrap(dst_inner, index)


def _to(call: Call) -> Any:
    kwargs = dict(call.kwargs)
    copy = bool(kwargs.pop("copy", False))
    source = call.args[0]
    rest = unwrap(call.args[1:])
    other = next((a for a in call.args[1:] if isinstance(a, torch.Tensor)), None)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    if other is not None:
        device, dtype = other.device, other.dtype
    return _move(call, source, device, dtype, bool(non_blocking), copy, memory_format)


def _cuda_method(call: Call) -> Any:
    kwargs = dict(call.kwargs)
    device = call.args[1] if len(call.args) > 1 else kwargs.pop("device", None)
    target = torch.device("cuda", call.rt.index(device))
    return _move(call, call.args[0], target, None, bool(kwargs.get("non_blocking")), False,
                 kwargs.get("memory_format"))


def _cpu(call: Call) -> Any:
    return _move(call, call.args[0], torch.device("cpu"), None, False, False,
                 call.kwargs.get("memory_format"))


def _copy_(call: Call) -> Any:
    dst, src = call.args[0], call.args[1]
    non_blocking = bool(call.args[2] if len(call.args) > 2 else call.kwargs.get("non_blocking"))
    di, si = index_of(dst), index_of(src)
    if di == si or (si is None and src.dim() == 0):
        return DEFAULT
    rt, label = call.rt, call.label()
    inner_of(dst).copy_(inner_of(src))
    if si is None:
        return _host_to_device(call, src, inner_of(dst), di, non_blocking, label, dst=dst)  # type: ignore[arg-type]
    if di is None:  # device to host
        stream = rt.current_stream(si)
        rt.tally("copy to host", stream, _nbytes(inner_of(src)))
        rt.order.launch(stream)
        block = device_block(rt, src)
        if block is not None:
            rt.order.access(stream, block, False, label)
        host = host_block(rt, dst)
        async_write = non_blocking and host is not None and host.device == PINNED
        if not async_write:
            rt.order.join(HOST, stream)
        if host is not None:
            rt.order.access(stream if async_write else HOST, host, True, label)
        return dst
    return _device_to_device(call, src, inner_of(dst), di, label, dst=dst)


def _pin_memory(call: Call) -> Any:
    t = call.args[0]
    if is_fake(t):
        raise RuntimeError(
            f"cannot pin '{_type_name(t)}' only dense CPU tensors can be pinned (fakegpu)"
        )
    if is_pinned(call.rt, t):
        return t
    out = t.clone()
    pin(call.rt, out)
    return out


def _is_pinned(call: Call) -> Any:
    t = call.args[0]
    return False if is_fake(t) else is_pinned(call.rt, t)


def _record_stream(call: Call) -> Any:
    t, stream = call.args[0], call.args[1]
    if not is_fake(t):
        return None
    if not call.rt.skipped("record_stream"):
        call.rt.tally("record_stream", stream)
        block = device_block(call.rt, t)
        if block is not None:
            block.recorded.add(stream)
    return None


def _type_name(t: FakeCudaTensor) -> str:
    return "torch.cuda." + str(inner_of(t).type()).rsplit(".", 1)[-1]


def _type(call: Call) -> Any:
    if is_fake(call.args[0]) and len(call.args) == 1 and not call.kwargs:
        return _type_name(call.args[0])
    return DEFAULT


def _get_device(call: Call) -> Any:
    t = call.args[0]
    return t._fakegpu_index if is_fake(t) else DEFAULT


def _deepcopy(call: Call) -> Any:
    t = call.args[0]
    if not is_fake(t):
        return DEFAULT
    memo = call.args[1] if len(call.args) > 1 else {}
    inner = t._fakegpu_inner.__deepcopy__(memo)
    out = call.place_outputs(inner, t._fakegpu_index, reads=[t])
    for key, value in t.__dict__.items():
        if not key.startswith("_fakegpu_"):
            setattr(out, key, copy.deepcopy(value, memo))
    return out


def _compatible(call: Call) -> Any:
    """Module._apply replaces a parameter's ``.data`` only when this holds: never across
    devices (a fake wrapper's device cannot change)."""
    a, b = call.args[0], call.args[1]
    return DEFAULT if index_of(a) == index_of(b) else False


SPECIAL: dict[str, Callable[[Call], Any]] = {
    "_has_compatible_shallow_copy_type": _compatible,
    "to": _to,
    "cuda": _cuda_method,
    "cpu": _cpu,
    "copy_": _copy_,
    "pin_memory": _pin_memory,
    "is_pinned": _is_pinned,
    "record_stream": _record_stream,
    "type": _type,
    "get_device": _get_device,
    "__deepcopy__": _deepcopy,
}
