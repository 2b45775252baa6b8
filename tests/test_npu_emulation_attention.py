"""npu_fusion_attention / npu_fusion_attention_grad of the stand-in against a dense reference:
layouts, sparse modes, masks, GQA, TND varlen, dropout, validation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainbridge.tests.npu_emulation_support import (  # noqa: F401 (tnpu is a fixture)
    TEMPLATE,
    assert_close_all,
    grads_of,
    tnpu,
)


# ================================================================================ fusion attention


def _ref_attn(q, k, v, keep=None, scale=1.0, pse=None, sink=None, drop=None, keep_prob=1.0):
    """Plain PyTorch attention in BNSD; keep True = attended; GQA by consecutive head repeat."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = s * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        col = sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat((s, col), -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    if drop is not None:
        p = p * drop / keep_prob
    return p @ v


def _top_left(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril()


def _bottom_right(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=skv - sq)


def _window(sq, skv, w):  # flash-attn window_size=(w, 0): keys i+d-w .. i+d (w + 1 keys)
    ones = torch.ones(sq, skv, dtype=torch.bool)
    d = skv - sq
    return ones.tril(diagonal=d) & ~ones.tril(diagonal=d - w - 1)


def _qkv(b=2, nq=4, nkv=4, sq=5, skv=5, d=8, dtype=torch.float32, seed=13):
    torch.manual_seed(seed)
    return (torch.randn(b, nq, sq, d, dtype=dtype), torch.randn(b, nkv, skv, d, dtype=dtype),
            torch.randn(b, nkv, skv, d, dtype=dtype))


def test_fusion_attention_dense_default_scale_is_one_and_outputs(tnpu):
    q, k, v = _qkv()
    out = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD")
    assert len(out) == 7
    o, smax, ssum, softmax_out, seed, offset, numels = out
    torch.testing.assert_close(o, _ref_attn(q, k, v, scale=1.0))
    assert not torch.allclose(o, _ref_attn(q, k, v, scale=1 / math.sqrt(8)))
    assert smax.shape == ssum.shape == (2, 4, 5, 8) and smax.dtype == torch.float32
    assert softmax_out.shape == (0,)
    assert (seed, offset, numels) == (0, 0, 2 * 4 * 5 * 5)
    scores = q @ k.transpose(-1, -2)
    torch.testing.assert_close(smax, scores.amax(-1, keepdim=True).expand(-1, -1, -1, 8))
    torch.testing.assert_close(ssum[..., 0], torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1))
    torch.testing.assert_close(smax[..., 0] + ssum[..., 0].log(), torch.logsumexp(scores, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fusion_attention_half_precision_keeps_dtype_and_fp32_stats(tnpu, dtype):
    q, k, v = _qkv(sq=6, skv=6)
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    o, smax, ssum, softmax_out, *_ = tnpu.npu_fusion_attention(qh, kh, vh, 4, "BNSD", atten_mask=TEMPLATE, scale=0.35,
                                                                sparse_mode=2)
    assert o.dtype == dtype and softmax_out.dtype == dtype and smax.dtype == ssum.dtype == torch.float32
    want = _ref_attn(qh.double(), kh.double(), vh.double(), keep=_top_left(6, 6), scale=0.35)
    torch.testing.assert_close(o.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 7)])
def test_fusion_attention_sparse_mode_2_is_sdpa_causal(tnpu, sq, skv):
    q, k, v = _qkv(sq=sq, skv=skv)
    scale = 1 / math.sqrt(q.shape[-1])
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, scale=scale, next_tockens=0, sparse_mode=2)[0]
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))


@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 7)])
def test_fusion_attention_sparse_mode_3_is_bottom_right_causal(tnpu, sq, skv):
    q, k, v = _qkv(sq=sq, skv=skv)
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, sparse_mode=3)[0]
    keep = _bottom_right(sq, skv)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0))
    if sq != skv:  # the two alignments differ when Sq != Skv
        o2 = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, sparse_mode=2)[0]
        assert not torch.allclose(o, o2)


