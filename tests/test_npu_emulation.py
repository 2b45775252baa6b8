"""The torch_npu CPU stand-in: op numerics against plain PyTorch formulas, autograd, validation,
signatures against the op-plugin schemas, the npu -> cpu device mapping, and real/emulated selection.

Op tests import the stand-in in-process with TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP=0 (so this pytest
process keeps no npu backend registration); the device mapping is tested in a child process, the
way the sandbox uses it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainbridge.sandbox.npu_emulation import NpuSelection, emulation_path, select_torch_npu, selection_env

REFERENCE = Path(__file__).parent / "fixtures" / "npu_reference"
TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.fixture(scope="module")
def tnpu():
    """The stand-in, imported in-process without the device mapping; removed again afterwards."""
    assert "torch_npu" not in sys.modules, "a torch_npu is already imported in this process"
    old_env = os.environ.get("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP")
    os.environ["TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"] = "0"
    path = str(emulation_path())
    sys.path.insert(0, path)
    try:
        module = importlib.import_module("torch_npu")
        assert module.__trainbridge_emulated__ is True
        yield module
    finally:
        sys.path.remove(path)
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        if old_env is None:
            os.environ.pop("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", None)
        else:
            os.environ["TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"] = old_env


def _grads(fn, inputs, upstream):
    """Gradients of sum(fn(*inputs) * upstream) w.r.t. inputs (a fixed random upstream gradient)."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    torch.autograd.backward(out, upstream)
    return out.detach(), [t.grad for t in inputs]


def _assert_close_all(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **tol)


# ================================================================================ RMSNorm


def _ref_rms(x, gamma, eps):
    axes = tuple(range(x.dim() - gamma.dim(), x.dim()))
    return x * torch.rsqrt(x.pow(2).mean(axes, keepdim=True) + eps) * gamma


def test_rms_norm_forward_backward_match_formula(tnpu):
    torch.manual_seed(0)
    x, gamma = torch.randn(2, 3, 8), torch.randn(8)
    y, rstd = tnpu.npu_rms_norm(x, gamma, 1e-5)
    torch.testing.assert_close(y, _ref_rms(x, gamma, 1e-5))
    assert rstd.shape == (2, 3, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    dy = torch.randn(2, 3, 8)
    _, got = _grads(lambda a, g: tnpu.npu_rms_norm(a, g, 1e-5)[0], [x, gamma], dy)
    _, want = _grads(lambda a, g: _ref_rms(a, g, 1e-5), [x, gamma], dy)
    _assert_close_all(got, want)
    # the explicit backward op gives the same, with dgamma in fp32
    dx, dgamma = tnpu.npu_rms_norm_backward(dy, x, gamma, rstd)
    _assert_close_all([dx, dgamma], want)


def test_rms_norm_gradcheck_float64_two_dim_gamma(tnpu):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    gamma = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, g: tnpu.npu_rms_norm(a, g)[0], (x, gamma))
    assert tnpu.npu_rms_norm(x, gamma)[1].shape == (2, 1, 1)


def test_rms_norm_mixed_precision_rounds_once(tnpu):
    torch.manual_seed(2)
    x, gamma = torch.randn(4, 16).to(torch.bfloat16), torch.randn(16)
    y, rstd = tnpu.npu_rms_norm(x, gamma)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    want = _ref_rms(x.float(), gamma, 1e-6).to(torch.bfloat16)  # fp32 math, one rounding
    torch.testing.assert_close(y, want, atol=0, rtol=0)


def test_rms_norm_validation(tnpu):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="gamma shape"):
        tnpu.npu_rms_norm(x, torch.ones(4))
    with pytest.raises(TypeError, match="gamma=torch.float16"):
        tnpu.npu_rms_norm(x, torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="gamma"):
        tnpu.npu_rms_norm(torch.randn(8), torch.ones(2, 4))


