"""The emulated NPU's device count and current device (shared by torch_npu.npu and the fused ops)."""

from __future__ import annotations

import os
from typing import Any

import torch

_current = 0


def current_index() -> int:
    return _current


def set_current(index: int) -> None:
    global _current
    _current = index


def device_count() -> int:
    raw = os.environ.get("TRAINBRIDGE_EMULATED_NPU_COUNT", "1")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"TRAINBRIDGE_EMULATED_NPU_COUNT must be a positive int, got {raw!r}") from None
    if count < 1:
        raise ValueError(f"TRAINBRIDGE_EMULATED_NPU_COUNT must be a positive int, got {raw!r}")
    return count


def _index(device: Any = None) -> int:
    if device is None:
        return _current
    if isinstance(device, str):
        kind, _, num = device.partition(":")
        if kind != "npu" or (num and not num.isdigit()):
            raise ValueError(f"expected an npu device such as 'npu' or 'npu:0', got {device!r}")
        index = int(num) if num else _current
    elif isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"expected an npu device, got {device}")
        index = _current if device.index is None else device.index
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        raise TypeError(f"expected an npu device (int, 'npu:N' or torch.device), got {device!r}")
    if not 0 <= index < device_count():
        raise RuntimeError(f"Invalid device ordinal {index}: the emulated NPU has {device_count()} device(s)")
    return index


