"""The profiler agent's entry point for the loop: judge one candidate commit against the run's head.

The graph's profiler node and `trainbridge verify` call this; it picks the tolerances a recipe's
numerics class allows and whether speed can be measured on this host, then runs the gate.
"""

from __future__ import annotations

from pathlib import Path

from trainbridge.agents.profiler import tamper
from trainbridge.agents.profiler.drift import TIMED_DELTA_COSINE_FLOOR, TIMED_DELTA_NORM_RTOL_CAP
from trainbridge.agents.profiler.gate import drift_threads, gate_steps, run_gate
from trainbridge.agents.profiler.numerics import NumericsTolerance
from trainbridge.agents.profiler.region_lab import lab_enabled, lab_env, region_verdict, time_region
from trainbridge.agents.profiler.verdict import Verdict
from trainbridge.sandbox.backends import npu_emulated
from trainbridge.sandbox.confinement import remove_side
from trainbridge.sandbox.workload import load_workload, workload_for_launch


def tolerance_for(numerics) -> NumericsTolerance:
    """The gate's tolerances from a recipe's numerics class (never tighter than the gate's defaults
    for a tolerance recipe: the reference's own run-to-run drift sets the floor)."""
    defaults = NumericsTolerance()
    if numerics.class_ == "exact":
        return NumericsTolerance(grad_rtol=1e-6, grad_atol=1e-9, loss_rtol=1e-6, loss_atol=1e-9)
    return NumericsTolerance(
        grad_rtol=max(numerics.rtol or 0.0, defaults.grad_rtol),
        grad_atol=max(numerics.atol or 0.0, defaults.grad_atol),
        loss_rtol=max(numerics.loss_rtol or 0.0, defaults.loss_rtol),
        grad_cosine_min=min(numerics.grad_cosine_min or defaults.grad_cosine_min, defaults.grad_cosine_min),
        # a recipe may lower the timed steps' direction floor to the gate's own floor for a drifting baseline, not below
        timed_delta_cosine_min=max(min(numerics.timed_delta_cosine_min or defaults.timed_delta_cosine_min,
                                       defaults.timed_delta_cosine_min), TIMED_DELTA_COSINE_FLOOR),
        # and widen the size check of that change up to the gate's own cap for a drifting baseline, not past it
        timed_delta_norm_rtol=min(max(numerics.timed_delta_norm_rtol or defaults.timed_delta_norm_rtol,
                                      defaults.timed_delta_norm_rtol), TIMED_DELTA_NORM_RTOL_CAP),
    )


def speed_measurable(target: str) -> bool:
    """False for the NPU target on a host where it runs under emulation: numerics only."""
    return not (target == "npu" and npu_emulated())


def ready_servers(baseline_root: Path, *, target: str, launch: str | None = None) -> int:
    """Launch, in the background, the fork servers the run's first gate will fork from (its children's,
    its drift child's and the region lab's: sandbox/child/fork_server.py, `prestart`), so that their imports
    overlap whatever the run does meanwhile instead of the first candidate's judging. How many were
    launched: none outside a run's warm scope, for script-mode workloads (exec'd) or off the CPU."""
    from trainbridge.sandbox.child import fork_server
    from trainbridge.sandbox.runner import child_env

    baseline = workload_for_launch(baseline_root, launch) if launch else load_workload(baseline_root)
    if baseline.config.mode != "entry" or not speed_measurable(target):
        return 0
    base_env = fork_server.prewarm_env((baseline.root,))
    envs = [child_env(baseline.config, target, base_env),
            child_env(baseline.with_overrides(threads=drift_threads(baseline.config.threads)).config, target, base_env)]
    if lab_enabled():
        envs.append(lab_env(baseline.config, target))
    return fork_server.prestart(envs, backend=target)


def judge_candidate(baseline_root: Path, candidate_root: Path, *, target: str, recipe_numerics=None, rounds: int,
                    max_rounds: int | None, min_gain: float, launch: str | None = None, determinism: dict | None = None,
                    sites: list | None = None, baseline_step_s: float | None = None, watched: tuple[Path, ...] = (),
                    on_progress=None, reference_root: Path | None = None, reference_what: str | None = None) -> Verdict:
    """The gate's verdict on the candidate worktree against the baseline worktree (`launch`: the
    run's script-mode launch line, when it gave one on the command line; `determinism`: the run's
    repeatability report of the unmodified program, as the prepare node stored it; `sites`: the
    candidate's rewritten regions: when speed is measurable, the region lab times them first and a
    clearly slower region skips the gate, agents/profiler/region_lab.py; `baseline_step_s`: the run's
    baseline step time, from which the gate sizes its children's measured steps, `gate.gate_steps`; `watched`: the
    run's state files, hashed with the installed tool before the region lab and after the gate: agents/profiler/tamper.py;
    `on_progress`: the gate's (phase, done, total) callback, `gate.GateProgress`; `reference_root`: a worktree of the
    baseline with the region computed in higher precision, the recipe's precision reference, or the verified pending
    head the candidate stacks on, `reference_what` saying which: `gate.run_gate`)."""
    from trainbridge.sandbox.script.determinism import DeterminismReport

    tolerance = tolerance_for(recipe_numerics) if recipe_numerics is not None else None
    report = DeterminismReport.model_validate(determinism) if determinism else None

    def workload(root: Path):
        return workload_for_launch(root, launch) if launch else load_workload(root)

    try:
        return _judge(workload(baseline_root), workload(candidate_root), target=target, tolerance=tolerance, rounds=rounds,
                      max_rounds=max_rounds, min_gain=min_gain, report=report, sites=sites, baseline_step_s=baseline_step_s,
                      watched=watched, on_progress=on_progress,
                      reference=workload(reference_root) if reference_root is not None else None, reference_what=reference_what)
    finally:
        remove_side(candidate_root)  # its children's HOME, TMPDIR and compile caches (sandbox/confinement.py)
        if reference_root is not None:
            remove_side(reference_root)


def _judge(baseline, candidate, *, target: str, tolerance, rounds: int, max_rounds: int | None, min_gain: float, report,
           sites: list | None, baseline_step_s: float | None, watched: tuple[Path, ...], on_progress=None,
           reference=None, reference_what: str | None = None) -> Verdict:
    region = None
    harness_before = tamper.harness_digest(watched)  # the region lab runs the candidate's code too
    if sites and speed_measurable(target) and lab_enabled() and baseline.config.mode == "entry":
        region = time_region(baseline, candidate, list(sites), backend=target)
        early = region_verdict(region, backend=target)
        if early is not None:
            return early
    verdict = run_gate(baseline, candidate, backend=target, rounds=rounds, max_rounds=max_rounds, min_gain=min_gain,
                       steps_per_round=gate_steps(baseline.config.steps, baseline_step_s), tolerance=tolerance,
                       emulated_speed=not speed_measurable(target), determinism=report, watched=watched,
                       harness_before=harness_before, on_progress=on_progress, reference=reference, reference_what=reference_what)
    if region is None:
        return verdict
    seconds = {"region": round(region.wall_s, 3), **verdict.phase_seconds}
    return verdict.model_copy(update={"region": region.model_dump(mode="json"), "phase_seconds": seconds})
