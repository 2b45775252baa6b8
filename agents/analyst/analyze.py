"""The analyst: collect evidence for a repository and turn it into ranked intents.

Phases (each timed): the static source scan; the eager step profiled on the target in the sandbox;
the reference (the step under torch.compile in the sandbox, or an evidence pack brought from
another machine); the advisor's rules over the eager ops; the static scan of the library files the
step ran (library_scan.py: regions of a model that lives in a library); alignment and ranking. User code only ever
runs in sandbox children.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from pydantic import Field

from trainbridge.agents.analyst import affinity
from trainbridge.agents.analyst.align import EarlierLookup, align
from trainbridge.agents.analyst.library_scan import scan_library_regions
from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.records import FusionGroup, Intent, Record
from trainbridge.sandbox.npu_emulation import host_reference_env
from trainbridge.sandbox.results import RunResult
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.scratch import scratch_dir
from trainbridge.sandbox.workload import Workload
from trainbridge.tools.eager_profile import EagerOpTable
from trainbridge.tools.inductor.parser import EvidenceSummary, parse_evidence_dir

REFERENCE_TIMED_STEPS = 5  # compiled steps timed after the capture: the torch.compile reference's speed here
REFERENCE_TIMEOUT_FLOOR_S = 600.0  # a cold compile with every cache off takes minutes on a small CPU; timeout_s is sized for eager steps

PhaseCallback = Callable[[str], None]


class AnalysisError(RuntimeError):
    """Evidence could not be collected; the message says which phase failed and why."""


class Analysis(Record):
    repo: str
    backend: str
    mode: str = Field(description="runtime (profile + reference), runtime-earlier-reference (K of unchanged regions from "
                      "the run's first analysis), runtime-no-reference, or static")
    intents: list[Intent]
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    eager_ops_per_step: int | None = None
    eager_step_time_us: float | None = None
    reference_step_s: float | None = Field(default=None, description="median step of the torch.compile reference when compiled "
                                           "here (same machine and sandbox as the eager runs; one run, not interleaved)")
    reference: EvidenceSummary | None = None
    reference_source: str | None = Field(default=None, description="where the reference was compiled ('compiled here', "
                                         "'compiled here on the host CPU ...' for an NPU target without an NPU) or the pack's path")
    skipped_files: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def analyze_repo(
    workload: Workload,
    *,
    backend: str = "cpu",
    static_only: bool = False,
    reference_pack: Path | None = None,
    compile_reference: bool = True,
    on_phase: PhaseCallback | None = None,
    earlier: EarlierLookup | None = None,
) -> Analysis:
    """Analyse `workload` (its root may be a worktree). Raises AnalysisError when a runtime phase fails. Without a
    reference to compile or read, `earlier` (agents/analyst/earlier_reference.py) gives K of the regions an earlier
    analysis of the same run counted and whose code is unchanged."""
    timings: dict[str, float] = {}
    notes: list[str] = []
    root = workload.root

    with _timed("static_scan", timings, on_phase):
        scanned = scan_repo_result(root, target=backend)
    skipped = [f"{s.file}: {s.reason}" for s in scanned.skipped]
    notes += [failure.describe() for failure in scanned.detector_failures]
    if static_only:
        intents = align(scanned.intents)
        return Analysis(repo=str(root), backend=backend, mode="static", intents=intents, phase_seconds=timings,
                        skipped_files=skipped, notes=["static scan only: no runtime evidence, savings not estimated", *notes])

    with _timed("target_profile", timings, on_phase):
        profiled = run_workload(workload.with_overrides(steps=1, warmup_steps=1), backend=backend, mode="profile")
    table = EagerOpTable.model_validate(_extra(profiled, "eager_ops", "profiling the eager step"))
    optimizer_class = profiled.extra.get("optimizer_class")

    reference_groups: list[FusionGroup] | None = None
    reference_step_s: float | None = None
    summary: EvidenceSummary | None = None
    source: str | None = None
    if reference_pack is not None or compile_reference:
        with _timed("reference", timings, on_phase), scratch_dir("trainbridge-evidence-") as tmp:
            evidence_dir, source = _reference_dir(workload, backend, reference_pack, Path(tmp))
            # a reference compiled on another device than the target's times nothing the target's steps compare with
            reference_step_s = _compiled_step_s(evidence_dir) if reference_pack is None and source != HOST_REFERENCE else None
            parsed = parse_evidence_dir(evidence_dir, root)
            reference_groups, summary = parsed.groups, parsed.summary
    elif earlier is not None:
        notes.append("no reference compiled in this analysis: K (reference kernels) from the run's first analysis for the "
                     "regions whose code is unchanged since; elsewhere unknown, savings estimated coarsely")
    else:
        notes.append("no compiled reference: K (reference kernels) unknown, savings estimated coarsely")

    with _timed("advisor_rules", timings, on_phase):
        advisor_intents = affinity.detect(table, optimizer_class)
    with _timed("library_scan", timings, on_phase):
        library_intents, library_notes = scan_library_regions(table, target=backend)
    notes.extend(library_notes)
    with _timed("align", timings, on_phase):
        intents = align(scanned.intents + library_intents + advisor_intents, table, reference_groups, earlier=earlier)
    step_ops = sum(1 for op in table.ops if op.step == 0)
    return Analysis(
        repo=str(root),
        backend=backend,
        mode="runtime" if reference_groups is not None else ("runtime-earlier-reference" if earlier is not None
                                                              else "runtime-no-reference"),
        intents=intents,
        phase_seconds=timings,
        eager_ops_per_step=step_ops,
        eager_step_time_us=(sorted(table.step_times_us)[len(table.step_times_us) // 2] if table.step_times_us else None),
        reference_step_s=reference_step_s,
        reference=summary,
        reference_source=source,
        skipped_files=skipped,
        notes=notes,
    )


def _reference_dir(workload: Workload, backend: str, pack: Path | None, tmp: Path) -> tuple[Path, str]:
    if pack is not None:
        from trainbridge.tools.evidence_pack import read_pack

        unpacked = read_pack(pack, tmp)
        return unpacked.evidence_dir, str(pack)
    evidence_dir = tmp / "evidence"
    compile_backend, source = reference_backend(backend)
    # script mode (sandbox/script/capture.py) compiles the modules the optimizers train, or honours the script's own
    # torch.compile, over the script's own steps; entry mode compiles parts["model"]
    timeout_s = max(workload.config.timeout_s, REFERENCE_TIMEOUT_FLOOR_S)
    # an NPU program compiled on the host CPU imports torch_npu: the stand-in maps its npu device onto the CPU there
    extra_env = host_reference_env({}) if backend == "npu" and compile_backend == "cpu" else None
    captured = run_workload(workload.with_overrides(steps=2, warmup_steps=0, timeout_s=timeout_s), backend=compile_backend,
                            mode="capture", extra_request={"evidence_dir": str(evidence_dir), "timed_steps": REFERENCE_TIMED_STEPS},
                            extra_env=extra_env)
    return Path(_extra(captured, "evidence_dir", f"compiling the reference step with torch.compile ({source})")), source


HOST_REFERENCE = ("compiled here on the host CPU (Inductor): no NPU on this host, so the reference is what Inductor fuses "
                  "for the same lines on the CPU")


def reference_backend(backend: str) -> tuple[str, str]:
    """The backend the torch.compile reference of a `backend` target is compiled on, and how the analysis says so.
    An NPU target compiles on the NPU when a real torch_npu is usable; without one the reference runs on the host
    CPU: the emulated npu device only checks numerics, it has no compiler (what Inductor fuses is read per source
    line, and the lines are the same)."""
    if backend != "npu":
        return backend, "compiled here"
    from trainbridge.sandbox.backends import npu_selection

    if npu_selection().mode == "real":
        return "npu", "compiled here on the NPU"
    return "cpu", HOST_REFERENCE


def _compiled_step_s(evidence_dir: Path) -> float | None:
    try:
        manifest = json.loads((Path(evidence_dir) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = manifest.get("compiled_step_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _extra(result: RunResult, key: str, what: str):
    if result.failure is not None:
        tail = f"\n{result.failure.traceback_tail}" if result.failure.traceback_tail else ""
        raise AnalysisError(f"{what} failed ({result.failure.kind}): {result.failure.message}{tail}")
    if key not in result.extra:
        raise AnalysisError(f"{what} returned no {key}; stderr tail:\n{result.stderr_tail}")
    return result.extra[key]


@contextmanager
def _timed(phase: str, timings: dict[str, float], on_phase: PhaseCallback | None) -> Iterator[None]:
    if on_phase is not None:
        on_phase(phase)
    started = time.monotonic()
    try:
        yield
    finally:
        timings[phase] = round(time.monotonic() - started, 3)