@pytest.mark.parametrize("mode,shape", [(0, (5, 5)), (1, (2, 1, 5, 5)), (0, (2, 4, 5, 5)), (1, (1, 1, 5, 5))])
def test_fusion_attention_explicit_mask_true_is_excluded(tnpu, mode, shape):
    q, k, v = _qkv()
    torch.manual_seed(14)
    mask = torch.rand(shape) < 0.4
    mask[..., 0] = False  # no fully masked row
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, sparse_mode=mode)[0]
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=1.0))
    o_u8 = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask.to(torch.uint8), sparse_mode=mode)[0]
    torch.testing.assert_close(o_u8, o)


@pytest.mark.parametrize("sq,skv,w", [(6, 6, 2), (4, 9, 3), (5, 5, 0)])
def test_fusion_attention_sliding_window_sparse_mode_4(tnpu, sq, skv, w):
    q, k, v = _qkv(sq=sq, skv=skv)
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, pre_tockens=w, next_tockens=0, sparse_mode=4)[0]
    keep = _window(sq, skv, w)
    assert int(keep.sum(-1).max()) == w + 1
    torch.testing.assert_close(o, _ref_attn(q, k, v, keep=keep))


def test_fusion_attention_mode_0_applies_band_with_mask(tnpu):
    q, k, v = _qkv(sq=6, skv=6)
    causal = ~_top_left(6, 6)
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=causal, pre_tockens=1, next_tockens=0)[0]
    torch.testing.assert_close(o, _ref_attn(q, k, v, keep=_window(6, 6, 1)))


def test_fusion_attention_mode_0_band_limits_are_inclusive(tnpu):
    """Mode 0 keeps -pre <= j - i <= next (top-left origin); the emulation applies mask and band together."""
    q, k, v = _qkv(sq=6, skv=8)
    none_masked = torch.zeros(6, 8, dtype=torch.bool)
    o = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=none_masked, pre_tockens=1, next_tockens=2)[0]
    rel = torch.arange(8).view(1, 8) - torch.arange(6).view(6, 1)
    torch.testing.assert_close(o, _ref_attn(q, k, v, keep=(rel >= -1) & (rel <= 2)))


def test_fusion_attention_without_mask_ignores_sparse_mode_and_window(tnpu):
    q, k, v = _qkv()
    dense = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    for kwargs in ({"sparse_mode": 2, "next_tockens": 0}, {"sparse_mode": 4, "pre_tockens": 1, "next_tockens": 0}):
        torch.testing.assert_close(tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", **kwargs)[0], dense)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND"])
def test_fusion_attention_layouts_agree_with_bnsd(tnpu, layout):
    q, k, v = _qkv(nq=4, nkv=2, sq=5, skv=7)
    want = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, sparse_mode=3)[0]

    def conv(t):
        b, n, s, d = t.shape
        return {"BSND": t.transpose(1, 2), "BSH": t.transpose(1, 2).reshape(b, s, n * d),
                "SBH": t.permute(2, 0, 1, 3).reshape(s, b, n * d)}[layout].contiguous()

    got = tnpu.npu_fusion_attention(conv(q), conv(k), conv(v), 4, layout, atten_mask=TEMPLATE, sparse_mode=3)[0]
    torch.testing.assert_close(got, conv(want))


def test_fusion_attention_gqa_backward_matches_reference(tnpu):
    q, k, v = _qkv(nq=6, nkv=2, sq=5, skv=6, dtype=torch.float64)
    scale = 0.3
    up = torch.randn(2, 6, 5, 8, dtype=torch.float64)
    keep = _bottom_right(5, 6)
    out, got = grads_of(lambda a, b, c: tnpu.npu_fusion_attention(a, b, c, 6, "BNSD", atten_mask=TEMPLATE, scale=scale,
                                                                 sparse_mode=3)[0], [q, k, v], up)
    ref, want = grads_of(lambda a, b, c: _ref_attn(a, b, c, keep=keep, scale=scale), [q, k, v], up)
    torch.testing.assert_close(out, ref)
    assert_close_all(got, want)


