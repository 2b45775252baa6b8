"""CPU stand-in for torch_npu, put on a child's import path by trainbridge when no real torch_npu is usable.

It provides the fused APIs that TrainBridge recipes use, with CPU reference math and autograd that
follow reference/npu/semantics.md, and maps the `npu` device onto the CPU (see _device_map). It is
standalone (imports only torch). Speed measured with it means nothing; numerics are what it checks.

Setting TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP=0 before import skips the device mapping and torch.npu
registration (used by trainbridge's in-process tests of the op math).
"""

from __future__ import annotations

import os as _os

import torch as _torch

from . import npu, optim
from ._attention import npu_fusion_attention, npu_fusion_attention_grad
from ._gated import npu_geglu, npu_geglu_grad, npu_swiglu, npu_swiglu_backward
from ._norm import npu_add_rms_norm, npu_rms_norm, npu_rms_norm_backward
from ._rotary import npu_rotary_mul, npu_rotary_mul_backward
from ._transpose import npu_confusion_transpose

__trainbridge_emulated__ = True
__version__ = _torch.__version__.split("+")[0]

__all__ = [
    "npu_add_rms_norm",
    "npu_confusion_transpose",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_geglu",
    "npu_geglu_grad",
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_rotary_mul",
    "npu_rotary_mul_backward",
    "npu_swiglu",
    "npu_swiglu_backward",
    "npu",
    "optim",
]


def _autoload() -> None:
    """Entry point named by a real torch_npu's `torch.backends` entry point; importing did the work."""


if _os.environ.get("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", "1") != "0":
    from ._device_map import install as _install

    _install(npu)
