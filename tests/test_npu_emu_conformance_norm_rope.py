"""Ascend's own op-test cases, against the emulation: RMSNorm family, rotary ops, confusion transpose.

Each test names the upstream test it mirrors (@upstream: API, repository and path, test method);
shapes, dtypes, value ranges and tolerances are the upstream ones, the golden formulas are restated
here (their code stays upstream). `assert_rtol_equal` is the emulated torch_npu.testing's restatement
of TestCase.assertRtolEqual. benchmarks/npu_emulation_conformance.py turns these into the table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainbridge.tests.npu_emulation_support import tnpu, to_npu, upstream  # noqa: F401 (tnpu is a fixture)

OP = "Ascend/op-plugin test/test_custom_ops/"
OP_BASE = "Ascend/op-plugin test/test_base_ops/"


def _rtol(tnpu, expected, actual, prec=1e-4, prec16=1e-3):
    from torch_npu.testing import assert_rtol_equal

    assert_rtol_equal(expected, actual, prec, prec16)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# --- npu_rms_norm -------------------------------------------------------------------------------


def _rms_golden(x: np.ndarray, gamma: np.ndarray):
    x32, g32 = x.astype(np.float32), gamma.astype(np.float32)
    rstd = 1 / np.sqrt(np.mean(x32 ** 2, axis=-1, keepdims=True) + 1e-6)
    return (x32 * rstd * g32).astype(x.dtype), rstd


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_rms_norm", OP + "test_npu_rms_norm.py", "test_rms_norm")
@pytest.mark.parametrize("x_dtype,gamma_dtype", [(np.float32, np.float32)])
def test_rms_norm(tnpu, x_dtype, gamma_dtype):
    x = np.random.uniform(0, 100, [1024, 12288]).astype(x_dtype)
    gamma = np.random.uniform(0, 100, [12288]).astype(gamma_dtype)
    y, rstd = tnpu.npu_rms_norm(to_npu(torch.from_numpy(x)), to_npu(torch.from_numpy(gamma)))
    gy, grstd = _rms_golden(x, gamma)
    _rtol(tnpu, gy, _np(y))
    _rtol(tnpu, grstd, _np(rstd))


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_rms_norm", OP + "test_npu_rms_norm.py", "test_rms_norm_mix_dtype")
def test_rms_norm_mix_dtype(tnpu):
    x = np.random.uniform(0, 100, [1024, 12288]).astype(np.float16)
    gamma = np.random.uniform(0, 100, [12288]).astype(np.float32)
    y, rstd = tnpu.npu_rms_norm(to_npu(torch.from_numpy(x)), to_npu(torch.from_numpy(gamma)))
    gy, grstd = _rms_golden(x, gamma)
    _rtol(tnpu, gy, _np(y))
    _rtol(tnpu, grstd, _np(rstd))


@upstream("npu_rms_norm_backward", OP + "test_npu_rms_norm_backward.py", "test_npu_rms_norm_backward")
def test_rms_norm_backward(tnpu):
    x = np.random.uniform(0, 100, [10, 128]).astype(np.float32)
    gamma = np.random.uniform(0, 100, [128]).astype(np.float32)
    dy = np.random.uniform(0, 100, [10, 128]).astype(np.float32)
    rstd = 1 / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6)
    gdgamma = np.sum(dy * x * rstd, 0)
    gdx = dy * gamma * rstd - x * np.sum(rstd ** 3 * dy * gamma * x, 1, keepdims=True) / 128
    xt = to_npu(torch.from_numpy(x)).requires_grad_()
    gt = to_npu(torch.from_numpy(gamma)).requires_grad_()
    tnpu.npu_rms_norm(xt, gt)[0].backward(to_npu(torch.from_numpy(dy)))
    _rtol(tnpu, gdx, _np(xt.grad.float()))
    _rtol(tnpu, gdgamma, _np(gt.grad.float()))


# --- npu_add_rms_norm ---------------------------------------------------------------------------


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_add_rms_norm", OP + "test_npu_add_rms_norm.py", "test_add_rms_norm_fp32 / test_add_rms_norm_fp16")
@pytest.mark.parametrize("dtype,prec", [(np.float32, 1e-4), (np.float16, 1e-3)])
def test_add_rms_norm(tnpu, dtype, prec):
    x1 = np.random.uniform(0, 100, [1024, 12288]).astype(dtype)
    x2 = np.random.uniform(0, 100, [1024, 12288]).astype(dtype)
    gamma = np.random.uniform(0, 100, [12288]).astype(dtype)
    x = x1 + x2  # formed in the input dtype
    x32 = x.astype(np.float32)
    rstd = 1 / np.sqrt(np.mean(x32 ** 2, axis=-1, keepdims=True) + 1e-6)
    y = (x32 * rstd * gamma.astype(np.float32)).astype(dtype)
    out_y, out_rstd, out_x = tnpu.npu_add_rms_norm(*(to_npu(torch.from_numpy(a)) for a in (x1, x2, gamma)), 1e-6)
    _rtol(tnpu, y, _np(out_y), prec, prec)
    _rtol(tnpu, rstd, _np(out_rstd), prec, prec)
    _rtol(tnpu, x, _np(out_x), prec, prec)


@upstream("npu_add_rms_norm", "Ascend/op-plugin@26.1.0 test/test_base_ops/test_autograd_error_fallback.py",
          "test_npu_add_rms_norm_backward_raises")
def test_add_rms_norm_backward_raises(tnpu, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", "26.1.0")
    leaf = lambda *s: to_npu(torch.randn(*s, dtype=torch.float16)).requires_grad_()  # noqa: E731
    out = tnpu.npu_add_rms_norm(leaf(4, 16), leaf(4, 16), leaf(16), 1e-6)[0]
    with pytest.raises(RuntimeError, match="not implemented"):
        out.float().sum().backward()


# --- npu_rotary_mul -----------------------------------------------------------------------------


def _rot_half(x, r1, r2):
    x1, x2 = torch.chunk(x, 2, -1)
    return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)


def _rot_interleave(x, r1, r2):
    x_new = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    return x * r1 + x_new * r2


_ROT_SHAPES = [
    [[2, 8192, 5, 128], [1, 8192, 1, 128], [1, 8192, 1, 128]],
    [[8192, 2, 5, 128], [8192, 1, 1, 128], [8192, 1, 1, 128]],
    [[2048, 4, 32, 64], [2048, 4, 1, 64], [2048, 4, 1, 64]],
]
_ROT_MODE_SHAPES = [
    [[2, 2, 5, 128], [1, 2, 1, 128], [1, 2, 1, 128]],
    [[2, 24, 5, 128], [1, 1, 5, 128], [1, 1, 5, 128]],
    [[128, 4, 4, 256], [1, 1, 4, 256], [1, 1, 4, 256]],
    [[64, 8, 8, 512], [1, 1, 8, 512], [1, 1, 8, 512]],
]


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_rotary_mul", OP + "test_npu_rotary_mul.py", "test_rotary_mul")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shapes", _ROT_SHAPES, ids=lambda s: "x".join(map(str, s[0])))
def test_rotary_mul(tnpu, shapes, dtype):
    x, r1, r2 = (torch.rand(s, dtype=dtype) for s in shapes)
    out = tnpu.npu_rotary_mul(to_npu(x), to_npu(r1), to_npu(r2))
    _rtol(tnpu, _rot_half(x, r1, r2), out.cpu())


@upstream("npu_rotary_mul", OP + "test_npu_rotary_mul.py", "test_rotary_mul_mode")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shapes", _ROT_MODE_SHAPES, ids=lambda s: "x".join(map(str, s[0])))
def test_rotary_mul_mode(tnpu, shapes, dtype):
    x, r1, r2 = (torch.rand(s, dtype=dtype) for s in shapes)
    out = tnpu.npu_rotary_mul(to_npu(x), to_npu(r1), to_npu(r2), rotary_mode="interleave")
    _rtol(tnpu, _rot_interleave(x, r1, r2), out.cpu())


@upstream("npu_rotary_mul", OP + "test_npu_rotary_mul.py", "test_rotary_mul_error_param")
def test_rotary_mul_error_param(tnpu):
    x, r = torch.rand(2, 2, 5, 128), torch.rand(1, 2, 1, 128)
    with pytest.raises(RuntimeError, match="The rotary_mode of npu_rotary_mul should be half or interleave, but got "):
        tnpu.npu_rotary_mul(to_npu(x), to_npu(r), to_npu(r), "quarter")


def _rotary_grads(fn, x, r1, r2):
    leaves = [t.requires_grad_() for t in (x, r1, r2)]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return [t.grad.detach().cpu() for t in leaves]


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_rotary_mul_backward", OP + "test_npu_rotary_mul_backward.py",
          "test_rotary_mul_backward / test_rotary_mul_mode_backward")
@pytest.mark.parametrize("mode,shapes,dtype", [("half", s, torch.float32) for s in _ROT_SHAPES]
                         + [("interleave", s, d) for s in _ROT_MODE_SHAPES for d in (torch.float16, torch.float32)],
                         ids=lambda v: v if isinstance(v, str) else ("x".join(map(str, v[0])) if isinstance(v, list)
                                                                      else str(v).split(".")[-1]))
def test_rotary_mul_backward(tnpu, mode, shapes, dtype):
    """Separate host and device leaves: with an aliasing .npu() this upstream test compares a gradient
    buffer with itself."""
    host = [torch.rand(s, dtype=dtype) for s in shapes]
    device = [to_npu(t) for t in host]
    golden = _rotary_grads(_rot_half if mode == "half" else _rot_interleave, *host)
    got = _rotary_grads(lambda x, a, b: tnpu.npu_rotary_mul(x, a, b, mode), *device)
    for g, o in zip(golden, got):
        _rtol(tnpu, g, o)


# --- npu_apply_rotary_pos_emb, npu_interleave_rope ----------------------------------------------


@pytest.mark.slow  # upstream shapes: seconds each on a shared CPU
@upstream("npu_apply_rotary_pos_emb", OP + "test_npu_apply_rotary_pos_emb.py", "test_npu_apply_rotary_pos_emb")
def test_apply_rotary_pos_emb(tnpu):
    q = torch.from_numpy(np.random.uniform(0, 1, [4, 1024, 16, 128]).astype(np.float16))
    k = torch.from_numpy(np.random.uniform(0, 1, [4, 1024, 16, 128]).astype(np.float16))
    cos = torch.from_numpy(np.random.uniform(0, 1, [4, 1024, 1, 128]).astype(np.float16))
    sin = torch.from_numpy(np.random.uniform(0, 1, [4, 1024, 1, 128]).astype(np.float16))
    golden = [_rot_half(q, cos, sin), _rot_half(k, cos, sin)]
    qd, kd = to_npu(q), to_npu(k)
    out = tnpu.npu_apply_rotary_pos_emb(qd, kd, to_npu(cos), to_npu(sin), "BSND", "half")
    _rtol(tnpu, golden, [t.cpu() for t in out], 0.001)
    _rtol(tnpu, golden, [qd.cpu(), kd.cpu()], 0.001)  # updated in place, as documented


@upstream("npu_apply_rotary_pos_emb", "Ascend/op-plugin@26.1.0 test/test_base_ops/test_autograd_error_fallback.py",
          "test_npu_apply_rotary_pos_emb_backward_raises")
def test_apply_rotary_pos_emb_backward_raises(tnpu, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", "26.1.0")
    q = to_npu(torch.randn(1, 4, 2, 64, dtype=torch.float16)).requires_grad_()
    k = to_npu(torch.randn(1, 4, 2, 64, dtype=torch.float16)).requires_grad_()
    cos, sin = (to_npu(torch.randn(1, 4, 1, 64, dtype=torch.float16)) for _ in range(2))
    out = tnpu.npu_apply_rotary_pos_emb(q, k, cos, sin, "BSND", "half")[0]
    with pytest.raises(RuntimeError, match="not implemented"):
        out.float().sum().backward()


@upstream("npu_interleave_rope", "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_interleave_rope.md",
          "doc example [32, 32, 1, 64] and formula")
def test_interleave_rope_doc_example(tnpu):
    x = torch.randn(32, 32, 1, 64, dtype=torch.float16)
    cos = torch.randn(32, 1, 1, 64, dtype=torch.float16)
    sin = torch.randn(32, 1, 1, 64, dtype=torch.float16)
    q = x.float().reshape(32, 32, 1, 32, 2).transpose(-1, -2).reshape(32, 32, 1, 64)
    golden = _rot_half(q, cos.float(), sin.float()).half()
    out = tnpu.npu_interleave_rope(to_npu(x), to_npu(cos), to_npu(sin))
    _rtol(tnpu, golden, out.cpu())


@upstream("npu_interleave_rope", "Ascend/op-plugin@26.1.0 test/test_base_ops/test_autograd_error_fallback.py",
          "test_npu_interleave_rope_backward_raises")
def test_interleave_rope_backward_raises(tnpu, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", "26.1.0")
    x = to_npu(torch.randn(1, 4, 2, 64, dtype=torch.float16)).requires_grad_()
    cos, sin = (to_npu(torch.randn(1, 1, 2, 64, dtype=torch.float16)) for _ in range(2))
    out = tnpu.npu_interleave_rope(x, cos, sin)
    with pytest.raises(RuntimeError, match="not implemented"):
        out.float().sum().backward()


# --- npu_confusion_transpose --------------------------------------------------------------------

_CT_CASES = [
    [np.float32, [1, 576, 2560], [1, 576, 32, 80], (0, 2, 1, 3), False],
    [np.float32, [1, 32, 576, 80], [1, 576, 2560], (0, 2, 1, 3), True],
    [np.float16, [1, 576, 2560], [1, 576, 32, 80], (0, 2, 1, 3), False],
    [np.float16, [1, 32, 576, 80], [1, 576, 2560], (0, 2, 1, 3), True],
    [np.int_, [1, 576, 2560], [1, 576, 32, 80], (0, 2, 1, 3), False],
    [np.int_, [1, 32, 576, 80], [1, 576, 2560], (0, 2, 1, 3), True],
]


def _ct_golden(x, shape, perm, transpose_first):
    return x.permute(*perm).contiguous().view(shape) if transpose_first else x.view(shape).permute(*perm)


@upstream("npu_confusion_transpose", OP_BASE + "test_confusion_transpose.py", "test_confusion_transpose")
@pytest.mark.parametrize("dtype,in_shape,shape,perm,transpose_first", _CT_CASES)
def test_confusion_transpose(tnpu, dtype, in_shape, shape, perm, transpose_first):
    x = torch.from_numpy(np.random.uniform(0, 100, in_shape).astype(dtype))
    out = tnpu.npu_confusion_transpose(to_npu(x), perm, shape, transpose_first)
    _rtol(tnpu, _ct_golden(x, shape, perm, transpose_first).numpy(), _np(out))


@upstream("npu_confusion_transpose", OP_BASE + "test_confusion_transpose_backward.py",
          "test_confusion_transpose_backward")
@pytest.mark.parametrize("dtype,in_shape,shape,perm,transpose_first", [c for c in _CT_CASES if c[0] != np.int_])
def test_confusion_transpose_backward(tnpu, dtype, in_shape, shape, perm, transpose_first):
    x = torch.from_numpy(np.random.uniform(0, 100, in_shape).astype(dtype))
    xc = x.clone().requires_grad_()
    golden = _ct_golden(xc, shape, perm, transpose_first)
    golden.backward(torch.ones_like(golden))
    xd = to_npu(x).requires_grad_()
    out = tnpu.npu_confusion_transpose(xd, perm, shape, transpose_first)
    out.backward(torch.ones_like(out))
    _rtol(tnpu, golden.detach().numpy(), _np(out))
    _rtol(tnpu, xc.grad.numpy(), _np(xd.grad))
