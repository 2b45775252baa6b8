"""NpuFusedRMSprop: torch.optim.RMSprop's math on combined buffers (centered and momentum variants)."""

from __future__ import annotations

from .npu_fused_optim_base import NpuFusedOptimizerBase, _Flat, check_common


class NpuFusedRMSprop(NpuFusedOptimizerBase):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False):
        check_common(lr, eps, weight_decay)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if alpha < 0.0:
            raise ValueError(f"Invalid alpha value: {alpha}")
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered,
                                      weight_decay=weight_decay))

    def _state_names_for(self, group) -> tuple[str, ...]:
        names = ("square_avg",)
        if group["momentum"] > 0:
            names += ("momentum_buffer",)
        if group["centered"]:
            names += ("grad_avg",)
        return names

    def _flat_step(self, flat: _Flat, group) -> None:
        alpha, eps = group["alpha"], group["eps"]
        g = flat.grad.add(flat.param, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else flat.grad
        square_avg = flat.states["square_avg"]
        square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
        if group["centered"]:
            grad_avg = flat.states["grad_avg"]
            grad_avg.mul_(alpha).add_(g, alpha=1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_().add_(eps)
        else:
            avg = square_avg.sqrt().add_(eps)
        if group["momentum"] > 0:
            buf = flat.states["momentum_buffer"]
            buf.mul_(group["momentum"]).addcdiv_(g, avg)
            flat.param.add_(buf, alpha=-group["lr"])
        else:
            flat.param.addcdiv_(g, avg, value=-group["lr"])