def test_add_rms_norm_values_and_output_order(tnpu):
    torch.manual_seed(3)
    x1, x2, gamma = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(8)
    y, rstd, x = tnpu.npu_add_rms_norm(x1, x2, gamma, 1e-5)
    torch.testing.assert_close(x, x1 + x2)
    torch.testing.assert_close(y, _ref_rms(x1 + x2, gamma, 1e-5))
    torch.testing.assert_close(rstd, torch.rsqrt((x1 + x2).pow(2).mean(-1, keepdim=True) + 1e-5))
    # fp16: the sum is rounded to fp16 first, then normalised in fp32
    h1, h2, hg = x1.half(), x2.half(), gamma.half()
    yh, _, xh = tnpu.npu_add_rms_norm(h1, h2, hg)
    torch.testing.assert_close(xh, h1 + h2, atol=0, rtol=0)
    torch.testing.assert_close(yh, _ref_rms((h1 + h2).float(), hg.float(), 1e-6).half(), atol=0, rtol=0)


def test_add_rms_norm_is_forward_only_like_torch_npu(tnpu):
    x1 = torch.randn(3, 8, requires_grad=True)
    x2 = torch.randn(3, 8, requires_grad=True)
    gamma = torch.randn(8, requires_grad=True)
    y, _, _ = tnpu.npu_add_rms_norm(x1, x2, gamma)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        (y * torch.randn(3, 8)).sum().backward()
    assert x1.grad is None and x2.grad is None and gamma.grad is None


def test_add_rms_norm_trains_through_documented_wrapper(tnpu):
    """semantics.md 3.2: wrap it; backward = npu_rms_norm_backward + the gradient of the x output."""

    class AddRmsNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x1, x2, gamma):
            y, rstd, x = tnpu.npu_add_rms_norm(x1, x2, gamma)
            ctx.save_for_backward(x, gamma, rstd)
            return y, x

        @staticmethod
        def backward(ctx, dy, dx_sum):
            x, gamma, rstd = ctx.saved_tensors
            dx, dgamma = tnpu.npu_rms_norm_backward(dy, x, gamma, rstd)
            return dx + dx_sum, dx + dx_sum, dgamma

    torch.manual_seed(4)
    inputs = [torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)]
    up = torch.randn(3, 8)

    def fused(a, b, g):
        y, x = AddRmsNorm.apply(a, b, g)
        return y + 0.5 * x

    def ref(a, b, g):
        return _ref_rms(a + b, g, 1e-6) + 0.5 * (a + b)

    _, got = _grads(fused, inputs, up)
    _, want = _grads(ref, inputs, up)
    _assert_close_all(got, want)


def test_add_rms_norm_validation(tnpu):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="x2 shape"):
        tnpu.npu_add_rms_norm(x, torch.randn(2, 4), torch.ones(8))
    with pytest.raises(TypeError, match="share one dtype"):
        tnpu.npu_add_rms_norm(x.half(), x.half(), torch.ones(8))


# ================================================================================ rotary


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _tables(s, d, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv)  # [S, D/2]
    return freqs.to(dtype)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "SBND"])
def test_rotary_half_matches_hf_formula(tnpu, layout):
    torch.manual_seed(5)
    b, n, s, d = 2, 3, 5, 8
    freqs = _tables(s, d)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    shape, rshape = {
        "BNSD": ((b, n, s, d), (1, 1, s, d)),
        "BSND": ((b, s, n, d), (1, s, 1, d)),
        "SBND": ((s, b, n, d), (s, 1, 1, d)),
    }[layout]
    x, r1, r2 = torch.randn(shape), cos.reshape(rshape), sin.reshape(rshape)
    up = torch.randn(shape)
    out, got = _grads(lambda a, c, si: tnpu.npu_rotary_mul(a, c, si), [x, r1, r2], up)
    ref, want = _grads(lambda a, c, si: a * c + _rotate_half(a) * si, [x, r1, r2], up)
    torch.testing.assert_close(out, ref)
    _assert_close_all(got, want)


