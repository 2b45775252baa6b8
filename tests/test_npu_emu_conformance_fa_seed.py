"""Fusion attention's seed/offset, as op-plugin's bindings treat them (semantics.md 1.9): the caller's
values come back as given with an external dropout_mask or keep_prob=1 (every chip, v1 and v2), and
for v2's internally generated mask on Ascend950 (FlashAttentionV2KernelNpuOpApi.cpp, commit b5972fe0
"offset and seed did not take effect": A2/A3 draw them from the NPU generator, Ascend950 keeps them);
the emulated chip is chosen with TRAINBRIDGE_EMULATED_NPU_SOC (torch_npu._soc).
"""

from __future__ import annotations

import pytest
import torch

from trainbridge.tests.npu_emulation_support import tnpu, to_npu, upstream  # noqa: F401 (tnpu is a fixture)

OP = "Ascend/op-plugin "
FA2 = OP + "test/test_custom_ops/test_npu_flash_attention_v2.py"
V1_CODE = OP + "op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp"
V2_CODE = OP + "op_plugin/ops/opapi/FlashAttentionV2KernelNpuOpApi.cpp"
SOC_ENV = "TRAINBRIDGE_EMULATED_NPU_SOC"


def _bsh(b=1, n=4, s=32, d=16, seed=0):
    torch.manual_seed(seed)
    return [to_npu(torch.randn(b, s, n * d, dtype=torch.float16)) for _ in range(3)]


def _call(tnpu, version, q, k, v, **kwargs):
    fn = tnpu.npu_fusion_attention if version == 1 else tnpu.npu_fusion_attention_v2
    return fn(q, k, v, head_num=4, input_layout="BSH", **kwargs)


@upstream("npu_fusion_attention_v2", FA2, "test_..._v2_with_external_dropout_mask: the mask's seed/offset come back")
@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("version", [1, 2])
def test_an_external_mask_keeps_the_callers_seed_and_offset(tnpu, monkeypatch, version, soc):
    monkeypatch.setenv(SOC_ENV, soc)
    q, k, v = _bsh()
    tnpu.npu.manual_seed(123)
    mask = tnpu._npu_dropout_gen_mask(to_npu(torch.randn(1)), [1, 4, 32, 32], p=0.2, seed=123, offset=8)
    state = tnpu.npu.get_rng_state()
    out = _call(tnpu, version, q, k, v, keep_prob=0.8, dropout_mask=mask, seed=123, offset=8)
    assert (out[4], out[5], out[6]) == (123, 8, 4 * 32 * 32)
    assert torch.equal(tnpu.npu.get_rng_state(), state)  # nothing drawn


@upstream("npu_fusion_attention_v2", V2_CODE, "dropout_gen_mask: keep_prob == 1 draws nothing")
@pytest.mark.parametrize("version", [1, 2])
def test_without_dropout_the_callers_seed_and_offset_come_back(tnpu, version):
    q, k, v = _bsh()
    state = tnpu.npu.get_rng_state()
    out = _call(tnpu, version, q, k, v, keep_prob=1.0, seed=77, offset=40)
    assert (out[4], out[5]) == (77, 40) and torch.equal(tnpu.npu.get_rng_state(), state)


@upstream("npu_fusion_attention_v2", FA2, "test_npu_flash_attention_v2_dropout_mask_with_offset_seed (Ascend950)")
def test_v2_on_ascend950_keeps_the_callers_seed_and_offset(tnpu, monkeypatch):
    monkeypatch.setenv(SOC_ENV, "Ascend950")
    q, k, v = _bsh()
    tnpu.npu.manual_seed(5)
    state = tnpu.npu.get_rng_state()
    out = _call(tnpu, 2, q, k, v, keep_prob=0.8, seed=100, offset=200)
    assert (out[4], out[5]) == (100, 200) and torch.equal(tnpu.npu.get_rng_state(), state)
    # the mask is made from them: the same pair gives the same output, another pair another one
    assert torch.equal(out[0].cpu(), _call(tnpu, 2, q, k, v, keep_prob=0.8, seed=100, offset=200)[0].cpu())
    assert not torch.equal(out[0].cpu(), _call(tnpu, 2, q, k, v, keep_prob=0.8, seed=101, offset=200)[0].cpu())


@upstream("npu_fusion_attention_v2 / _grad_v2", V2_CODE,
          "Ascend950: the backward regenerates the mask from the caller's (seed, offset, numels)")
def test_v2_on_ascend950_explicit_grad_matches_autograd(tnpu, monkeypatch):
    monkeypatch.setenv(SOC_ENV, "Ascend950")
    q, k, v = (t.float().requires_grad_(True) for t in _bsh(seed=1))
    out = _call(tnpu, 2, q, k, v, keep_prob=0.7, seed=31, offset=4, scale=0.25)
    dy = to_npu(torch.randn(q.shape))
    out[0].backward(dy)
    grads = tnpu.npu_fusion_attention_grad_v2(
        q.detach(), k.detach(), v.detach(), dy, 4, "BSH", softmax_max=out[1], softmax_sum=out[2],
        attention_in=out[0].detach(), scale_value=0.25, keep_prob=0.7, seed=out[4], offset=out[5], numels=out[6])
    for got, want in zip(grads[:3], (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


@upstream("npu_fusion_attention / _v2", V1_CODE + " and FlashAttentionV2KernelNpuOpApi.cpp",
          "dropout_gen_mask: v1 draws on every chip, v2 on chips before Ascend950")
@pytest.mark.parametrize("version,soc", [(1, "Ascend910B"), (2, "Ascend910B"), (2, "Ascend910_93"), (1, "Ascend950")])
def test_the_generator_overwrites_the_callers_seed_elsewhere(tnpu, monkeypatch, version, soc):
    monkeypatch.setenv(SOC_ENV, soc)
    q, k, v = _bsh()
    tnpu.npu.manual_seed(9)
    first = _call(tnpu, version, q, k, v, keep_prob=0.8, seed=100, offset=200)
    second = _call(tnpu, version, q, k, v, keep_prob=0.8, seed=100, offset=200)
    assert (first[4], first[5]) == (9, 0) and (second[4], second[5]) == (9, 12)  # philox_engine_inputs(10)


def test_the_emulated_chip_is_checked_and_drives_supported_devices(tnpu, monkeypatch):
    import unittest

    from torch_npu.testing.common_utils import SupportedDevices

    ran = []
    only_950 = SupportedDevices(["Ascend950"])(lambda: ran.append(950))
    only_a2 = SupportedDevices(["Ascend910B"])(lambda: ran.append(910))
    only_a2()
    with pytest.raises(unittest.SkipTest, match="the emulation is Ascend910B"):
        only_950()
    monkeypatch.setenv(SOC_ENV, "Ascend950")
    only_950()
    with pytest.raises(unittest.SkipTest, match="the emulation is Ascend950"):
        only_a2()
    assert ran == [910, 950]
    monkeypatch.setenv(SOC_ENV, "Ascend310P")
    q, k, v = _bsh()
    with pytest.raises(ValueError, match=f"{SOC_ENV} must be one of Ascend910B, Ascend910_93, Ascend950"):
        _call(tnpu, 2, q, k, v, keep_prob=0.8)
