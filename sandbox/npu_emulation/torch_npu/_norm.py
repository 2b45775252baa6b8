"""RMSNorm family: npu_rms_norm (with backward), npu_rms_norm_backward, npu_add_rms_norm (no backward).

Semantics (reference/npu/semantics.md section 3): rstd = 1/sqrt(mean(x^2) + eps) over the trailing
`gamma.dim()` axes, y = x * rstd * gamma computed in fp32 and rounded once to x's dtype; rstd is fp32
with keepdim ones; dgamma is produced in fp32.
"""

from __future__ import annotations

import torch

from ._no_backward import no_backward
from ._checks import check_float, check_not_empty, check_rank, check_tensor, compute_dtype

_RMS_DTYPE_PAIRS = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),  # emulation only (gradcheck)
}


def _check_gamma(op: str, x: torch.Tensor, gamma: torch.Tensor, x_name: str) -> None:
    check_rank(op, "gamma", gamma, 1, 8)
    if x.dim() < gamma.dim():
        raise ValueError(
            f"{op}: {x_name} has {x.dim()} dims but gamma has {gamma.dim()}; gamma must cover trailing dims"
        )
    if tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(
            f"{op}: gamma shape {tuple(gamma.shape)} must equal the trailing dims of {x_name} "
            f"{tuple(x.shape[x.dim() - gamma.dim():])}"
        )


def _axes(x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def _forward(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=_axes(x, gamma), keepdim=True) + epsilon)
    y = (xf * rstd * gamma.to(cd)).to(x.dtype)
    return y, rstd


def npu_rms_norm_backward(dy, self, gamma, rstd):
    """dx = rstd*g - x*rstd^3*mean(g*x) with g = dy*gamma; dgamma = sum(dy*x*rstd) over leading axes (fp32)."""
    op = "npu_rms_norm_backward"
    for name, t in (("dy", dy), ("self", self), ("gamma", gamma), ("rstd", rstd)):
        check_tensor(op, name, t)
    _check_gamma(op, self, gamma, "self")
    if dy.shape != self.shape:
        raise ValueError(f"{op}: dy shape {tuple(dy.shape)} must equal self shape {tuple(self.shape)}")
    cd = compute_dtype(self.dtype)
    xf, gf, dyf, r = self.to(cd), gamma.to(cd), dy.to(cd), rstd.to(cd)
    axes = _axes(self, gamma)
    g_hat = dyf * gf
    dx = r * g_hat - xf * r.pow(3) * (g_hat * xf).mean(dim=axes, keepdim=True)
    lead = tuple(range(self.dim() - gamma.dim()))
    dgamma = dyf * xf * r
    if lead:
        dgamma = dgamma.sum(dim=lead)
    return dx.to(self.dtype), dgamma


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        y, rstd = _forward(x, gamma, epsilon)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _unused_drstd):
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = npu_rms_norm_backward(dy, x, gamma, rstd)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dgamma.to(gamma.dtype) if ctx.needs_input_grad[1] else None,
            None,
        )


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """RMSNorm over the trailing gamma.dim() axes; returns (y in x's dtype, rstd fp32 keepdim)."""
    op = "npu_rms_norm"
    check_tensor(op, "self", self)
    check_tensor(op, "gamma", gamma)
    check_rank(op, "self", self, 1, 8)
    _check_gamma(op, self, gamma, "self")
    if (self.dtype, gamma.dtype) not in _RMS_DTYPE_PAIRS:
        raise TypeError(
            f"{op}: unsupported dtype pair self={self.dtype}, gamma={gamma.dtype}; allowed: "
            "(fp16, fp32), (bf16, fp32), (fp16, fp16), (bf16, bf16), (fp32, fp32)"
        )
    return _RmsNorm.apply(self, gamma, float(epsilon))


class _AddRmsNormNoBackward(torch.autograd.Function):
    """torch_npu registers no derivative: backward raises or warns by release (see _no_backward)."""

    @staticmethod
    def forward(ctx, x1, x2, gamma, epsilon):
        x = x1 + x2  # formed in the input dtype (rounded), as in the official golden
        y, rstd = _forward(x, gamma, epsilon)
        ctx.mark_non_differentiable(rstd)
        return y, rstd, x

    @staticmethod
    def backward(ctx, *grads):
        return (*no_backward("npu_add_rms_norm", 3), None)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """(y, rstd, x1 + x2) with y = rms_norm(x1 + x2) * gamma.

    Forward-only, as in torch_npu: the real op has no registered backward; backward through it raises
    "derivative for npu::npu_add_rms_norm is not implemented" from release 26.1.0, and warns (no
    gradient to x1, x2, gamma) before (TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE). To train, use
    npu_rms_norm_backward in a custom autograd.Function.
    """
    op = "npu_add_rms_norm"
    for name, t in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        check_tensor(op, name, t)
        check_float(op, name, t)
        check_not_empty(op, name, t)
    check_rank(op, "x1", x1, 1, 8)
    if x2.shape != x1.shape:
        raise ValueError(f"{op}: x2 shape {tuple(x2.shape)} must equal x1 shape {tuple(x1.shape)}")
    if not x1.dtype == x2.dtype == gamma.dtype:
        raise TypeError(
            f"{op}: x1, x2 and gamma must share one dtype (got {x1.dtype}, {x2.dtype}, {gamma.dtype}); "
            "unlike npu_rms_norm, fp32 gamma with half inputs is not allowed"
        )
    _check_gamma(op, x1, gamma, "x1")
    return _AddRmsNormNoBackward.apply(x1, x2, gamma, float(epsilon))