def test_rotary_interleave_matches_llama_complex_form(tnpu):
    torch.manual_seed(6)
    b, s, n, d = 2, 6, 2, 8
    freqs = _tables(s, d)
    x = torch.randn(b, s, n, d)
    # llama reference: adjacent pairs as complex numbers times exp(i * theta)
    xc = torch.view_as_complex(x.reshape(b, s, n, d // 2, 2))
    rot = torch.polar(torch.ones_like(freqs), freqs).view(1, s, 1, d // 2)
    ref = torch.view_as_real(xc * rot).flatten(-2)
    r1 = freqs.cos().repeat_interleave(2, dim=-1).view(1, s, 1, d)
    r2 = freqs.sin().repeat_interleave(2, dim=-1).view(1, s, 1, d)
    torch.testing.assert_close(tnpu.npu_rotary_mul(x, r1, r2, "interleave"), ref)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_gradcheck_float64(tnpu, mode):
    torch.manual_seed(7)
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    r1 = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    r2 = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c, s: tnpu.npu_rotary_mul(a, c, s, mode), (x, r1, r2))


def test_rotary_tnd_three_dim(tnpu):
    torch.manual_seed(8)
    t, n, d = 7, 2, 4
    x, r1, r2 = torch.randn(t, n, d), torch.randn(t, 1, d), torch.randn(t, 1, d)
    torch.testing.assert_close(tnpu.npu_rotary_mul(x, r1, r2), x * r1 + _rotate_half(x) * r2)


def test_rotary_rotate_matrix_forward_and_ignored_backward(tnpu):
    torch.manual_seed(9)
    d = 4
    half = torch.zeros(d, d)
    half[: d // 2, d // 2:] = torch.eye(d // 2)  # +I top-right
    half[d // 2:, : d // 2] = -torch.eye(d // 2)  # -I bottom-left
    x, r1, r2 = torch.randn(1, 2, 3, d), torch.randn(1, 1, 3, d), torch.randn(1, 1, 3, d)
    torch.testing.assert_close(tnpu.npu_rotary_mul(x, r1, r2, "half", half), tnpu.npu_rotary_mul(x, r1, r2))
    # torch_npu's autograd ignores `rotate` and uses the mode's standard rotation (documented pitfall)
    other = torch.eye(d)
    up = torch.randn(1, 2, 3, d)
    _, with_rotate = _grads(lambda a: tnpu.npu_rotary_mul(a, r1, r2, "half", other), [x], up)
    _, standard = _grads(lambda a: tnpu.npu_rotary_mul(a, r1, r2, "half"), [x], up)
    _, true_grad = _grads(lambda a: a * r1 + (a @ other) * r2, [x], up)
    torch.testing.assert_close(with_rotate[0], standard[0])
    assert not torch.allclose(with_rotate[0], true_grad[0])


def test_rotary_validation(tnpu):
    x, r = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="should be half or interleave"):
        tnpu.npu_rotary_mul(x, r, r, "quarter")
    with pytest.raises(ValueError, match="self must be 4-D"):
        tnpu.npu_rotary_mul(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="must be even"):
        tnpu.npu_rotary_mul(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5))
    with pytest.raises(ValueError, match="does not broadcast"):
        tnpu.npu_rotary_mul(x, torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    with pytest.raises(ValueError, match="fully broadcast"):
        tnpu.npu_rotary_mul(torch.randn(2, 2, 3, 4), torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), "interleave")
    with pytest.raises(ValueError, match="rotate must be"):
        tnpu.npu_rotary_mul(x, r, r, "half", torch.eye(3))


# ================================================================================ gated activations


@pytest.mark.parametrize("dim", [-1, 1])
def test_swiglu_activates_first_half(tnpu, dim):
    torch.manual_seed(10)
    x, up = torch.randn(3, 6, 4), None
    a, b = x.chunk(2, dim=dim)
    up = torch.randn((F.silu(a) * b).shape)
    out, got = _grads(lambda t: tnpu.npu_swiglu(t, dim), [x], up)
    ref, want = _grads(lambda t: F.silu(t.chunk(2, dim=dim)[0]) * t.chunk(2, dim=dim)[1], [x], up)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(tnpu.npu_swiglu_backward(up, x, dim), want[0])


def test_swiglu_gradcheck_and_validation(tnpu):
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: tnpu.npu_swiglu(t), (x,))
    with pytest.raises(ValueError, match="divisible by 2"):
        tnpu.npu_swiglu(torch.randn(2, 5))
    with pytest.raises(IndexError, match="dim=2 is out of range"):
        tnpu.npu_swiglu(torch.randn(2, 4), dim=2)


@pytest.mark.parametrize("approximate,torch_mode", [(1, "tanh"), (0, "none")])
@pytest.mark.parametrize("activate_left", [False, True])
def test_geglu_halves_and_approximation(tnpu, approximate, torch_mode, activate_left):
    torch.manual_seed(11)
    x = torch.randn(4, 10)
    a, b = x.chunk(2, dim=-1)
    out, gelu_out = tnpu.npu_geglu(x, -1, approximate, activate_left)
    if activate_left:
        want_gelu, want = F.gelu(a, approximate=torch_mode), F.gelu(a, approximate=torch_mode) * b
    else:
        want_gelu, want = F.gelu(b, approximate=torch_mode), a * F.gelu(b, approximate=torch_mode)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(gelu_out, want_gelu)
    xd = x.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: tnpu.npu_geglu(t, -1, approximate, activate_left)[0], (xd,))


