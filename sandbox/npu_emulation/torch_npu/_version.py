"""Which torch_npu release the emulation behaves like (behaviour that changed between releases).

TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE names the Ascend release (the op-plugin branch: "7.3.0",
"26.0.0", "26.1.0", ...); read at call time, default DEFAULT_RELEASE. Version-dependent behaviour:
- backward through an op without a derivative (npu_add_rms_norm, npu_interleave_rope,
  npu_apply_rotary_pos_emb): from 26.1.0 op-plugin registers PyTorch's autogradNotImplementedFallback
  (op_plugin/ops/opapi/AutogradErrorFallback.cpp), so `.backward()` raises RuntimeError
  "derivative for npu::<op> is not implemented"; before, PyTorch's default autograd fallback only
  warns and the inputs get no gradient.
"""

from __future__ import annotations

import os
import re

ENV = "TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE"
DEFAULT_RELEASE = "26.1.0"
AUTOGRAD_ERROR_FALLBACK_SINCE = (26, 1, 0)


def release() -> tuple[int, int, int]:
    raw = os.environ.get(ENV, DEFAULT_RELEASE).strip()
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.\w+)?", raw)
    if not m:
        raise ValueError(f"{ENV} must be an Ascend release such as '7.3.0' or '26.1.0', got {raw!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def release_string() -> str:
    return ".".join(map(str, release()))


def raises_on_missing_derivative() -> bool:
    return release() >= AUTOGRAD_ERROR_FALLBACK_SINCE
