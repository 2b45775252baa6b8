"""Which emulated device a process gets: a real `npu` device type, or the npu -> cpu mapping.

TRAINBRIDGE_NPU_EMULATION_DEVICE (read once, at `import torch_npu`):
- "backend" (default): tensors on device npu:N through PyTorch's Python backend hook
  (_device_backend): transfers copy, mixed host/device ops raise the NPU's error, autograd,
  optimizers, autocast("npu") and DDP work;
- "map": the npu device is mapped onto the CPU (_device_map): tensors report device cpu, `.npu()`
  returns the tensor itself; kept as the fallback for programs the backend cannot run.
`DEVICE_MODE` / `device_description()` say which one is in use (the harness reports it).
"""

from __future__ import annotations

import os

ENV = "TRAINBRIDGE_NPU_EMULATION_DEVICE"
MODES = ("backend", "map")
DEFAULT = "backend"
DEVICE_MODE: str | None = None

_DESCRIPTIONS = {
    "backend": "a real npu device type via PyTorch's PrivateUse1 Python backend (transfers copy, mixed devices raise)",
    "map": "npu mapped onto the CPU (tensors report device cpu; .npu() aliases)",
}


def requested_mode() -> str:
    raw = os.environ.get(ENV, DEFAULT).strip().lower()
    if raw not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {raw!r}")
    return raw


def device_description() -> str:
    return _DESCRIPTIONS.get(DEVICE_MODE or "", "no device registered (op math only)")


def install(npu_module) -> str:
    global DEVICE_MODE
    mode = requested_mode()
    if mode == "backend":
        from ._device_backend import install as install_backend

        install_backend(npu_module)
    else:
        from ._device_map import install as install_map

        install_map(npu_module)
    DEVICE_MODE = mode
    return mode