def test_geglu_defaults_and_validation(tnpu):
    x = torch.randn(2, 8, requires_grad=True)
    out, gelu_out = tnpu.npu_geglu(x)
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(out, a * F.gelu(b, approximate="tanh"))  # default: 2nd half, tanh
    assert out.requires_grad and not gelu_out.requires_grad
    with pytest.raises(ValueError, match="approximate must be 0"):
        tnpu.npu_geglu(x, approximate=2)
    with pytest.raises(ValueError, match="divisible by 2"):
        tnpu.npu_geglu(torch.randn(2, 7))


# ================================================================================ confusion transpose


def test_confusion_transpose_doc_examples_and_backward(tnpu):
    torch.manual_seed(12)
    x = torch.randn(2, 3, 4, 6)
    y = tnpu.npu_confusion_transpose(x, (0, 2, 1, 3), (2, 4, 18), True)
    assert y.shape == (2, 4, 18) and y.is_contiguous()
    torch.testing.assert_close(y, x.permute(0, 2, 1, 3).reshape(2, 4, 18))
    z = tnpu.npu_confusion_transpose(x, (0, 2, 1), (2, 12, 6), False)
    assert z.shape == (2, 6, 12)
    torch.testing.assert_close(z, x.reshape(2, 12, 6).permute(0, 2, 1))
    xd = x.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: tnpu.npu_confusion_transpose(t, [0, 2, 1, 3], [2, 4, 18], True), (xd,))
    assert torch.autograd.gradcheck(lambda t: tnpu.npu_confusion_transpose(t, [0, 2, 1], [2, 12, 6], False), (xd,))


def test_confusion_transpose_validation(tnpu):
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="perm\\[1\\]=3 is out of range"):
        tnpu.npu_confusion_transpose(x, [0, 3, 1], [2, 3, 4], False)
    with pytest.raises(ValueError, match="repeated"):
        tnpu.npu_confusion_transpose(x, [0, 0, 1], [2, 3, 4], True)
    with pytest.raises(ValueError, match="does not match the 24 elements"):
        tnpu.npu_confusion_transpose(x, [0, 1], [5, 5], False)


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
    out, got = _grads(lambda a, b, c: tnpu.npu_fusion_attention(a, b, c, 6, "BNSD", atten_mask=TEMPLATE, scale=scale,
                                                                 sparse_mode=3)[0], [q, k, v], up)
    ref, want = _grads(lambda a, b, c: _ref_attn(a, b, c, keep=keep, scale=scale), [q, k, v], up)
    torch.testing.assert_close(out, ref)
    _assert_close_all(got, want)


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

    out, got = _grads(fused, [q, k, v], up)
    ref, want = _grads(lambda a, b, c: _tnd_reference(a, b, c, lq, lk, keep_fn, 0.7), [q, k, v], up)
    torch.testing.assert_close(out, ref)
    _assert_close_all(got, want)
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
    with pytest.raises(ValueError, match="prefix\\[1\\]=0 must lie in \\[1, 6\\]"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=prefix_template, prefix=[4, 0], sparse_mode=6)
    with pytest.raises(ValueError, match="needs prefix"):
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
    _assert_close_all([dq, dk, dv], [qs.grad, ks.grad, vs.grad])
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
    _assert_close_all([dq, dk, dv], [qs.grad, ks.grad, vs.grad])
    assert dpse.numel() == 0 and dsink.numel() == 0


def test_fusion_attention_fully_masked_row_warns(tnpu):
    q, k, v = _qkv(b=1, nq=1, nkv=1, sq=2, skv=2)
    mask = torch.tensor([[True, True], [False, False]])
    with pytest.warns(RuntimeWarning, match="every key masked"):
        o = tnpu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    assert torch.all(o[0, 0, 0] == 0)


