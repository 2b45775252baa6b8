"""Which Ascend chip (SoC) the emulation behaves as, where torch_npu's bindings branch on it.

TRAINBRIDGE_EMULATED_NPU_SOC, read at each call: "Ascend910B" (Atlas A2, the default),
"Ascend910_93" (Atlas A3) or "Ascend950". What differs today: npu_fusion_attention_v2 on Ascend950
keeps the caller's seed/offset for its dropout mask, where A2/A3 draw them from the NPU generator
(op-plugin FlashAttentionV2KernelNpuOpApi.cpp `dropout_gen_mask`), and the torch_npu.testing
`SupportedDevices` decorator skips tests for other chips.
"""

from __future__ import annotations

import os

ENV = "TRAINBRIDGE_EMULATED_NPU_SOC"
SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")
DEFAULT = "Ascend910B"


def soc_version() -> str:
    raw = os.environ.get(ENV, DEFAULT).strip()
    if raw not in SOCS:
        raise ValueError(f"{ENV} must be one of {', '.join(SOCS)}, got {raw!r}")
    return raw


def is_ascend950() -> bool:
    return soc_version() == "Ascend950"
