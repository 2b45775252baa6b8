"""NPU emulation: a CPU stand-in for torch_npu (./torch_npu) and the logic that decides when to use it.

The stand-in is never imported here; a child process gets it on its PYTHONPATH (see
`selection_env`) only when `select_torch_npu` finds no usable real torch_npu.
"""

from ._selection import NpuSelection, emulation_path, select_torch_npu, selection_env

__all__ = ["NpuSelection", "emulation_path", "select_torch_npu", "selection_env"]
