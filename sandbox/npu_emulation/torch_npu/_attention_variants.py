"""npu_fusion_attention_v2 / _v3 and their explicit grads, on top of the v1 emulation (_attention).

v2 (semantics.md 1.1): everything after input_layout keyword-only, `pre_tokens`/`next_tokens`
spelling, `query_rope`/`key_rope` (extra rope head dims: scores = scale * (q k^T + q_r k_r^T + pse)),
`pse_type` 1 = v1 ("add pse, then scale"), 0 = `scale * q k^T + pse`; 2/3 (ALiBi generated inside
the kernel from slopes, with q_start_idx/kv_start_idx) are not emulated and raise. Returns v1's
7-tuple; npu_fusion_attention_grad_v2 returns (dq, dk, dv, dpse, dq_rope, dk_rope, dsink).
Seed/offset of v2 (op-plugin FlashAttentionV2KernelNpuOpApi.cpp `dropout_gen_mask`): with
0 < keep_prob < 1 and no dropout_mask, A2/A3 draw them from the NPU generator (the caller's values are
overwritten, like v1), Ascend950 keeps the caller's values and makes the mask from them (_soc picks the
chip); with an external dropout_mask or keep_prob=1 they come back as given on every chip.
v3 (graph capture): v1's arguments, but actual_seq_* are CPU int64 tensors, no dropout_mask/seed/
offset arguments, and seed/offset come back as int64 tensors (6 outputs, no numels): CPU tensors,
device tensors inside an NPUGraph capture (torch_npu doc). npu_fusion_attention_grad_v3 takes them as
tensors. v1 and v2 refuse a capture; v3 is captured for input_layout BNSD (what the doc says aclgraph
supports) without dropout (per-replay Philox offsets are not emulated).
"""

from __future__ import annotations

import torch

from ._attention import CAPTURE_HINT, fusion_attention, npu_fusion_attention_grad
from ._soc import is_ascend950
from .npu.graphs import is_current_stream_capturing, refuse_capture

OP2 = "npu_fusion_attention_v2"
OP3 = "npu_fusion_attention_v3"


def _split_heads(t: torch.Tensor, layout: str, heads_dim_size: int):
    """(view with a separate head-dim axis last, function back to the layout)."""
    if layout in ("BSH", "SBH"):
        d = heads_dim_size
        return t.reshape(*t.shape[:-1], -1, d), lambda u: u.reshape(*u.shape[:-2], -1)
    return t, lambda u: u


def _cat_rope(x: torch.Tensor, rope: torch.Tensor | None, layout: str, head_dim: int, rope_dim: int | None):
    if rope is None:
        return x
    xs, back = _split_heads(x, layout, head_dim)
    rs, _ = _split_heads(rope, layout, rope_dim)
    return back(torch.cat((xs, rs), dim=-1))


def _head_dims(query, head_num, layout, query_rope):
    if layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        dr = query_rope.shape[-1] // head_num if query_rope is not None else None
    else:
        d = query.shape[-1]
        dr = query_rope.shape[-1] if query_rope is not None else None
    return d, dr


def _check_v2(pse_type, query_rope, key_rope, q_start_idx, kv_start_idx):
    if pse_type not in (0, 1, 2, 3):
        raise RuntimeError(f"{OP2}: pse_type must be 0, 1, 2 or 3, got {pse_type!r}")
    if pse_type in (2, 3):
        raise NotImplementedError(
            f"{OP2}: pse_type={pse_type} (ALiBi generated inside the kernel) is not emulated by trainbridge; "
            "pass an explicit pse with pse_type 0 or 1"
        )
    if (query_rope is None) != (key_rope is None):
        raise RuntimeError(f"{OP2}: query_rope and key_rope must be given together")
    if q_start_idx is not None or kv_start_idx is not None:
        raise NotImplementedError(f"{OP2}: q_start_idx/kv_start_idx only matter for pse_type 2/3 (not emulated)")


def _v2_inputs(query, key, head_num, input_layout, pse, query_rope, key_rope, scale, pse_type):
    layout = str(input_layout).upper()
    d, dr = _head_dims(query, head_num, layout, query_rope)
    q = _cat_rope(query, query_rope, layout, d, dr)
    k = _cat_rope(key, key_rope, layout, d, dr)
    pse_eff = pse
    if pse is not None and pse_type == 0:  # scale*qk + pse == scale*(qk + pse/scale)
        pse_eff = pse / scale
    return q, k, pse_eff, layout, d, dr


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                            atten_mask=None, query_rope=None, key_rope=None, scale=1., keep_prob=1.,
                            pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                            sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout="",
                            sink=None, dropout_mask=None, seed=0, offset=0):
    """v2 of npu_fusion_attention: 7 outputs like v1 (take [0]); seed/offset as in the module doc."""
    refuse_capture(OP2, CAPTURE_HINT)
    _check_v2(pse_type, query_rope, key_rope, q_start_idx, kv_start_idx)
    q, k, pse_eff, _, _, _ = _v2_inputs(query, key, head_num, input_layout, pse, query_rope, key_rope, scale,
                                        pse_type)
    return fusion_attention(q, k, value, head_num, input_layout, pse_eff, padding_mask, atten_mask, scale,
                            keep_prob, pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen,
                            actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink,
                            dropout_mask, seed, offset, draw_seed=not is_ascend950())


