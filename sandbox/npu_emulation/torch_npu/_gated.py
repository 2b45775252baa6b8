"""Gated activations (reference/npu/semantics.md section 4).

npu_swiglu: out = silu(A) * B, A = FIRST half along `dim`.
npu_geglu: default activate_left=False -> out = A * gelu(B) (the SECOND half is activated);
approximate 0 = erf GELU, 1 (default) = tanh GELU; returns (out, gelu_of_activated_half).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import (
    check_float,
    check_not_empty,
    check_rank,
    check_tensor,
    compute_dtype,
    normalize_dim,
)


def _check_split(op: str, x, dim) -> int:
    check_tensor(op, "self", x)
    check_float(op, "self", x)
    check_rank(op, "self", x, 1, 8)
    check_not_empty(op, "self", x)
    d = normalize_dim(op, dim, x.dim())
    if x.shape[d] % 2:
        raise ValueError(f"{op}: the size of self along dim={dim} ({x.shape[d]}) should be divisible by 2")
    return d


# --- SwiGLU ---------------------------------------------------------------------------------


def npu_swiglu_backward(grad_output, self, dim=-1):
    """Gradient of silu(A) * B: [g*B*s*(1 + A*(1 - s)), g*silu(A)] concatenated along dim."""
    op = "npu_swiglu_backward"
    d = _check_split(op, self, dim)
    cd = compute_dtype(self.dtype)
    a, b = self.to(cd).chunk(2, dim=d)
    g = grad_output.to(cd)
    sig = torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    db = g * a * sig
    return torch.cat((da, db), dim=d).to(self.dtype)


class _SwiGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, d):
        cd = compute_dtype(x.dtype)
        a, b = x.to(cd).chunk(2, dim=d)
        ctx.save_for_backward(x)
        ctx.dim = d
        return (F.silu(a) * b).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return npu_swiglu_backward(g, x, ctx.dim), None


def npu_swiglu(self, dim=-1):
    """SwiGLU: silu(first half) * second half, split along `dim` (size must be even)."""
    d = _check_split("npu_swiglu", self, dim)
    return _SwiGlu.apply(self, d)


# --- GeGLU ----------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: torch.Tensor, approximate: int) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if approximate == 1 else "none")


def _gelu_grad(x: torch.Tensor, approximate: int) -> torch.Tensor:
    if approximate == 1:
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))
        t = torch.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf


def _check_geglu(op: str, self, dim, approximate, activate_left) -> int:
    d = _check_split(op, self, dim)
    if isinstance(approximate, bool) or approximate not in (0, 1):
        raise ValueError(f"{op}: approximate must be 0 (erf GELU) or 1 (tanh GELU), got {approximate!r}")
    if not isinstance(activate_left, bool):
        raise TypeError(f"{op}: activate_left must be a bool, got {type(activate_left).__name__}")
    return d


def npu_geglu_grad(grad_output, self, gelu, dim=-1, approximate=1, activate_left=False):
    """Input gradient of npu_geglu's first output (`gelu` = its second output; recomputed here)."""
    op = "npu_geglu_grad"
    d = _check_geglu(op, self, dim, approximate, activate_left)
    cd = compute_dtype(self.dtype)
    left, right = self.to(cd).chunk(2, dim=d)
    act, gate = (left, right) if activate_left else (right, left)
    g = grad_output.to(cd)
    d_act = g * gate * _gelu_grad(act, approximate)
    d_gate = g * _gelu(act, approximate)
    parts = (d_act, d_gate) if activate_left else (d_gate, d_act)
    return torch.cat(parts, dim=d).to(self.dtype)


class _GeGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, d, approximate, activate_left):
        cd = compute_dtype(x.dtype)
        left, right = x.to(cd).chunk(2, dim=d)
        act, gate = (left, right) if activate_left else (right, left)
        gelu = _gelu(act, approximate)
        ctx.save_for_backward(x)
        ctx.args = (d, approximate, activate_left)
        gelu_out = gelu.to(x.dtype)
        ctx.mark_non_differentiable(gelu_out)
        return (gate * gelu).to(x.dtype), gelu_out

    @staticmethod
    def backward(ctx, g, _unused):
        (x,) = ctx.saved_tensors
        d, approximate, activate_left = ctx.args
        return npu_geglu_grad(g, x, None, d, approximate, activate_left), None, None, None


def npu_geglu(self, dim=-1, approximate=1, activate_left=False):
    """GeGLU: (out, gelu_out). activate_left=False (default) activates the SECOND half: out = A * gelu(B)."""
    d = _check_geglu("npu_geglu", self, dim, approximate, activate_left)
    return _GeGlu.apply(self, d, approximate, activate_left)
