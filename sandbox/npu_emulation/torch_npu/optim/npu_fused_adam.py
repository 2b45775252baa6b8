"""NpuFusedAdam (semantics.md 6.4): torch.optim.Adam's math (L2 weight decay added to the gradient)."""

from __future__ import annotations

import math

import torch

from .npu_fused_optim_base import NpuFusedOptimizerBase, _Flat, check_common


class NpuFusedAdam(NpuFusedOptimizerBase):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False):
        check_common(lr, eps, weight_decay, betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    def _state_names_for(self, group) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _flat_step(self, flat: _Flat, group) -> None:
        beta1, beta2 = group["betas"]
        g = flat.grad.add(flat.param, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else flat.grad
        exp_avg, exp_avg_sq = flat.states["exp_avg"], flat.states["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        second = exp_avg_sq
        if group["amsgrad"]:
            torch.maximum(flat.states["max_exp_avg_sq"], exp_avg_sq, out=flat.states["max_exp_avg_sq"])
            second = flat.states["max_exp_avg_sq"]
        denom = (second.sqrt() / math.sqrt(1 - beta2**flat.step)).add_(group["eps"])
        flat.param.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**flat.step))