@pytest.mark.parametrize("call,error,match", [
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 0, "BNSD"), ValueError, "head_num must > 0"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 3, "BNSD"), ValueError, "head_num=3 is inconsistent"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BHSD"), ValueError, "input_layout 'BHSD'"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BSH"), ValueError, "needs 3-D query"),
    (lambda t, q, k, v: t.npu_fusion_attention(q[0, 0], k[0, 0], v[0, 0], 4, "BNSD"), ValueError, "3-D or 4-D"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", sparse_mode=9), ValueError, "sparse_mode value"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.0), ValueError, "keep_prob"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=1.5), ValueError, "keep_prob"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(5, 5)), TypeError,
     "bool or uint8"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~TEMPLATE, sparse_mode=2), ValueError,
     "compressed causal template"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~_top_left(5, 5), sparse_mode=3),
     ValueError, "compressed atten_mask"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
     ValueError, "atten_mask shape"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=TEMPLATE, sparse_mode=4,
                                               pre_tockens=-1, next_tockens=-1), ValueError, "both be negative"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", softmax_layout="TND"), ValueError,
     "softmax_layout='TND' needs"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", padding_mask=q), ValueError, "padding_mask"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k.half(), v, 4, "BNSD"), TypeError, "share one dtype"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", pse=torch.zeros(2, 4, 5, 5).double()), TypeError,
     "pse dtype"),
    (lambda t, q, k, v: t.npu_fusion_attention(q, k, v, 4, "BNSD", actual_seq_qlen=[5]), ValueError, "only for"),
])
def test_fusion_attention_validation(tnpu, call, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        call(tnpu, q, k, v)


def test_fusion_attention_validation_bsh_and_tnd(tnpu):
    q = torch.randn(2, 5, 12)
    with pytest.raises(ValueError, match="head_num=5 does not divide"):
        tnpu.npu_fusion_attention(q, q, q, 5, "BSH")
    lq = lk = [2, 3]
    tq, tk, tv = _tnd(lq, lk)
    with pytest.raises(ValueError, match="needs actual_seq_qlen"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND")
    with pytest.raises(ValueError, match="same length"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[5])
    with pytest.raises(ValueError, match="cumulative"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[3, 2], actual_seq_kvlen=[2, 5])
    with pytest.raises(ValueError, match="upper case"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "tnd", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5])
    with pytest.raises(ValueError, match="sparse_mode value"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], sparse_mode=5)
    with pytest.raises(NotImplementedError, match="sparse_mode=7"):
        tnpu.npu_fusion_attention(tq, tk, tv, 2, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], sparse_mode=7)
    kq, kk, kv = _tnd([3, 2], [2, 3])
    with pytest.raises(ValueError, match="every Sq_i <= Skv_i"):
        tnpu.npu_fusion_attention(kq, kk, kv, 2, "TND", atten_mask=TEMPLATE, sparse_mode=3,
                                  actual_seq_qlen=[3, 5], actual_seq_kvlen=[2, 5])


# ================================================================================ NpuFusedAdamW


