"""Port a CUDA training program to the Ascend NPU as a reviewable source rewrite (libcst).

Where torch_npu's `transfer_to_npu` monkey-patches cuda -> npu at run time, this rewrites the code
(device strings, `.cuda()`, `torch.cuda.*` that torch.npu provides, amp, nccl -> hccl, and
`import torch_npu`), and reports with file:line what it cannot port: Triton, flash-attn, FP8, CUDA
graphs, CUDA extensions, the `kernels` hub, torch.compile choices and cuDNN/CUDA backend flags.
FP8 `torch._scaled_mm` ops become bf16 matmuls (fp8.py, flagged as a precision change) and Triton
launches whose kernels it can read become the PyTorch ops they compute (triton_kernels.py,
triton_math.py); what it cannot derive stays reported. FlexAttention with causal / sliding-window /
document masks, flash-attn's flash_attn_func / flash_attn_varlen_func and the FlashAttention-3 kernel of
the `kernels` hub become torch_npu.npu_fusion_attention (attention.py, attention_masks.py, with the
helpers of attention_helpers.py written into the ported file); an arbitrary mask_mod stays reported.
"""

from trainbridge.tools.porting.repo import port_repo
from trainbridge.tools.porting.results import (
    ChangeKind,
    PortChange,
    PortResult,
    RepoPortResult,
    SkipCategory,
    Skipped,
)
from trainbridge.tools.porting.source import port_source

__all__ = ["ChangeKind", "PortChange", "PortResult", "RepoPortResult", "SkipCategory", "Skipped", "port_repo",
           "port_source"]