def _split_back(grad: torch.Tensor, layout: str, d: int, dr: int | None):
    if dr is None:
        return grad, None
    gs, back = _split_heads(grad, layout, d + dr)
    return back(gs[..., :d].contiguous()), back(gs[..., d:].contiguous())


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1., keep_prob=1.,
                                 pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, seed=0, offset=0,
                                 numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                 gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                                 kv_start_idx=None, softmax_layout="", sink=None):
    """(dq, dk, dv, dpse, dq_rope, dk_rope, dsink); absent optional inputs give empty tensors."""
    _check_v2(pse_type, query_rope, key_rope, q_start_idx, kv_start_idx)
    q, k, pse_eff, layout, d, dr = _v2_inputs(query, key, head_num, input_layout, pse, query_rope, key_rope,
                                              scale_value, pse_type)
    dq, dk, dv, dpse, dsink = npu_fusion_attention_grad(
        q, k, value, dy, head_num, input_layout, pse=pse_eff, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tockens=pre_tokens, next_tockens=next_tokens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
        gen_mask_parallel=gen_mask_parallel, sync=sync, softmax_layout=softmax_layout, sink=sink)
    if pse is not None and pse_type == 0 and dpse.numel():
        dpse = dpse / scale_value
    dq, dq_rope = _split_back(dq, layout, d, dr)
    dk, dk_rope = _split_back(dk, layout, d, dr)
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return (dq, dk, dv, dpse, dq_rope if dq_rope is not None else empty,
            dk_rope if dk_rope is not None else empty, dsink)


def _seq_list(name: str, value):
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"npu_fusion_attention_v3: {name} must be a CPU int64 tensor (v3), got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise RuntimeError(f"npu_fusion_attention_v3: {name} must be int64, got {value.dtype}")
    return [int(v) for v in value.reshape(-1).tolist()]


def _check_capturable(input_layout, keep_prob) -> None:
    if str(input_layout).upper() != "BNSD":
        raise RuntimeError(f"{OP3}: aclgraph (NPUGraph capture) supports input_layout BNSD only (torch_npu doc), "
                           f"got {input_layout!r}")
    if keep_prob < 1:
        raise NotImplementedError(f"{OP3}: dropout (keep_prob={keep_prob}) inside an NPUGraph capture is not emulated "
                                  "by trainbridge (a replay draws a new Philox offset on the NPU)")


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                            atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
                            next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                            actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                            softmax_layout="", sink=None):
    """v3: (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset) with seed/offset int64 tensors."""
    capturing = is_current_stream_capturing()
    if capturing:
        _check_capturable(input_layout, keep_prob)
    out = fusion_attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
                           _seq_list("actual_seq_qlen", actual_seq_qlen),
                           _seq_list("actual_seq_kvlen", actual_seq_kvlen), sparse_mode, gen_mask_parallel,
                           sync, softmax_layout, sink)
    where = query.device if capturing else "cpu"
    seed_t = torch.tensor([out[4]], dtype=torch.int64, device=where)
    offset_t = torch.tensor([out[5]], dtype=torch.int64, device=where)
    return out[0], out[1], out[2], out[3], seed_t, offset_t


def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                                 next_tockens=2147483647, inner_precise=0, seed=None, offset=None, prefix=None,
                                 actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                 sync=False, softmax_layout="", sink=None):
    """(dq, dk, dv, dpse, dsink); seed/offset are the v3 forward's tensors."""
    # read on the host only where dropout needs them (a capture refuses host reads of device tensors)
    drops = keep_prob < 1
    seed_i = int(seed.reshape(-1)[0]) if drops and isinstance(seed, torch.Tensor) else 0
    offset_i = int(offset.reshape(-1)[0]) if drops and isinstance(offset, torch.Tensor) else 0
    return npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
        inner_precise=inner_precise, seed=seed_i, offset=offset_i, numels=0, prefix=prefix,
        actual_seq_qlen=_seq_list("actual_seq_qlen", actual_seq_qlen),
        actual_seq_kvlen=_seq_list("actual_seq_kvlen", actual_seq_kvlen), sparse_mode=sparse_mode,
        gen_mask_parallel=gen_mask_parallel, sync=sync, softmax_layout=softmax_layout, sink=sink)
