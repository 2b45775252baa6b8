"""Ascend's own op-test cases, against the emulation: GELU variants, scaled masked softmax,
cross-entropy, format casts and dropout masks (see test_npu_emu_conformance_norm_rope.py for the
conventions: @upstream names the mirrored test; shapes, dtypes and tolerances are upstream's, except fewer rows in
the scaled-masked-softmax and cross-entropy cases, where rows are independent: see _SMS_CASES and _CE_SHAPES).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainbridge.tests.npu_emulation_support import tnpu, to_npu, upstream  # noqa: F401 (tnpu is a fixture)

OP = "Ascend/op-plugin test/test_custom_ops/"
OP_BASE = "Ascend/op-plugin test/test_base_ops/"
PT = "Ascend/pytorch test/custom_ops/"


def _rtol(expected, actual, prec=1e-4, prec16=1e-3):
    from torch_npu.testing import assert_rtol_equal

    assert_rtol_equal(expected, actual, prec, prec16)


# --- GELU ---------------------------------------------------------------------------------------

_FAST_X = [1.0, 2.0, 3.0, 4.0]
_FAST_Y = [0.8458, 1.9357, 2.9819, 3.9956]
_FAST_DY = [1.0677795, 1.0738151, 1.0245483, 1.0064018]


@upstream("fast_gelu / npu_fast_gelu", OP_BASE + "test_fast_gelu.py", "TestFastGelu / TestNpuFastGelu")
@pytest.mark.parametrize("name", ["fast_gelu", "npu_fast_gelu"])
def test_fast_gelu(tnpu, name):
    out = getattr(tnpu, name)(to_npu(torch.tensor(_FAST_X)))
    _rtol(np.array(_FAST_Y, dtype=np.float32), out.cpu().numpy())


@upstream("fast_gelu / npu_fast_gelu (backward)", OP_BASE + "test_fast_gelu_backward.py",
          "TestFastGelu / TestNpuFastGeluBackward")
@pytest.mark.parametrize("name", ["fast_gelu", "npu_fast_gelu"])
def test_fast_gelu_backward(tnpu, name):
    x = to_npu(torch.tensor(_FAST_X)).requires_grad_()
    out = getattr(tnpu, name)(x)
    out.backward(torch.ones_like(out))
    _rtol(np.array(_FAST_DY, dtype=np.float32), x.grad.cpu().numpy())
    _rtol(np.array(_FAST_Y, dtype=np.float32), out.detach().cpu().numpy())


@upstream("npu_gelu", OP + "test_npu_gelu.py", "test_npu_gelu")
def test_npu_gelu(tnpu):
    tnpu.npu.config.allow_internal_format = False
    x = torch.rand([100, 400], dtype=torch.float16)
    tnpu.npu.synchronize()
    out = tnpu.npu_gelu(to_npu(x), approximate="tanh")
    tnpu.npu.synchronize()
    _rtol(F.gelu(x, approximate="tanh").half(), out.cpu().half())


@upstream("npu_gelu_backward", OP + "test_npu_gelu_backward.py", "test_npu_gelu_backward")
def test_npu_gelu_backward(tnpu):
    x = torch.rand([100, 400], dtype=torch.float16)
    g = torch.rand([100, 400], dtype=torch.float16)
    out = tnpu.npu_gelu_backward(to_npu(g), to_npu(x), approximate="tanh")
    _rtol(torch.ops.aten.gelu_backward(g, x, approximate="tanh").half(), out.cpu().half())


# --- npu_scaled_masked_softmax ------------------------------------------------------------------

# (x dtype, x shape, mask shape) of the upstream shape_format (formats do not change values), with a batch of 2 where
# upstream has 16: softmax is per row and the mask broadcasts over heads alike, so the batch only repeats rows (the
# suite's clock: the 16-batch 512x512 cases took a minute each on a loaded 2-core host)
_SMS_BATCH = 2
_SMS_CASES = [
    (np.float16, (_SMS_BATCH, 6, 128, 128), (_SMS_BATCH, 6, 128, 128)),
    (np.float16, (_SMS_BATCH, 6, 128, 512), (_SMS_BATCH, 1, 128, 512)),
    (np.float16, (_SMS_BATCH, 6, 512, 512), (_SMS_BATCH, 1, 512, 512)),
    (np.float32, (_SMS_BATCH, 6, 128, 128), (_SMS_BATCH, 6, 128, 128)),
    (np.float32, (_SMS_BATCH, 6, 128, 512), (_SMS_BATCH, 1, 128, 512)),
    (np.float32, (_SMS_BATCH, 6, 512, 512), (_SMS_BATCH, 1, 512, 512)),
]


def _sms_golden(x, mask, scale):
    return F.softmax((x.float() * scale).masked_fill(mask, value=-10000), dim=-1)


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_scaled_masked_softmax", OP_BASE + "test_scaled_masked_softmax.py",
          "test_scaled_masked_softmax_shape_format (forward; upstream-skipped)")
@pytest.mark.parametrize("dtype,x_shape,mask_shape", _SMS_CASES)
def test_scaled_masked_softmax(tnpu, dtype, x_shape, mask_shape):
    """Golden rounded to the output dtype: the current binding returns x's dtype, while the skipped test
    compares against fp16 (semantics.md section 8, conflict 10)."""
    x = torch.from_numpy(np.random.uniform(-5, 5, x_shape).astype(dtype))
    mask = torch.from_numpy(np.random.uniform(-1, 1, mask_shape).astype(dtype)) > 0
    scale = random.uniform(-1, 1)
    out = tnpu.npu_scaled_masked_softmax(to_npu(x), to_npu(mask), scale, False)
    assert out.dtype == x.dtype
    _rtol(_sms_golden(x, mask, scale).to(x.dtype).numpy(), out.cpu().numpy())


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_scaled_masked_softmax (backward)", OP_BASE + "test_scaled_masked_softmax.py",
          "test_scaled_masked_softmax_shape_format (backward; upstream-skipped)")
@pytest.mark.parametrize("dtype,x_shape,mask_shape", _SMS_CASES)
def test_scaled_masked_softmax_backward(tnpu, dtype, x_shape, mask_shape):
    x = torch.from_numpy(np.random.uniform(-5, 5, x_shape).astype(dtype))
    dy = torch.from_numpy(np.random.uniform(-5, 5, x_shape).astype(dtype))
    mask = torch.from_numpy(np.random.uniform(-1, 1, mask_shape).astype(dtype)) > 0
    scale = random.uniform(-1, 1)
    xg = x.detach().clone().float().requires_grad_()  # not x itself: x.float() of fp32 x would alias it
    _sms_golden(xg, mask, scale).backward(dy.float())
    xd = to_npu(x).requires_grad_()
    tnpu.npu_scaled_masked_softmax(xd, to_npu(mask), scale, False).backward(to_npu(dy))
    _rtol(xg.grad.half().numpy(), xd.grad.cpu().half().numpy())


@upstream("npu_scaled_masked_softmax", PT + "test_npu_scaled_masked_softmax.py",
          "test_scaled_masked_softmax_triu_false (upstream-skipped)")
def test_scaled_masked_softmax_triu_false(tnpu):
    x = torch.randn(16, 6, 128, 128, dtype=torch.float32)
    mask = torch.randn(16, 6, 128, 128, dtype=torch.float32) > 0
    out = tnpu.npu_scaled_masked_softmax(to_npu(x), to_npu(mask), 0.334, False)
    _rtol(_sms_golden(x, mask, 0.334).numpy(), out.cpu().numpy())


@upstream("npu_scaled_masked_softmax", PT + "test_npu_scaled_masked_softmax.py",
          "test_scaled_masked_softmax_triu_true (upstream-skipped): fixed_triu_mask is reserved (doc), raises here")
def test_scaled_masked_softmax_triu_true_is_reserved(tnpu):
    x = to_npu(torch.randn(16, 6, 128, 128))
    with pytest.raises(RuntimeError, match="fixed_triu_mask=True is reserved"):
        tnpu.npu_scaled_masked_softmax(x, to_npu(torch.zeros(16, 6, 128, 128, dtype=torch.bool)), 0.56, True)


# --- npu_cross_entropy_loss ---------------------------------------------------------------------


def _ce_golden(n, c, pred, target, weight, ignore_index, label_smoothing, reduction):
    weight = torch.ones(c) if weight is None else weight
    p = pred.float()
    lsm = p - p.max(1, keepdim=True)[0] - torch.log(torch.exp(p - p.max(1, keepdim=True)[0]).sum(-1, keepdim=True))
    nll = lsm.gather(1, target.reshape(-1, 1)).reshape(-1)
    w_y = weight.gather(0, target)
    keep = (target - ignore_index).bool().float() if ignore_index >= 0 else torch.ones(n)
    loss = -nll * w_y * keep
    smooth = -(lsm * weight.unsqueeze(0)).sum(-1) * (keep if ignore_index >= 0 else 1)
    if reduction == "mean":
        denom = (w_y * keep).sum()
        ret = ((1 - label_smoothing) * loss.sum() / denom + smooth.sum() / denom * label_smoothing / c).reshape(1)
    elif reduction == "sum":
        ret = ((1 - label_smoothing) * loss.sum() + smooth.sum() * label_smoothing / c).reshape(1)
    else:
        ret = (1 - label_smoothing) * loss + smooth * label_smoothing / c
    return ret.to(pred.dtype), lsm.to(pred.dtype)


# upstream's class counts (8080: not a multiple of 16; 8192) with 512 rows where upstream has 4096: each row's
# log-softmax is independent and the reductions still sum hundreds of rows in the low-precision dtypes
_CE_SHAPES = [[512, 8080], [512, 8192]]


def _ce_tol(dtype):
    return {torch.bfloat16: dict(prec16=2 ** -6), torch.float16: dict(prec=2 ** -7, prec16=2 ** -7)}.get(
        dtype, dict(prec=2 ** -10))


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_cross_entropy_loss", OP + "test_npu_cross_entropy_loss.py",
          "test_npu_cross_entropy_loss (upstream-skipped)")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", _CE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cross_entropy_loss(tnpu, shape, dtype, reduction):
    n, c = shape
    x = torch.randn(n, c).to(dtype)
    target = torch.arange(0, n)
    loss, log_prob, _, _ = tnpu.npu_cross_entropy_loss(to_npu(x), to_npu(target), None, reduction=reduction)
    g_loss, g_lp = _ce_golden(n, c, x, target, None, -100, 0.0, reduction)
    assert tuple(loss.shape) == ((n,) if reduction == "none" else (1,))
    _rtol(g_loss, loss.cpu(), **_ce_tol(dtype))
    _rtol(g_lp, log_prob.cpu(), **_ce_tol(dtype))


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_cross_entropy_loss (backward)", OP + "test_npu_cross_entropy_loss.py",
          "test_npu_cross_entropy_loss_backward (upstream-skipped)")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", _CE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cross_entropy_loss_backward(tnpu, shape, dtype, reduction):
    n, c = shape
    x = torch.randn(n, c).to(dtype)
    target = torch.arange(0, n)
    xg = x.clone().requires_grad_()
    _ce_golden(n, c, xg, target, None, -100, 0.0, reduction)[0].sum().backward()
    xd = to_npu(x).requires_grad_()
    tnpu.npu_cross_entropy_loss(xd, to_npu(target), None, reduction=reduction)[0].sum().backward()
    _rtol(xg.grad, xd.grad.cpu(), **_ce_tol(dtype))


# --- npu_format_cast / get_npu_format -----------------------------------------------------------


def _fmt_tensor(tnpu, fmt, shape):
    t = to_npu(torch.from_numpy(np.random.uniform(1, 5, shape).astype(np.float16)))
    return tnpu.npu_format_cast(t, fmt) if fmt != -1 else t


@upstream("npu_format_cast", OP_BASE + "test_format_cast.py", "test_format_cast_backward")
def test_format_cast_keeps_requires_grad(tnpu):
    a = to_npu(torch.rand(2, 3)).requires_grad_()
    assert tnpu.npu_format_cast(a, 29).requires_grad is True


@upstream("npu_format_cast", OP_BASE + "test_format_cast.py", "test_format_cast_tensor")
def test_format_cast_tensor(tnpu):
    for src_fmt in (0, 2):
        src = _fmt_tensor(tnpu, src_fmt, (2, 2, 4, 4))
        for dst_fmt, shape in ((3, (2, 2, 4, 4)), (4, (2, 2, 4, 4)), (29, (2, 2, 4, 4)), (30, (2, 2, 2, 4, 4))):
            dst = _fmt_tensor(tnpu, dst_fmt, shape)
            assert tnpu.get_npu_format(tnpu.npu_format_cast(src, dst)) == tnpu.get_npu_format(dst)


@upstream("npu_format_cast", OP_BASE + "test_format_cast.py", "test_format_cast")
def test_format_cast_sequences(tnpu):
    t = _fmt_tensor(tnpu, -1, (2, 2, 4, 4))
    for fmt, expected in ((2, 2), (3, 3), (0, 0), (3, 3), (2, 0)):  # 5HD back to ND gives its base NCHW
        t = tnpu.npu_format_cast(t, fmt)
        assert tnpu.get_npu_format(t) == expected
    for fmt in [0, 2, 0, 4, 0, 29, 0, 2, 4, 0, 2, 29, 0]:
        t = tnpu.npu_format_cast(t, fmt)
        assert tnpu.get_npu_format(t) == fmt
    t = t.view(2, 2, 2, 2, 4).clone()
    for fmt in [30, 33, 30, 2, 33, 2, 30, 32, 30, 2, 32, 2]:
        t = tnpu.npu_format_cast(t, fmt)
        assert tnpu.get_npu_format(t) == fmt
    values = torch.rand(2, 3)
    assert torch.equal(tnpu.npu_format_cast(to_npu(values), 29).cpu(), values)  # values never change


@upstream("npu_format_cast_", OP_BASE + "test_format_cast.py", "test_format_cast_inplace")
def test_format_cast_inplace(tnpu):
    t = _fmt_tensor(tnpu, -1, (2, 2, 4, 4))
    for fmt in (2, 3):
        t = tnpu.npu_format_cast_(t, fmt)
        assert tnpu.get_npu_format(t) == fmt


# --- _npu_dropout_gen_mask ----------------------------------------------------------------------


@upstream("_npu_dropout_gen_mask", OP + "test_npu_dropout_gen_mask.py", "test_dropout_gen_full_mask")
def test_dropout_gen_full_mask(tnpu):
    tnpu.npu.set_compile_mode(jit_compile=False)
    x = torch.randn(32, 16, dtype=torch.float16)
    out = tnpu._npu_dropout_gen_mask(to_npu(x), x.shape, 0.0, 1, 0, parallel=False)
    numels = 32 * 16
    expected = np.zeros((numels + 127) // 128 * 128 // 8, dtype=np.uint8)
    expected[: (numels + 7) // 8] = 255
    _rtol(expected, out.cpu().numpy())


@upstream("_npu_dropout_gen_mask", OP + "test_npu_dropout_gen_mask.py", "test_dropout_gen_mask")
def test_dropout_gen_mask(tnpu):
    x = torch.randn(17, 19)
    out = tnpu._npu_dropout_gen_mask(to_npu(x), x.shape, 0.4, 1, 0, parallel=False)
    assert out.dtype == torch.uint8 and out.numel() == (17 * 19 + 127) // 128 * 128 // 8
    kept = np.unpackbits(out.cpu().numpy(), count=17 * 19, bitorder="little").mean()
    assert 0.45 < kept < 0.75  # keep probability 0.6


@upstream("_npu_dropout_gen_mask", OP + "test_npu_dropout_gen_mask.py", "test_gen_mask_enable_parallel")
def test_gen_mask_enable_parallel(tnpu):
    x = torch.randn(17, 19)
    a = tnpu._npu_dropout_gen_mask(to_npu(x), x.shape, 0.7, 2, 100, parallel=True)
    b = tnpu._npu_dropout_gen_mask(to_npu(x), x.shape, 0.7, 2, 100, parallel=False)
    _rtol(a.cpu().numpy(), b.cpu().numpy())


@upstream("_npu_dropout_gen_mask", OP + "test_npu_dropout_gen_mask.py", "p outside [0, 1] (binding TORCH_CHECK)")
def test_dropout_gen_mask_rejects_bad_p(tnpu):
    with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1, but got 1.5"):
        tnpu._npu_dropout_gen_mask(to_npu(torch.randn(4)), [4], 1.5, 1, 0)


# --- npu_geglu / npu_swiglu ---------------------------------------------------------------------


@upstream("npu_geglu", PT + "test_npu_geglu.py", "test_npu_geglu_fp16 / _fp32 (upstream-skipped)")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_geglu(tnpu, dtype):
    """The skipped upstream golden uses erf GELU while calling approximate=1 (tanh): semantics.md
    section 8, conflict 6. Inputs in [-1, 1] keep the two within the upstream tolerance; the tanh
    golden must match exactly as well."""
    x = torch.from_numpy(np.random.uniform(-1, 1, [2, 10, 1024]).astype(dtype))
    y, gelu = tnpu.npu_geglu(to_npu(x), -1, 1, False)
    left, right = x.chunk(2, dim=-1)
    for mode, prec in (("none", 1e-3), ("tanh", 1e-4)):
        g = F.gelu(right.float(), approximate=mode).to(x.dtype)
        _rtol((left * g).numpy(), y.cpu().numpy(), prec=prec)
        _rtol(g.numpy(), gelu.cpu().numpy(), prec=prec)


@upstream("npu_geglu (backward)", PT + "test_npu_geglu_backward.py", "test_npu_geglu_backward_fp16 / _fp32 (upstream-skipped)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_geglu_backward(tnpu, dtype):
    x = torch.from_numpy(np.random.uniform(-1, 1, [2, 10, 1024])).to(dtype)
    dy = torch.randn(2, 10, 512).to(dtype)
    xg = x.detach().clone().float().requires_grad_()
    a, b = xg.chunk(2, dim=-1)
    (a * F.gelu(b, approximate="tanh")).backward(dy.float())
    xd = to_npu(x).requires_grad_()
    tnpu.npu_geglu(xd, -1, 1, False)[0].backward(to_npu(dy))
    _rtol(xg.grad.to(dtype).numpy(), xd.grad.cpu().numpy())


@upstream("npu_swiglu", "Ascend/pytorch torch_npu/_inductor/decomposition.py (no op test upstream)",
          "swiglu decomposition: silu(first half) * second half, and its backward")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_decomposition(tnpu, dtype):
    x = torch.randn(4, 64, 256).to(dtype)
    a, b = x.float().chunk(2, dim=-1)
    y = tnpu.npu_swiglu(to_npu(x), -1)
    _rtol((F.silu(a) * b).to(dtype).numpy(), y.cpu().numpy())
    xg = x.detach().clone().float().requires_grad_()
    a, b = xg.chunk(2, dim=-1)
    dy = torch.randn(4, 64, 128).to(dtype)
    (F.silu(a) * b).backward(dy.float())
    xd = to_npu(x).requires_grad_()
    tnpu.npu_swiglu(xd, -1).backward(to_npu(dy))
    _rtol(xg.grad.to(dtype).numpy(), xd.grad.cpu().numpy())
