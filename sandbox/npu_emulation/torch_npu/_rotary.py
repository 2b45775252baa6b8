"""npu_rotary_mul and its backward (reference/npu/semantics.md section 2).

out = x * r1 + R(x) * r2 with R the 'half' (rotate_half) or 'interleave' (pairwise) rotation, or
x @ rotate when a [D, D] `rotate` matrix is given. The registered backward ignores `rotate` and uses
the standard rotation of `rotary_mode` (a documented torch_npu pitfall, reproduced here).
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_tensor, compute_dtype, sum_to_shape

_MODES = ("half", "interleave")


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate_transposed(g: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        a, b = g.chunk(2, dim=-1)
        return torch.cat((b, -a), dim=-1)
    return torch.stack((g[..., 1::2], -g[..., 0::2]), dim=-1).flatten(-2)


def _check(op: str, x, r1, r2, rotary_mode) -> None:
    for name, t in (("self", x), ("r1", r1), ("r2", r2)):
        check_tensor(op, name, t)
        check_float(op, name, t)
    if rotary_mode not in _MODES:
        # TORCH_CHECK in op-plugin's get_rotary_mode: RuntimeError, this text
        raise RuntimeError(f"The rotary_mode of {op} should be half or interleave, but got {rotary_mode}")
    if x.dim() not in (3, 4):
        raise ValueError(
            f"{op}: self must be 4-D (BNSD, BSND, SBND) or 3-D (TND), got {x.dim()}-D shape {tuple(x.shape)}"
        )
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"{op}: the last dim of self (head dim D={d}) must be even")
    if r1.shape != r2.shape:
        raise ValueError(f"{op}: r1 shape {tuple(r1.shape)} and r2 shape {tuple(r2.shape)} must be equal")
    if r1.dim() != x.dim():
        raise ValueError(f"{op}: r1/r2 must have the rank of self ({x.dim()}), got shape {tuple(r1.shape)}")
    if r1.shape[-1] != d:
        raise ValueError(f"{op}: the last dim of r1/r2 ({r1.shape[-1]}) must equal the head dim of self ({d})")
    for i, (n, m) in enumerate(zip(r1.shape, x.shape)):
        if n not in (1, m):
            raise ValueError(
                f"{op}: r1/r2 shape {tuple(r1.shape)} does not broadcast to self shape {tuple(x.shape)} (dim {i})"
            )
    if rotary_mode == "interleave" and sum(1 for n in r1.shape[:-1] if n != 1) > 1:
        raise ValueError(
            f"{op}: in 'interleave' mode r1/r2 must be fully broadcast (11SD, 1S1D, S11D or T1D), "
            f"got shape {tuple(r1.shape)}"
        )


class _RotaryMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r1, r2, rotary_mode, rotate):
        cd = compute_dtype(x.dtype)
        xf, c, s = x.to(cd), r1.to(x.dtype).to(cd), r2.to(x.dtype).to(cd)
        rotated = xf @ rotate.to(x.dtype).to(cd) if rotate is not None else _rotate(xf, rotary_mode)
        ctx.save_for_backward(x, r1, r2)
        ctx.rotary_mode = rotary_mode
        return (xf * c + rotated * s).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, r1, r2 = ctx.saved_tensors
        dx, dr1, dr2 = npu_rotary_mul_backward(dy, x, r1, r2, ctx.rotary_mode)
        needs = ctx.needs_input_grad
        return (
            dx if needs[0] else None,
            dr1.to(r1.dtype) if needs[1] else None,
            dr2.to(r2.dtype) if needs[2] else None,
            None,
            None,
        )


def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode="half"):
    """(dx, dr1, dr2): dx = r1*g + R^T(r2*g); dr1 = sum(x*g), dr2 = sum(R(x)*g) over broadcast axes."""
    op = "npu_rotary_mul_backward"
    _check(op, self, r1, r2, rotary_mode)
    cd = compute_dtype(self.dtype)
    g, xf = grad.to(cd), self.to(cd)
    c, s = r1.to(self.dtype).to(cd), r2.to(self.dtype).to(cd)
    dx = c * g + _rotate_transposed(s * g, rotary_mode)
    dr1 = sum_to_shape(xf * g, r1.shape)
    dr2 = sum_to_shape(_rotate(xf, rotary_mode) * g, r2.shape)
    return dx.to(self.dtype), dr1.to(self.dtype), dr2.to(self.dtype)


def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    """Rotary embedding: self * r1 + rotate(self) * r2 (r1 = cos table, r2 = sin table)."""
    op = "npu_rotary_mul"
    _check(op, self, r1, r2, rotary_mode)
    if rotate is not None:
        check_tensor(op, "rotate", rotate)
        d = self.shape[-1]
        if tuple(rotate.shape) != (d, d):
            raise ValueError(f"{op}: rotate must be a [{d}, {d}] matrix, got shape {tuple(rotate.shape)}")
    return _RotaryMul.apply(self, r1, r2, rotary_mode, rotate)
