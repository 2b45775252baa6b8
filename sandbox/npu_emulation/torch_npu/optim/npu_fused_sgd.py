"""NpuFusedSGD (semantics.md 6.4): torch.optim.SGD's math on combined buffers.

g <- g + wd p; the momentum buffer is set to that g on its first update (unless a state was loaded
before the first step) and then buf <- mu buf + (1 - dampening) g; nesterov uses g + mu buf.
"""

from __future__ import annotations

from torch.optim.optimizer import required

from .npu_fused_optim_base import NpuFusedOptimizerBase, _Flat


class NpuFusedSGD(NpuFusedOptimizerBase):
    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0.0 or abs(dampening) > 1e-15):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    def _state_names_for(self, group) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _flat_step(self, flat: _Flat, group) -> None:
        wd, mu, damp = group["weight_decay"], group["momentum"], group["dampening"]
        g = flat.grad.add(flat.param, alpha=wd) if wd != 0 else flat.grad
        if mu != 0:
            buf = flat.states["momentum_buffer"]
            if flat.fresh:
                buf.copy_(g)
            else:
                buf.mul_(mu).add_(g, alpha=1 - damp)
            g = g.add(buf, alpha=mu) if group["nesterov"] else buf
        flat.param.add_(g, alpha=-group["lr"])
