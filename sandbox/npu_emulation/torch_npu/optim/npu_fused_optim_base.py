"""NpuFusedOptimizerBase: torch_npu's combined-tensor mechanism (reference/npu/semantics.md 6.2-6.3).

The combined-tensor mechanism is reproduced: at the first trigger (step(), zero_grad() once grads exist, clip_grad_norm_fused_())
every parameter that has a grad is grouped by dtype, copied into one flat buffer and re-pointed into
it (p.data and p.grad become views); moments live in flat buffers too. So the torch_npu hazards
behave as on the NPU: bf16 parameters raise TypeError; zero_grad(set_to_none=True) raises
ValueError; model.zero_grad() (grads set to None) after the first step trains on stale gradients;
re-allocating parameters or load_state_dict() after the first step is silently ignored; a
parameter that first gets a grad after combination fails with KeyError: 'step'.
"""

from __future__ import annotations

import math

import torch
from torch.optim.optimizer import Optimizer

from .._device_backend import rebind

_FUSED_DTYPES = (torch.float32, torch.float16)


class _Flat:
    """One (param group, dtype) bucket: flat buffers, the member params and their offsets."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.sizes = [p.numel() for p in params]
        dtype = params[0].dtype
        total = sum(self.sizes)
        self.param = torch.zeros(total, dtype=dtype, device=params[0].device)
        self.grad = torch.zeros(total, dtype=dtype, device=params[0].device)
        self.states: dict[str, torch.Tensor] = {}
        self.step = 0
        self.combined = False
        self.fresh = True
        for p, view in zip(params, self.views(self.param)):
            view.copy_(p.detach())
            rebind(p, view)
        for p, view in zip(params, self.views(self.grad)):
            view.copy_(p.grad.detach())
            p.grad = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, pos = [], 0
        for p, n in zip(self.params, self.sizes):
            out.append(flat[pos:pos + n].view_as(p))
            pos += n
        return out


def check_common(lr, eps=0.0, weight_decay=0.0, betas=None) -> None:
    """torch_npu's ValueError checks (same texts as torch.optim)."""
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class NpuFusedOptimizerBase(Optimizer):
    """Subclasses define `_state_names_for(group)` and `_flat_step(flat, group)` (one in-place update of a
    (group, dtype) bucket; flat.step is already advanced, flat.fresh is True on the first update of
    states that were created zero rather than loaded)."""

    def _state_names_for(self, group) -> tuple[str, ...]:
        return ()

    def _flat_step(self, flat: "_Flat", group) -> None:
        raise NotImplementedError

    def __init__(self, params, default):
        super().__init__(params, default)
        self._flats: list[list[_Flat]] | None = None  # per param group
        self._combined_ids: set[int] = set()

    # --- combination ----------------------------------------------------------------------
    def _combine_params_and_grads(self) -> None:
        if self._flats is not None:
            return
        flats: list[list[_Flat]] = []
        for group in self.param_groups:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in _FUSED_DTYPES:
                    raise TypeError("Fused optimizer's parameters must be either float32 or float16")
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if not p.is_contiguous():
                    raise RuntimeError("Tensors to combine must be contiguous.")
                by_dtype.setdefault(p.dtype, []).append(p)
            flats.append([_Flat(ps) for ps in by_dtype.values()])
        self._flats = flats
        self._combined_ids = {id(p) for group in flats for f in group for p in f.params}

    def _combine_states(self, flat: _Flat, names: tuple[str, ...]) -> None:
        if flat.combined:
            return
        flat.combined = True
        first = self.state.get(flat.params[0], {})
        flat.step = int(first.get("step", 0))
        flat.fresh = not any(n in first for n in names)
        for name in names:
            buf = torch.zeros_like(flat.param)
            for p, view in zip(flat.params, flat.views(buf)):
                old = self.state.get(p, {}).get(name)
                if old is not None:  # state loaded before the first step is kept
                    view.copy_(old)
            flat.states[name] = buf
        for p, *views in zip(flat.params, *(flat.views(flat.states[n]) for n in names)):
            state = self.state[p]
            state["step"] = flat.step
            for n, v in zip(names, views):
                state[n] = v

    def _check_new_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in self._combined_ids:
                    raise KeyError(
                        "step (a parameter got its first gradient after the fused optimizer combined its buffers; "
                        "torch_npu fails here too: give every trainable parameter a grad before the first step)"
                    )

    # --- public API -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._combine_params_and_grads()
        self._check_new_grads()
        for group, flats in zip(self.param_groups, self._flats):
            for flat in flats:
                self._combine_states(flat, self._state_names_for(group))
                flat.step += 1
                for p in flat.params:
                    self.state[p]["step"] = flat.step
                self._flat_step(flat, group)
                flat.fresh = False
        return loss

    def zero_grad(self, set_to_none: bool = False) -> None:
        if set_to_none:
            raise ValueError(
                f"{type(self).__name__} does not support zero_grad(set_to_none=True): its gradients live in a "
                "combined buffer; call optimizer.zero_grad() (and never model.zero_grad())"
            )
        if self._flats is None and any(p.grad is not None for g in self.param_groups for p in g["params"]):
            self._combine_params_and_grads()
        if self._flats is None:
            return
        for group in self._flats:
            for flat in group:
                flat.grad.zero_()

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    @torch.no_grad()
    def clip_grad_norm_fused_(self, max_norm, norm_type=2):
        self._combine_params_and_grads()
        grads = [flat.grad.float() for group in self._flats for flat in group]
        norm_type = float(norm_type)
        if not grads:
            return torch.tensor(0.0, device=self._device())
        if math.isinf(norm_type):
            total = torch.stack([g.abs().max() for g in grads]).max()
        else:
            total = torch.stack([g.abs().pow(norm_type).sum() for g in grads]).sum().pow(1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1:
            for group in self._flats:
                for flat in group:
                    flat.grad.mul_(coef)
        return total


