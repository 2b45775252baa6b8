"""The report's NPU kernels per step (issue 25, item 4): before, on the pending head, and what torch.compile's
reference runs the same step in. Without an NPU this is what can be counted; speed stays unmeasured."""

from __future__ import annotations

from typing import Any


def pending_head_kernels(state: dict[str, Any]) -> tuple[int, str] | None:
    """The pending head's kernels per step and its commit: the last numerics-verified NPU candidate's count (each one
    is made on the pending head, so it counts every rewrite stacked so far)."""
    for record in reversed(state.get("verdicts") or []):
        kernels = (record.get("gate") or {}).get("device_kernels")
        if record.get("reason") == "speed_unmeasured_numerics_ok" and kernels:
            return int(kernels["candidate"]), str(record.get("sha") or "")
    return None


def baseline_kernels(state: dict[str, Any]) -> int | None:
    if state.get("baseline_kernels") is not None:
        return int(state["baseline_kernels"])
    for record in state.get("verdicts") or []:
        kernels = (record.get("gate") or {}).get("device_kernels")
        if kernels:
            return int(kernels["baseline"])
    return None


def npu_kernels_line(state: dict[str, Any]) -> str | None:
    """One paragraph, or None where nothing was counted (a CPU or CUDA target, a real NPU)."""
    before = baseline_kernels(state)
    if before is None:
        return None
    reference = state.get("reference_kernels") or {}
    compiled = (f" torch.compile's reference ran the model's forward and backward in "
                f"{reference.get('forward', 0)} + {reference.get('backward', 0)} kernels (Inductor, on the host CPU; "
                "the optimizer not included)." if reference else "")
    pending = pending_head_kernels(state)
    if pending is None:
        return (f"NPU kernels per step: {before} (the original, counted on the emulated npu: forward, backward and "
                f"optimizer); no rewrite is pending, speed unmeasured.{compiled}")
    after, sha = pending
    change = f"{(after / before - 1) * 100:+.0f}%".replace("-", "\u2212") if before else "n/a"
    return (f"**NPU kernels per step {before} \u2192 {after}, {change}** (the original \u2192 the pending head"
            f"{f' `{sha[:12]}`' if sha else ''}, counted on the emulated npu: forward, backward and optimizer); "
            f"speed unmeasured.{compiled}")