@pytest.mark.parametrize("case", ["dense", "causal3", "window4", "gqa_mask0", "pse", "sink"])
def test_fusion_attention_gradcheck_float64(tnpu, case):
    torch.manual_seed(15)
    nkv = 1 if case == "gqa_mask0" else 2
    q, k, v = _qkv(b=1, nq=2, nkv=nkv, sq=3, skv=4, d=4, dtype=torch.float64)
    extra, args = {}, [q, k, v]
    if case == "causal3":
        extra = dict(atten_mask=TEMPLATE, sparse_mode=3)
    elif case == "window4":
        extra = dict(atten_mask=TEMPLATE, sparse_mode=4, pre_tockens=1, next_tockens=0)
    elif case == "gqa_mask0":
        mask = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
        extra = dict(atten_mask=mask)
    names = []
    if case == "pse":
        args.append(torch.randn(1, 2, 3, 4, dtype=torch.float64))
        names.append("pse")
    if case == "sink":
        args.append(torch.randn(2, dtype=torch.float64))
        names.append("sink")
    args = [a.requires_grad_(True) for a in args]

    def fn(a, b, c, *rest):
        return tnpu.npu_fusion_attention(a, b, c, 2, "BNSD", scale=0.5, **extra, **dict(zip(names, rest)))[0]

    assert torch.autograd.gradcheck(fn, tuple(args))


def test_fusion_attention_pse_added_before_scale_and_sink(tnpu):
    q, k, v = _qkv(b=1, nq=2, nkv=2, sq=3, skv=4)
    pse = torch.randn(1, 2, 3, 4)
    o = tnpu.npu_fusion_attention(q, k, v, 2, "BNSD", pse=pse, scale=0.5)[0]
    torch.testing.assert_close(o, _ref_attn(q, k, v, scale=0.5, pse=pse))  # scale * (QK^T + pse)
    sink = torch.randn(2)
    o = tnpu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.5, sink=sink)[0]
    torch.testing.assert_close(o, _ref_attn(q, k, v, scale=0.5, sink=sink))


def _tnd(lq, lk, n=2, nkv=2, d=4, dtype=torch.float32, seed=16):
    torch.manual_seed(seed)
    return torch.randn(sum(lq), n, d, dtype=dtype), torch.randn(sum(lk), nkv, d, dtype=dtype), \
        torch.randn(sum(lk), nkv, d, dtype=dtype)


def _cum(lengths):
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def _tnd_reference(q, k, v, lq, lk, keep_fn, scale=1.0):
    outs, qs, ks = [], 0, 0
    for a, b in zip(lq, lk):
        if a:
            qi, ki, vi = (t.permute(1, 0, 2).unsqueeze(0) for t in (q[qs:qs + a], k[ks:ks + b], v[ks:ks + b]))
            outs.append(_ref_attn(qi, ki, vi, keep=keep_fn(a, b), scale=scale)[0].permute(1, 0, 2))
        qs, ks = qs + a, ks + b
    return torch.cat(outs)


@pytest.mark.parametrize("mode", [3, 4])
def test_fusion_attention_tnd_varlen(tnpu, mode):
    lq, lk = [3, 5, 0, 2], [4, 5, 2, 3]
    q, k, v = _tnd(lq, lk, dtype=torch.float64)
    extra = dict(pre_tockens=1, next_tockens=0) if mode == 4 else {}
    keep_fn = (lambda a, b: _window(a, b, 1)) if mode == 4 else _bottom_right
    up = torch.randn(q.shape, dtype=torch.float64)

    def fused(a, b, c):
        return tnpu.npu_fusion_attention(a, b, c, 2, "TND", atten_mask=TEMPLATE, scale=0.7, sparse_mode=mode,
                                         actual_seq_qlen=_cum(lq), actual_seq_kvlen=_cum(lk), **extra)[0]

    out, got = grads_of(fused, [q, k, v], up)
    ref, want = grads_of(lambda a, b, c: _tnd_reference(a, b, c, lq, lk, keep_fn, 0.7), [q, k, v], up)
    torch.testing.assert_close(out, ref)
    assert_close_all(got, want)
    assert got[1][sum(lk[:2]):sum(lk[:3])].abs().max() == 0  # keys of the empty-query sequence get no grad


