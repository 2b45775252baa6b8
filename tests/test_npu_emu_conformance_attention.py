"""Ascend's own op-test cases, against the emulation: npu_fusion_attention (v1, v2, v3) and their
explicit grads, including the dropout cases driven by the NPU generator and external masks (see
test_npu_emu_conformance_norm_rope.py for the conventions).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainbridge.tests.npu_emulation_support import tnpu, to_npu, upstream  # noqa: F401 (tnpu is a fixture)

OP = "Ascend/op-plugin test/test_custom_ops/"
FA, FA_GRAD = OP + "test_npu_flash_attention.py", OP + "test_npu_flash_attention_grad.py"
FA2, FA2_GRAD = OP + "test_npu_flash_attention_v2.py", OP + "test_npu_flash_attention_grad_v2.py"


def _rtol(expected, actual, prec=1e-4, prec16=1e-3):
    from torch_npu.testing import assert_rtol_equal

    assert_rtol_equal(expected, actual, prec, prec16)


def _bnsd_to_bsh(t):
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def _softmax(x):
    m = x.max(dim=-1, keepdim=True)[0]
    y = torch.exp(x - m)
    s = y.sum(dim=-1, keepdim=True)
    return y / s, m, s


def _golden(q, k, v, scale, drop=None, keep_prob=1.0, dy=None):
    """fp32 forward (and grads with dy) of the upstream goldens, BNSD in and out."""
    p, m, s = _softmax(torch.matmul(q, k.transpose(2, 3)) * scale)
    pd = p if drop is None else p * drop / keep_prob
    out = torch.matmul(pd, v)
    if dy is None:
        return out, m, s
    dp = torch.matmul(dy, v.transpose(2, 3))
    dpd = dp if drop is None else dp * drop / keep_prob
    ds = p * (dpd - (dpd * p).sum(-1, keepdim=True)) * scale
    return out, m, s, torch.matmul(ds, k), torch.matmul(ds.transpose(2, 3), q), torch.matmul(pd.transpose(2, 3), dy)


def _drop_mask_bits(tnpu, like, shape, seed, keep_prob):
    """The upstream get_drop_mask: manual_seed(seed), then _npu_dropout_gen_mask(seed, offset 0), unpacked."""
    tnpu.npu.set_compile_mode(jit_compile=False)
    tnpu.npu.manual_seed(seed)
    packed = tnpu._npu_dropout_gen_mask(to_npu(like), shape, p=1 - keep_prob, seed=seed, offset=0, parallel=True,
                                        sync=False)
    n = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(packed.cpu().numpy(), count=n, bitorder="little")).reshape(shape).float()


def _qkv(b, n, s, d, dtype=torch.float16):
    return [torch.randn(b, n, s, d, dtype=dtype) for _ in range(3)]


# --- v1 forward ---------------------------------------------------------------------------------


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention")
def test_flash_attention_bsh(tnpu):
    q, k, v = _qkv(1, 32, 128, 128)
    out = tnpu.npu_fusion_attention(*(to_npu(_bnsd_to_bsh(t)) for t in (q, k, v)), head_num=32, input_layout="BSH",
                                    scale=0.08838)[0]
    golden = _bnsd_to_bsh(_golden(q.float(), k.float(), v.float(), 0.08838)[0]).half()
    _rtol(golden, out.cpu())


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention_with_dropmask")
def test_flash_attention_with_dropmask(tnpu):
    """The op draws (seed, offset) from the NPU generator: after manual_seed(2) that is (2, 0), the mask
    _npu_dropout_gen_mask makes for seed 2, offset 0."""
    q, k, v = _qkv(1, 32, 256, 128)
    keep_prob = 0.9
    drop = _drop_mask_bits(tnpu, q, [1, 32, 256, 256], seed=2, keep_prob=keep_prob)
    golden = _bnsd_to_bsh(_golden(q.float(), k.float(), v.float(), 0.08838, drop, keep_prob)[0]).half()
    out = tnpu.npu_fusion_attention(*(to_npu(_bnsd_to_bsh(t)) for t in (q, k, v)), head_num=32, input_layout="BSH",
                                    scale=0.08838, keep_prob=keep_prob)
    assert (out[4], out[5]) == (2, 0)
    _rtol(golden, out[0].cpu())


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention_with_external_dropout_mask")
def test_flash_attention_with_external_dropout_mask(tnpu):
    b, n, s, d = 1, 32, 128, 128
    q, k, v = (to_npu(_bnsd_to_bsh(t)) for t in _qkv(b, n, s, d))
    tnpu.npu.manual_seed(123)
    mask = tnpu._npu_dropout_gen_mask(to_npu(torch.randn(1)), [b, n, s, s], p=0.2, seed=123, offset=0)
    out, smax, ssum, _, seed, offset, numels = tnpu.npu_fusion_attention(
        q, k, v, head_num=n, input_layout="BSH", scale=0.08838, dropout_mask=mask, seed=123, offset=0, keep_prob=0.8)
    assert out.shape == q.shape and smax.shape[:2] == (b, n) and ssum.shape[:2] == (b, n)
    assert (seed, offset, numels) == (123, 0, b * n * s * s)


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention_dropout_mask_reproducibility")
def test_flash_attention_dropout_mask_reproducibility(tnpu):
    b, n, s, d = 1, 32, 128, 128
    q, k, v = (to_npu(torch.randn(b, s, n * d, dtype=torch.float16)) for _ in range(3))
    tnpu.npu.manual_seed(456)
    mask = tnpu._npu_dropout_gen_mask(to_npu(torch.randn(1)), [b, n, s, s], p=0.1, seed=456, offset=0)
    r1, r2 = (tnpu.npu_fusion_attention(q, k, v, head_num=n, input_layout="BSH", scale=0.125, dropout_mask=mask,
                                        seed=456, offset=0, keep_prob=0.9)[0] for _ in range(2))
    _rtol(r1.cpu(), r2.cpu())


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention_without_dropout_mask")
def test_flash_attention_without_dropout_mask(tnpu):
    b, n, s, d = 1, 32, 128, 128
    q, k, v = (to_npu(_bnsd_to_bsh(t)) for t in _qkv(b, n, s, d))
    out = tnpu.npu_fusion_attention(q, k, v, head_num=n, input_layout="BSH", scale=0.125, dropout_mask=None, seed=0,
                                    offset=0, keep_prob=1.0)
    assert out[0].shape == q.shape and (out[4], out[5]) == (0, 0)


def _cu(lengths):
    return tuple(np.cumsum(lengths).tolist())


def _tnd_golden(q, k, v, dy, lq, lk, scale, drops=None, keep_prob=1.0):
    """Per sequence, GQA by repeating kv heads consecutively; returns out, max, sum ([T, N, 8]) and grads."""
    n1, n2 = q.shape[1], k.shape[1]
    outs, maxs, sums, dqs, dks, dvs = [], [], [], [], [], []
    qo = ko = 0
    for i, (a, b) in enumerate(zip(lq, lk)):
        qi = q[qo:qo + a].float().permute(1, 0, 2).unsqueeze(0)
        ki = k[ko:ko + b].float().permute(1, 0, 2).unsqueeze(0).repeat_interleave(n1 // n2, dim=1)
        vi = v[ko:ko + b].float().permute(1, 0, 2).unsqueeze(0).repeat_interleave(n1 // n2, dim=1)
        dyi = dy[qo:qo + a].float().permute(1, 0, 2).unsqueeze(0)
        o, m, s, dq, dk, dv = _golden(qi, ki, vi, scale, None if drops is None else drops[i], keep_prob, dyi)
        outs.append(o[0].permute(1, 0, 2))
        maxs.append(m[0].permute(1, 0, 2).expand(a, n1, 8))
        sums.append(s[0].permute(1, 0, 2).expand(a, n1, 8))
        dqs.append(dq[0].permute(1, 0, 2))
        dks.append(dk[0].reshape(n2, n1 // n2, b, -1).sum(1).permute(1, 0, 2))
        dvs.append(dv[0].reshape(n2, n1 // n2, b, -1).sum(1).permute(1, 0, 2))
        qo, ko = qo + a, ko + b
    return [torch.cat(t) for t in (outs, maxs, sums, dqs, dks, dvs)]


@upstream("npu_fusion_attention", FA, "test_npu_flash_attention_tnd (forward + backward, GQA 8/2, softmax_layout TND)")
def test_flash_attention_tnd(tnpu):
    n1, n2, d = 8, 2, 128
    scale = 1 / d ** 0.5
    lq, lk = [1, 2, 3], [3, 4, 5]
    q = (2 * (torch.rand([sum(lq), n1, d]) - 0.5)).half()
    k = (2 * (torch.rand([sum(lk), n2, d]) - 0.5)).half()
    v = (2 * (torch.rand([sum(lk), n2, d]) - 0.5)).half()
    dy = (2 * (torch.rand([sum(lq), n1, d]) - 0.5)).half()
    out_g, max_g, sum_g, dq_g, dk_g, dv_g = _tnd_golden(q, k, v, dy, lq, lk, scale)
    qd, kd, vd = (to_npu(t).requires_grad_() for t in (q, k, v))
    res = tnpu.npu_fusion_attention(qd, kd, vd, n1, scale=scale, input_layout="TND", actual_seq_qlen=_cu(lq),
                                    actual_seq_kvlen=_cu(lk), softmax_layout="TND")
    _rtol(out_g.half(), res[0].detach().cpu())
    _rtol(max_g, res[1].cpu())
    _rtol(sum_g, res[2].cpu())
    res[0].backward(to_npu(dy))
    _rtol(dq_g.half(), qd.grad.cpu())
    _rtol(dk_g.half(), kd.grad.cpu())
    _rtol(dv_g.half(), vd.grad.cpu())


# --- v1 explicit grad ---------------------------------------------------------------------------


def _grad_case(tnpu, grad_fn, s, keep_prob):
    q, k, v, dy = (torch.randn(1, 32, s, 128, dtype=torch.float16) for _ in range(4))
    drop = _drop_mask_bits(tnpu, q, [1, 32, s, s], seed=2, keep_prob=keep_prob) if keep_prob < 1 else None
    out, _, m, l, dq, _, _ = (lambda r: (r[0], None, r[1], r[2], r[3], r[4], r[5]))(
        _golden(q.float(), k.float(), v.float(), 0.08838, drop, keep_prob, dy.float()))
    result = grad_fn(*(to_npu(_bnsd_to_bsh(t)) for t in (q, k, v, dy)), to_npu(m.expand(1, 32, s, 8)),
                     to_npu(l.expand(1, 32, s, 8)), to_npu(_bnsd_to_bsh(out).half()), keep_prob, 32 * s * s)
    _rtol(_bnsd_to_bsh(dq), result[0].cpu().float(), prec=0.005, prec16=0.005)


@upstream("npu_fusion_attention_grad", FA_GRAD, "test_npu_flash_attention / test_npu_flash_attention_with_dropmask")
@pytest.mark.parametrize("s,keep_prob", [(128, 1.0), (256, 0.9)])
def test_flash_attention_grad(tnpu, s, keep_prob):
    def call(q, k, v, dy, smax, ssum, attn, kp, numels):
        return tnpu.npu_fusion_attention_grad(q, k, v, dy, head_num=32, input_layout="BSH", softmax_max=smax,
                                              softmax_sum=ssum, attention_in=attn, scale_value=0.08838, keep_prob=kp,
                                              numels=numels if kp < 1 else 0, seed=2, offset=0)
    _grad_case(tnpu, call, s, keep_prob)


# --- v2 -----------------------------------------------------------------------------------------


@upstream("npu_fusion_attention_v2", FA2, "test_npu_flash_attention_v2")
def test_flash_attention_v2(tnpu):
    q, k, v = _qkv(1, 32, 128, 128)
    out = tnpu.npu_fusion_attention_v2(*(to_npu(_bnsd_to_bsh(t)) for t in (q, k, v)), head_num=32,
                                       input_layout="BSH", scale=0.08838)[0]
    _rtol(_bnsd_to_bsh(_golden(q.float(), k.float(), v.float(), 0.08838)[0]).half(), out.cpu())


@upstream("npu_fusion_attention_v2", FA2, "test_npu_flash_attention_v2_with_dropmask")
def test_flash_attention_v2_with_dropmask(tnpu):
    q, k, v = _qkv(1, 32, 256, 128)
    drop = _drop_mask_bits(tnpu, q, [1, 32, 256, 256], seed=2, keep_prob=0.9)
    out = tnpu.npu_fusion_attention_v2(*(to_npu(_bnsd_to_bsh(t)) for t in (q, k, v)), head_num=32,
                                       input_layout="BSH", scale=0.08838, keep_prob=0.9)[0]
    _rtol(_bnsd_to_bsh(_golden(q.float(), k.float(), v.float(), 0.08838, drop, 0.9)[0]).half(), out.cpu())


@upstream("npu_fusion_attention_v2", FA2,
          "test_..._v2_with_external_dropout_mask / _dropout_mask_reproducibility / _without_dropout_mask")
def test_flash_attention_v2_external_mask_cases(tnpu):
    b, n, s, d = 1, 32, 128, 128
    q, k, v = (to_npu(_bnsd_to_bsh(t)) for t in _qkv(b, n, s, d))
    tnpu.npu.manual_seed(123)
    mask = tnpu._npu_dropout_gen_mask(to_npu(torch.randn(1)), [b, n, s, s], p=0.2, seed=123, offset=0)
    first = tnpu.npu_fusion_attention_v2(q, k, v, head_num=n, input_layout="BSH", scale=0.08838, keep_prob=0.8,
                                         dropout_mask=mask, seed=123, offset=0)
    again = tnpu.npu_fusion_attention_v2(q, k, v, head_num=n, input_layout="BSH", scale=0.08838, keep_prob=0.8,
                                         dropout_mask=mask, seed=123, offset=0)
    assert first[0].shape == q.shape and first[1].shape[:2] == (b, n) and first[2].shape[:2] == (b, n)
    _rtol(first[0].cpu(), again[0].cpu())
    plain = tnpu.npu_fusion_attention_v2(q, k, v, head_num=n, input_layout="BSH", scale=0.08838, keep_prob=1.0,
                                         dropout_mask=None, seed=0, offset=0)
    assert plain[0].shape == q.shape


@upstream("npu_fusion_attention_v2", FA2, "test_npu_flash_attention_v2_dropout_mask_with_offset_seed "
          "(Ascend950 only: there the user seed/offset are kept; on A2, the emulated chip, they are overwritten)")
def test_flash_attention_v2_user_seed_is_overwritten_on_a2(tnpu):
    q, k, v = (to_npu(_bnsd_to_bsh(t)) for t in _qkv(1, 4, 32, 16))
    tnpu.npu.manual_seed(5)
    out = tnpu.npu_fusion_attention_v2(q, k, v, head_num=4, input_layout="BSH", keep_prob=0.8, seed=100, offset=200)
    assert (out[4], out[5]) == (5, 0)


@upstream("npu_fusion_attention_grad_v2", FA2_GRAD,
          "test_npu_flash_attention_v2 / test_npu_flash_attention_v2_with_dropmask")
@pytest.mark.parametrize("s,keep_prob", [(128, 1.0), (256, 0.9)])
def test_flash_attention_grad_v2(tnpu, s, keep_prob):
    def call(q, k, v, dy, smax, ssum, attn, kp, numels):
        result = tnpu.npu_fusion_attention_grad_v2(q, k, v, dy, head_num=32, input_layout="BSH", softmax_max=smax,
                                                   softmax_sum=ssum, attention_in=attn, scale_value=0.08838,
                                                   keep_prob=kp, numels=numels if kp < 1 else 0, seed=2)
        assert len(result) == 7 and result[4].numel() == 0 and result[5].numel() == 0  # no rope inputs
        return result
    _grad_case(tnpu, call, s, keep_prob)


# --- v3 -----------------------------------------------------------------------------------------


@upstream("npu_fusion_attention_v3 / _grad_v3", "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/"
          "torch_npu-npu_fusion_attention_v3.md (no op test upstream)", "v1's BSH case through v3: tensor seed/offset")
def test_flash_attention_v3_matches_v1(tnpu):
    q, k, v = (to_npu(_bnsd_to_bsh(t)) for t in _qkv(1, 8, 64, 32))
    tnpu.npu.manual_seed(9)
    v3 = tnpu.npu_fusion_attention_v3(q, k, v, 8, "BSH", scale=0.125, keep_prob=0.9)
    assert len(v3) == 6 and v3[4].dtype == torch.int64 and (int(v3[4]), int(v3[5])) == (9, 0)
    tnpu.npu.manual_seed(9)
    v1 = tnpu.npu_fusion_attention(q, k, v, 8, "BSH", scale=0.125, keep_prob=0.9)
    _rtol(v1[0].cpu(), v3[0].cpu())
    dy = to_npu(torch.randn(q.shape, dtype=q.dtype))
    g3 = tnpu.npu_fusion_attention_grad_v3(q, k, v, dy, 8, "BSH", softmax_max=v3[1], softmax_sum=v3[2],
                                           attention_in=v3[0], scale_value=0.125, keep_prob=0.9, seed=v3[4],
                                           offset=v3[5])
    g1 = tnpu.npu_fusion_attention_grad(q, k, v, dy, 8, "BSH", softmax_max=v1[1], softmax_sum=v1[2],
                                        attention_in=v1[0], scale_value=0.125, keep_prob=0.9, seed=v1[4],
                                        offset=v1[5], numels=v1[6])
    for a, b in zip(g1[:3], g3[:3]):
        _rtol(a.cpu(), b.cpu())


# --- error cases of the binding (semantics.md 1.11) ---------------------------------------------


@upstream("npu_fusion_attention", "Ascend/op-plugin op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp",
          "binding TORCH_CHECKs (RuntimeError, binding text): head_num, keep_prob, layout, sparse_mode")
@pytest.mark.parametrize("kwargs,match", [
    (dict(head_num=0), r"head_num must > 0, but got 0"),
    (dict(keep_prob=0.0), r"The keep_prob value must be in range of \(0, 1\], but got 0.0"),
    (dict(keep_prob=1.5), r"The keep_prob value must be in range of \(0, 1\], but got 1.5"),
    (dict(input_layout="XYZ"), r"The input_layout should be BSH/SBH/BNSD/BSND/TND\(case-insensitive\), but got XYZ"),
    (dict(sparse_mode=9, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
     r"The sparse_mode value must be in range of \[0,6\], but got 9"),
])
def test_flash_attention_invalid_arguments(tnpu, kwargs, match):
    q = to_npu(torch.randn(1, 16, 32, dtype=torch.float16))
    args = dict(head_num=2, input_layout="BSH")
    args.update({k: (to_npu(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    with pytest.raises(RuntimeError, match=match):
        tnpu.npu_fusion_attention(q, q, q, **args)
