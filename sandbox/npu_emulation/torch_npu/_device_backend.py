"""A real `npu` device type for the emulation: PyTorch's Python backend hook plus a wrapper tensor.

`install()` registers PrivateUse1 as "npu" through
torch.utils.backend_registration._setup_privateuseone_for_python_backend (device module, hooks,
device guard) and gives it kernels written in Python:
- `NpuTensor`, a wrapper subclass (torch.Tensor._make_wrapper_subclass with device npu:N) that
  holds its values in a private host tensor; its __torch_dispatch__ runs every ATen op on those
  host tensors and wraps the results again, below autograd, so autograd, optimizers and modules
  see ordinary tensors whose device.type is "npu";
- PrivateUse1 kernels for what reaches the backend without a wrapper argument: empty.memory_format,
  empty_strided (factories, `.to("npu")`, C++ allocations such as DDP's buckets) and _copy_from /
  _copy_from_and_resize (host <-> device copies). So `x.npu()` and `x.to("npu")` COPY: mutating
  the device tensor leaves the host tensor unchanged, as on an NPU; arange and eye are made on the host
  and wrapped (PyTorch builds them by resizing an empty tensor, which a wrapper's size cannot follow);
- the device check of a real backend: an op that mixes a device tensor with a host tensor (other
  than a 0-dim host scalar, and other than index tensors and cross-device copies) raises
  RuntimeError "Expected all tensors to be on the same device, but found at least two devices,
  npu:0 and cpu!";
- random ops on device tensors (dropout, rand, normal_, ...) draw from the emulated NPU generator's
  stream (torch.npu.manual_seed / get_rng_state), never from the host generator;
- c10d collectives on device tensors run on their host values (gloo), so DDP(model,
  device_ids=[local_rank]) works on an emulated-npu module.
A program's own torch.compile traces on device tensors and runs the captured graph on the device
(_device_compile).
Known deviation: every process's device tensors report npu:0, whatever torch.npu.set_device chose
(one device per process is all the hook's autograd support allows; see _npu_device).
Autocast for device_type "npu" is emulated with CPU autocast's op lists (see _device_autocast).
Everything runs on the CPU: speed means nothing, numerics are what it checks.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import _device_compile, _kernel_count
from ._checks import same_device_message

_installed = False
_lib: torch.library.Library | None = None

# ops that may legitimately take host tensors next to device tensors
_aten = torch.ops.aten
_MIXED_OK = {
    _aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default, _aten._copy_from_and_resize.default,
    _aten.copy.default,  # copy_'s functional form, in graphs AOTAutograd traces
    _aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default,
    _aten.set_.source_Tensor, _aten.lift_fresh.default,
}
# host <-> device transfers: memory copies, not kernels (_kernel_count)
_COPIES = {_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default, _aten._copy_from_and_resize.default,
           _aten.copy.default}
# stream bookkeeping: the emulated device has one synchronous stream
_NO_OPS = {_aten.record_stream.default}


def _npu_device(index: int | None = None) -> torch.device:
    """Every device tensor of a process is on npu:0. PyTorch's Python backend hook gives the autograd
    engine one ready queue for the backend (its device guard reports one device), so a tensor on
    npu:1 fails in backward; torch.npu.set_device(local_rank) is still honoured by the torch.npu
    queries (current_device, device_count from TRAINBRIDGE_EMULATED_NPU_COUNT)."""
    return torch.device("npu", 0)


class NpuTensor(torch.Tensor):
    """A tensor on the emulated NPU: device npu:N, values in a private host tensor (`_host`)."""

    _host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor, device: torch.device | None = None, size=None, stride=None):
        # an empty tensor's wrapper keeps a one-byte storage: Dynamo's fake copy of a tensor whose storage has
        # zero bytes resizes the fake's storage to zero, which a Python backend cannot do ("register
        # PrivateUse1HooksInterface ... resizePrivateUse1Bytes"): an empty device tensor entering a compiled frame
        # (torch.nonzero finding nothing) stopped the program's own torch.compile
        empty = {"storage_size": 1} if host.numel() == 0 else {}
        t = torch.Tensor._make_wrapper_subclass(
            cls, host.size() if size is None else size, strides=host.stride() if stride is None else stride,
            storage_offset=host.storage_offset(), dtype=host.dtype, layout=host.layout,
            device=device or _npu_device(), requires_grad=False, **empty,
        )
        t._host = host
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    # a traceable wrapper subclass: Module.to() then swaps parameters in place (torch.utils.swap_tensors)
    # instead of making new Parameter objects, so tied weights stay tied and optimizers keep their params
    def __tensor_flatten__(self):
        return ["_host"], (self.device,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        # a compiler's trace gives the outer size and stride (symbolic under dynamic shapes): keep them
        return NpuTensor(inner_tensors["_host"], meta[0], outer_size, outer_stride)

    def __repr__(self, *, tensor_contents=None):
        text = repr(self._host)
        head, _, rest = text.partition("(")
        rest = rest.rstrip(")")
        return f"tensor({rest}, device='{self.device}')" if head == "tensor" else text

    def __reduce_ex__(self, protocol):  # torch.save / deepcopy of a device tensor: rebuilt on the device
        return (_rebuild, (self._host.detach().clone(), self.device.index or 0, self.requires_grad))

    def tolist(self):  # a host read, as on an NPU (PyTorch refuses .tolist() on a tensor subclass)
        return self.cpu().tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NO_OPS:
            return None
        flat, _ = tree_flatten((args, kwargs))
        device = next(a.device for a in flat if isinstance(a, NpuTensor))
        # under a compiler's trace, a device tensor made by the traced code is a fake/functional tensor on
        # npu, not an NpuTensor: a device tensor all the same (_device_compile)
        traced = [a for a in flat if _device_compile.traced_device_tensor(a, NpuTensor)]
        host_tensors = any(_is_host_tensor(a) for a in flat)
        if func not in _MIXED_OK and host_tensors:
            a = next(a for a in flat if _is_host_tensor(a))
            raise RuntimeError(same_device_message(device, a.device))
        counted = not _device_compile.tracing(next(a._host for a in flat if isinstance(a, NpuTensor)))
        if func is _aten._to_copy.default:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != "npu":
                if counted:
                    _kernel_count.dispatched(func, crosses_host=True)
                return func(host_of(args[0]), **kwargs)
        if counted:
            _kernel_count.dispatched(func, crosses_host=host_tensors and func in _COPIES)
        by_id = {}
        written = []

        def unwrap(a):
            if isinstance(a, NpuTensor):
                by_id[id(a._host)] = a
                return a._host
            if traced and any(a is t for t in traced):
                host = _device_compile.to_host(a)
                by_id[id(host)] = a
                written.append((a, host))
                return host
            if isinstance(a, torch.device) and a.type == "npu":
                return torch.device("cpu")
            return a

        host_args, host_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            out = _on_device_stream(func, host_args, host_kwargs)
        else:
            out = func(*host_args, **host_kwargs)
        if written and func._schema.is_mutable:  # an in-place op on a traced device tensor: write it back
            _device_compile.write_back(func, args, kwargs, written)

        def wrap(o):
            if isinstance(o, torch.Tensor) and not isinstance(o, NpuTensor):
                same = by_id.get(id(o))
                if same is not None:
                    return same
                if o.is_conj() or o.is_neg():
                    # a lazy conj/neg view's bit lives on the host tensor, which the wrapper does not carry:
                    # the next op on the wrapper would read the plain values (a * a.conj() gave a * a, and
                    # complex autograd, which conjugates, got wrong gradients). Materialise it here.
                    o = o.resolve_conj().resolve_neg()
                return NpuTensor(o, device)
            return o

        return tree_map(wrap, out)


def _is_host_tensor(a) -> bool:
    """A host tensor for the device check: not a device tensor, not a 0-dim scalar, not meta."""
    return isinstance(a, torch.Tensor) and not isinstance(a, NpuTensor) and a.dim() > 0 \
        and a.device.type not in ("meta", "npu")


def _on_device_stream(func, args, kwargs):
    """A random op on device tensors draws from the NPU generator's op stream, not the host's."""
    from ._generator import default_generator

    gen = default_generator(0)
    host_state = torch.default_generator.get_state()
    torch.default_generator.set_state(gen.ops_state)
    try:
        return func(*args, **kwargs)
    finally:
        gen.ops_state = torch.default_generator.get_state()
        torch.default_generator.set_state(host_state)


def _rebuild(host: torch.Tensor, index: int, requires_grad: bool) -> NpuTensor:
    t = NpuTensor(host, _npu_device(index))
    return t.requires_grad_(requires_grad) if requires_grad else t


def host_of(t: torch.Tensor) -> torch.Tensor:
    return t._host if isinstance(t, NpuTensor) else t


def rebind(param: torch.Tensor, new: torch.Tensor) -> None:
    """`param.data = new` that also re-points a device tensor's host values (fused optimizers)."""
    param.data = new
    if isinstance(param, NpuTensor) and isinstance(new, NpuTensor):
        param._host = new._host


