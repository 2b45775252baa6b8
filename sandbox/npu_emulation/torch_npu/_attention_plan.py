"""The plan of an npu_fusion_attention call: layouts, keep masks per sparse_mode, TND offsets, dropout bits.

Follows reference/npu/semantics.md section 1 (1.3-1.9). A `Plan` holds the validated call: its
segments (the whole batch, or one per TND sequence) with their keep masks and dropout bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from ._checks import values_unknown
from ._dropout_mask import drop_prob_from_keep, keep_bits


OP = "npu_fusion_attention"
TEMPLATE_SIDE = 2048


@dataclass
class Segment:
    """One attention problem in BNSD (batch b0:b1 of the layout, or a TND sequence)."""

    q_rows: slice | None  # TND: rows of the packed T axis; None for the whole batch
    kv_rows: slice | None
    sq: int
    skv: int
    keep: torch.Tensor | None  # bool, broadcastable to [B, Nq, sq, skv]; None = dense
    drop: torch.Tensor | None = None  # bool keep-bits [B, Nq, sq, skv] when keep_prob < 1


@dataclass
class Plan:
    layout: str
    nq: int
    nkv: int
    d: int
    dv: int
    scale: float
    keep_prob: float
    softmax_layout: str
    segments: list[Segment] = field(default_factory=list)
    numels: int = 0


# --- layouts --------------------------------------------------------------------------------


def to_bnsd(t: torch.Tensor, layout: str, heads: int, seg: Segment, is_q: bool) -> torch.Tensor:
    if layout == "TND":
        rows = seg.q_rows if is_q else seg.kv_rows
        return t[rows].permute(1, 0, 2).unsqueeze(0)
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).permute(0, 2, 1, 3)
    s, b, h = t.shape  # SBH
    return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)


def from_bnsd(parts: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Inverse of to_bnsd over all segments (one part per segment)."""
    if layout == "TND":
        return torch.cat([p[0].permute(1, 0, 2) for p in parts], dim=0).contiguous()
    (o,) = parts
    if layout == "BNSD":
        return o.contiguous()
    if layout == "BSND":
        return o.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = o.shape
    if layout == "BSH":
        return o.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return o.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def dims(t: torch.Tensor, layout: str, heads: int | None) -> tuple[int, int, int, int]:
    """(B, N, S, D) of a layout tensor; heads=None derives N from D (key/value in BSH/SBH)."""
    if layout in ("BSH", "SBH"):
        b, s, h = (t.shape[0], t.shape[1], t.shape[2]) if layout == "BSH" else (t.shape[1], t.shape[0], t.shape[2])
        return b, heads, s, h // heads
    if layout == "BSND":
        return t.shape[0], t.shape[2], t.shape[1], t.shape[3]
    if layout == "BNSD":
        return tuple(t.shape)  # type: ignore[return-value]
    return 1, t.shape[1], t.shape[0], t.shape[2]  # TND: (1, N, T, D)


# --- masks ----------------------------------------------------------------------------------

_TEMPLATE: torch.Tensor | None = None


def causal_template() -> torch.Tensor:
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = torch.triu(torch.ones(TEMPLATE_SIDE, TEMPLATE_SIDE, dtype=torch.bool, device="cpu"), diagonal=1)
    return _TEMPLATE


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of two CPU bool tensors (numpy's compare is much faster than torch.equal here)."""
    a = a.detach().cpu().contiguous()
    try:
        import numpy
    except ImportError:
        return torch.equal(a, b)
    return a.shape == b.shape and bool(numpy.array_equal(a.numpy(), b.numpy()))


def as_bool_mask(atten_mask: torch.Tensor) -> torch.Tensor:
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"{OP}: atten_mask must be bool or uint8 with True/1 = masked (excluded), got {atten_mask.dtype}; "
            "convert an additive float mask with `mask < 0` (or `~keep` for an SDPA-style keep mask)"
        )
    return atten_mask.bool().cpu()  # the keep-set is planned on the host; moved to the inputs' device at use


def prefix_template() -> torch.Tensor:
    """The [3072, 2048] mask of sparse_mode 6."""
    want = torch.zeros(3 * 1024, TEMPLATE_SIDE, dtype=torch.bool, device="cpu")
    want[:TEMPLATE_SIDE] = causal_template()
    want[TEMPLATE_SIDE:, 1024:] = True
    return want


