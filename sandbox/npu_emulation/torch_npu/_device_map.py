"""Map the `npu` device onto the CPU so that ported programs run unchanged.

What `install()` does (once per process, at `import torch_npu`, like the real plugin):
- registers `npu` as PyTorch's PrivateUse1 backend with Python hooks and `torch.npu` as its device
  module (torch.utils.backend_registration._setup_privateuseone_for_python_backend), so
  torch.device("npu:0"), torch.get_device_module("npu") and torch.accelerator queries work;
- pushes a TorchFunctionMode that rewrites npu devices to cpu in every torch call: `device=`
  arguments of factories and methods, the positional device of Tensor.to, and constructors run
  under torch.set_default_device("npu") / `with torch.device("npu")`;
- Tensor.npu() / Module.npu() return CPU tensors; pin_memory() for the npu is a no-op (host memory
  is the device memory); torch.autocast("npu", ...) runs CPU autocast with the same dtype.

Limits: torch function modes are thread-local, so device arguments in threads other than the
importing one are not rewritten; there, factories with device="npu" still make CPU tensors (PrivateUse1
kernels for empty / empty_strided, `_register_host_factories`) (the DataLoader
pin-memory thread is covered by the pin_memory patch); torch.Generator(device="npu") is not supported (use the
default generator).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as _torch_device

_CPU = torch.device("cpu")
_installed = False


def _is_npu(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index names the current accelerator, which is the npu
    if isinstance(device, str):
        return device == "npu" or device.startswith("npu:")
    if isinstance(device, torch.device):
        return device.type == "npu"
    return False


class NpuToCpuMode(TorchFunctionMode):
    """Rewrites npu device arguments to cpu before the call reaches the dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None:
            if _is_npu(dev):
                kwargs = {**kwargs, "device": _CPU}
        elif func in _torch_device._device_constructors():
            current = _torch_device.CURRENT_DEVICE
            if current is not None and current.type == "npu":
                kwargs = {**kwargs, "device": _CPU}
        if len(args) > 1 and getattr(func, "__name__", None) == "to" and _is_npu(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _tensor_npu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """Tensor.npu(): the emulated NPU is the CPU."""
    if device is not None:
        torch.npu._index(device)  # validates the ordinal like the real method
    return self.to(device=_CPU, non_blocking=non_blocking, memory_format=memory_format)


def _module_npu(self, device=None):
    return self._apply(lambda t: _tensor_npu(t, device))


def patch_pin_memory() -> None:
    original_pin, original_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def pin_memory(self, device=None):
        if device is None or _is_npu(device):
            return self
        return original_pin(self, device)

    def is_pinned(self, device=None):
        if device is None or _is_npu(device):
            return False
        return original_is_pinned(self, device)

    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = is_pinned
    # factories asked for pinned host memory (Modded-NanoGPT's shard loader: torch.empty(n, pin_memory=True)) make
    # ordinary host tensors, as pin_memory() above returns the tensor itself: with a PrivateUse1 backend registered,
    # PyTorch asks it for a pinned-memory allocator, which the Python backend cannot give
    # (torch.device(...) as a context manager reads the factories once, by identity: it keeps the real ones)
    _torch_device._device_constructors()
    for name in ("empty", "zeros", "ones", "full", "tensor"):
        setattr(torch, name, _unpinned(getattr(torch, name)))


def _unpinned(factory):
    def made(*args, pin_memory=False, **kwargs):
        return factory(*args, **kwargs)

    made.__name__, made.__qualname__, made.__doc__, made.__wrapped__ = (
        factory.__name__, factory.__name__, factory.__doc__, factory)
    return made


def _patch_autocast() -> None:
    autocast_cls = torch.amp.autocast_mode.autocast
    original_init = autocast_cls.__init__

    def __init__(self, device_type, *args, **kwargs):
        if device_type == "npu":
            device_type = "cpu"
        original_init(self, device_type, *args, **kwargs)

    autocast_cls.__init__ = __init__


def _patch_ddp() -> None:
    """DDP(model, device_ids=[local_rank]) as NPU programs write it: under the mapping the module's parameters are
    CPU tensors, for which DDP refuses device_ids; they name the npu the mapping put on the CPU, so they are dropped."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if (device_ids is not None or output_device is not None) and all(
                p.device.type == "cpu" for p in module.parameters()):
            device_ids, output_device = None, None
        original(self, module, device_ids, output_device, *args, **kwargs)

    DistributedDataParallel.__init__ = __init__


def _keep_math_sdpa() -> None:
    """torch.backends.cuda.enable_math_sdp(False) is a CUDA program's choice among its attention kernels (records 8-10
    of Modded-NanoGPT keep only cuDNN's); on the mapped CPU it would leave scaled_dot_product_attention no kernel at
    all. The math kernel stays on, as the emulated device's attention ignores the CUDA backend flags."""
    original = torch._C._set_sdp_use_math

    def _set_sdp_use_math(enabled: bool) -> None:
        original(True)

    torch._C._set_sdp_use_math = _set_sdp_use_math


_lib = None


def _register_host_factories() -> None:
    """PrivateUse1 kernels for the allocations that reach the npu backend although the mode rewrites device
    arguments: where the mode is not on the stack (another thread: torch function modes are thread-local) a factory
    with device="npu" dispatched to the backend, which had no kernel ("Could not run 'aten::empty.memory_format' with
    arguments from the 'npu' backend": the Modded-NanoGPT records' torch.empty(1, device="cuda",
    requires_grad=True).backward(), ported, in the host reference). They allocate on the host, as the mode does;
    the other factories (zeros, ones, full, arange, ...) and .to("npu") are built on these."""
    global _lib
    _lib = torch.library.Library("aten", "IMPL")

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return torch.empty(size, dtype=dtype, layout=layout, device=_CPU,
                           memory_format=memory_format or torch.contiguous_format)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=_CPU)

    _lib.impl("empty.memory_format", empty, "PrivateUse1")
    _lib.impl("empty_strided", empty_strided, "PrivateUse1")


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
    _register_host_factories()
    torch.Tensor.npu = _tensor_npu
    torch.nn.Module.npu = _module_npu
    patch_pin_memory()
    _patch_autocast()
    NpuToCpuMode().__enter__()  # stays on the mode stack for the life of the process
    from ._device_collectives import install as install_collectives

    install_collectives()  # init_process_group("hccl") as a ported torchrun program calls it: gloo underneath
    from ._device_collectives import opaque_to_compile
    from ._device_compile import wrap_compile

    wrap_compile(opaque_to_compile)  # under a program's torch.compile the collectives run whole, as on the npu device
    _patch_ddp()
    _keep_math_sdpa()
    _installed = True
