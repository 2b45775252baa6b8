"""NPU emulation: a CPU stand-in for torch_npu (./torch_npu) and the logic that decides when to use it.

The stand-in is never imported here; a child process gets it on its PYTHONPATH (see
`selection_env`) only when `select_torch_npu` finds no usable real torch_npu.

Settings the stand-in reads (environment of the child):
- TRAINBRIDGE_NPU_EMULATION_DEVICE: "backend" (default) gives a real `npu` device type through
  PyTorch's Python backend hook (transfers copy, mixed host/device ops raise the NPU's error);
  "map" maps npu onto the CPU (the fallback). torch_npu.__version__ carries the mode as a local
  label ("2.13.0+trainbridge.backend"), so the run's versions say which one was used.
- TRAINBRIDGE_EMULATED_TORCH_NPU_RELEASE: the Ascend release emulated (default 26.1.0), for
  behaviour that changed between releases (backward through ops without a derivative raises from
  26.1.0, warns before).
- TRAINBRIDGE_EMULATED_NPU_COUNT: torch.npu.device_count() (default 1).
- TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP=0: no device at all (in-process op tests).
Conformance with Ascend's own op tests: benchmarks/npu_emulation_conformance.py.
"""

from ._selection import NpuSelection, emulation_path, host_reference_env, select_torch_npu, selection_env

__all__ = ["NpuSelection", "emulation_path", "host_reference_env", "select_torch_npu", "selection_env"]
