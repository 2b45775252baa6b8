"""torch_npu.npu.amp stand-in: autocast and GradScaler for the emulated device.

With the real device type (TRAINBRIDGE_NPU_EMULATION_DEVICE=backend) they are torch's own for device
"npu" (autocast kernels in torch_npu._device_autocast); with the npu -> cpu mapping, CPU autocast
and a CPU GradScaler (tensors live on the CPU there).
"""

from __future__ import annotations

import torch


def _device_type() -> str:
    from .._device_mode import DEVICE_MODE

    return "npu" if DEVICE_MODE == "backend" else "cpu"


class autocast(torch.autocast):
    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        super().__init__(_device_type(), dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, dynamic=True, **kwargs):
        super().__init__(_device_type(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._dynamic = dynamic

    def update(self, new_scale=None):
        """torch_npu's dynamic=False: a static loss scale (never grows or backs off; inf steps still skipped)."""
        if self._dynamic or new_scale is not None or not self._enabled:
            return super().update(new_scale)
        self._per_optimizer_states.clear()