def test_fusion_attention_tnd_statistics_layout(tnpu):
    lq = lk = [2, 3]
    q, k, v = _tnd(lq, lk, n=3, nkv=3)
    common = dict(atten_mask=TEMPLATE, sparse_mode=3, actual_seq_qlen=_cum(lq), actual_seq_kvlen=_cum(lk))
    _, smax_default, *_ = tnpu.npu_fusion_attention(q, k, v, 3, "TND", **common)
    _, smax_tnd, *rest = tnpu.npu_fusion_attention(q, k, v, 3, "TND", softmax_layout="TND", **common)
    assert smax_default.shape == smax_tnd.shape == (5, 3, 8)
    assert rest[-1] == 3 * (2 * 2 + 3 * 3)  # numels = Nq * sum(Sq_i * Skv_i)
    want = []  # row max of each sequence's causal scores, [T, N]
    for s, (a, b) in zip([0, 2], zip(lq, lk)):
        sc = (q[s:s + a].permute(1, 0, 2) @ k[s:s + b].permute(1, 2, 0)).masked_fill(~_bottom_right(a, b), -math.inf)
        want.append(sc.amax(-1).t())
    want = torch.cat(want)
    torch.testing.assert_close(smax_tnd[..., 0], want)
    torch.testing.assert_close(smax_default.view(3, 5, 8)[..., 0], want.t())  # N-major data by default


def test_fusion_attention_prefix_modes_5_and_6(tnpu):
    q, k, v = _qkv(b=2, sq=5, skv=6)
    prefix = [4, 2]
    keep = torch.stack([_bottom_right(5, 6) | (torch.arange(6) < p).view(1, 6) for p in prefix]).unsqueeze(1)
    prefix_template = torch.zeros(3072, 2048, dtype=torch.bool)
    prefix_template[:2048] = TEMPLATE
    prefix_template[2048:, 1024:] = True
    o6 = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=prefix_template, prefix=prefix, sparse_mode=6)[0]
    torch.testing.assert_close(o6, _ref_attn(q, k, v, keep=keep))
    o5 = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~keep, prefix=prefix, sparse_mode=5)[0]
    torch.testing.assert_close(o5, o6)
    with pytest.raises(RuntimeError, match="prefix\\[1\\]=0 must lie in \\[1, 6\\]"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=prefix_template, prefix=[4, 0], sparse_mode=6)
    with pytest.raises(RuntimeError, match="needs prefix"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=prefix_template, sparse_mode=6)


def test_fusion_attention_tnd_full_mask_and_grad_api(tnpu):
    lq, lk = [2, 4], [3, 4]
    q, k, v = _tnd(lq, lk, n=2, nkv=1, dtype=torch.float64)
    torch.manual_seed(20)
    mask = torch.rand(4, 4) < 0.3  # [maxSq, maxSkv], sliced top-left per sequence
    mask[:, 0] = False
    common = dict(atten_mask=mask, sparse_mode=1, actual_seq_qlen=_cum(lq), actual_seq_kvlen=_cum(lk))
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, smax, ssum, *_ = tnpu.npu_fusion_attention(qs, ks, vs, 2, "TND", **common)
    ref = _tnd_reference(q, k, v, lq, lk, lambda a, b: ~mask[:a, :b])
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape, dtype=torch.float64)
    out.backward(dy)
    dq, dk, dv, _, _ = tnpu.npu_fusion_attention_grad(q, k, v, dy, 2, "TND", softmax_max=smax, softmax_sum=ssum,
                                                      **common)
    assert_close_all([dq, dk, dv], [qs.grad, ks.grad, vs.grad])
    # wrong statistics give wrong gradients: the explicit backward really uses them
    bad = tnpu.npu_fusion_attention_grad(q, k, v, dy, 2, "TND", softmax_max=smax, softmax_sum=ssum * 2, **common)
    assert not torch.allclose(bad[0], dq)


def test_fusion_attention_dropout_with_external_mask(tnpu):
    q, k, v = _qkv(b=1, nq=2, nkv=2, sq=3, skv=4)
    torch.manual_seed(17)
    numels = 1 * 2 * 3 * 4
    bits = torch.rand(numels) < 0.7
    padded = torch.cat((bits, torch.zeros(-numels % 8, dtype=torch.bool))).view(-1, 8)
    packed = (padded.to(torch.int32) << torch.arange(8)).sum(-1).to(torch.uint8)  # little-endian bits
    o = tnpu.npu_fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.7, dropout_mask=packed)[0]
    torch.testing.assert_close(o, _ref_attn(q, k, v, drop=bits.view(1, 2, 3, 4), keep_prob=0.7))


