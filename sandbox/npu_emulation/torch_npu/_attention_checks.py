"""Argument validation of npu_fusion_attention and the construction of its `Plan`.

Checks follow reference/npu/semantics.md 1.2-1.6 and 1.11 (the binding's errors); messages name the
argument. `build_plan` turns a validated call into per-segment keep masks (one segment, or one per
TND sequence).
"""

from __future__ import annotations

import torch

from . import _attention_plan as ap
from ._checks import EMULATION_FLOAT_DTYPES, check_int, check_same_device, check_tensor, values_unknown

OP = ap.OP
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def check_layout(input_layout) -> str:
    if not isinstance(input_layout, str) or not input_layout:
        raise RuntimeError(f"The input_layout should be BSH/SBH/BNSD/BSND/TND(case-insensitive), but got {input_layout}")
    layout = input_layout.upper()
    if layout not in LAYOUTS:
        raise RuntimeError(f"The input_layout should be BSH/SBH/BNSD/BSND/TND(case-insensitive), but got {input_layout}")
    if layout == "TND" and input_layout != "TND":
        raise RuntimeError(f"{OP}: pass input_layout='TND' in upper case (torch_npu's TND checks are case-sensitive)")
    return layout


def _check_qkv_tensors(query, key, value, layout: str) -> None:
    want = 3 if layout in ("BSH", "SBH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(OP, name, t)
        if t.dim() not in (3, 4):
            raise RuntimeError(f"The shapes of the input {name} should be 3 or 4 dimensional, but got {t.dim()}-dimensional")
        if t.dim() != want:
            raise RuntimeError(f"{OP}: input_layout {layout} needs {want}-D {name}, got shape {tuple(t.shape)}")
        if t.dtype not in EMULATION_FLOAT_DTYPES:
            raise TypeError(f"{OP}: {name} has dtype {t.dtype}; use float16, bfloat16 or float32")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"{OP}: query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )


def check_qkv(query, key, value, head_num, layout: str) -> tuple[int, int, int, int, int, int, int]:
    """(B, Nq, Nkv, Sq, Skv, D, Dv) after checking shapes against the layout and head_num."""
    _check_qkv_tensors(query, key, value, layout)
    check_int(OP, "head_num", head_num)
    if head_num <= 0:
        raise RuntimeError(f"head_num must > 0, but got {head_num}")
    if layout in ("BSH", "SBH"):
        hq = query.shape[2]
        if hq % head_num:
            raise RuntimeError(f"{OP}: head_num={head_num} does not divide the hidden size of query ({hq}) in {layout}")
        d = hq // head_num
        if key.shape[2] % d:
            raise RuntimeError(f"{OP}: key hidden size {key.shape[2]} is not a multiple of the head dim {d} (H/head_num)")
        nkv = key.shape[2] // d
        if value.shape[2] % nkv:
            raise RuntimeError(f"{OP}: value hidden size {value.shape[2]} is not a multiple of the {nkv} key heads")
        b, nq, sq, d = ap.dims(query, layout, head_num)
        bk, _, skv, dk = ap.dims(key, layout, nkv)
        bv, _, sv, dv = ap.dims(value, layout, nkv)
    else:
        b, nq, sq, d = ap.dims(query, layout, None)
        bk, nkv, skv, dk = ap.dims(key, layout, None)
        bv, nv, sv, dv = ap.dims(value, layout, None)
        if nq != head_num:
            raise RuntimeError(
                f"{OP}: head_num={head_num} is inconsistent with query shape {tuple(query.shape)} ({layout}: N={nq})"
            )
        if nv != nkv:
            raise RuntimeError(f"{OP}: key has {nkv} heads but value has {nv}")
    if not b == bk == bv:
        raise RuntimeError(f"{OP}: batch sizes differ: query {b}, key {bk}, value {bv}")
    if skv != sv:
        raise RuntimeError(f"{OP}: key and value sequence lengths differ ({skv} vs {sv})")
    if d != dk:
        raise RuntimeError(f"{OP}: query head dim {d} must equal key head dim {dk}")
    if dv > dk:
        raise RuntimeError(f"{OP}: value head dim {dv} must not exceed key head dim {dk}")
    if nq % nkv:
        raise RuntimeError(f"{OP}: head_num={nq} must be a multiple of the key/value heads ({nkv}) for GQA/MQA")
    return b, nq, nkv, sq, skv, d, dv


def check_sparse_mode(sparse_mode, layout: str) -> int:
    check_int(OP, "sparse_mode", sparse_mode)
    allowed = (0, 1, 2, 3, 4, 6, 7, 8) if layout == "TND" else (0, 1, 2, 3, 4, 5, 6)
    if sparse_mode not in allowed:
        raise RuntimeError(
            ("The sparse_mode value must be in range of [0,4] or [6,8] for TND" if layout == "TND" else
             "The sparse_mode value must be in range of [0,6]") + f", but got {sparse_mode}"
        )
    if sparse_mode in (7, 8):
        raise NotImplementedError(
            f"{OP}: sparse_mode={sparse_mode} (context-parallel varlen) is valid on torch_npu but not emulated by "
            "trainbridge; check this call on an NPU"
        )
    return sparse_mode


def check_band(pre: int, nxt: int, sq: int, skv: int) -> None:
    if pre < 0 and nxt < 0:
        raise RuntimeError(f"{OP}: pre_tockens ({pre}) and next_tockens ({nxt}) must not both be negative")
    if nxt < 0 and (pre < -nxt or -nxt >= skv):
        raise RuntimeError(f"{OP}: next_tockens={nxt} < 0 requires pre_tockens >= {-nxt} and |next_tockens| < Skv={skv}")
    if pre < 0 and (nxt < -pre or -pre >= sq):
        raise RuntimeError(f"{OP}: pre_tockens={pre} < 0 requires next_tockens >= {-pre} and |pre_tockens| < Sq={sq}")


def check_template(mask: torch.Tensor, sparse_mode: int) -> None:
    side = ap.TEMPLATE_SIDE
    if values_unknown():  # a tracer's shapes-only run: the mask's values are stand-ins
        return
    if sparse_mode == 6:
        if tuple(mask.shape) != (3 * 1024, side) or not ap.same(mask, ap.prefix_template()):
            raise RuntimeError(
                f"{OP}: sparse_mode=6 needs the compressed prefix atten_mask [3072, 2048]: rows 0-2047 = "
                "torch.triu(ones(2048, 2048, bool), 1), rows 2048-3071 False in columns 0-1023 and True in 1024-2047"
            )
        return
    if tuple(mask.shape) != (side, side):
        raise RuntimeError(
            f"{OP}: sparse_mode={sparse_mode} needs the compressed atten_mask "
            f"torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1), got shape {tuple(mask.shape)}"
        )
    if not ap.same(mask, ap.causal_template()):
        raise RuntimeError(
            f"{OP}: sparse_mode={sparse_mode} reads atten_mask as the compressed causal template "
            "torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1) (True = masked); this mask differs "
            "(an SDPA-polarity tril mask?), and the NPU result for it is undocumented"
        )


def check_full_mask(mask: torch.Tensor, b: int, nq: int, sq: int, skv: int, layout: str) -> None:
    shape = tuple(mask.shape)
    if layout == "TND":
        if shape != (sq, skv):
            raise RuntimeError(
                f"{OP}: with TND, atten_mask for sparse_mode 0/1 must be [maxSq, maxSkv] = [{sq}, {skv}], got {shape}"
            )
        return
    allowed = [(sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, nq, sq, skv)]
    if shape not in allowed:
        raise RuntimeError(f"{OP}: atten_mask shape {shape} is not one of {allowed} (B={b}, Nq={nq}, Sq={sq}, Skv={skv})")


def _check_scalars(padding_mask, scale, keep_prob, inner_precise, softmax_layout, layout) -> None:
    if padding_mask is not None:
        raise RuntimeError(f"{OP}: padding_mask is not supported by torch_npu; leave it None")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{OP}: scale must be a float, got {scale!r}")
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)) or not 0.0 < keep_prob <= 1.0:
        raise RuntimeError(f"The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    if check_int(OP, "inner_precise", inner_precise) not in (0, 1, 2):
        raise RuntimeError(f"{OP}: inner_precise must be 0, 1 or 2, got {inner_precise}")
    if softmax_layout not in ("", "TND"):
        raise RuntimeError(f"{OP}: softmax_layout must be '' or 'TND', got {softmax_layout!r}")
    if softmax_layout == "TND" and layout != "TND":
        raise RuntimeError(f"{OP}: softmax_layout='TND' needs input_layout='TND', got {layout}")


def _check_pse_sink(pse, sink, query, layout, b, nq, sq, skv) -> None:
    if pse is not None:
        check_tensor(OP, "pse", pse)
        if layout == "TND":
            raise NotImplementedError(f"{OP}: pse with input_layout TND is not emulated by trainbridge")
        if pse.dtype != query.dtype:
            raise TypeError(
                f"{OP}: pse dtype {pse.dtype} must equal query dtype {query.dtype} "
                "(a mismatch is silently wrong on NPU)"
            )
        allowed = [(b, nq, sq, skv), (b, nq, 1, skv), (1, nq, sq, skv)]
        if tuple(pse.shape) not in allowed:
            if pse.dim() == 4 and pse.shape[2] == 1024 and sq > 1024:
                raise NotImplementedError(f"{OP}: the ALiBi-compressed pse (last 1024 rows) is not emulated")
            raise RuntimeError(f"{OP}: pse shape {tuple(pse.shape)} must be one of {allowed}")
    if sink is not None:
        check_tensor(OP, "sink", sink)
        if tuple(sink.shape) != (nq,) or sink.dtype not in (torch.float32, torch.float64):
            raise RuntimeError(
                f"{OP}: sink must be a float32 tensor of shape [{nq}] (one logit per query head), "
                f"got {sink.dtype} {tuple(sink.shape)}"
            )


def _sequences(layout, query, key, actual_seq_qlen, actual_seq_kvlen, sq, skv):
    """(q_rows, kv_rows, lengths): one entry per TND sequence, or a single whole-batch entry."""
    if layout != "TND":
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            raise RuntimeError(f"{OP}: actual_seq_qlen/actual_seq_kvlen are only for input_layout='TND' (got {layout})")
        return [None], [None], [(sq, skv)]
    q_rows = ap.cumulative_to_rows("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_rows = ap.cumulative_to_rows("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    if len(q_rows) != len(kv_rows):
        raise RuntimeError(
            f"{OP}: actual_seq_qlen and actual_seq_kvlen must have the same length ({len(q_rows)} vs {len(kv_rows)})"
        )
    lengths = [(qe - qs, ke - ks) for (qs, qe), (ks, ke) in zip(q_rows, kv_rows)]
    for i, (lq, lk) in enumerate(lengths):
        if lq > 0 and lk == 0:
            raise RuntimeError(f"{OP}: sequence {i} has {lq} queries but no keys (Sq_i != 0 with Skv_i = 0)")
    return q_rows, kv_rows, lengths


def _check_mask_args(mask, mode, layout, prefix, pre, nxt, lengths, b, nq) -> None:
    sq, skv = max(lq for lq, _ in lengths), max(lk for _, lk in lengths)
    if mode in (0, 1):
        check_full_mask(mask, b, nq, sq, skv, layout)
    elif mode == 5:
        if tuple(mask.shape) not in [(b, nq, sq, skv), (b, 1, sq, skv)]:
            raise RuntimeError(
                f"{OP}: sparse_mode=5 needs a full atten_mask [B, Nq, Sq, Skv] or [B, 1, Sq, Skv], "
                f"got {tuple(mask.shape)}"
            )
    else:
        check_template(mask, mode)
    if mode in (5, 6):
        n_prefix = b if layout != "TND" else len(lengths)
        if prefix is None or len(prefix) != n_prefix:
            raise RuntimeError(
                f"{OP}: sparse_mode={mode} needs prefix with one entry per batch/sequence ({n_prefix}), got {prefix!r}"
            )
        for idx, p in enumerate(prefix):
            lq, lk = lengths[idx] if layout == "TND" else lengths[0]
            low = 0 if lq > lk else lk - lq
            if not low <= int(p) <= lk:
                raise RuntimeError(f"{OP}: prefix[{idx}]={p} must lie in [{low}, {lk}] (Sq={lq}, Skv={lk})")
    for lq, lk in lengths:
        if lq == 0:
            continue
        if mode in (0, 4):
            check_band(pre, nxt, lq, lk)
        if layout == "TND" and mode == 3 and lq > lk:
            raise RuntimeError(f"{OP}: sparse_mode=3 with TND needs every Sq_i <= Skv_i (got {lq} > {lk})")
        if layout == "TND" and mode == 4 and (pre < 0 or lq - nxt > lk):
            raise RuntimeError(
                f"{OP}: sparse_mode=4 with TND needs pre_tockens >= 0 and Sq_i - next_tockens <= Skv_i "
                f"(Sq_i={lq}, Skv_i={lk})"
            )


def build_plan(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
               pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
               softmax_layout, sink) -> tuple[ap.Plan, int]:
    """Validate a call; returns the plan and the batch size of its segments (TND: 1)."""
    layout = check_layout(input_layout)
    b, nq, nkv, sq, skv, d, dv = check_qkv(query, key, value, head_num, layout)
    _check_scalars(padding_mask, scale, keep_prob, inner_precise, softmax_layout, layout)
    pre, nxt = check_int(OP, "pre_tockens", pre_tockens), check_int(OP, "next_tockens", next_tockens)
    mode = check_sparse_mode(sparse_mode, layout)
    _check_pse_sink(pse, sink, query, layout, b, nq, sq, skv)
    q_rows, kv_rows, lengths = _sequences(layout, query, key, actual_seq_qlen, actual_seq_kvlen, sq, skv)
    batch = 1 if layout == "TND" else b
    mask = None
    if atten_mask is not None:
        check_same_device(OP, query, atten_mask)
        mask = ap.as_bool_mask(check_tensor(OP, "atten_mask", atten_mask))
        _check_mask_args(mask, mode, layout, prefix, pre, nxt, lengths, b, nq)

    plan = ap.Plan(layout, nq, nkv, d, dv, float(scale), float(keep_prob), softmax_layout)
    for idx, ((lq, lk), qr, kr) in enumerate(zip(lengths, q_rows, kv_rows)):
        seg_prefix = None
        if mode in (5, 6) and mask is not None:
            seg_prefix = list(prefix) if layout != "TND" else [prefix[idx]]
        keep = ap.keep_mask(mode, mask, pre, nxt, lq, lk, seg_prefix, full_slice=layout == "TND")
        if lq > 0:
            ap.warn_fully_masked(keep, (batch, nq, lq, lk))
        plan.segments.append(ap.Segment(slice(*qr) if qr else None, slice(*kr) if kr else None, lq, lk, keep))
    plan.numels = batch * nq * sum(lq * lk for lq, lk in lengths)
    return plan, batch
