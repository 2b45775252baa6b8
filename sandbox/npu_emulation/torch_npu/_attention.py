"""npu_fusion_attention and npu_fusion_attention_grad on the CPU (reference/npu/semantics.md section 1).

Forward per segment, in fp32 (fp64 for fp64 inputs): S = scale * (Q K^T + pse), excluded positions
dropped, m = rowmax, l = sum exp(S - m) (+ exp(sink - m)), P = exp(S - m) / l, dropout on P, O = P V.
Backward (explicit, as the registered npu_fusion_attention_grad): P recomputed from Q, K, the keep
set and the saved m, l; dS = P * (dP - rowsum(dP * P)); dQ = scale dS K, dK = scale dS^T Q (summed
over each GQA group), dV = P'^T dO.
"""

from __future__ import annotations

import torch

from . import _attention_plan as ap
from ._attention_checks import build_plan
from ._checks import check_int, check_tensor, compute_dtype, sum_to_shape
from ._generator import default_generator
from .npu._state import current_index
from .npu.graphs import refuse_capture

OP = ap.OP
# FlashAttentionKernelNpuOpApi.cpp dropout_gen_mask: philox_engine_inputs(10) (offset advances by 12)
_PHILOX_INCREMENT = 10
CAPTURE_HINT = ("torch_npu documents npu_fusion_attention as not supported in graph mode / aclgraph; capture "
                "npu_fusion_attention_v3 (input_layout BNSD) instead")


# --- math on one segment, BNSD ----------------------------------------------------------------


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _scores(q, k, pse, scale, group):
    s = q @ _repeat_kv(k, group).transpose(-1, -2)
    if pse is not None:
        s = s + pse
    return s * scale


def _probs(s, keep, m, l, sink_v):
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m_safe)
    if keep is not None:
        e = e.masked_fill(~keep, 0.0)
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    p = torch.where(l > 0, e / safe_l, torch.zeros_like(e))
    p_sink = None
    if sink_v is not None:
        p_sink = torch.where(l > 0, torch.exp(sink_v - m_safe) / safe_l, torch.zeros_like(l))
    return p, p_sink


def _on(t, like):
    """A plan tensor (keep-set or dropout bits, built on the host) on the device of `like`."""
    return t if t is None or t.device == like.device else t.to(like.device)


def _segment_forward(q, k, v, seg, pse, sink_v, scale, keep_prob, group):
    s = _scores(q, k, pse, scale, group)
    keep, drop = _on(seg.keep, q), _on(seg.drop, q)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    if sink_v is not None:
        m = torch.maximum(m, sink_v.expand_as(m))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.exp(s - m_safe).sum(dim=-1, keepdim=True)
    if sink_v is not None:
        l = l + torch.exp(sink_v - m_safe)
    p, _ = _probs(s, keep, m, l, sink_v)
    if drop is not None:
        p = p * drop / keep_prob
    return p @ _repeat_kv(v, group), m, l


