"""npu_scaled_masked_softmax and its backward (reference/npu/semantics.md 7.2).

y = softmax(masked_fill(scale * x, mask, -10000), dim=-1), mask True = masked, in fp32, returned in
x's dtype (the current binding; old kernels returned fp16). Backward: dx = scale * y * (dy - sum(dy * y)),
zero where masked. x: 4-D with the last two dims in [32, 4096] and multiples of 32; mask: bool 4-D,
same last two dims, broadcastable on the first two; fixed_triu_mask must be False.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_tensor, compute_dtype

OP = "npu_scaled_masked_softmax"
_FILL = -10000.0


def _check(op: str, x, mask, fixed_triu_mask) -> None:
    check_tensor(op, "x", x)
    check_float(op, "x", x)
    check_tensor(op, "mask", mask)
    if x.dim() != 4:
        raise RuntimeError(f"{op}: x must be 4-D, got shape {tuple(x.shape)}")
    for n in x.shape[-2:]:
        if not (32 <= n <= 4096 and n % 32 == 0):
            raise RuntimeError(
                f"{op}: the last two dims of x must lie in [32, 4096] and be multiples of 32, got {tuple(x.shape)}"
            )
    if mask.dtype != torch.bool:
        raise RuntimeError(f"{op}: mask must be a bool tensor, got {mask.dtype}")
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != tuple(x.shape[-2:]):
        raise RuntimeError(f"{op}: mask shape {tuple(mask.shape)} must be 4-D with x's last two dims {tuple(x.shape)}")
    for i in (0, 1):
        if mask.shape[i] not in (1, x.shape[i]):
            raise RuntimeError(f"{op}: mask shape {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}")
    if fixed_triu_mask:
        raise RuntimeError(f"{op}: fixed_triu_mask=True is reserved and not supported")


def _forward(x, mask, scale):
    cd = compute_dtype(x.dtype)
    return torch.softmax((x.to(cd) * scale).masked_fill(mask, _FILL), dim=-1)


def npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask):
    op = "npu_scaled_masked_softmax_backward"
    check_tensor(op, "y_grad", y_grad)
    check_tensor(op, "y", y)
    check_tensor(op, "mask", mask)
    cd = compute_dtype(y.dtype)
    yf, g = y.to(cd), y_grad.to(cd)
    dx = float(scale) * yf * (g - (g * yf).sum(dim=-1, keepdim=True))
    return dx.masked_fill(mask, 0.0).to(y_grad.dtype)


class _ScaledMaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale):
        y32 = _forward(x, mask, scale)
        ctx.save_for_backward(y32, mask)
        ctx.scale = scale
        return y32.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        y32, mask = ctx.saved_tensors
        return npu_scaled_masked_softmax_backward(g, y32, mask, ctx.scale, False), None, None


def npu_scaled_masked_softmax(x, mask, scale=1, fixed_triu_mask=False):
    """softmax(masked_fill(scale * x, mask, -10000)) over the last dim; mask True = excluded."""
    _check(OP, x, mask, fixed_triu_mask)
    return _ScaledMaskedSoftmax.apply(x, mask, float(scale))
