"""npu_confusion_transpose (reference/npu/semantics.md section 5).

transpose_first=True: x.permute(perm).reshape(shape); False: x.view(shape).permute(perm).
The result is materialised (contiguous). Backward: the same op with the inverse permutation.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_tensor


def _as_int_list(op: str, name: str, value) -> list[int]:
    if isinstance(value, torch.Size):
        value = list(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{op}: {name} must be a list of ints, got {value!r}")
    return list(value)


def _check_perm(op: str, perm: list[int], rank: int, against: str) -> None:
    if len(perm) != rank:
        raise ValueError(f"{op}: perm {perm} must have one entry per dim of {against} ({rank})")
    for i, p in enumerate(perm):
        if not 0 <= p < rank:
            raise ValueError(f"{op}: perm[{i}]={p} is out of range for the {rank} dims of {against}")
    if sorted(perm) != list(range(rank)):
        raise ValueError(f"{op}: perm {perm} has repeated entries; it must be a permutation of 0..{rank - 1}")


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


class _ConfusionTranspose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, shape, transpose_first):
        ctx.meta = (perm, tuple(x.shape), transpose_first)
        if transpose_first:
            return x.permute(perm).reshape(shape).contiguous()
        return x.reshape(shape).permute(perm).contiguous()

    @staticmethod
    def backward(ctx, g):
        perm, in_shape, transpose_first = ctx.meta
        inv = _inverse(perm)
        if transpose_first:
            permuted = [in_shape[p] for p in perm]
            dx = g.reshape(permuted).permute(inv)
        else:
            dx = g.permute(inv).reshape(in_shape)
        return dx.contiguous(), None, None, None


def npu_confusion_transpose(self, perm, shape, transpose_first):
    """Fused permute+reshape; see module docstring for the order given by `transpose_first`."""
    op = "npu_confusion_transpose"
    check_tensor(op, "self", self)
    perm = _as_int_list(op, "perm", perm)
    shape = _as_int_list(op, "shape", shape)
    if not isinstance(transpose_first, bool):
        raise TypeError(f"{op}: transpose_first must be a bool, got {type(transpose_first).__name__}")
    if any(s < 0 for s in shape) or math.prod(shape) != self.numel():
        raise ValueError(f"{op}: shape {shape} does not match the {self.numel()} elements of self {tuple(self.shape)}")
    if transpose_first:
        _check_perm(op, perm, self.dim(), "self")
    else:
        _check_perm(op, perm, len(shape), "shape")
    return _ConfusionTranspose.apply(self, perm, shape, transpose_first)
