"""Profile the eager training step on a real NPU with torch_npu.profiler; parse what it writes.

Runs INSIDE the sandbox child (harness mode "npu_profile"), on an NPU host. The settings follow
reference/README.md and reference/npu/profiler_output_formats.md:

- activities CPU + NPU, `record_shapes=True`, `with_stack=True` (the parser maps operators to
  source lines through their call stacks);
- a schedule (skip_first=0, wait=0, warmup=1, active=steps, repeat=1) so step_trace_time.csv has
  one row per profiled step; the caller's warm-up steps run before the profiler starts;
- `on_trace_ready=tensorboard_trace_handler(dir)`, never `export_chrome_trace` (which writes no
  step_trace_time.csv and none of the CSV tables);
- `_ExperimentalConfig(export_type=Text, profiler_level=Level0, aic_metrics=AiCoreNone)` by
  default (cheapest); `attribution=True` asks for Level1 + PipeUtilization (per-kernel pipe
  utilisation, api_statistic.csv), which costs more but says why a kernel is slow.

TASK_QUEUE_ENABLE and CPU_AFFINITY_CONF are set in the child's environment before torch_npu is
imported (sandbox.backends.Backend.child_env). The output is parsed by
tools.npu_profiler_parser into the same TargetProfile the eager CPU profile gives.

The parent side, `capture_npu_profile(workload, profile_dir)`, is sandbox/npu_profile.py (it starts
the sandbox child; tools never import the sandbox).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from trainbridge.records import Record, TargetProfile

PROFILER_WARMUP_STEPS = 1  # profiler-schedule warm-up (not recorded), after the caller's warm-up steps


class NpuProfileCapture(Record):
    """What one capture produced: where torch_npu wrote it, with which settings, and the parsed profile."""

    output_dir: str | None = Field(default=None, description="the <host>_<pid>_<time>_ascend_pt directory")
    settings: dict[str, Any] = Field(description="the profiler settings used (names as torch_npu spells them)")
    steps: int
    warmup_steps: int
    host_step_times_us: list[float] = Field(description="profiled steps, timed between syncs on the host (profiler overhead included)")
    target_profile: TargetProfile | None = None
    kernels_per_step: float | None = None
    parse_error: str | None = Field(default=None, description="why the output could not be parsed, when it could not")


def profiler_kwargs(torch_npu: Any, out_dir: Path, *, steps: int, attribution: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments for torch_npu.profiler.profile, and a JSON-able record of them."""
    prof = torch_npu.profiler
    level = "Level1" if attribution else "Level0"
    metrics = "PipeUtilization" if attribution else "AiCoreNone"
    experimental: dict[str, Any] = {
        "profiler_level": getattr(prof.ProfilerLevel, level),
        "aic_metrics": getattr(prof.AiCMetrics, metrics),
    }
    if hasattr(prof, "ExportType"):  # older torch_npu has no export_type (text is its only format)
        experimental["export_type"] = prof.ExportType.Text
    kwargs = {
        "activities": [prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU],
        "schedule": prof.schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=steps, repeat=1, skip_first=0),
        "on_trace_ready": prof.tensorboard_trace_handler(str(out_dir)),
        "record_shapes": True,
        "with_stack": True,
        "profile_memory": False,
        "experimental_config": prof._ExperimentalConfig(**experimental),
    }
    record = {"activities": ["CPU", "NPU"], "schedule": {"wait": 0, "warmup": PROFILER_WARMUP_STEPS, "active": steps,
                                                         "repeat": 1, "skip_first": 0},
              "on_trace_ready": f"tensorboard_trace_handler({out_dir})", "record_shapes": True, "with_stack": True,
              "profiler_level": level, "aic_metrics": metrics, "export_type": "Text" if "export_type" in experimental else None}
    return kwargs, record


def profile_npu_step(
    parts: dict[str, Any],
    profile_dir: Path,
    repo_root: Path,
    *,
    steps: int = 3,
    warmup: int = 2,
    attribution: bool = False,
    sync: Callable[[], None] = lambda: None,
    torch_npu_module: Any = None,
) -> NpuProfileCapture:
    """Run `warmup` unrecorded steps, then profile `steps` steps, and parse the output.

    A parse failure is reported in `parse_error` (the raw output stays in `profile_dir` for
    `trainbridge` to re-read or for a person to inspect); a failing step raises as usual.
    """
    if steps < 1:
        raise ValueError(f"profile at least one step (got steps={steps})")
    torch_npu = torch_npu_module
    if torch_npu is None:
        import torch_npu  # noqa: F811  (the real one: this module is for NPU hosts)
    if getattr(torch_npu, "__trainbridge_emulated__", False):
        raise RuntimeError("torch_npu.profiler needs a real NPU; this child runs trainbridge's CPU emulation. "
                           "Profile with harness mode 'profile' instead, or run on an NPU host.")
    profile_dir = Path(profile_dir)
    profile_dir.mkdir(parents=True, exist_ok=True)
    before = set(profile_dir.glob("*_ascend_pt"))
    model, optimizer, batch, train_step = parts["model"], parts["optimizer"], parts["batch"], parts["train_step"]
    for step in range(warmup):
        train_step(model, optimizer, batch(step))
    sync()
    kwargs, settings = profiler_kwargs(torch_npu, profile_dir, steps=steps, attribution=attribution)
    times: list[float] = []
    with torch_npu.profiler.profile(**kwargs) as prof:
        for index in range(PROFILER_WARMUP_STEPS + steps):
            data = batch(warmup + index)
            sync()
            started = time.perf_counter()
            train_step(model, optimizer, data)
            sync()
            if index >= PROFILER_WARMUP_STEPS:
                times.append((time.perf_counter() - started) * 1e6)
            prof.step()
    capture = NpuProfileCapture(settings=settings, steps=steps, warmup_steps=warmup, host_step_times_us=times)
    created = sorted(set(profile_dir.glob("*_ascend_pt")) - before, key=lambda p: p.stat().st_mtime)
    if not created:
        capture.parse_error = (f"torch_npu.profiler wrote no *_ascend_pt directory under {profile_dir}; check the "
                               "profiler's log in the child's stderr")
        return capture
    capture.output_dir = str(created[-1])
    return parse_capture(capture, repo_root)


def parse_capture(capture: NpuProfileCapture, repo_root: Path) -> NpuProfileCapture:
    """Fill the capture's TargetProfile and kernel count from its output directory."""
    from trainbridge.tools.npu_profile.parser import NpuProfileError, kernels_per_step, load_npu_profile, to_target_profile

    try:
        table = load_npu_profile(capture.output_dir)
        step_time = None if table.step_trace or not capture.host_step_times_us else statistics.median(capture.host_step_times_us)
        capture.target_profile = to_target_profile(table, repo_root, step_time_us=step_time)
        capture.kernels_per_step = kernels_per_step(table) if table.kernels is not None else None
    except (NpuProfileError, OSError) as exc:
        capture.parse_error = str(exc)
    return capture
