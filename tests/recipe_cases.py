"""The recipe cases: every seed recipe applied to real code (a bundled example, a differently written
variant under tests/fixtures/recipe_variants/, or a runnable real-style program under
tests/fixtures/real_style/runnable/), plus code that only looks similar and the documented traps put
back into a recipe. Data for tests/test_recipes.py; the Case record is in benchmarks/recipe_lab.py."""

from __future__ import annotations

from recipe_lab import Case, examples

CASES: list[Case] = [
    # --- bundled examples (slow: real model sizes) ----------------------------------------------
    *examples(
        Case("rmsnorm-f-rms-norm", "llama_pretrain", "cpu", "rmsnorm"),
        Case("silu-functional", "llama_pretrain", "cpu", "silu"),
        Case("attention-sdpa-causal", "llama_pretrain", "cpu", "attention"),
        Case("cross-entropy-f-cross-entropy", "llama_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "llama_pretrain", "cpu", "optimizer_step"),
        Case("host-sync-log-every", "llama_pretrain", "cpu", "host_sync"),
        Case("rmsnorm-npu-rms-norm", "llama_pretrain", "npu", "rmsnorm"),
        Case("add-rms-norm-npu", "llama_pretrain", "npu", function="model.py:DecoderLayer.forward"),
        Case("rope-npu-rotary-mul", "llama_pretrain", "npu", "rope"),
        Case("swiglu-npu-swiglu", "llama_pretrain", "npu", "swiglu"),
        Case("attention-npu-fusion-causal", "llama_pretrain", "npu", "attention"),
        Case("permute-reshape-npu-confusion-transpose", "llama_pretrain", "npu", "permute_reshape"),
        Case("adamw-npu-fused", "llama_pretrain", "npu", "optimizer_step"),
        Case("layernorm-f-layer-norm", "gpt2_pretrain", "cpu", "layernorm"),
        Case("gelu-tanh-functional", "gpt2_pretrain", "cpu", "gelu"),
        Case("attention-sdpa-masked", "gpt2_pretrain", "cpu", "attention"),
        Case("cross-entropy-f-cross-entropy", "gpt2_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "gpt2_pretrain", "cpu", "optimizer_step"),
        Case("attention-npu-fusion-masked", "gpt2_pretrain", "npu", "attention"),
        Case("permute-reshape-npu-confusion-transpose", "gpt2_pretrain", "npu", "permute_reshape"),
        Case("layernorm-f-layer-norm", "gpt2_pretrain", "npu", "layernorm"),
        # gpt2 zeroes with set_to_none=True, which NpuFusedAdamW refuses (a documented pitfall):
        # the rewritten program must fail loudly, not train on stale gradients.
        Case("adamw-npu-fused", "gpt2_pretrain", "npu", "optimizer_step", expect="fails",
             expect_error=r"set_to_none"),
        Case("conv-channels-last", "resnet_classify", "cpu", "conv_layout"),
        Case("sgd-fused", "resnet_classify", "cpu", "optimizer_step"),
        Case("layernorm-f-layer-norm", "clip_pretrain", "cpu", "layernorm"),
        Case("gelu-erf-functional", "clip_pretrain", "cpu", "gelu", nth=0),
        Case("normalize-f-normalize", "clip_pretrain", "cpu", "normalize"),
        Case("attention-sdpa-causal-conditional", "clip_pretrain", "cpu", "attention"),
        Case("cross-entropy-contrastive-diagonal", "clip_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "clip_pretrain", "cpu", "optimizer_step"),
        Case("permute-reshape-npu-confusion-transpose", "clip_pretrain", "npu", "permute_reshape"),
        Case("cross-entropy-npu-fused", "llama_pretrain", "npu", "cross_entropy"),
        Case("softmax-npu-scaled-masked", "llama_pretrain", "npu", function="model.py:causal_attention"),
        Case("softmax-npu-scaled-masked", "gpt2_pretrain", "npu", function="model.py:CausalSelfAttention.forward"),
        Case("gelu-npu-gelu", "clip_pretrain", "npu", "gelu", nth=0),
        Case("sgd-npu-fused", "resnet_classify", "npu", "optimizer_step"),
    ),
    # QuickGELU (x * sigmoid(1.702 x)) is neither GELU nor SiLU: every activation recipe refuses it.
    Case("gelu-erf-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    Case("gelu-tanh-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    Case("silu-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    # --- variants: other spellings, tiny models ---------------------------------------------------
    Case("rmsnorm-f-rms-norm", "variant_lm", "cpu", "rmsnorm"),
    Case("silu-functional", "variant_lm", "cpu", "silu"),
    Case("attention-sdpa-causal", "variant_lm", "cpu", "attention"),
    Case("cross-entropy-f-cross-entropy", "variant_lm", "cpu", "cross_entropy"),
    Case("adam-foreach-to-fused", "variant_lm", "cpu", "optimizer_step"),
    Case("zero-grad-set-to-none", "variant_lm", "cpu", "zero_grad"),
    Case("host-sync-inline-log-every", "variant_lm", "cpu", "host_sync", steps=12),
    Case("rmsnorm-npu-rms-norm", "variant_lm", "npu", "rmsnorm"),
    Case("add-rms-norm-npu", "variant_lm", "npu", function="lm.py:Block.forward"),
    Case("rope-npu-rotary-mul", "variant_lm", "npu", "rope"),
    Case("swiglu-npu-swiglu", "variant_lm", "npu", "swiglu"),
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention"),
    Case("permute-reshape-npu-confusion-transpose", "variant_lm", "npu", "permute_reshape"),
    # the emulation has no TorchAir 'npu' dynamo backend: the helper must say so instead of running eager
    Case("compile-regional-npu", "variant_lm", "npu", "rope", expect="fails",
         expect_error=r"torch\.compile\(backend='npu'\) is not available"),
    Case("compile-regional", "variant_lm", "cpu", "rope", slow=True),
    Case("layernorm-f-layer-norm", "variant_clip", "cpu", "layernorm"),
    Case("gelu-erf-functional", "variant_clip", "cpu", "gelu", nth=0),
    Case("gelu-tanh-functional", "variant_clip", "cpu", "gelu", nth=1),
    Case("attention-sdpa-masked", "variant_clip", "cpu", "attention"),
    Case("normalize-f-normalize", "variant_clip", "cpu", "normalize"),
    Case("cross-entropy-contrastive-diagonal", "variant_clip", "cpu", "cross_entropy"),
    Case("adamw-foreach-to-fused", "variant_clip", "cpu", "optimizer_step"),
    Case("attention-sdpa-causal-conditional", "variant_clip", "cpu", "attention", nth=1),
    Case("geglu-npu-geglu", "variant_clip", "npu", "geglu"),
    Case("attention-npu-fusion-masked", "variant_clip", "npu", "attention"),
    Case("permute-reshape-npu-confusion-transpose", "variant_clip", "npu", "permute_reshape"),
    Case("adamw-npu-fused", "variant_clip", "npu", "optimizer_step"),
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy"),
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward"),
    # the text tower's sequence is 8 long: npu_scaled_masked_softmax needs the last two dims in [32, 4096]
    # and multiples of 32, and must say so instead of computing something
    Case("softmax-npu-scaled-masked", "variant_clip", "npu", function="model.py:MaskedAttention.forward",
         expect="fails", expect_error=r"last two dims of x must lie in \[32, 4096\]"),
    Case("gelu-npu-gelu", "variant_clip", "npu", "gelu", nth=0),
    Case("adam-npu-fused", "variant_lm", "npu", "optimizer_step"),
    Case("sgd-npu-fused", "variant_cnn", "npu", "optimizer_step"),
    Case("conv-channels-last", "variant_cnn", "cpu", "conv_layout"),
    Case("sgd-fused", "variant_cnn", "cpu", "optimizer_step"),
    Case("host-sync-log-every", "variant_cnn", "cpu", "host_sync"),
    # --- runnable real-style programs (tests/fixtures/real_style/runnable): recipes where real code writes the op
    Case("adamw-fused", "real_package", "cpu", "optimizer_step"),  # AdamW(..., **extra_args), fused only on cuda
    Case("adamw-npu-fused", "real_package", "npu", "optimizer_step"),  # the **extra_args that only holds fused dropped
    Case("adam-fused", "real_speedrun", "cpu", "optimizer_step", nth=1),
    Case("adamw-fused", "real_hf", "cpu", "optimizer_step"),
    Case("optimizer-loop-compile", "real_speedrun", "cpu", "optimizer_step", nth=0, slow=True),  # Muon-like step loop
    Case("optimizer-loop-compile-npu", "real_speedrun", "npu", "optimizer_step", nth=0, expect="fails",
         expect_error=r"torch\.compile\(backend='npu'\) is not available"),
    Case("rmsnorm-library-npu", "real_speedrun", "npu", "rmsnorm", scan_target="npu"),  # F.rms_norm in a helper
    Case("rmsnorm-module-npu", "real_package", "npu", "rmsnorm", scan_target="npu"),  # torch.nn.RMSNorm(...) from a factory
    Case("attention-sdpa-npu-fusion", "real_speedrun", "npu", "attention", scan_target="npu"),  # SDPA on transposed views, in a method
    Case("attention-sdpa-npu-fusion", "real_package", "npu", "attention", scan_target="npu"),
    Case("compile-regional", "real_speedrun", "cpu", function="train_gpt.py:MLP.forward", slow=True),  # a method
    Case("rmsnorm-statements-f-rms-norm", "real_hf", "cpu", "rmsnorm"),  # upcast norm, self.scale / self.tiny
    Case("rmsnorm-statements-npu-rms-norm", "real_hf", "npu", "rmsnorm"),
    Case("rmsnorm-normalize-f-rms-norm", "real_hf", "cpu", "rmsnorm", nth=1),  # F.normalize(x) * sqrt(d) * g
    Case("rmsnorm-normalize-npu-rms-norm", "real_hf", "npu", "rmsnorm", nth=1),
    Case("cross-entropy-library-npu", "real_speedrun", "npu", "cross_entropy", scan_target="npu"),  # soft-capped fp32
    Case("cross-entropy-library-npu", "real_hf", "npu", "cross_entropy", scan_target="npu"),  # loss() method
    Case("cross-entropy-library-npu", "variant_polar", "npu", function="run.py:loss_fn"),  # -100 padded targets
    Case("cross-entropy-library-npu", "variant_qknorm", "npu", "cross_entropy", scan_target="npu"),  # ignore_index=-1
    Case("rope-npu-rotary-mul", "real_hf", "npu", "rope"),
    Case("host-sync-inline-log-every", "real_package", "cpu", "host_sync"),
    Case("attention-sdpa-additive-mask", "real_hf", "cpu", "attention"),  # eager method, program's mask helper
    Case("attention-sdpa-additive-mask", "real_hf", "npu", "attention"),
    Case("permute-reshape-npu-confusion-transpose-split", "real_package", "npu", "permute_reshape"),  # print("loss", loss.cpu()) every step  # rotate_half as a static helper under another name
    Case("rope-chunk-npu-rotary-mul", "real_speedrun", "npu", "rope"),  # chunk halves, y1 = x1 c + x2 s
    Case("permute-reshape-npu-confusion-transpose", "real_speedrun", "npu", "permute_reshape"),  # reshape(B, T, -1)
    Case("rope-chunk-npu-rotary-mul", "real_speedrun", "npu", "rope", expect="diverges",
         mutate=("-torch.cat(($s, $s)", "torch.cat(($s, $s)")),  # the rotation's direction: r2 = -sin
    # QK-norm decoder under bf16 autocast (speedrun-record style): two F.rms_norm in one tuple assignment,
    # rotary on sliced halves in named statements, SDPA on transposed views
    Case("rmsnorm-library-npu", "variant_qknorm", "npu", "rmsnorm", scan_target="npu"),  # q, k = F.rms_norm(q, ..), F.rms_norm(k, ..)
    Case("rmsnorm-library-npu", "variant_qknorm", "npu", "rmsnorm", nth=2, scan_target="npu"),  # inside self.up(...) in a call chain
    Case("rope-halves-npu-rotary-mul", "variant_qknorm", "npu", "rope"),
    Case("attention-sdpa-npu-fusion", "variant_qknorm", "npu", "attention", scan_target="npu"),
    # the Muon optimizer's Newton-Schulz step in both associations of the records (issue 28)
    Case("newton-schulz-addmm-npu", "variant_muon", "npu", function="net.py:orthogonalise_early"),
    Case("matmul-blend-addmm-npu", "variant_muon", "npu", function="net.py:orthogonalise_late"),
    Case("rmsnorm-expression-npu-rms-norm", "variant_muon", "npu", "rmsnorm", scan_target="npu"),
    Case("rope-function-npu-rotary-mul", "variant_qknorm", "npu", function="net.py:rotate_pairs"),  # by behaviour
    Case("rope-method-npu-rotary-mul", "real_speedrun", "npu", "rope"),  # Rotary.forward over its own buffers, by behaviour
    Case("rope-complex-npu-rotary-mul", "variant_polar", "npu", "rope"),  # view_as_complex(x) * polar freqs, by behaviour
    Case("rope-halves-npu-rotary-mul", "variant_qknorm", "npu", "rope", expect="diverges",
         mutate=("-torch.cat(($s, $s)", "torch.cat(($s, $s)")),  # the rotation's direction: r2 = -sin
    Case("rope-halves-npu-rotary-mul", "variant_qknorm", "npu", "rope", expect="diverges",
         mutate=("torch.cat(($c, $c), dim=-1)", "$c.repeat_interleave(2, dim=-1)")),  # per-half tables, not pairwise
    Case("attention-sdpa-npu-fusion", "variant_qknorm", "npu", "attention", scan_target="npu", expect="diverges",
         mutate=("atten_mask=atten_mask, scale=scale,", "atten_mask=atten_mask,")),  # npu_fusion_attention's scale defaults to 1.0
    Case("attention-sdpa-npu-fusion", "variant_qknorm", "npu", "attention", scan_target="npu", expect="diverges",
         mutate=("_tb_npu_causal_mask(query.device), 0, 2", "None, 2147483647, 0")),  # is_causal dropped: dense attention
    # --- the documented traps, each put back into a recipe: the numerics check must reject them ----
    Case("attention-sdpa-masked", "variant_clip", "cpu", "attention", expect="diverges",
         mutate=("attn_mask=torch.logical_not($m)", "attn_mask=$m")),  # SDPA's True = keep
    Case("geglu-npu-geglu", "variant_clip", "npu", "geglu", expect="diverges",
         mutate=("approximate=0", "approximate=1")),  # npu_geglu's default is tanh
    Case("swiglu-npu-swiglu", "variant_lm", "npu", "swiglu", expect="diverges",
         mutate=("torch.cat(($g, $u)", "torch.cat(($u, $g)")),  # the first half is activated
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention", expect="diverges",
         mutate=(", scale=$scale", "")),  # scale defaults to 1.0
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention", expect="diverges",
         mutate=("atten_mask=_tb_npu_causal_mask($q.device), ", "")),  # no mask: dense, sparse_mode ignored
    # npu_add_rms_norm has no backward: from torch_npu release 26.1.0 (the emulation's default) backward
    # through it raises; before, it only warned and the grads were lost
    Case("add-rms-norm-npu", "variant_lm", "npu", function="lm.py:Block.forward", expect="fails",
         expect_error=r"derivative for npu::npu_add_rms_norm is not implemented",
         mutate=("_tb_normed, $h = _TbAddRmsNorm.apply(",
                 "_tb_normed, _tb_rstd, $h = torch_npu.npu_add_rms_norm(")),
    Case("gelu-npu-gelu", "variant_clip", "npu", "gelu", nth=0, expect="diverges",
         mutate=("torch_npu.npu_gelu($x, approximate='none')", "torch_npu.npu_fast_gelu($x)")),  # QuickGELU
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward",
         expect="diverges", mutate=("_tb_npu_softmax_mask($m)", "~_tb_npu_softmax_mask($m)")),  # True = masked
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward",
         expect="diverges", mutate=(", 1.0, False)", ", 0.125, False)")),  # scale applies before the mask
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy", expect="fails",
         expect_error=r"reduction='mean' requires weight=None, ignore_index=-100 and label_smoothing=0",
         mutate=("$t.reshape(-1).long())", "$t.reshape(-1).long(), label_smoothing=0.1)")),  # fused backward's limit
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy", expect="fails",
         expect_error=r"does not require grad",
         mutate=(".long())[0], 0)", ".long())[1].mean(), 0)")),  # output #0 is the loss, #1 log_prob (no grad)
]