# --- PrivateUse1 kernels ----------------------------------------------------------------------


def _device_index(device) -> int | None:
    return None if device is None else torch.device(device).index


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    host = torch.empty(size, dtype=dtype, layout=layout, device="cpu",
                       memory_format=memory_format or torch.contiguous_format)
    return NpuTensor(host, _npu_device(_device_index(device)))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    host = torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu")
    return NpuTensor(host, _npu_device(_device_index(device)))


def _copy_from(self, dst, non_blocking=False):
    host_of(dst).copy_(host_of(self))
    return dst


def _copy_from_and_resize(self, dst):
    d = host_of(dst)
    if d.shape != self.shape:
        raise RuntimeError(f"emulated npu: cannot resize a device tensor of shape {tuple(d.shape)} to "
                           f"{tuple(self.shape)} in a copy")
    d.copy_(host_of(self))
    return dst


def _host_factory(op):
    """A factory that PyTorch builds as `empty({0})` plus an out= op resizing it (arange, eye): a wrapper's
    size cannot follow its host tensor's resize, so the device tensor is made from the host result."""
    def factory(*args, device=None, **kwargs):
        _kernel_count.dispatched(op, crosses_host=False)
        return NpuTensor(op(*args, device="cpu", **kwargs), _npu_device(_device_index(device)))

    return factory


