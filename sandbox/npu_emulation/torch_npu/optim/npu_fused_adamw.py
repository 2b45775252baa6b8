"""NpuFusedAdamW (reference/npu/semantics.md 6.1): torch.optim.AdamW's single-tensor math on combined buffers."""

from __future__ import annotations

import math

import torch

from .npu_fused_optim_base import NpuFusedOptimizerBase, _Flat


class NpuFusedAdamW(NpuFusedOptimizerBase):
    """torch_npu.optim.NpuFusedAdamW: AdamW with decoupled weight decay over combined flat buffers."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(params, defaults)

    def _state_names_for(self, group) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _flat_step(self, flat: _Flat, group) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        param, grad = flat.param, flat.grad
        exp_avg, exp_avg_sq = flat.states["exp_avg"], flat.states["exp_avg_sq"]
        param.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**flat.step
        bias_correction2_sqrt = math.sqrt(1 - beta2**flat.step)
        second = exp_avg_sq
        if group["amsgrad"]:
            torch.maximum(flat.states["max_exp_avg_sq"], exp_avg_sq, out=flat.states["max_exp_avg_sq"])
            second = flat.states["max_exp_avg_sq"]
        denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
