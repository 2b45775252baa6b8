"""npu_cross_entropy_loss and its backward (reference/npu/semantics.md 7.1; golden of op-plugin's
test/test_custom_ops/test_npu_cross_entropy_loss.py).

log_prob = x - logsumexp(x) in fp32 (returned in x's dtype); l_n = -w[y_n] log_prob[n, y_n], zeroed
where y_n == ignore_index only when ignore_index >= 0 (a negative ignore_index ignores nothing,
unlike PyTorch); label smoothing (1-e) loss + e/C * smooth with smooth_n = -sum_c w_c log_prob[n, c];
'mean' divides by sum of w[y_n] over kept rows. The loss has shape [1] for 'mean'/'sum' (not 0-d),
[N] for 'none'. zloss outputs are not supported (zeros of the meta shapes). Targets must lie in
[0, C): PyTorch's -100 padding is invalid here and raises. Backward (registered, loss only): with
input requiring grad, 'sum'/'none' need label_smoothing=0 and 'mean' needs every optional argument
at its default (the doc's constraint; the emulation raises where it is broken).
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_tensor

OP = "npu_cross_entropy_loss"
_REDUCTIONS = ("mean", "sum", "none")


def _check(x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale_for_zloss, return_zloss):
    check_tensor(OP, "input", x)
    check_float(OP, "input", x)
    check_tensor(OP, "target", target)
    if x.dim() != 2:
        raise RuntimeError(f"{OP}: input must be 2-D [N, C], got shape {tuple(x.shape)}")
    n, c = x.shape
    if target.dtype != torch.int64 or tuple(target.shape) != (n,):
        raise RuntimeError(f"{OP}: target must be int64 of shape [{n}], got {target.dtype} {tuple(target.shape)}")
    if n and (int(target.min()) < 0 or int(target.max()) >= c):
        raise RuntimeError(
            f"{OP}: target values must lie in [0, {c}), got min {int(target.min())}, max {int(target.max())}; "
            "PyTorch-style -100 padding is invalid here (a negative ignore_index ignores nothing): "
            "pass the padding class as a non-negative ignore_index"
        )
    if weight is not None:
        check_tensor(OP, "weight", weight)
        if weight.dtype != torch.float32 or tuple(weight.shape) != (c,):
            raise RuntimeError(f"{OP}: weight must be float32 of shape [{c}], got {weight.dtype} {tuple(weight.shape)}")
    if reduction not in _REDUCTIONS:
        raise RuntimeError(f"{OP}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if return_zloss or lse_square_scale_for_zloss != 0.0:
        raise RuntimeError(f"{OP}: zloss (return_zloss, lse_square_scale_for_zloss) is not supported yet")
    if x.requires_grad and torch.is_grad_enabled():
        if reduction != "mean" and label_smoothing != 0.0:
            raise RuntimeError(f"{OP}: backward with reduction={reduction!r} requires label_smoothing=0")
        if reduction == "mean" and (weight is not None or ignore_index != -100 or label_smoothing != 0.0):
            raise RuntimeError(
                f"{OP}: backward with reduction='mean' requires weight=None, ignore_index=-100 and "
                "label_smoothing=0 (the documented constraint of the fused kernel)"
            )


def _parts(log_prob32, target, weight, ignore_index):
    n, c = log_prob32.shape
    w = weight if weight is not None else torch.ones(c, dtype=torch.float32, device=log_prob32.device)
    w_y = w.gather(0, target)
    keep = (target != ignore_index).float() if ignore_index >= 0 else torch.ones(n, device=log_prob32.device)
    return w, w_y, keep


def _loss(log_prob32, target, weight, reduction, ignore_index, label_smoothing):
    c = log_prob32.shape[1]
    w, w_y, keep = _parts(log_prob32, target, weight, ignore_index)
    nll = -log_prob32.gather(1, target.view(-1, 1)).view(-1) * w_y * keep
    smooth = -(log_prob32 * w.unsqueeze(0)).sum(-1) * keep
    if reduction == "none":
        return (1 - label_smoothing) * nll + label_smoothing / c * smooth
    if reduction == "sum":
        return ((1 - label_smoothing) * nll.sum() + label_smoothing / c * smooth.sum()).reshape(1)
    denom = (w_y * keep).sum()
    return ((1 - label_smoothing) * nll.sum() / denom + label_smoothing / c * smooth.sum() / denom).reshape(1)


def npu_cross_entropy_loss_backward(grad_loss, log_prob, target, weight=None, grad_zloss=None, lse_for_zloss=None,
                                    reduction="mean", ignore_index=-100, label_smoothing=0.0,
                                    lse_square_scale_for_zloss=0.0):
    """d loss / d input from the saved log_prob: w (softmax - onehot-or-smoothed), scaled by the reduction."""
    lp = log_prob.float()
    n, c = lp.shape
    w, w_y, keep = _parts(lp, target, weight, ignore_index)
    g = grad_loss.float().reshape(-1)
    if reduction == "none":
        row = g * keep
    else:
        row = g.expand(n) * keep
        if reduction == "mean":
            row = row / (w_y * keep).sum()
    prob = lp.exp()
    onehot = torch.zeros_like(lp).scatter_(1, target.view(-1, 1), 1.0)
    d_nll = (prob * w_y.unsqueeze(1) - onehot * w_y.unsqueeze(1))
    d_smooth = prob * w.sum() - w.unsqueeze(0)
    dx = (1 - label_smoothing) * d_nll + label_smoothing / c * d_smooth
    return (dx * row.unsqueeze(1)).to(log_prob.dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, reduction, ignore_index, label_smoothing):
        lp32 = torch.log_softmax(x.float(), dim=-1)
        loss = _loss(lp32, target, weight, reduction, ignore_index, label_smoothing).to(x.dtype)
        log_prob = lp32.to(x.dtype)
        ctx.save_for_backward(lp32, target, weight)
        ctx.args = (reduction, ignore_index, label_smoothing)
        ctx.mark_non_differentiable(log_prob)
        return loss, log_prob

    @staticmethod
    def backward(ctx, g_loss, _g_log_prob):
        lp32, target, weight = ctx.saved_tensors
        reduction, ignore_index, label_smoothing = ctx.args
        dx = npu_cross_entropy_loss_backward(g_loss, lp32, target, weight, reduction=reduction,
                                             ignore_index=ignore_index, label_smoothing=label_smoothing)
        return dx.to(g_loss.dtype), None, None, None, None, None


def npu_cross_entropy_loss(input, target, weight=None, reduction='mean', ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    """(loss, log_prob, zloss, lse_for_zloss); loss is [1] for 'mean'/'sum'. Take [0] for the loss."""
    _check(input, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale_for_zloss, return_zloss)
    loss, log_prob = _CrossEntropy.apply(input, target, weight, reduction, int(ignore_index), float(label_smoothing))
    zloss = torch.zeros(loss.shape, dtype=input.dtype, device=input.device)
    lse = torch.zeros(input.shape[0], dtype=torch.float32, device=input.device)
    return loss, log_prob, zloss, lse