def _segment_backward(q, k, v, do, seg, pse, sink_v, m, l, scale, keep_prob, group):
    s = _scores(q, k, pse, scale, group)
    keep, drop = _on(seg.keep, q), _on(seg.drop, q)
    p, p_sink = _probs(s, keep, m, l, sink_v)
    v_rep = _repeat_kv(v, group)
    pd = p * drop / keep_prob if drop is not None else p
    dv = pd.transpose(-1, -2) @ do
    dp = do @ v_rep.transpose(-1, -2)
    if drop is not None:
        dp = dp * drop / keep_prob
    row = (dp * p).sum(dim=-1, keepdim=True)
    ds = p * (dp - row)
    dq = scale * (ds @ _repeat_kv(k, group))
    dk = scale * (ds.transpose(-1, -2) @ q)
    b, nq = q.shape[0], q.shape[1]
    if group > 1:
        dk = dk.view(b, nq // group, group, *dk.shape[2:]).sum(dim=2)
        dv = dv.view(b, nq // group, group, *dv.shape[2:]).sum(dim=2)
    dpse = scale * ds if pse is not None else None
    dsink = -(p_sink * row).sum(dim=(0, 2, 3)) if sink_v is not None else None
    return dq, dk, dv, dpse, dsink


# --- statistics packing -----------------------------------------------------------------------


def _pack_stats(parts: list[torch.Tensor], plan: ap.Plan, dtype: torch.dtype) -> torch.Tensor:
    if plan.layout != "TND":
        return parts[0].to(dtype).expand(*parts[0].shape[:3], 8).contiguous()
    n_t = torch.cat([p[0, :, :, 0] for p in parts], dim=1).to(dtype)  # [N, T]
    if plan.softmax_layout == "TND":
        return n_t.t().unsqueeze(-1).expand(-1, -1, 8).contiguous()
    # default: the kernel writes N-major data into a tensor declared [T, N, 8]
    t = n_t.shape[1]
    return n_t.unsqueeze(-1).expand(-1, -1, 8).contiguous().view(t, plan.nq, 8)


def _unpack_stats(packed: torch.Tensor, plan: ap.Plan, cd: torch.dtype) -> list[torch.Tensor]:
    if plan.layout != "TND":
        return [packed[..., :1].to(cd)]
    if plan.softmax_layout == "TND":
        n_t = packed[..., 0].t()
    else:
        n_t = packed.reshape(plan.nq, -1, 8)[..., 0]
    out, pos = [], 0
    for seg in plan.segments:
        out.append(n_t[:, pos:pos + seg.sq].reshape(1, plan.nq, seg.sq, 1).to(cd))
        pos += seg.sq
    return out


# --- autograd ---------------------------------------------------------------------------------


def _pse_for(pse, cd):
    return pse.to(cd) if pse is not None else None


def _sink_for(sink, cd):
    return sink.to(cd).view(1, -1, 1, 1) if sink is not None else None


def _run_backward(query, key, value, dout, pse, sink, maxes, sums, plan):
    cd = compute_dtype(query.dtype)
    group = plan.nq // plan.nkv
    pse_c, sink_v = _pse_for(pse, cd), _sink_for(sink, cd)
    dqs, dks, dvs = [], [], []
    dpse = dsink = None
    for seg, m, l in zip(plan.segments, maxes, sums):
        q = ap.to_bnsd(query, plan.layout, plan.nq, seg, True).to(cd)
        k = ap.to_bnsd(key, plan.layout, plan.nkv, seg, False).to(cd)
        v = ap.to_bnsd(value, plan.layout, plan.nkv, seg, False).to(cd)
        if seg.sq == 0:
            dqs.append(q.new_zeros(q.shape))
            dks.append(k.new_zeros(k.shape))
            dvs.append(v.new_zeros(v.shape))
            continue
        do = ap.to_bnsd(dout, plan.layout, plan.nq, seg, True).to(cd)
        dq, dk, dv, dps, dsk = _segment_backward(q, k, v, do, seg, pse_c, sink_v, m, l, plan.scale,
                                                 plan.keep_prob, group)
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
        if dps is not None:
            dpse = sum_to_shape(dps, pse.shape)
        if dsk is not None:
            dsink = dsk if dsink is None else dsink + dsk
    return (
        ap.from_bnsd(dqs, plan.layout).to(query.dtype),
        ap.from_bnsd(dks, plan.layout).to(key.dtype),
        ap.from_bnsd(dvs, plan.layout).to(value.dtype),
        dpse.to(pse.dtype) if dpse is not None else None,
        dsink.to(sink.dtype) if dsink is not None else None,
    )


class _FusionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, pse, sink, plan):
        cd = compute_dtype(query.dtype)
        group = plan.nq // plan.nkv
        pse_c, sink_v = _pse_for(pse, cd), _sink_for(sink, cd)
        outs, maxes, sums = [], [], []
        for seg in plan.segments:
            q = ap.to_bnsd(query, plan.layout, plan.nq, seg, True).to(cd)
            k = ap.to_bnsd(key, plan.layout, plan.nkv, seg, False).to(cd)
            v = ap.to_bnsd(value, plan.layout, plan.nkv, seg, False).to(cd)
            if seg.sq == 0:
                outs.append(q.new_zeros(*q.shape[:3], plan.dv))
                maxes.append(q.new_zeros(*q.shape[:3], 1))
                sums.append(q.new_zeros(*q.shape[:3], 1))
                continue
            o, m, l = _segment_forward(q, k, v, seg, pse_c, sink_v, plan.scale, plan.keep_prob, group)
            outs.append(o)
            maxes.append(m)
            sums.append(l)
        out = ap.from_bnsd(outs, plan.layout).to(query.dtype)
        ctx.save_for_backward(query, key, value, pse, sink, *maxes, *sums)
        ctx.plan = plan
        stat_dtype = torch.float64 if cd == torch.float64 else torch.float32
        smax, ssum = _pack_stats(maxes, plan, stat_dtype), _pack_stats(sums, plan, stat_dtype)
        ctx.mark_non_differentiable(smax, ssum)
        return out, smax, ssum

    @staticmethod
    def backward(ctx, dout, _dmax, _dsum):
        plan = ctx.plan
        saved = ctx.saved_tensors
        query, key, value, pse, sink = saved[:5]
        n = len(plan.segments)
        maxes, sums = list(saved[5:5 + n]), list(saved[5 + n:5 + 2 * n])
        dq, dk, dv, dpse, dsink = _run_backward(query, key, value, dout, pse, sink, maxes, sums, plan)
        return dq, dk, dv, dpse, dsink, None


# --- dropout ---------------------------------------------------------------------------------


def _attach_dropout(plan, batch, dropout_mask, seed, offset, draw):
    """Set keep-bits on the segments; returns the (seed, offset) the op reports."""
    if plan.keep_prob >= 1.0:
        return seed, offset
    if dropout_mask is not None:
        check_tensor(OP, "dropout_mask", dropout_mask)
        bits = ap.unpack_keep_bits(dropout_mask, plan.numels)
    else:
        if draw:  # like the NPU code: seed/offset come from the NPU generator, user values overwritten
            seed, offset = default_generator(current_index()).philox_engine_inputs(_PHILOX_INCREMENT)
        bits = ap.generate_keep_bits(plan.numels, plan.keep_prob, seed, offset)
    ap.split_keep_bits(bits, plan, batch)
    return seed, offset


# --- public API -------------------------------------------------------------------------------


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """FlashAttentionScore. Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels).

    Pitfalls kept from torch_npu: scale defaults to 1.0; atten_mask True = masked (excluded); without
    atten_mask, sparse_mode and pre/next_tockens are ignored (dense attention); causal top-left is
    sparse_mode=2, bottom-right sparse_mode=3, both with the 2048x2048 triu(diagonal=1) template.
    Dropout: seed/offset from the emulated NPU generator (torch.npu.manual_seed), offset +12 per
    call, never the host generator; the bits are the emulation's own (Philox on DSA is not reproducible).
    The caller's seed/offset come back unchanged only with an external dropout_mask or keep_prob=1.
    Not capturable in an NPUGraph (torch_npu doc: "not supported in graph mode / aclgraph").
    """
    refuse_capture(OP, CAPTURE_HINT)
    return fusion_attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                            keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
                            actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink,
                            dropout_mask, seed, offset)


def fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                     scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                     prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                     sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0, *,
                     draw_seed=True):
    """npu_fusion_attention's work, shared by v1/v2/v3. draw_seed=False keeps the caller's seed/offset for an
    internally generated mask (v2 on Ascend950) instead of drawing them from the NPU generator."""
    plan, batch = build_plan(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                             keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
                             actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    seed_out, offset_out = _attach_dropout(plan, batch, dropout_mask, check_int(OP, "seed", seed),
                                           check_int(OP, "offset", offset), draw=draw_seed)
    out, smax, ssum = _FusionAttention.apply(query, key, value, pse, sink, plan)
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, smax, ssum, softmax_out, seed_out, offset_out, plan.numels


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """Explicit backward: (dq, dk, dv, dpse, dsink); dpse/dsink are empty when pse/sink are None.

    Uses softmax_max/softmax_sum (outputs #1/#2 of the forward) when given, else recomputes them;
    dropout bits are regenerated from (seed, offset) as the NPU backward does.
    """
    plan, batch = build_plan(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask,
                             scale_value, keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
                             actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    check_tensor(OP, "dy", dy)
    if dy.shape[:-1] != query.shape[:-1] or dy.dim() != query.dim():
        raise RuntimeError(
            f"npu_fusion_attention_grad: dy shape {tuple(dy.shape)} does not match the attention output of "
            f"query {tuple(query.shape)}"
        )
    _attach_dropout(plan, batch, None, check_int(OP, "seed", seed), check_int(OP, "offset", offset), draw=False)
    cd = compute_dtype(query.dtype)
    if (softmax_max is None) != (softmax_sum is None):
        raise RuntimeError("npu_fusion_attention_grad: pass both softmax_max and softmax_sum, or neither")
    with torch.no_grad():
        if softmax_max is None:
            _, smax, ssum = _FusionAttention.apply(query.detach(), key.detach(), value.detach(),
                                                   None if pse is None else pse.detach(),
                                                   None if sink is None else sink.detach(), plan)
        else:
            smax, ssum = softmax_max, softmax_sum
        maxes, sums = _unpack_stats(smax, plan, cd), _unpack_stats(ssum, plan, cd)
        dq, dk, dv, dpse, dsink = _run_backward(query, key, value, dy, pse, sink, maxes, sums, plan)
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return dq, dk, dv, dpse if dpse is not None else empty, dsink if dsink is not None else empty
