"""Dropout keep-bits from (p, seed, offset) and torch_npu._npu_dropout_gen_mask.

One function makes the bits for every op (as aclnnDropoutGenMaskV2 does on the NPU), so a mask
made by _npu_dropout_gen_mask(x, size, 1 - keep_prob, seed, offset) is exactly the one
npu_fusion_attention draws internally for that (seed, offset), and its backward regenerates.
The bits themselves are the emulation's own (NPU Philox bits are not reproducible on a CPU).
Packing (op-plugin DropoutGenMaskKernelNpuOpApi.cpp and the mask tests): one bit per element,
little-endian inside each byte, 1 = keep, length rounded up to a multiple of 128 bits.
"""

from __future__ import annotations

import struct

import torch

from ._checks import check_tensor

_ALIGN_BITS = 128


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def drop_prob_from_keep(keep_prob: float) -> float:
    """The binding passes float(1.0) - float(keep_prob), computed in float32."""
    return _float32(_float32(1.0) - _float32(keep_prob))


def keep_bits(numels: int, p: float, seed: int, offset: int) -> torch.Tensor:
    """Bool [numels], True = keep; element kept with probability 1 - p; deterministic in (seed, offset)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 1_000_003 + int(offset)) % (2**63 - 1))
    return torch.rand(int(numels), generator=gen, device="cpu") >= p


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    numels = bits.numel()
    length = (numels + _ALIGN_BITS - 1) // _ALIGN_BITS * _ALIGN_BITS // 8
    padded = torch.zeros(length * 8, dtype=torch.uint8)
    padded[:numels] = bits.reshape(-1).to(torch.uint8)
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (padded.view(length, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def _npu_dropout_gen_mask(self, size, p, seed, offset, *, parallel=True, sync=None):
    """Packed uint8 keep-mask for prod(size) elements, each dropped with probability p."""
    op = "_npu_dropout_gen_mask"
    check_tensor(op, "self", self)
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    numels = 1
    for n in size:
        numels *= int(n)
    return pack_bits(keep_bits(numels, _float32(p), seed, offset))
