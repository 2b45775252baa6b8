"""What torch.npu offers in place of torch.cuda, and why the rest cannot be ported mechanically.

Data, not logic. `NPU_DEVICE_MODULE` is `torch_npu/npu/__init__.py`'s `__all__` from the
torch-npu 2.14.0 wheel (reference/npu/torch_npu_python_api_surface.txt); torch_npu registers that
module as `torch.npu`. `torch_npu.npu.amp` (autocast, GradScaler) is a subpackage of it
(reference/npu/semantics.md §6 cites torch_npu/npu/amp/grad_scaler.py).
"""

from __future__ import annotations

NPU_DEVICE_MODULE: frozenset[str] = frozenset("""
is_initialized init set_dump synchronize device_count can_device_access_peer set_device current_device
get_device_name get_device_properties get_device_capability mem_get_info is_available device device_of
StreamContext stream set_stream current_stream default_stream set_sync_debug_mode get_sync_debug_mode
set_task_queue_enable get_task_queue_enable init_dump utilization finalize_dump manual_seed manual_seed_all
seed seed_all initial_seed caching_allocator_alloc caching_allocator_delete get_per_process_memory_fraction
set_per_process_memory_fraction empty_cache empty_virt_addr_cache memory_stats memory_stats_as_nested_dict
reset_accumulated_memory_stats reset_peak_memory_stats reset_max_memory_allocated reset_max_memory_cached
memory_allocated max_memory_allocated memory_reserved max_memory_reserved memory_cached max_memory_cached
memory_snapshot memory_summary MemPool use_mem_pool get_allocator_backend NPUPluggableAllocator
change_current_allocator Stream Event set_option CubeMathType set_aoe set_compile_mode set_mm_bmm_format_nd
get_mm_bmm_format_nd get_npu_overflow_flag clear_npu_overflow_flag stress_detect get_rng_state set_rng_state
get_rng_state_all set_rng_state_all is_jit_compile_false get_amp_supported_dtype is_autocast_enabled
is_bf16_supported set_autocast_enabled get_autocast_dtype set_autocast_dtype BoolStorage ByteStorage
ShortStorage LongStorage IntStorage HalfStorage CharStorage DoubleStorage FloatStorage BoolTensor ByteTensor
CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor BFloat16Tensor BFloat16Storage
current_blas_handle stop_device restart_device check_uce_in_memory config matmul conv
enable_deterministic_with_backward disable_deterministic_with_backward mstx SyncLaunchStream NPUGraph graph
graph_pool_handle is_current_stream_capturing make_graphed_callables ExternalEvent ExternalStream
graph_task_group_begin graph_task_group_end graph_task_update_begin graph_task_update_end set_device_limit
get_device_limit set_stream_limit reset_stream_limit get_stream_limit ipc_collect obfuscation_initialize
obfuscation_finalize obfuscation_calculate set_op_timeout_ms host_empty_cache host_memory_stats
host_memory_stats_as_nested_dict reset_accumulated_host_memory_stats reset_peak_host_memory_stats
set_deterministic_level use_compatible_impl are_compatible_impl_enabled NpuGraphOpHandler
register_npu_graph_handler super_kernel_scope_begin super_kernel_scope_end npurt
""".split())

NPU_AMP: frozenset[str] = frozenset({"autocast", "GradScaler"})

# torch.cuda members that exist under the same name on torch.npu but are not a drop-in port.
CUDA_GRAPH_MEMBERS: frozenset[str] = frozenset({
    "CUDAGraph", "graph", "graphs", "make_graphed_callables", "graph_pool_handle", "is_current_stream_capturing",
})

CUDA_GRAPH_REASON = (
    "CUDA graph capture/replay has no drop-in NPU port: torch_npu's aclgraph API (torch.npu.NPUGraph, "
    "torch.npu.graph, torch.npu.make_graphed_callables) has its own capture rules (operators that cannot be "
    "captured, static shapes and addresses, stream handling). Port the capture region by hand and check it, "
    "or run it eagerly first."
)
NVTX_REASON = (
    "torch.cuda.nvtx has no torch.npu counterpart; torch_npu's torch.npu.mstx (mark / range_start / range_end) "
    "annotates NPU profiles with a different API. Replace the ranges by hand or remove them."
)

# Why a torch.cuda member is missing from torch.npu, where there is more to say than "not provided".
CUDA_MEMBER_HINTS: dict[str, str] = {
    "nccl": "use torch.distributed with backend='hccl' instead of torch.cuda.nccl",
    "comm": "use torch.distributed collectives (backend 'hccl') instead of torch.cuda.comm",
    "jiterator": "jiterator compiles CUDA C++ at run time; write the op in PyTorch or as an Ascend C kernel",
    "memory": "use torch.npu's memory_* / max_memory_* / memory_snapshot functions instead of torch.cuda.memory",
    "get_arch_list": "NPU builds have no CUDA architecture list; query torch.npu.get_device_name() instead",
    "tunable": "TunableOp is CUDA/ROCm-only",
    "cudart": "use torch.npu.npurt for the runtime bindings, by hand",
    "custom_fwd": "use torch.amp.custom_fwd(device_type='npu', ...)",
    "custom_bwd": "use torch.amp.custom_bwd(device_type='npu')",
}

