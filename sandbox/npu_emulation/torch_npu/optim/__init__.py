"""torch_npu.optim stand-in: the fused optimizers over combined flat buffers (see npu_fused_optim_base).

Emulated: NpuFusedSGD, NpuFusedAdam, NpuFusedAdamW, NpuFusedAdadelta, NpuFusedRMSprop (the ones with
a torch.optim counterpart, so the ones a rewrite can target). NpuFusedLamb, NpuFusedAdamP,
NpuFusedBertAdam and NpuFusedRMSpropTF (third-party algorithms) exist so that programs and Ascend's
tests import, and raise NotImplementedError when constructed.
"""

from .npu_fused_adadelta import NpuFusedAdadelta
from .npu_fused_adam import NpuFusedAdam
from .npu_fused_adamw import NpuFusedAdamW
from .npu_fused_optim_base import NpuFusedOptimizerBase
from .npu_fused_rmsprop import NpuFusedRMSprop
from .npu_fused_sgd import NpuFusedSGD
from .npu_fused_unemulated import NpuFusedAdamP, NpuFusedBertAdam, NpuFusedLamb, NpuFusedRMSpropTF

__all__ = [
    "NpuFusedOptimizerBase", "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedLamb", "NpuFusedAdam", "NpuFusedAdamW",
    "NpuFusedAdamP", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF",
]
