"""npu_moe_gating_top_k_softmax: the MoE router's softmax over experts, then top-k (no backward).

Semantics (op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k_softmax.md, the
binding MoeGatingTopKSoftmaxKernelNpuOpApi.cpp, the golden of
test/test_custom_ops/test_npu_moe_gating_top_k_softmax.py, the aclnnMoeGatingTopKSoftmax doc):
- x is 2-D [N, E] or 3-D [B, S, E] (rows = every leading position, N = their count), fp16/bf16/fp32;
  softmax over the last axis (E experts), computed in fp32; for fp16 the probabilities are rounded to
  fp16 before the top-k, as the golden does;
- y, expert_idx: the k largest probabilities of each row, descending, and their expert indices
  (ties: the lower index first, the golden's stable sort); y has x's dtype, expert_idx int32;
- finished (bool, x.shape[:-1]): a True row is not routed: its expert_idx are all E (the expert
  count); its y stays the top-k probabilities (golden and kernel both leave y alone);
- row_idx (int32, y's shape): row_idx[r, j] = j * N + r, i.e. arange(N * k).reshape(k, N).T, the
  position of (row r, choice j) in the k-major expanded order npu_moe_init_routing consumes;
- 0 <= k <= E and k <= 1024; k = 0, or an empty x, gives empty outputs (the binding skips the kernel).
torch_npu registers no derivative for it: backward raises or warns by release (see _no_backward).
"""

from __future__ import annotations

import torch

from ._checks import check_tensor
from ._no_backward import ForwardOnly

OP = "npu_moe_gating_top_k_softmax"
K_LIMIT = 1024  # aclnnMoeGatingTopKSoftmax: k <= 1024
_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


def _check(x, finished, k) -> None:
    check_tensor(OP, "x", x)
    if x.dim() not in (2, 3):
        raise RuntimeError(f"{OP}: The x should be 2D or 3D, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise RuntimeError(f"{OP}: float16, float32 or bfloat16 tensor expected but got a tensor with dtype: {x.dtype}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{OP}: k must be an int, got {type(k).__name__} {k!r}")
    experts = x.shape[-1]
    if not 0 <= k <= experts:
        raise RuntimeError(f"{OP}: The k should be in [0, {experts}], got {k}")
    if k > K_LIMIT:
        raise RuntimeError(f"{OP}: k must not be larger than {K_LIMIT} (aclnnMoeGatingTopKSoftmax), got {k}")
    if finished is None:
        return
    check_tensor(OP, "finished", finished)
    if finished.dtype != torch.bool:
        raise RuntimeError(f"{OP}: bool tensor expected but got a tensor with dtype: {finished.dtype}")
    if finished.dim() != x.dim() - 1 or tuple(finished.shape) != tuple(x.shape[:-1]):
        raise RuntimeError(f"{OP}: finished must have x's shape without the last axis {tuple(x.shape[:-1])}, "
                           f"got {tuple(finished.shape)}")
    if finished.device != x.device:
        raise RuntimeError(f"{OP}: finished is on {finished.device}, x on {x.device}")


def _gating(x: torch.Tensor, finished: torch.Tensor | None, k: int):
    experts = x.shape[-1]
    rows = x.reshape(-1, experts)
    n = rows.shape[0]
    probs = torch.softmax(rows.float(), dim=-1)
    if x.dtype == torch.float16:
        probs = probs.half()
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    y = probs.gather(-1, order).to(x.dtype)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        expert_idx = torch.where(finished.reshape(n, 1), torch.full_like(expert_idx, experts), expert_idx)
    row_idx = torch.arange(n * k, dtype=torch.int32, device=x.device).reshape(k, n).t()
    shape = (*x.shape[:-1], k)
    return y.reshape(shape), expert_idx.reshape(shape), row_idx.reshape(shape)


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """(y, expert_idx, row_idx): top-k of softmax(x, -1) per row; see the module doc."""
    _check(x, finished, k)
    if k == 0 or x.numel() == 0:
        shape = (*x.shape[:-1], k)
        return (x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32))
    return ForwardOnly.apply(OP, _gating, x, finished, k)
