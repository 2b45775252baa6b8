"""The torch_npu stand-in's norm, rotary, gated-activation and transpose ops against plain PyTorch
formulas: values, autograd, validation (in-process, no device registration).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainbridge.tests.npu_emulation_support import (  # noqa: F401 (tnpu is a fixture)
    assert_close_all,
    grads_of,
    tnpu,
)


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
    _, got = grads_of(lambda a, g: tnpu.npu_rms_norm(a, g, 1e-5)[0], [x, gamma], dy)
    _, want = grads_of(lambda a, g: _ref_rms(a, g, 1e-5), [x, gamma], dy)
    assert_close_all(got, want)
    # the explicit backward op gives the same, with dgamma in fp32
    dx, dgamma = tnpu.npu_rms_norm_backward(dy, x, gamma, rstd)
    assert_close_all([dx, dgamma], want)


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


@pytest.mark.parametrize("release,raises", [("26.1.0", True), ("26.2.0", True), ("26.0.0", False), ("7.3.0", False)])
def test_add_rms_norm_has_no_backward_and_it_depends_on_the_release(tnpu, monkeypatch, release, raises):
    """op-plugin 26.1.0 registers autogradNotImplementedFallback (AutogradErrorFallback.cpp; its test
    test_base_ops/test_autograd_error_fallback.py::test_npu_add_rms_norm_backward_raises); older
    releases fall back to PyTorch's warning autograd fallback (no gradient)."""
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", release)
    x1 = torch.randn(3, 8, requires_grad=True)
    x2 = torch.randn(3, 8, requires_grad=True)
    gamma = torch.randn(8, requires_grad=True)
    y, _, _ = tnpu.npu_add_rms_norm(x1, x2, gamma)
    loss = (y * torch.randn(3, 8)).sum()
    if raises:
        with pytest.raises(RuntimeError, match="derivative for npu::npu_add_rms_norm is not implemented"):
            loss.backward()
    else:
        with pytest.warns(UserWarning, match="autograd kernel was not registered"):
            loss.backward()
        assert x1.grad is None and x2.grad is None and gamma.grad is None


def test_emulated_release_setting_is_validated(tnpu, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", "latest")
    y, _, _ = tnpu.npu_add_rms_norm(torch.randn(2, 4, requires_grad=True), torch.randn(2, 4), torch.ones(4))
    with pytest.raises(ValueError, match="TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE must be an Ascend release"):
        y.sum().backward()


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

    _, got = grads_of(fused, inputs, up)
    _, want = grads_of(ref, inputs, up)
    assert_close_all(got, want)


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
    out, got = grads_of(lambda a, c, si: tnpu.npu_rotary_mul(a, c, si), [x, r1, r2], up)
    ref, want = grads_of(lambda a, c, si: a * c + _rotate_half(a) * si, [x, r1, r2], up)
    torch.testing.assert_close(out, ref)
    assert_close_all(got, want)


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
    _, with_rotate = grads_of(lambda a: tnpu.npu_rotary_mul(a, r1, r2, "half", other), [x], up)
    _, standard = grads_of(lambda a: tnpu.npu_rotary_mul(a, r1, r2, "half"), [x], up)
    _, true_grad = grads_of(lambda a: a * r1 + (a @ other) * r2, [x], up)
    torch.testing.assert_close(with_rotate[0], standard[0])
    assert not torch.allclose(with_rotate[0], true_grad[0])


def test_rotary_validation(tnpu):
    x, r = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="The rotary_mode of npu_rotary_mul should be half or interleave, but got quarter"):
        tnpu.npu_rotary_mul(x, r, r, "quarter")
    with pytest.raises(RuntimeError, match="rotary_mode of npu_rotary_mul_backward should be half or interleave"):
        tnpu.npu_rotary_mul_backward(x, x, r, r, "quarter")
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
    out, got = grads_of(lambda t: tnpu.npu_swiglu(t, dim), [x], up)
    ref, want = grads_of(lambda t: F.silu(t.chunk(2, dim=dim)[0]) * t.chunk(2, dim=dim)[1], [x], up)
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


