"""NpuFusedAdadelta: torch.optim.Adadelta's math on combined buffers."""

from __future__ import annotations

from .npu_fused_optim_base import NpuFusedOptimizerBase, _Flat, check_common


class NpuFusedAdadelta(NpuFusedOptimizerBase):
    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0):
        check_common(lr, eps, weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay))

    def _state_names_for(self, group) -> tuple[str, ...]:
        return ("square_avg", "acc_delta")

    def _flat_step(self, flat: _Flat, group) -> None:
        rho, eps = group["rho"], group["eps"]
        g = flat.grad.add(flat.param, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else flat.grad
        square_avg, acc_delta = flat.states["square_avg"], flat.states["acc_delta"]
        square_avg.mul_(rho).addcmul_(g, g, value=1 - rho)
        delta = acc_delta.add(eps).sqrt_().div_(square_avg.add(eps).sqrt_()).mul_(g)
        flat.param.add_(delta, alpha=-group["lr"])
        acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
