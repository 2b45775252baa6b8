"""Which source findings are a gain on which target backend.

Most static findings are hand-written forms of an operation (RMSNorm, rotary, a per-parameter
update loop): replacing them gains on every backend, so they are reported whatever the target.
Some are not: a library call that is one kernel on CUDA can be several ops, a copy or a slower
layout on the NPU (reference/npu/semantics.md), and a chain of pointwise ops is one kernel only
where a compiler fuses it. Those findings name a *gain* below and are reported only for the
targets that list it.

- ``library_attention``: ``F.scaled_dot_product_attention`` on transposed BNSD views,
  ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``varlen_attn``, ``flex_attention`` with a
  block mask, xformers' ``memory_efficient_attention`` -> ``npu_fusion_attention`` (BSND without the transposes, sparse_mode 2/3, TND).
  On CUDA these already are flash kernels; on the CPU there is nothing faster.
- ``library_rope``: flash-attn's rotary kernel (its ``RotaryEmbedding`` module or functions) has no
  NPU build -> ``npu_rotary_mul``. On CUDA it is already one kernel.
- ``library_rmsnorm``: ``F.rms_norm`` / ``nn.RMSNorm`` decompose into pow/mean/rsqrt/mul in NPU
  eager -> ``npu_rms_norm``. Fused on CUDA; the CPU build has no fused kernel either way
  (reference/README.md: same ops as the manual form).
- ``fp32_logits_loss``: ``logits.float()`` of the full vocabulary feeding ``F.cross_entropy`` ->
  ``npu_cross_entropy_loss`` on the bf16 logits (fp32 inside, no [tokens, vocab] fp32 copy).
- ``elementwise_chain``: ReLU², tanh/sigmoid soft-capping, ``a * x + b * y`` blends: one Inductor
  kernel, several eager launches. A launch costs most on the NPU and on CUDA; on this CPU the
  measured per-rewrite gains were within noise, so cpu does not list it.

``target=None`` (a scan that does not know its target) reports only target-independent findings.
"""

from __future__ import annotations

GAINS: dict[str, frozenset[str]] = {
    "npu": frozenset({"library_attention", "library_rmsnorm", "library_rope", "fp32_logits_loss", "elementwise_chain"}),
    "cuda": frozenset({"elementwise_chain"}),
    "cpu": frozenset(),
}


def gains_for(target: str | None) -> frozenset[str]:
    """The target-specific gains reported for ``target``; raises ValueError for an unknown one."""
    if target is None:
        return frozenset()
    try:
        return GAINS[target]
    except KeyError:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(sorted(GAINS))}") from None
