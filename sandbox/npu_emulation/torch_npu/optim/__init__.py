"""torch_npu.optim stand-in: the fused AdamW (other NpuFused* optimizers are not emulated)."""

from .npu_fused_adamw import NpuFusedAdamW, NpuFusedOptimizerBase

__all__ = ["NpuFusedAdamW", "NpuFusedOptimizerBase"]
