"""CPU stand-in for torch_npu, put on a child's import path by trainbridge when no real torch_npu is usable.

It provides the fused APIs that TrainBridge recipes use, with CPU reference math and autograd that
follow reference/npu/semantics.md and Ascend's own op tests, an `npu` device (a real device type
through PyTorch's Python backend hook by default, or the npu -> cpu mapping: see _device_mode), the
NPU generator (_generator), torch.npu, torch_npu.optim and a torch_npu.testing shim. It is
standalone (imports only torch). Speed measured with it means nothing; numerics are what it checks.

Setting TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP=0 before import registers no device at all (used by
trainbridge's in-process tests of the op math).
"""

from __future__ import annotations

import os as _os

import torch as _torch

from . import npu, optim
from ._activations import fast_gelu, npu_fast_gelu, npu_fast_gelu_backward, npu_gelu, npu_gelu_backward
from ._attention import npu_fusion_attention, npu_fusion_attention_grad
from ._attention_variants import (
    npu_fusion_attention_grad_v2,
    npu_fusion_attention_grad_v3,
    npu_fusion_attention_v2,
    npu_fusion_attention_v3,
)
from ._cross_entropy import npu_cross_entropy_loss, npu_cross_entropy_loss_backward
from ._dropout_mask import _npu_dropout_gen_mask
from ._format import get_npu_format, npu_format_cast, npu_format_cast_
from ._gated import npu_geglu, npu_geglu_grad, npu_swiglu, npu_swiglu_backward
from ._moe_gating import npu_moe_gating_top_k_softmax
from ._norm import npu_add_rms_norm, npu_rms_norm, npu_rms_norm_backward
from ._rope_ops import npu_apply_rotary_pos_emb, npu_interleave_rope
from ._rotary import npu_rotary_mul, npu_rotary_mul_backward
from ._softmax import npu_scaled_masked_softmax, npu_scaled_masked_softmax_backward
from ._transpose import npu_confusion_transpose

__trainbridge_emulated__ = True
_RELEASE = _torch.__version__.split("+")[0]  # torch_npu pins torch's release
__version__ = _RELEASE

__all__ = [
    "_npu_dropout_gen_mask",
    "fast_gelu",
    "get_npu_format",
    "npu_apply_rotary_pos_emb",
    "npu_cross_entropy_loss",
    "npu_cross_entropy_loss_backward",
    "npu_fast_gelu",
    "npu_fast_gelu_backward",
    "npu_format_cast",
    "npu_format_cast_",
    "npu_fusion_attention_grad_v2",
    "npu_fusion_attention_grad_v3",
    "npu_fusion_attention_v2",
    "npu_fusion_attention_v3",
    "npu_gelu",
    "npu_gelu_backward",
    "npu_interleave_rope",
    "npu_moe_gating_top_k_softmax",
    "npu_scaled_masked_softmax",
    "npu_scaled_masked_softmax_backward",
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
    from ._device_mode import install as _install

    # the local version label says which emulated device is in use (reported in the run's versions)
    __version__ = f"{_RELEASE}+trainbridge.{_install(npu)}"
    if __version__.endswith(".backend"):  # ops reach the device only there: count its kernels (_kernel_count)
        import sys as _sys

        from ._kernel_count import install as _count_kernels, launched as __trainbridge_kernels_launched__

        _count_kernels(_sys.modules[__name__])
