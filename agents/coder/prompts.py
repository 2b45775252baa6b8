"""Prompts of the LLM coder (module constants; `llm.py` fills them in).

The reply format is aider's search/replace block, confined to the intent's region; `llm.py` parses
it and refuses anything outside these rules, so the rules here are a courtesy to the model, not the
enforcement.
"""

from __future__ import annotations

# torch_npu fused APIs that TrainBridge can check numerically on hosts without an NPU (the
# emulation in sandbox/npu_emulation provides exactly these). Signatures from
# reference/npu/intent_to_npu_api.yaml and semantics.md.
NPU_FUSED_APIS: dict[str, str] = {
    "npu_rms_norm": "torch_npu.npu_rms_norm(x, gamma, epsilon=1e-06) -> (y, rstd); take [0]; plain gamma (not 1+gamma)",
    "npu_add_rms_norm": "torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x1+x2)",
    "npu_rotary_mul": "torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode='half') -> Tensor; x 4-D (BNSD/BSND/SBND)",
    "npu_swiglu": "torch_npu.npu_swiglu(x, dim=-1) -> silu(first half) * second half; the dim size must be even",
    "npu_geglu": "torch_npu.npu_geglu(x, dim=-1, approximate=1, activate_left=False) -> (out, gelu_out); "
                 "approximate 0=erf, 1=tanh (default tanh!)",
    "npu_fusion_attention": "torch_npu.npu_fusion_attention(q, k, v, head_num, input_layout, atten_mask=None, "
                            "scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, "
                            "sparse_mode=0) -> tuple; take [0]; atten_mask True = masked",
    "npu_confusion_transpose": "torch_npu.npu_confusion_transpose(x, perm, shape, transpose_first) -> Tensor",
}

_PORTABLE_APIS = """\
- torch.nn.functional: scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None),
  rms_norm(x, normalized_shape, weight, eps), layer_norm, gelu(x, approximate='none'|'tanh'), silu,
  softmax / log_softmax(dim=..., dtype=...), cross_entropy, normalize, linear, dropout
- torch: addcmul, addcdiv, baddbmm, addmm, lerp, rsqrt, fused in-place forms of the same math
- torch.optim optimizers with fused=True or foreach=True (never both)"""

ALLOWED_APIS: dict[str, str] = {
    "cpu": _PORTABLE_APIS,
    "cuda": _PORTABLE_APIS,
    "npu": _PORTABLE_APIS + "\n- torch_npu fused ops (only these):\n"
    + "\n".join(f"  - {signature}" for signature in NPU_FUSED_APIS.values()),
}

# Modules a patch may import from (an IMPORTS block adds them at the top of the file).
_PORTABLE_MODULES = ("torch", "torch.nn", "torch.nn.functional", "math")
ALLOWED_IMPORT_MODULES: dict[str, tuple[str, ...]] = {
    "cpu": _PORTABLE_MODULES,
    "cuda": _PORTABLE_MODULES,
    "npu": (*_PORTABLE_MODULES, "torch_npu"),
}

SYSTEM_PROMPT = """\
You are the coder of TrainBridge, which makes PyTorch training programs faster on the {target} backend.
A compiler (torch.compile) fused the region you are shown into fewer kernels than the eager program
launches. Rewrite ONLY that region so that eager PyTorch launches fewer, fused kernels, computing the
same values (same shapes, dtypes and gradients, within floating-point rounding).

Rules (a patch that breaks any of them is rejected automatically):
1. Edit only the numbered lines of the region. Every SEARCH text must be copied exactly (same
   indentation, no line numbers) from those lines and must occur exactly once in the file.
2. Do not touch timing (time.*, perf_counter, synchronize), seeds or random state (manual_seed,
   random.seed, np.random.seed, RNG state), the data pipeline or batch function, the training
   loop, logging, or anything of TrainBridge.
3. Do not cache results across steps (no `global`, no functools.cache / lru_cache, no tensors
   stored on `self` or in module-level state) and do not skip work (no torch.no_grad,
   inference_mode, detach(), .data, and no new return / break / continue that bypasses computation).
4. No I/O, no os / sys / subprocess, no eval / exec / __import__ / getattr tricks.
5. Use only these APIs beyond what the region already uses:
{allowed_apis}
6. Imports: only of {allowed_imports}, listed in an IMPORTS block; never edit import lines directly.

Reply format: a short explanation, then one or more blocks exactly like this
(the first line is the file's path as given):

{example}
Optionally, one IMPORTS block:

<<<<<<< IMPORTS
import torch.nn.functional as F
>>>>>>> IMPORTS

If the region cannot be improved under these rules, reply with no blocks and say why."""

EXAMPLE_BLOCK = """\
path/to/file.py
<<<<<<< SEARCH
        y = x * torch.sigmoid(x)
=======
        y = torch.nn.functional.silu(x)
>>>>>>> REPLACE
"""

USER_PROMPT = """\
Intent {intent_id}: {category} on target backend {target}.
Evidence: the compiler used K={kernels} kernel(s) where eager launches N={ops} op(s) per step{time}.
{evidence_details}
Region to rewrite: {regions}

{region_listing}

Surrounding code (read-only, for context):

{context_listing}
{feedback}"""

FEEDBACK_SECTION = """
An earlier patch for this intent was rejected. Take this into account:
{feedback}
"""

RETRY_PROMPT = """\
Your previous reply could not be used (attempt {attempt} of {max_attempts}):
{failure}

Reply again with corrected SEARCH/REPLACE blocks that follow every rule; edit only lines {regions}."""