def keep_mask(
    sparse_mode: int,
    mask: torch.Tensor | None,
    pre: int,
    nxt: int,
    sq: int,
    skv: int,
    prefix: list[int] | None,
    full_slice: bool,
) -> torch.Tensor | None:
    """Bool keep-set broadcastable to [B, Nq, sq, skv]; None means dense (no mask given)."""
    if mask is None:
        return None
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    delta = skv - sq
    if sparse_mode in (0, 1, 5):
        m = mask[:sq, :skv] if full_slice else mask
        keep = ~m.reshape(1, 1, sq, skv) if m.dim() == 2 else ~m
        if sparse_mode == 0:
            keep = keep & ((j - i) >= -pre) & ((j - i) <= nxt)
        return keep
    if sparse_mode == 2:
        return (j <= i).view(1, 1, sq, skv)
    if sparse_mode == 3:
        return (j <= i + delta).view(1, 1, sq, skv)
    if sparse_mode == 4:
        rel = j - i - delta
        return ((rel >= -pre) & (rel <= nxt)).view(1, 1, sq, skv)
    # sparse_mode 6: prefix, compressed -> keep iff causal (bottom-right) or j < prefix[b]
    pre_t = torch.tensor(prefix, dtype=torch.long).view(-1, 1, 1, 1)
    return (j <= i + delta).view(1, 1, sq, skv) | (j.view(1, 1, 1, skv) < pre_t)


def warn_fully_masked(keep: torch.Tensor | None, shape: tuple[int, int, int, int]) -> None:
    if keep is None or values_unknown():
        return
    if not torch.broadcast_to(keep, shape).any(dim=-1).all():
        warnings.warn(
            f"{OP}: some query rows have every key masked; the NPU output for such rows is undocumented "
            "(the emulation returns zeros there). Avoid fully masked rows in comparisons.",
            RuntimeWarning,
            stacklevel=4,
        )


# --- TND offsets ----------------------------------------------------------------------------


def cumulative_to_rows(name: str, offsets, total: int) -> list[tuple[int, int]]:
    """Cumulative end offsets (no leading 0; trailing zeros exclude sequences) -> [(start, end)]."""
    if offsets is None:
        raise RuntimeError(f"{OP}: input_layout TND needs {name} (cumulative end offsets, e.g. cu_seqlens[1:])")
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    offsets = [int(v) for v in offsets]
    if not offsets:
        raise RuntimeError(f"{OP}: {name} must not be empty")
    n = len(offsets)
    while n > 1 and offsets[n - 1] == 0:
        n -= 1
    rows, start = [], 0
    for k, end in enumerate(offsets[:n]):
        if end < start:
            raise RuntimeError(f"{OP}: {name} must be cumulative (non-decreasing) end offsets, got {offsets} (entry {k})")
        rows.append((start, end))
        start = end
    if start != total:
        raise RuntimeError(f"{OP}: the last entry of {name} ({start}) must equal T ({total}), got {offsets}")
    return rows + [(start, start)] * (len(offsets) - n)


# --- dropout --------------------------------------------------------------------------------


def generate_keep_bits(numels: int, keep_prob: float, seed: int, offset: int) -> torch.Tensor:
    """The bits the NPU's DropoutGenMask makes for (1 - keep_prob, seed, offset): 1 = keep (see _dropout_mask)."""
    return keep_bits(numels, drop_prob_from_keep(keep_prob), seed, offset)


def unpack_keep_bits(dropout_mask: torch.Tensor, numels: int) -> torch.Tensor:
    """Packed uint8 mask, little-endian bit order inside each byte, 1 = keep."""
    if dropout_mask.dtype != torch.uint8:
        raise TypeError(f"{OP}: dropout_mask must be a packed uint8 tensor, got {dropout_mask.dtype}")
    flat = dropout_mask.reshape(-1)
    if flat.numel() * 8 < numels:
        raise RuntimeError(f"{OP}: dropout_mask holds {flat.numel() * 8} bits, needs {numels}")
    bits = (flat.to(torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:numels].bool()


def split_keep_bits(bits: torch.Tensor, plan: Plan, batch: int) -> None:
    pos = 0
    for seg in plan.segments:
        n = batch * plan.nq * seg.sq * seg.skv
        seg.drop = bits[pos:pos + n].view(batch, plan.nq, seg.sq, seg.skv)
        pos += n