def _tiny_model(seed=18, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def _batches(n, seed=19):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adamw_matches_torch_adamw(tnpu, amsgrad):
    fused_model, ref_model = _tiny_model(), _tiny_model()
    hp = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    fused = tnpu.optim.NpuFusedAdamW(fused_model.parameters(), **hp)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **hp)
    for x, y in _batches(5):
        for model, opt in ((fused_model, fused), (ref_model, ref)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for p, r in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert fused.state[next(iter(fused_model.parameters()))]["step"] == 5


def test_fused_adamw_raises_like_torch_npu(tnpu):
    model = _tiny_model(dtype=torch.bfloat16)
    opt = tnpu.optim.NpuFusedAdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(TypeError, match="must be either float32 or float16"):
        opt.step()
    opt32 = tnpu.optim.NpuFusedAdamW(_tiny_model().parameters())
    with pytest.raises(ValueError, match="set_to_none=True"):
        opt32.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        tnpu.optim.NpuFusedAdamW(_tiny_model().parameters(), lr=-1.0)


def test_fused_adamw_model_zero_grad_trains_on_stale_gradients(tnpu):
    """The combined-buffer hazard of torch_npu, reproduced: model.zero_grad() detaches the grads."""
    model, ref_model = _tiny_model(), _tiny_model()
    opt = tnpu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    (x1, y1), (x2, y2) = _batches(2)
    F.mse_loss(model(x1), y1).backward()
    opt.step()
    model.zero_grad()  # set_to_none=True: the next backward allocates grads outside the flat buffer
    F.mse_loss(model(x2), y2).backward()
    opt.step()
    # the reference sees the first batch's gradient twice: that is what the fused optimizer used
    F.mse_loss(ref_model(x1), y1).backward()
    first = [p.grad.clone() for p in ref_model.parameters()]
    ref.step()
    for p, g in zip(ref_model.parameters(), first):
        p.grad = g.clone()
    ref.step()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_fused_adamw_late_grad_and_clip(tnpu):
    model = _tiny_model()
    params = list(model.parameters())
    opt = tnpu.optim.NpuFusedAdamW(params)
    params[0].requires_grad_(False)
    (x, y), = _batches(1)
    F.mse_loss(model(x), y).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[1:]]))
    total = opt.clip_grad_norm_fused_(0.01)
    torch.testing.assert_close(total, want)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[1:]])) < 0.0101
    opt.step()
    params[0].requires_grad_(True)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with pytest.raises(KeyError, match="step"):
        opt.step()


# ================================================================================ npu module


def test_npu_module_queries(tnpu, monkeypatch):
    npu = tnpu.npu
    assert npu.is_available() and npu.device_count() == 1 and npu.current_device() == 0
    npu.set_device("npu:0")
    npu.synchronize()
    with pytest.raises(RuntimeError, match="Invalid device ordinal 1"):
        npu.set_device(1)
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_NPU_COUNT", "2")
    npu.set_device(1)
    assert npu.current_device() == 1
    npu.set_device(0)
    cur, peak = npu.memory_allocated(), npu.max_memory_allocated()
    assert 0 < cur <= peak
    free, total = npu.mem_get_info()
    assert 0 < free <= total
    npu.manual_seed(123)
    a = torch.rand(3)
    torch.manual_seed(123)
    torch.testing.assert_close(a, torch.rand(3))
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0


# ================================================================================ signatures


def _parse_default(text: str):
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "'\"":
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def _schema_params(line: str) -> list[tuple[str, bool, object]]:
    """[(name, keyword_only, default or inspect.Parameter.empty)] from an op-plugin schema line."""
    args = line[line.index("(") + 1: line.rindex(") ->")]
    out, kw_only = [], False
    for raw in (a.strip() for a in args.split(",")):
        if raw == "*":
            kw_only = True
            continue
        decl, _, default = raw.partition("=")
        name = decl.split()[-1]
        out.append((name, kw_only, _parse_default(default) if default else inspect.Parameter.empty))
    return out


def _schemas() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (REFERENCE / "fused_api_signatures.txt").read_text().splitlines():
        m = re.match(r"(\w+)\(", line)
        if m and not line.startswith("#"):
            found.setdefault(m.group(1), line)
    for line in (REFERENCE / "torch_npu_2.14_ops_from_wheel.txt").read_text().splitlines():
        m = re.match(r"\[custom[^\]]*\] (\w+)\(", line)
        if m:
            found.setdefault(m.group(1), line[line.index("] ") + 2:])
    return found


EMULATED_OPS = [
    "npu_rms_norm", "npu_rms_norm_backward", "npu_add_rms_norm", "npu_rotary_mul", "npu_rotary_mul_backward",
    "npu_swiglu", "npu_swiglu_backward", "npu_geglu", "npu_geglu_grad", "npu_fusion_attention",
    "npu_fusion_attention_grad", "npu_confusion_transpose",
]


@pytest.mark.parametrize("name", EMULATED_OPS)
def test_signature_matches_op_plugin_schema(tnpu, name):
    assert_signature_matches(getattr(tnpu, name), name, _schemas()[name], same_default_type=True)


