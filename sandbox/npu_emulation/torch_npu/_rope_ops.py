"""npu_apply_rotary_pos_emb and npu_interleave_rope: inference-oriented rotary ops without a backward.

npu_apply_rotary_pos_emb(query, key, cos, sin, layout='BSND', rotary_mode='half') updates query and
key IN PLACE with x*cos + rotate_half(x)*sin and returns them (op-plugin doc; golden of
test/test_custom_ops/test_npu_apply_rotary_pos_emb.py). A2/A3 limits kept: 'half' only, BSND (4-D)
or TND (3-D), D of 64 or 128, cos/sin [B, S, 1, D] (TND: [T, 1, D]), one dtype for all four.
npu_interleave_rope(x, cos, sin): x [B, N, S, D] with D = 64 is de-interleaved
(reshape [.., D/2, 2] -> transpose -> [.., D]) and then rotated with rotate_half; fp16/bf16 only.
Neither has a derivative: backward raises (release >= 26.1.0) or warns (see _no_backward).
"""

from __future__ import annotations

import torch

from ._checks import check_tensor, compute_dtype
from ._no_backward import ForwardOnly

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x, cos, sin):
    cd = compute_dtype(x.dtype)
    xf = x.to(cd)
    return (xf * cos.to(cd) + _rotate_half(xf) * sin.to(cd)).to(x.dtype)


def _check_apply(op, query, key, cos, sin, layout, rotary_mode):
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        check_tensor(op, name, t)
    if rotary_mode != "half":
        raise RuntimeError(f"{op}: rotary_mode must be 'half' on Atlas A2/A3 (got {rotary_mode!r})")
    if layout not in ("BSND", "TND"):
        raise RuntimeError(f"{op}: layout must be 'BSND' or 'TND' on Atlas A2/A3 (got {layout!r})")
    rank = 4 if layout == "BSND" else 3
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if t.dim() != rank:
            raise RuntimeError(f"{op}: {name} must be {rank}-D for layout {layout}, got shape {tuple(t.shape)}")
    if not query.dtype == key.dtype == cos.dtype == sin.dtype:
        raise RuntimeError(f"{op}: query, key, cos and sin must share one dtype")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"{op}: dtype must be float16, bfloat16 or float32, got {query.dtype}")
    d = query.shape[-1]
    if d not in (64, 128) or key.shape[-1] != d or cos.shape[-1] != d or sin.shape != cos.shape:
        raise RuntimeError(f"{op}: the last dim D of query/key/cos/sin must be equal and 64 or 128")
    lead = rank - 2
    if tuple(query.shape[:lead]) != tuple(key.shape[:lead]) or tuple(cos.shape[:lead]) != tuple(query.shape[:lead]):
        raise RuntimeError(f"{op}: the leading dims ({'B, S' if rank == 4 else 'T'}) of query, key, cos, sin must match")
    if cos.shape[-2] != 1:
        raise RuntimeError(f"{op}: the N dim of cos/sin must be 1, got shape {tuple(cos.shape)}")


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout='BSND', rotary_mode='half'):
    """In place: query, key <- x*cos + rotate_half(x)*sin; returns (query, key)."""
    op = "npu_apply_rotary_pos_emb"
    _check_apply(op, query, key, cos, sin, layout, rotary_mode)
    q_out = ForwardOnly.apply(op, _rope, query, cos, sin)
    k_out = ForwardOnly.apply(op, _rope, key, cos, sin)
    with torch.no_grad():
        query.detach().copy_(q_out.detach())
        key.detach().copy_(k_out.detach())
    return q_out, k_out


def _interleave(x, cos, sin):
    b, n, s, d = x.shape
    q = x.reshape(b, n, s, d // 2, 2).transpose(-1, -2).reshape(b, n, s, d)
    return _rope(q, cos, sin)


def npu_interleave_rope(x, cos, sin):
    """RoPE on interleaved pairs: de-interleave x (D = 64), then x*cos + rotate_half(x)*sin."""
    op = "npu_interleave_rope"
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_tensor(op, name, t)
        if t.dim() != 4:
            raise RuntimeError(f"{op}: {name} must be 4-D [B, N, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _HALF_DTYPES:
            raise RuntimeError(f"{op}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.shape[-1] != 64:
            raise RuntimeError(f"{op}: the D dim of {name} must be 64, got {t.shape[-1]}")
    if not x.dtype == cos.dtype == sin.dtype or cos.shape != sin.shape:
        raise RuntimeError(f"{op}: cos and sin must have one shape and x's dtype")
    b, _, s, _ = x.shape
    if cos.shape[0] != b or cos.shape[1] != 1 or cos.shape[2] not in (1, s):
        raise RuntimeError(f"{op}: cos/sin must be [B, 1, S or 1, D] for x {tuple(x.shape)}, got {tuple(cos.shape)}")
    return ForwardOnly.apply(op, _interleave, x, cos, sin)