def test_fusion_attention_grad_api_matches_autograd_with_dropout(tnpu):
    q, k, v = _qkv(b=2, nq=2, nkv=1, sq=4, skv=4, dtype=torch.float64)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    common = dict(atten_mask=TEMPLATE, sparse_mode=2, keep_prob=0.6, scale=0.4)
    out, smax, ssum, _, seed, offset, numels = tnpu.npu_fusion_attention(qs, ks, vs, 2, "BNSD", **common)
    dy = torch.randn(out.shape, dtype=torch.float64)
    out.backward(dy)
    assert not torch.allclose(out, tnpu.npu_fusion_attention(q, k, v, 2, "BNSD", **{**common, "keep_prob": 1.0})[0])
    kwargs = {k2: v2 for k2, v2 in common.items() if k2 != "scale"}
    dq, dk, dv, dpse, dsink = tnpu.npu_fusion_attention_grad(
        q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(), scale_value=0.4,
        seed=seed, offset=offset, numels=numels, **kwargs)
    assert_close_all([dq, dk, dv], [qs.grad, ks.grad, vs.grad])
    assert dpse.numel() == 0 and dsink.numel() == 0


def test_fusion_attention_fully_masked_row_warns(tnpu):
    q, k, v = _qkv(b=1, nq=1, nkv=1, sq=2, skv=2)
    mask = torch.tensor([[True, True], [False, False]])
    with pytest.warns(RuntimeWarning, match="every key masked"):
        o = tnpu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    assert torch.all(o[0, 0, 0] == 0)


@pytest.mark.parametrize("call,error,match", [
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 0, "BNSD"), RuntimeError, "head_num must > 0"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 3, "BNSD"), RuntimeError, "head_num=3 is inconsistent"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BHSD"), RuntimeError, "input_layout should be BSH/SBH/BNSD/BSND/TND\\(case-insensitive\\), but got BHSD"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BSH"), RuntimeError, "needs 3-D query"),
    (lambda t, q, k, v: t.npu_fusion_attention(q[0, 0], k[0, 0], v[0, 0], 4, "BNSD"), RuntimeError, "should be 3 or 4 dimensional"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", sparse_mode=9), RuntimeError, "sparse_mode value"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.0), RuntimeError, "keep_prob"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=1.5), RuntimeError, "keep_prob"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(5, 5)), TypeError,
     "bool or uint8"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~TEMPLATE, sparse_mode=2), RuntimeError,
     "compressed causal template"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~_top_left(5, 5), sparse_mode=3),
     RuntimeError, "compressed atten_mask"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
     RuntimeError, "atten_mask shape"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, sparse_mode=4,
                                               pre_tockens=-1, next_tockens=-1), RuntimeError, "both be negative"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", softmax_layout="TND"), RuntimeError,
     "softmax_layout='TND' needs"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", padding_mask=q), RuntimeError, "padding_mask"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k.half(), v, 4, "BNSD"), TypeError, "share one dtype"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", pse=torch.zeros(2, 4, 5, 5).double()), TypeError,
     "pse dtype"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", actual_seq_qlen=[5]), RuntimeError, "only for"),
])
def test_fusion_attention_validation(tnpu, call, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        call(tnpu, q, k, v)


def test_fusion_attention_validation_bsh_and_tnd(tnpu):
    q = torch.randn(2, 5, 12)
    with pytest.raises(RuntimeError, match="head_num=5 does not divide"):
        tnpu.npu_fusion_attention(q, q, q, 5, "BSH")
    lq = lk = [2, 3]
    tq, tk, tv = _tnd(lq, lk)
    with pytest.raises(RuntimeError, match="needs actual_seq_qlen"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND")
    with pytest.raises(RuntimeError, match="same length"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[5])
    with pytest.raises(RuntimeError, match="cumulative"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[3, 2], actual_seq_kvlen=[2, 5])
    with pytest.raises(RuntimeError, match="upper case"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "tnd", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5])
    with pytest.raises(RuntimeError, match="sparse_mode value"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], sparse_mode=5)
    with pytest.raises(NotImplementedError, match="sparse_mode=7"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], sparse_mode=7)
    kq, kk, kv = _tnd([3, 2], [2, 3])
    with pytest.raises(RuntimeError, match="every Sq_i <= Skv_i"):
        tnpu.npu_fusion_attention(kq, kk, kv, 2, "TND", atten_mask=TEMPLATE, sparse_mode=3,
                                  actual_seq_qlen=[3, 5], actual_seq_kvlen=[2, 5])


