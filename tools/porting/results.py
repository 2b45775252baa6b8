"""Typed results of a port: what was changed and what could not be ported, with file:line."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from trainbridge.records import Record


class ChangeKind(StrEnum):
    device_string = "device_string"  # "cuda" / "cuda:N" -> "npu" / "npu:N"
    dist_backend = "dist_backend"  # "nccl" -> "hccl", Backend.NCCL -> Backend.HCCL
    env_var = "env_var"  # CUDA_VISIBLE_DEVICES -> ASCEND_RT_VISIBLE_DEVICES
    to_npu_method = "to_npu_method"  # x.cuda(...) -> x.npu(...), x.is_cuda -> x.is_npu
    device_module = "device_module"  # torch.cuda.X -> torch.npu.X (amp included)
    import_rewrite = "import_rewrite"  # from torch.cuda[.amp] import X -> from torch_npu.npu[.amp] import X
    import_torch_npu = "import_torch_npu"  # `import torch_npu` added
    fused_optimizer = "fused_optimizer"  # torch.optim.X(..., fused=True) -> foreach=True (the NPU's own fused ones: recipes)
    fp8_matmul = "fp8_matmul"  # torch._scaled_mm(a, b, ...) in an FP8 op -> a bf16 torch.mm times the scales (precision change)
    fp8_dtype = "fp8_dtype"  # torch.float8_* casts in an FP8 op (and its fake) -> torch.bfloat16 (precision change)
    triton_launch = "triton_launch"  # kernel[grid](...) -> the PyTorch ops derived from the @triton.jit kernel's tl ops
    triton_removed = "triton_removed"  # a @triton.jit kernel (or its autotune helper) no longer launched: deleted
    triton_import = "triton_import"  # `import triton` dropped, or guarded where the file still names triton
    flex_attention = "flex_attention"  # flex_attention(...) -> _tb_npu_flex_attention(...) on npu_fusion_attention
    flex_block_mask = "flex_block_mask"  # create_block_mask / BlockMask.from_kv_blocks of a causal/window/document mask_mod
    flash_attention = "flash_attention"  # flash_attn_func / flash_attn_varlen_func (flash-attn, FA3, kernels hub) -> npu_fusion_attention
    smi_command = "smi_command"  # subprocess ["nvidia-smi"] -> ["npu-smi", "info"] where npu-smi exists, else a no-op
    attention_fullgraph = "attention_fullgraph"  # torch.compile(..., fullgraph=True) -> False where carried attention reads the host


class SkipCategory(StrEnum):
    triton = "triton"
    flash_attn = "flash_attn"
    flex_attention = "flex_attention"  # a FlexAttention mask or call the port cannot carry (an arbitrary mask_mod, score_mod)
    kernels_hub = "kernels_hub"
    fp8 = "fp8"
    cuda_graph = "cuda_graph"
    nvtx = "nvtx"
    cuda_api = "cuda_api"  # a torch.cuda member torch.npu does not provide
    cuda_extension = "cuda_extension"  # torch.utils.cpp_extension with CUDA sources
    cuda_source = "cuda_source"  # a .cu / .cuh file in the repository
    compile = "compile"  # torch.compile choices that mean nothing on the NPU
    backend_flag = "backend_flag"  # torch.backends.cuda / cudnn settings, SDPA backend selection
    parse_error = "parse_error"  # the file does not parse; left untouched


class PortChange(Record):
    file: str = Field(description="repo-relative POSIX path")
    line: int = Field(ge=1, description="line in the original file")
    kind: ChangeKind
    before: str
    after: str
    review: str = Field(default="", description="why a person should review this change (a precision change, a "
                                                "kernel's math derived by TrainBridge); empty for mechanical renames")


class Skipped(Record):
    """A construct left as it was because it cannot be ported mechanically."""

    file: str = Field(description="repo-relative POSIX path")
    line: int = Field(ge=1, description="line in the original file")
    category: SkipCategory
    code: str = Field(description="the source line in question")
    reason: str = Field(description="why it was not ported and what to do instead")
    blocking: bool = Field(description="True when the program needs manual work to run correctly on the NPU; "
                                       "False when leaving the code as it is is harmless there")

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


class PortResult(Record):
    file: str
    source: str = Field(description="the ported source (the original when nothing changed)")
    changed: bool
    changes: list[PortChange] = Field(default_factory=list)
    skipped: list[Skipped] = Field(default_factory=list)


class RepoPortResult(Record):
    root: str
    files: list[PortResult] = Field(default_factory=list, description="every Python file, in path order")
    other_skipped: list[Skipped] = Field(default_factory=list, description="findings in non-Python files")

    @property
    def changes(self) -> list[PortChange]:
        return [c for f in self.files for c in f.changes]

    @property
    def skipped(self) -> list[Skipped]:
        return [s for f in self.files for s in f.skipped] + self.other_skipped

    @property
    def changed_files(self) -> list[PortResult]:
        return [f for f in self.files if f.changed]