def assert_signature_matches(function, name: str, schema: str, *, same_default_type: bool) -> None:
    """The Python signature of an emulated op against one op-plugin/wheel schema line: names, order,
    keyword-only marks and defaults (and their types, with `same_default_type`)."""
    params = list(inspect.signature(function).parameters.values())
    want = _schema_params(schema)
    assert [p.name for p in params] == [w[0] for w in want], schema
    for p, (wname, kw_only, default) in zip(params, want):
        kind = inspect.Parameter.KEYWORD_ONLY if kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert p.kind == kind, f"{name}.{wname}: kind {p.kind} vs schema {schema}"
        assert p.default == default, f"{name}.{wname}: {p.default!r} vs {default!r} in {schema}"
        if same_default_type:
            assert type(p.default) is type(default), f"{name}.{wname}: {p.default!r} vs {default!r}"


def test_fused_adamw_signature_matches_wheel(tnpu):
    surface = (REFERENCE / "torch_npu_python_api_surface.txt").read_text()
    line = next(ln for ln in surface.splitlines() if "class NpuFusedAdamW(" in ln)
    assert str(inspect.signature(tnpu.optim.NpuFusedAdamW.__init__)) == line.split(".__init__", 1)[1].strip()


def test_parser_detects_a_wrong_default():
    params = _schema_params("f(Tensor self, float epsilon=1e-06, *, str s=\"\", int? k=None) -> Tensor")
    assert params == [("self", False, inspect.Parameter.empty), ("epsilon", False, 1e-06), ("s", True, ""),
                      ("k", True, None)]


# ================================================================================ device mapping (child)

_DEVICE_SCRIPT = textwrap.dedent(r"""
    import json, math, torch, torch_npu
    import torch.nn.functional as F
    r = {"emulated": torch_npu.__trainbridge_emulated__, "version": torch_npu.__version__,
         "torch_npu_is_torch_npu": torch.npu is torch_npu.npu,
         "device_module": torch.get_device_module("npu") is torch_npu.npu}
    r["factories"] = sorted({str(t.device) for t in (
        torch.zeros(2, device="npu"), torch.ones(2, device="npu:0"), torch.randn(2, device=torch.device("npu", 0)),
        torch.arange(3, device="npu"), torch.tensor([1.0], device="npu"), torch.empty_like(torch.ones(1), device="npu"),
        torch.ones(1).to("npu"), torch.ones(1).to(torch.device("npu:0"), torch.float16), torch.ones(1).npu(),
        torch.ones(1).to(device="npu", non_blocking=True), torch.ones(1, device=0), torch.ones(1).to(0))})
    with torch.device("npu"):
        r["ctx"] = str(torch.zeros(1).device)
    with torch.autocast("npu", dtype=torch.bfloat16):
        r["autocast"] = str(torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype)
    r["pinned_loader"] = [str(b[0].device) for b in torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2, pin_memory=True)]

    class Block(torch.nn.Module):
        def __init__(self, npu):
            super().__init__()
            self.npu_ops = npu
            self.qkv = torch.nn.Linear(16, 48)
            self.up = torch.nn.Linear(16, 64)
            self.down = torch.nn.Linear(32, 16)
            self.norm = torch.nn.Parameter(torch.ones(16))
        def forward(self, x):
            b, s, _ = x.shape
            if self.npu_ops:
                h = torch_npu.npu_rms_norm(x, self.norm)[0]
                q, k, v = self.qkv(h).view(b, s, 3, 2, 8).unbind(2)
                mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="npu"), diagonal=1)
                a = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=mask, scale=1 / math.sqrt(8),
                                                   sparse_mode=2)[0].reshape(b, s, 16)
                x = x + a
                return x + self.down(torch_npu.npu_swiglu(self.up(x)))
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
            q, k, v = (t.transpose(1, 2) for t in self.qkv(h).view(b, s, 3, 2, 8).unbind(2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16)
            x = x + a
            g, u = self.up(x).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    losses, params, grads = {}, {}, {}
    for name, npu in (("npu", True), ("cpu", False)):
        torch.manual_seed(0)
        model = Block(npu)
        x = torch.randn(2, 5, 16)
        if npu:
            model = model.to("npu")
            x = x.to("npu")
            opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2, eps=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, foreach=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses[name] = (loss.item(), model(x).pow(2).mean().item())
        params[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        r[name + "_param_device"] = str(next(model.parameters()).device)
    r["losses"] = losses
    r["max_param_diff"] = (params["npu"] - params["cpu"]).abs().max().item()
    r["max_grad_diff"] = (grads["npu"] - grads["cpu"]).abs().max().item()
    r["accelerator"] = str(torch.accelerator.current_accelerator())
    print("RESULT " + json.dumps(r))
""")