# torch.backends.cuda / torch.backends.cudnn settings: what (if anything) plays their role on the NPU.
BACKEND_FLAG_HINTS: dict[str, str] = {
    "benchmark": "cuDNN autotuning has no NPU equivalent; the setting has no effect there (harmless, can be removed)",
    "deterministic": "use torch.use_deterministic_algorithms(True), which torch_npu honours "
                     "(torch.npu.enable_deterministic_with_backward covers the backward)",
    "allow_tf32": "TF32 does not exist on the NPU; torch.npu.matmul.allow_hf32 / torch.npu.conv.allow_hf32 enable "
                  "HF32, which has a different precision: decide explicitly",
    "matmul": "TF32/reduced-precision matmul flags do not apply on the NPU; torch.npu.matmul.allow_hf32 enables HF32 "
              "(different precision): decide explicitly",
    "enabled": "cuDNN does not exist on the NPU; the setting has no effect there (harmless, can be removed)",
    "sdp_kernel": "SDPA backend selection is CUDA-only; on the NPU SDPA dispatches to torch_npu's kernel, or use "
                  "torch_npu.npu_fusion_attention (mind its scale default and inverted mask, semantics.md)",
    "enable_flash_sdp": "SDPA backend flags are CUDA-only (no effect on the NPU)",
    "enable_mem_efficient_sdp": "SDPA backend flags are CUDA-only (no effect on the NPU)",
    "enable_math_sdp": "SDPA backend flags are CUDA-only (no effect on the NPU)",
    "enable_cudnn_sdp": "SDPA backend flags are CUDA-only (no effect on the NPU)",
    "preferred_linalg_library": "cuSOLVER/MAGMA selection is CUDA-only (no effect on the NPU)",
    "preferred_blas_library": "cuBLAS/cuBLASLt selection is CUDA-only (no effect on the NPU)",
    "cufft_plan_cache": "the cuFFT plan cache is CUDA-only",
}

TRITON_REASON = (
    "Triton kernels are compiled for CUDA GPUs and do not run on the NPU (torch_npu's transfer_to_npu forces "
    "Triton off). Replace the kernel with PyTorch ops or a torch_npu fused API, or port it to triton-ascend / "
    "Ascend C by hand."
)
FLASH_ATTN_REASON = (
    "flash-attn is a CUDA-only package. The NPU counterpart is torch_npu.npu_fusion_attention, but it differs: "
    "scale defaults to 1.0 (pass 1/sqrt(D)), its boolean mask marks positions to EXCLUDE, flash-attn's causal "
    "(bottom-right) is sparse_mode=3 with the 2048x2048 upper-triangular mask, window_size=(w, 0) is "
    "pre_tockens=w, and it returns 7 values (reference/npu/semantics.md). Port the call by hand and check "
    "forward and gradients."
)
KERNELS_HUB_REASON = (
    "The Hugging Face `kernels` hub loads prebuilt CUDA kernels; they do not run on the NPU. Use the "
    "model's PyTorch fallback path or a torch_npu fused API instead."
)
FP8_REASON = (
    "FP8 (torch.float8_* dtypes, torch._scaled_mm) has no torch_npu kernel in its 2.14 API surface. Keep the "
    "layer in bf16/fp16, or move it to a quantized NPU matmul (torch_npu.npu_quant_matmul, with its own "
    "scale conventions) by hand and check numerics."
)
CUDA_EXTENSION_REASON = (
    "A custom CUDA extension (.cu sources / CUDAExtension) cannot be built for the NPU. Reimplement the op "
    "with PyTorch or torch_npu fused APIs, or as an Ascend C custom operator."
)
CUDA_SOURCE_REASON = ("CUDA C++ source file: it is compiled by nvcc for GPUs and cannot run on the NPU "
                      "(see the code that builds or loads it).")
COMPILE_INDUCTOR_REASON = (
    "torch.compile with Inductor generates Triton/C++ kernels for CUDA/CPU. On the NPU, torch.compile(backend='npu') "
    "(TorchAir) is the graph backend; note that a torch_npu built without torchair silently runs backend='npu' "
    "eagerly. Decide by measurement whether to compile here (the TrainBridge playbook makes selective compile the "
    "last resort)."
)
VERSION_CUDA_REASON = (
    "`torch.version.cuda` is None with an NPU build of torch: code that branches on it takes its non-CUDA path; "
    "`torch_npu.__version__` names the NPU stack"
)
FUSED_OPTIMIZER_REASON = (
    "`fused=True` asks for the fused optimizer kernels of the tensors' device: on the NPU that needs torch_npu's "
    "fused kernel for this optimizer; torch_npu.optim's NpuFusedAdamW/NpuFusedSGD (or foreach=True) are the NPU's "
    "own fused updates (trainbridge's recipes adamw-npu-fused, sgd-npu-fused rewrite to them and check the numerics)"
)
NVIDIA_SMI_REASON = (
    "nvidia-smi does not exist on an Ascend host: `npu-smi info` is its counterpart (another output format), and "
    "torch.npu.device_count()/mem_get_info() answer from Python"
)
# what `["nvidia-smi"]`, the command of a subprocess call that only logs the GPUs, becomes: npu-smi's overview where
# npu-smi is installed, else a command that prints that it is not (a CPU host running the emulation)
SMI_COMMAND = ('["npu-smi", "info"] if __import__("shutil").which("npu-smi") else '
               '[__import__("sys").executable, "-c", "print(\'npu-smi: not on this host\')"]')
COMPILE_MODE_REASON = (
    "torch.compile mode {mode!r} selects CUDA graphs and/or Triton autotuning, which mean nothing on the NPU; "
    "drop the mode or compile with backend='npu' (TorchAir) and measure."
)
