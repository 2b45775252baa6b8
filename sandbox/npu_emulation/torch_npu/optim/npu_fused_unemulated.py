"""torch_npu.optim's third-party fused optimizers: present by name, not emulated (construction raises).

They have no torch.optim counterpart (LAMB, AdamP, BERT's Adam, TF-style RMSprop) and Ascend's own
test of their numerics is skipped upstream (test/optim/test_fused_optimizers.py,
test_step_3rd_optims), so there is no reference to check an emulation against here.
"""

from __future__ import annotations


class _NotEmulated:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"torch_npu.optim.{type(self).__name__} is not emulated by trainbridge (no torch.optim counterpart "
            "and no upstream reference); use NpuFusedSGD/Adam/AdamW/Adadelta/RMSprop or run on an NPU"
        )


class NpuFusedLamb(_NotEmulated):
    pass


class NpuFusedAdamP(_NotEmulated):
    pass


class NpuFusedBertAdam(_NotEmulated):
    pass


class NpuFusedRMSpropTF(_NotEmulated):
    pass
