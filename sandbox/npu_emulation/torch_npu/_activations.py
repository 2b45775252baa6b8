"""GELU variants (reference/npu/semantics.md 7.3): npu_gelu / npu_gelu_backward, fast_gelu / npu_fast_gelu.

npu_gelu(x, approximate='none'|'tanh') is F.gelu with that mode (its golden in op-plugin's
test_npu_gelu.py is F.gelu; the backward golden is aten.gelu_backward).
fast_gelu(x) = x * sigmoid(1.702 x) (the "quick GELU"), with the registered backward
sigmoid(1.702x) + 1.702 x sigmoid(1.702x)(1 - sigmoid(1.702x)). Computed in fp32, rounded to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_float, check_tensor, compute_dtype

_FAST = 1.702
_MODES = ("none", "tanh")


def _check_mode(op: str, approximate) -> None:
    if approximate not in _MODES:
        raise RuntimeError(f"{op}: approximate argument must be either none or tanh, got {approximate!r}")


def npu_gelu_backward(grad_output, self, *, approximate="none"):
    op = "npu_gelu_backward"
    check_tensor(op, "grad_output", grad_output)
    check_tensor(op, "self", self)
    _check_mode(op, approximate)
    cd = compute_dtype(self.dtype)
    return torch.ops.aten.gelu_backward(grad_output.to(cd), self.to(cd), approximate=approximate).to(self.dtype)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        cd = compute_dtype(x.dtype)
        return F.gelu(x.to(cd), approximate=approximate).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return npu_gelu_backward(g, x, approximate=ctx.approximate), None


def npu_gelu(self, *, approximate="none"):
    """GELU with an explicit mode (unlike F.gelu on the NPU, which uses tanh whatever `approximate` says)."""
    op = "npu_gelu"
    check_tensor(op, "self", self)
    check_float(op, "self", self)
    _check_mode(op, approximate)
    return _Gelu.apply(self, approximate)


def npu_fast_gelu_backward(grad, self):
    op = "npu_fast_gelu_backward"
    check_tensor(op, "grad", grad)
    check_tensor(op, "self", self)
    cd = compute_dtype(self.dtype)
    x, g = self.to(cd), grad.to(cd)
    s = torch.sigmoid(_FAST * x)
    return (g * (s + _FAST * x * s * (1 - s))).to(self.dtype)


class _FastGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        cd = compute_dtype(x.dtype)
        xf = x.to(cd)
        return (xf * torch.sigmoid(_FAST * xf)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return npu_fast_gelu_backward(g, x)


def npu_fast_gelu(self):
    """x * sigmoid(1.702 x): exact for CLIP's QuickGELU, NOT a drop-in for F.gelu (max diff ~0.02)."""
    op = "npu_fast_gelu"
    check_tensor(op, "self", self)
    check_float(op, "self", self)
    return _FastGelu.apply(self)


def fast_gelu(self):
    """Same op as npu_fast_gelu (torch_npu exposes both names)."""
    op = "fast_gelu"
    check_tensor(op, "self", self)
    check_float(op, "self", self)
    return _FastGelu.apply(self)