_HOST_FACTORIES = ("arange", "arange.start", "arange.start_step", "eye", "eye.m")


def _register_kernels() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    for name, fn in (("empty.memory_format", _empty), ("empty_strided", _empty_strided),
                     ("_copy_from", _copy_from), ("_copy_from_and_resize", _copy_from_and_resize)):
        _lib.impl(name, fn, "PrivateUse1")
    for name in _HOST_FACTORIES:
        packet, _, overload = name.partition(".")
        _lib.impl(name, _host_factory(getattr(getattr(_aten, packet), overload or "default")), "PrivateUse1")


def install(npu_module) -> None:
    """Idempotent; raises if another PrivateUse1 backend is already registered in this process."""
    global _installed
    if _installed:
        return
    from torch.utils import backend_registration

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "npu"):
        raise RuntimeError(
            f"cannot emulate torch_npu: PyTorch's PrivateUse1 backend is already registered as {current!r}"
        )
    backend_registration._setup_privateuseone_for_python_backend(rename="npu", backend_module=npu_module)
    _register_kernels()
    from ._device_autocast import install as install_autocast
    from ._device_collectives import install as install_collectives
    from ._device_map import patch_pin_memory
    from ._device_params import install as keep_parameter_attributes

    patch_pin_memory()
    keep_parameter_attributes()
    install_autocast()
    install_collectives()
    _device_compile.install()
    _installed = True
