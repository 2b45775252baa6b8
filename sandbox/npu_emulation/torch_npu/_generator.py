"""The emulated NPU generator: a Philox-style (seed, offset) state per device, apart from the host's.

Mirrors torch_npu's NPUGeneratorImpl (Ascend/pytorch torch_npu/csrc/aten/NPUGeneratorImpl.cpp):
the default seed is c10::default_rng_seed_val (67280421310721); manual_seed sets the seed and
resets the offset to 0; philox_engine_inputs(increment) returns (seed, offset) and then advances
the offset by the increment rounded up to a multiple of 4 (so npu_fusion_attention, which asks for
10, advances it by 12 per call). Fused ops that draw random bits take (seed, offset) from here and
never touch the host generator. Ordinary random ops on device tensors (dropout, rand, normal_, ...)
draw from the device's own stream too (`ops_state`, a CPU generator state seeded with the same seed),
so they never consume the host stream either (see _device_backend). State tensors: 16 uint8 bytes
(seed, offset: little-endian int64) followed by the op stream's state.
"""

from __future__ import annotations

import os
import struct

import torch

DEFAULT_SEED = 67280421310721


class NpuGenerator:
    def __init__(self, device_index: int = 0):
        self.device_index = device_index
        self._seed = DEFAULT_SEED
        self._offset = 0
        self.ops_state = _stream_state(DEFAULT_SEED)

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.device_index)

    def manual_seed(self, seed: int) -> "NpuGenerator":
        self._seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self._offset = 0
        self.ops_state = _stream_state(self._seed)
        return self

    def seed(self) -> int:
        self.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return self._seed

    def initial_seed(self) -> int:
        return self._seed

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> None:
        if int(offset) % 4:
            raise RuntimeError("RNG offset must be a multiple of 4.")
        self._offset = int(offset)

    def philox_engine_inputs(self, increment: int) -> tuple[int, int]:
        offset = self._offset
        self._offset += (int(increment) + 3) // 4 * 4
        return self._seed, offset

    def get_state(self) -> torch.Tensor:
        head = torch.tensor(list(struct.pack("<QQ", self._seed, self._offset)), dtype=torch.uint8)
        return torch.cat((head, self.ops_state))

    def set_state(self, state: torch.Tensor) -> "NpuGenerator":
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() <= 16:
            raise RuntimeError("Expected a torch.ByteTensor from torch.npu.get_rng_state() as the NPU generator state")
        state = state.detach().cpu()
        self._seed, self._offset = struct.unpack("<QQ", bytes(state[:16].tolist()))
        self.ops_state = state[16:].clone()
        return self


def _stream_state(seed: int) -> torch.Tensor:
    return torch.Generator(device="cpu").manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF).get_state()


_generators: dict[int, NpuGenerator] = {}


def default_generator(index: int = 0) -> NpuGenerator:
    gen = _generators.get(index)
    if gen is None:
        gen = _generators[index] = NpuGenerator(index)
    return gen


def all_generators(count: int) -> list[NpuGenerator]:
    return [default_generator(i) for i in range(count)]
