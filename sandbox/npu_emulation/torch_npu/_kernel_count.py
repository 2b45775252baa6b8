"""NPU kernels launched, counted on the emulated device (issue 25, item 4: the paper's own measure).

Without an NPU, speed is unmeasured, but how many device kernels a training step launches is
countable: every ATen op that reaches the emulated device (`NpuTensor.__torch_dispatch__`, below
autograd, so forward, backward and the optimizer all count) is one kernel launch, as an eager
torch_npu program launches one aclnn kernel per ATen op, except
- views and other metadata-only ops (`OpOverload.is_view`: view, transpose, expand, slice, ...,
  detach, alias): no kernel runs on a device for them;
- host <-> device copies (`.npu()`, `.cpu()`, `.item()`'s read of the value): memory copies, not kernels;
- the work inside a fused torch_npu API: `npu_rms_norm`, `npu_fusion_attention`, ... run here as
  several host ops but are one kernel on an NPU, so each call counts once, and so does the backward of
  its autograd function (`count_fused`: a call made inside another fused call is not counted again).
A fused optimizer's step is counted op by op: it works on combined buffers (torch_npu.optim), so it
launches few ops, as the real one does.

`launched()` is the running total of this process (`torch_npu.__trainbridge_kernels_launched__`);
the harness reads it at each step's boundaries. The child reports its own count: it is a figure for
the report, never part of a gate's decision.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import torch

_aten = torch.ops.aten
# ops that launch no kernel beyond the views `is_view` names
_METADATA = {
    _aten._local_scalar_dense.default,  # `.item()`: a device-to-host read of one value
    _aten.lift_fresh.default, _aten.set_.source_Tensor, _aten.record_stream.default, _aten.resize_.default,
    _aten._unsafe_view.default, _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
}

_total = 0
_local = threading.local()
# set by _device_compile once a program compiles: (fn, args, kwargs) -> the outputs a tracer gets for a fused call on
# its fake tensors, or NOT_TRACED for a call on real tensors
trace_call = None
NOT_TRACED = object()


def launched() -> int:
    """Kernels launched on the emulated device by this process so far."""
    return _total


def dispatched(func, crosses_host: bool) -> None:
    """One ATen op reached the device (called by NpuTensor.__torch_dispatch__)."""
    global _total
    if crosses_host or getattr(_local, "depth", 0) or func.is_view or func in _METADATA:
        return
    _total += 1


class _Fused:
    """Inside a fused API: one kernel for the whole call, none for the ops it is made of."""

    def __enter__(self):
        global _total
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            _total += 1
        _local.depth = depth + 1

    def __exit__(self, *exc):
        _local.depth -= 1
        return False


def count_fused(fn):
    """`fn` as one kernel launch per call."""
    if getattr(fn, "__trainbridge_fused__", False):
        return fn

    @functools.wraps(fn)
    def fused(*args, **kwargs):
        if trace_call is not None:
            out = trace_call(fn, args, kwargs)
            if out is not NOT_TRACED:
                return out
        with _Fused():
            return fn(*args, **kwargs)

    fused.__trainbridge_fused__ = True
    return fused


def install(package) -> None:
    """Count each fused API of `package` (torch_npu: its `npu_*` functions and the other fused names it
    exports) once per call, and each backward of the autograd functions they are built on once: the
    package's exported functions are replaced by counting wrappers (a program that imported a name
    before this ran keeps the uncounted one: the harness imports torch_npu first)."""
    for name in getattr(package, "__all__", ()):
        value = getattr(package, name, None)
        if inspect.isfunction(value) and value.__module__.startswith(package.__name__ + "."):
            setattr(package, name, count_fused(value))
    prefix = package.__name__ + "."
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            if inspect.isclass(value) and issubclass(value, torch.autograd.Function) and value.__module__ == module_name \
                    and "backward" in vars(value):
                value.backward = staticmethod(count_fused(vars(value)["backward"].__func__
                                                          if isinstance(vars(value)["backward"], staticmethod)
                                                          else vars(value)["backward"]))
