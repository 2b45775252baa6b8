"""Target backends: the one place that knows device names, synchronisation and memory statistics.

Shared code asks a `Backend` instead of naming `torch.cuda` or `torch.npu`; the device module is
resolved once through `torch.get_device_module`. Methods that touch torch run inside the sandbox
child; `child_env` and `probe` run in the parent.
"""

from __future__ import annotations

import importlib.util
import resource
import sys
from dataclasses import dataclass
from typing import Literal

BackendName = Literal["cpu", "cuda", "npu"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str


@dataclass(frozen=True)
class Backend:
    name: str

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"unknown backend {self.name!r}: choose one of {', '.join(BACKENDS)}")

    @property
    def device(self) -> str:
        return self.name

    def child_env(self) -> dict[str, str]:
        """Environment the child needs before it imports torch (NPU: task queue, CPU affinity)."""
        if self.name == "npu":
            return {"TASK_QUEUE_ENABLE": "2", "CPU_AFFINITY_CONF": "1"}
        return {}

    # --- child side -------------------------------------------------------------------------
    def _module(self):  # the torch device module (torch.cuda, torch.npu), resolved once per call site
        import torch

        return torch.get_device_module(self.name)

    def sync(self) -> None:
        if self.name != "cpu":
            self._module().synchronize()

    def reset_peak_memory(self) -> None:
        if self.name != "cpu":
            self._module().reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Device peak allocated bytes; on the CPU, the process's peak resident set size."""
        if self.name == "cpu":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(self._module().max_memory_allocated())


def probe(name: str) -> Availability:
    """Whether a backend can run here, with a precise reason when it cannot (parent side)."""
    Backend(name)  # validates the name
    if name == "cpu":
        return Availability(True, "the CPU is always available")
    if name == "cuda":
        import torch

        if not torch.backends.cuda.is_built():
            return Availability(False, f"this torch ({torch.__version__}) is built without CUDA")
        if not torch.cuda.is_available():
            return Availability(False, "torch has CUDA support but no CUDA device is visible")
        return Availability(True, f"{torch.cuda.device_count()} CUDA device(s)")
    if importlib.util.find_spec("torch_npu") is None:
        return Availability(False, f"torch_npu is not installed in {sys.executable}")
    return Availability(True, "torch_npu is installed (device probed in the child)")
