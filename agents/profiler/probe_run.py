"""Run the numerics probe for one side in a sandbox child (parent side)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from trainbridge.agents.profiler.probe_report import ProbeReport, ProbeReportError
from trainbridge.sandbox.results import Failure, FailureKind, RunResult
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import Workload


def run_probe(
    workload: Workload,
    *,
    backend: str,
    seed: int,
    batch_indices: list[int],
    grads_path: Path,
    compile: bool = False,
    extra_env: dict[str, str] | None = None,
    work_dir: Path | None = None,
) -> tuple[RunResult, ProbeReport | None]:
    """One child in harness mode "numerics", its workload built under `seed`. The report is None
    exactly when the run failed (the RunResult says how)."""
    if workload.config.mode != "entry":
        raise ValueError(f"{workload.root}: the numerics probe needs an entry-mode workload (entry = \"module:function\" in "
                         "trainbridge.toml); command mode gives no access to gradients")
    request = {"numerics": {"seed": seed, "batch_indices": list(batch_indices), "grads_path": str(grads_path), "compile": compile}}
    result = run_workload(workload.with_overrides(seed=seed), backend=backend, mode="numerics", extra_request=request,
                          extra_env=extra_env, work_dir=work_dir)
    if not result.ok:
        return result, None
    try:
        return result, ProbeReport.from_run(result)
    except (ProbeReportError, ValidationError) as exc:
        result.failure = Failure(kind=FailureKind.crashed, message=f"the numerics run returned no valid probe report: {exc}"[:2000])
        return result, None
