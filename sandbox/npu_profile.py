"""Parent side of the NPU profile capture: run the eager step under torch_npu.profiler in a sandbox
child (harness mode "npu_profile", which calls tools/npu_profile_capture.profile_npu_step), and
refuse up front, with the reason, where the child would get the CPU emulation instead of an NPU."""

from __future__ import annotations

from pathlib import Path

from trainbridge.sandbox.backends import npu_selection
from trainbridge.sandbox.runner import run_workload
from trainbridge.tools.npu_profile.capture import NpuProfileCapture


class NpuProfileUnavailable(RuntimeError):
    """No real NPU for the child: the profiler cannot run; the message says why."""


def capture_npu_profile(workload, profile_dir: Path, *, attribution: bool = False, steps: int | None = None):
    """Run the workload's step under torch_npu.profiler in a sandbox child (parent side).

    Returns (RunResult, NpuProfileCapture | None): the capture is None when the child failed (the
    RunResult says how). Raises NpuProfileUnavailable where the child would get the CPU emulation.
    """
    selection = npu_selection()
    if selection.mode != "real":
        raise NpuProfileUnavailable(f"torch_npu.profiler needs a real NPU: {selection.reason}")
    run = run_workload(workload.with_overrides(steps=steps), backend="npu", mode="npu_profile",
                       extra_request={"profile_dir": str(Path(profile_dir).resolve()), "attribution": attribution})
    capture = run.extra.get("npu_profile") if run.ok else None
    return run, NpuProfileCapture.model_validate(capture) if capture else None
