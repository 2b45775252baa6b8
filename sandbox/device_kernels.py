"""Device kernels per step, read in the child where the device counts them (issue 25, item 4).

The NPU emulation counts every kernel a program launches on its emulated device
(sandbox/npu_emulation/torch_npu/_kernel_count.py, `torch_npu.__trainbridge_kernels_launched__`);
`KernelCounter` reads it at a step's start and end, and the step's reply carries the difference
(`kernels`). Where nothing counts (the CPU, CUDA, a real torch_npu, the npu -> cpu mapping) every
reading is None and the replies carry nothing. On a real NPU the profiler's kernel count gives the
same figure measured (tools/npu_profile).
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _reader() -> Callable[[], int] | None:
    npu = sys.modules.get("torch_npu")
    read = getattr(npu, "__trainbridge_kernels_launched__", None) if npu is not None else None
    return read if callable(read) else None


class KernelCounter:
    """Kernels launched between two readings. The count is looked up at each `mark` until found: a
    script may import torch_npu after the harness set its hooks."""

    def __init__(self) -> None:
        self._read: Callable[[], int] | None = None

    def mark(self) -> int | None:
        if self._read is None:
            self._read = _reader()
        return self._read() if self._read is not None else None

    def since(self, mark: int | None) -> int | None:
        if mark is None or self._read is None:
            return None
        return self._read() - mark


def step_reply_field(counter: KernelCounter, mark: int | None) -> dict[str, int]:
    """`{"kernels": n}` for a step reply, or nothing where no device counts."""
    n = counter.since(mark)
    return {} if n is None else {"kernels": n}