def test_device_mapping_in_child_trains_a_tiny_model(tmp_path):
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if k != "TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"})
    script = tmp_path / "child.py"
    script.write_text(_DEVICE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert r["emulated"] is True and r["version"] == torch.__version__.split("+")[0]
    assert r["torch_npu_is_torch_npu"] and r["device_module"]
    assert r["factories"] == ["cpu"] and r["ctx"] == "cpu" and r["npu_param_device"] == "cpu"
    assert r["autocast"] == "torch.bfloat16"
    assert r["pinned_loader"] == ["cpu", "cpu"]
    assert r["accelerator"] == "npu"
    (npu_before, npu_after), (cpu_before, cpu_after) = r["losses"]["npu"], r["losses"]["cpu"]
    assert npu_after < npu_before
    assert abs(npu_before - cpu_before) < 1e-5 and abs(npu_after - cpu_after) < 1e-5
    assert r["max_grad_diff"] < 1e-5 and r["max_param_diff"] < 1e-5


# ================================================================================ selection


def _fake_torch_npu(root: Path, body: str, npu_body: str = "") -> Path:
    pkg = root / "torch_npu"
    (pkg / "npu").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    (pkg / "npu" / "__init__.py").write_text(textwrap.dedent(npu_body))
    return root


def _env_with(*paths: Path | str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def test_selection_emulates_when_not_installed():
    sel = select_torch_npu(env=_env_with(emulation_path()))  # the stand-in alone never counts as real
    assert sel.mode == "emulated" and sel.cause == "not_installed"
    assert "not installed" in sel.reason and sys.executable in sel.reason


def test_selection_real_wins_even_with_the_stand_in_first_on_the_path(tmp_path):
    root = _fake_torch_npu(tmp_path, "__version__ = '2.13.0'\nfrom . import npu\n",
                           "def is_available():\n    return True\ndef device_count():\n    return 8\n")
    sel = select_torch_npu(env=_env_with(emulation_path(), root))
    assert sel.mode == "real" and sel.cause == "real_usable"
    assert "2.13.0" in sel.reason and "8 NPU device(s)" in sel.reason and str(root) in sel.reason
    child = selection_env(sel, _env_with(emulation_path(), root))
    assert str(emulation_path()) not in child["PYTHONPATH"].split(os.pathsep)
    probe = subprocess.run([sys.executable, "-c", "import torch_npu; print(hasattr(torch_npu, '__trainbridge_emulated__'))"],
                           env=child, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


def test_selection_reports_import_failure_with_the_error(tmp_path):
    root = _fake_torch_npu(tmp_path, "raise ImportError('libhccl.so: cannot open shared object file')\n")
    sel = select_torch_npu(env=_env_with(root))
    assert sel.mode == "emulated" and sel.cause == "import_failed"
    assert "libhccl.so: cannot open shared object file" in sel.reason and "CANN" in sel.reason


def test_selection_reports_no_device(tmp_path):
    root = _fake_torch_npu(tmp_path, "__version__ = '2.13.0'\nfrom . import npu\n",
                           "def is_available():\n    return False\ndef device_count():\n    return 1\n")
    sel = select_torch_npu(env=_env_with(root))
    assert sel.mode == "emulated" and sel.cause == "no_device"
    assert "sees no NPU device" in sel.reason and "is_available()=False" in sel.reason


def test_selection_probe_sets_autoload_off(tmp_path):
    root = _fake_torch_npu(tmp_path, "import os\nassert os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'] == '0', 'autoload on'\n"
                                     "from . import npu\n",
                           "def is_available():\n    return True\ndef device_count():\n    return 1\n")
    env = _env_with(root)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"
    assert select_torch_npu(env=env).mode == "real"


def test_selection_env_for_emulated_child():
    sel = NpuSelection(mode="emulated", cause="not_installed", reason="x", python=sys.executable)
    env = selection_env(sel, {"PYTHONPATH": os.pathsep.join(["/a", str(emulation_path()), "/b"])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(emulation_path()), "/a", "/b"]
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    with pytest.raises(Exception):
        NpuSelection(mode="emulated", cause="not_installed", reason="x", python="p", extra=1)
