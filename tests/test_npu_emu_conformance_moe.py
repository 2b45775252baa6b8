"""npu_moe_gating_top_k_softmax against Ascend's golden (a numpy rewrite of what
Ascend/op-plugin test/test_custom_ops/test_npu_moe_gating_top_k_softmax.py computes) and against a
plain PyTorch formula (softmax, topk, the documented row_idx layout), plus the binding's checks and
its missing derivative (see test_npu_emu_conformance_norm_rope.py for the conventions).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from trainbridge.tests.npu_emulation_support import tnpu, to_npu, upstream  # noqa: F401 (tnpu is a fixture)

MOE = "Ascend/op-plugin test/test_custom_ops/test_npu_moe_gating_top_k_softmax.py"
DOC = "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k_softmax.md"
BINDING = "Ascend/op-plugin op_plugin/ops/opapi/MoeGatingTopKSoftmaxKernelNpuOpApi.cpp"


def _golden(x: np.ndarray, finished: np.ndarray | None, k: int):
    """The upstream cpu_op_exec, 2-D x: fp32 softmax (rounded to fp16 for fp16 x), stable descending
    argsort, finished rows get expert E, row_idx = arange(N*k).reshape(k, N).T."""
    experts = x.shape[-1]
    xf = x.astype(np.float32)
    e = np.exp(xf - xf.max(axis=-1, keepdims=True))
    soft = e / e.sum(axis=-1, keepdims=True)
    if x.dtype == np.float16:
        soft = soft.astype(np.float16)
    idx = np.argsort(-soft, axis=-1, kind="stable")[:, :k]
    y = np.take_along_axis(soft, idx, axis=-1)
    if finished is not None:
        idx = np.where(np.tile(finished.reshape(-1, 1), (1, k)), experts, idx)
    row_idx = np.arange(y.shape[0] * y.shape[1]).reshape(y.shape[1], y.shape[0]).transpose(1, 0)
    return y.astype(x.dtype), idx.astype(np.int32), row_idx.astype(np.int32)


def _run(tnpu, x, finished, k):
    y, idx, row = tnpu.npu_moe_gating_top_k_softmax(to_npu(x), None if finished is None else to_npu(finished), k)
    return y.cpu(), idx.cpu(), row.cpu()


@upstream("npu_moe_gating_top_k_softmax", MOE, "test_npu_noe_init_routing (smaller n/col, same k and dtypes)")
@pytest.mark.parametrize("n,k,col,dtype", list(itertools.product([10, 43], [2, 4, 5, 9], [20, 125],
                                                                  [np.float16, np.float32])))
def test_matches_the_upstream_golden(tnpu, n, k, col, dtype):
    rng = np.random.default_rng(n * 1000 + k * 10 + col)
    x = rng.uniform(-1, 1, size=(n, col)).astype(dtype)
    finished = rng.uniform(-1, 1, size=(n,)).astype(bool)  # upstream: nonzero floats -> all True
    finished[::3] = False
    want_y, want_idx, want_row = _golden(x, finished, k)
    y, idx, row = _run(tnpu, torch.from_numpy(x), torch.from_numpy(finished), k)
    assert y.dtype == torch.from_numpy(x).dtype and idx.dtype == row.dtype == torch.int32
    np.testing.assert_allclose(y.float().numpy(), want_y.astype(np.float32), rtol=1e-3 if dtype == np.float16 else 1e-6)
    np.testing.assert_array_equal(idx.numpy(), want_idx)
    np.testing.assert_array_equal(row.numpy(), want_row)


@upstream("npu_moe_gating_top_k_softmax", DOC, "formula: softmax, topK, rowIdx = arange(N*k).reshape(k, N).T")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_a_plain_pytorch_formula_on_3d_input(tnpu, dtype):
    torch.manual_seed(3)
    b, s, experts, k = 2, 5, 16, 4
    x = torch.randn(b, s, experts).to(dtype)
    y, idx, row = _run(tnpu, x, None, k)
    probs = torch.softmax(x.float(), dim=-1)
    if dtype == torch.float16:
        probs = probs.half()
    want_y, want_idx = torch.topk(probs, k, dim=-1)  # random data: no ties
    n = b * s
    want_row = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().reshape(b, s, k)
    assert y.shape == idx.shape == row.shape == (b, s, k)
    torch.testing.assert_close(y, want_y.to(dtype), rtol=0, atol=0)
    assert torch.equal(idx, want_idx.to(torch.int32)) and torch.equal(row, want_row)
    # the 3-D op is the 2-D op on the flattened rows
    y2, idx2, row2 = _run(tnpu, x.reshape(n, experts), None, k)
    assert torch.equal(y2.reshape(b, s, k), y) and torch.equal(idx2.reshape(b, s, k), idx)
    assert torch.equal(row2.reshape(b, s, k), row)


@upstream("npu_moe_gating_top_k_softmax", DOC, "row_idx layout, finished rows get expert index E")
def test_row_idx_layout_finished_rows_and_ties(tnpu):
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 5.0]])
    finished = torch.tensor([False, True, False])
    y, idx, row = _run(tnpu, x, finished, 2)
    assert row.tolist() == [[0, 3], [1, 4], [2, 5]]  # row_idx[r, j] = j * N + r
    assert idx.tolist() == [[0, 1], [4, 4], [0, 1]]  # ties: lower index first; finished row: E = 4
    torch.testing.assert_close(y[0], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(y[1], torch.softmax(x[1], -1)[[1, 2]])  # a finished row keeps its y
    assert torch.allclose(y.sum(-1)[2], 2 * torch.softmax(x[2], -1)[0])


@upstream("npu_moe_gating_top_k_softmax", BINDING, "k == 0 returns before the kernel: outputs [..., 0]")
def test_k_zero_and_empty_rows_give_empty_outputs(tnpu):
    y, idx, row = _run(tnpu, torch.randn(3, 6), None, 0)
    assert y.shape == idx.shape == row.shape == (3, 0) and idx.dtype == row.dtype == torch.int32
    y, _, _ = _run(tnpu, torch.randn(0, 6), None, 2)
    assert y.shape == (0, 2)


@upstream("npu_moe_gating_top_k_softmax", BINDING, "TORCH_CHECKs: rank, dtype, k range, finished dtype/shape")
@pytest.mark.parametrize("x,finished,k,match", [
    (torch.randn(8), None, 1, "The x should be 2D or 3D"),
    (torch.randn(2, 3, 4, 5), None, 1, "The x should be 2D or 3D"),
    (torch.randn(4, 8).double(), None, 1, "float16, float32 or bfloat16 tensor expected"),
    (torch.randn(4, 8), None, 9, r"The k should be in \[0, 8\]"),
    (torch.randn(4, 8), None, -1, r"The k should be in \[0, 8\]"),
    (torch.randn(2, 2000), None, 1025, "k must not be larger than 1024"),
    (torch.randn(4, 8), torch.zeros(4, dtype=torch.int32), 1, "bool tensor expected"),
    (torch.randn(4, 8), torch.zeros(3, dtype=torch.bool), 1, "finished must have x's shape"),
    (torch.randn(2, 4, 8), torch.zeros(8, dtype=torch.bool), 1, "finished must have x's shape"),
])
def test_invalid_arguments_raise(tnpu, x, finished, k, match):
    with pytest.raises(RuntimeError, match=match):
        tnpu.npu_moe_gating_top_k_softmax(to_npu(x), None if finished is None else to_npu(finished), k)


def test_it_is_exported_and_checked_against_the_wheel_schema(tnpu):
    """EMULATED_OPS puts it through test_npu_wheel_schema.py and test_npu_emulation.py's signature checks."""
    from trainbridge.tests.npu_emulation_support import EMULATED_OPS

    assert "npu_moe_gating_top_k_softmax" in tnpu.__all__ and "npu_moe_gating_top_k_softmax" in EMULATED_OPS


@upstream("npu_moe_gating_top_k_softmax", "Ascend/op-plugin op_plugin/config/derivatives.yaml",
          "not listed: no derivative (backward raises from 26.1.0, warns before; see _no_backward)")
@pytest.mark.parametrize("release,raises", [("26.1.0", True), ("7.3.0", False)])
def test_it_has_no_backward(tnpu, monkeypatch, release, raises):
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE", release)
    x = to_npu(torch.randn(4, 8)).requires_grad_(True)
    y, idx, _ = tnpu.npu_moe_gating_top_k_softmax(x, None, 2)
    assert y.requires_grad and not idx.requires_grad
    if raises:
        with pytest.raises(RuntimeError, match="derivative for npu::npu_moe_gating_top_k_softmax is not implemented"):
            y.sum().backward()
    else:
        with pytest.warns(UserWarning, match="npu_moe_gating_top_k_softmax"):
            y.sum().backward()
        assert x.grad is None
