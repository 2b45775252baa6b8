"""The profiler gate: is the candidate numerically the baseline, and is it faster?

Order of checks, cheapest and most decisive first:

1. **Configuration.** Both sides run under the baseline's trainbridge.toml; a candidate that
   changes it (seed, steps, entry, threads) is rejected as ``tampered_inputs``.
2. **Numerics.** One child per side in harness mode "numerics" with a seed and batch indices drawn
   fresh for this check (unknowable to the candidate). A candidate failure becomes the matching
   typed rejection (crashed, timed_out, out_of_memory, import_error); gate-gaming signs
   (`integrity`) reject before the numbers are judged; then gradients and losses are compared
   (`numerics`). With ``emulated_speed`` (NPU emulation on a host without an NPU) the gate stops
   here: ``speed_unmeasured_numerics_ok``.
3. **Timing.** ``rounds`` rounds (up to ``max_rounds`` when the first look is inconclusive but
   shows a gain or loss of at least ``min_gain``, see `stats.gate_decision`), each a fresh child per side running warm-up plus
   ``steps_per_round`` measured steps, in alternating order (AB, BA, AB, ...: position effects
   cancel within each pair of rounds). Both sides use one fresh timing seed; their losses must
   agree round by round (a candidate that only does the work when it is not timed shows here).
4. **Decision** on the per-round medians (`stats.decide_speed`).

A failure of the *baseline* is not the candidate's fault: it raises `GateError`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from trainbridge.agents.profiler.integrity import Finding, check_config, check_probes, check_timed_losses
from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance, compare_numerics, load_grads
from trainbridge.agents.profiler.probe_report import ProbeReport
from trainbridge.agents.profiler.probe_run import run_probe
from trainbridge.agents.profiler.stats import SpeedOutcome, decide_speed, gate_decision, wants_more_rounds
from trainbridge.agents.profiler.verdict import FAILURE_REASONS, Verdict, VerdictReason
from trainbridge.sandbox.results import Failure, FailureKind, RunResult
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.scratch import scratch_dir
from trainbridge.sandbox.workload import Workload

GateProgress = Callable[[str, int, int], None]  # (phase, done, total); phases "numerics", "timing"
SEED_LIMIT = 2**31 - 1
_SPEED_REASONS = {
    SpeedOutcome.accepted: VerdictReason.accepted,
    SpeedOutcome.slower: VerdictReason.slower,
    SpeedOutcome.not_significant: VerdictReason.not_significant,
}


class GateError(RuntimeError):
    """The gate could not judge the candidate (the baseline itself failed, or bad arguments)."""


def run_gate(
    baseline: Workload,
    candidate: Workload,
    *,
    backend: str = "cpu",
    rounds: int = 10,
    max_rounds: int | None = None,
    steps_per_round: int | None = None,
    min_gain: float = 0.01,
    tolerance: NumericsTolerance | None = None,
    emulated_speed: bool = False,
    confidence: float = 0.95,
    numerics_steps: int = 3,
    batch_index_range: int = 256,
    rng: random.Random | None = None,
    extra_env: dict[str, str] | None = None,
    on_progress: GateProgress | None = None,
    work_dir: Path | None = None,
) -> Verdict:
    """Judge `candidate` against `baseline` (see the module doc). `rng` only for reproducible tests:
    by default seeds and batch indices come from the operating system's entropy."""
    max_rounds = rounds if max_rounds is None else max_rounds
    if rounds < 1 or max_rounds < rounds or numerics_steps < 1 or batch_index_range < numerics_steps:
        raise GateError(f"need rounds >= 1 (got {rounds}), max_rounds >= rounds (got {max_rounds}), numerics_steps >= 1 (got {numerics_steps}) and "
                        f"batch_index_range >= numerics_steps (got {batch_index_range})")
    if baseline.config.mode != "entry":
        raise GateError(f"{baseline.root}: the gate checks numerics through entry = \"module:function\" in trainbridge.toml; "
                        "command-mode workloads give no access to gradients. Add an entry function (see README, "
                        "'The workload contract').")
    started = time.monotonic()
    rng = rng or random.SystemRandom()
    numerics_seed, timing_seed = rng.randrange(1, SEED_LIMIT), rng.randrange(1, SEED_LIMIT)
    batch_indices = rng.sample(range(batch_index_range), numerics_steps)
    tolerance = tolerance or NumericsTolerance()
    progress = on_progress or (lambda phase, done, total: None)
    common = {"backend": backend, "numerics_seed": numerics_seed, "timing_seed": timing_seed}

    marks: dict[str, float] = {}

    def verdict(reason: VerdictReason, message: str, phase: str, **fields) -> Verdict:
        now = time.monotonic()
        numerics_end = marks.get("numerics_end", now)
        seconds = {"numerics": round(numerics_end - started, 3)}
        if "numerics_end" in marks:
            seconds["timing"] = round(now - numerics_end, 3)
        return Verdict(accepted=reason == VerdictReason.accepted, reason=reason, message=message, phase=phase,
                       wall_s=now - started, phase_seconds=seconds, **common, **fields)

    tampered = check_config(baseline.config, candidate.config)
    if tampered:
        return verdict(VerdictReason.tampered_inputs, tampered[0].message, "config", findings=tampered)
    candidate = Workload(root=candidate.root, config=baseline.config)

    # --- numerics -----------------------------------------------------------------------------
    progress("numerics", 0, 2)
    sides: dict[str, tuple[RunResult, ProbeReport, dict]] = {}
    for done, (side, workload) in enumerate((("baseline", baseline), ("candidate", candidate)), start=1):
        # each side writes into a directory of its own that is gone before the other side runs
        with scratch_dir(f"trainbridge-gate-{side}-", work_dir) as tmp:
            grads_path = tmp / "grads.pt"
            run, report = run_probe(workload, backend=backend, seed=numerics_seed, batch_indices=batch_indices,
                                    grads_path=grads_path, extra_env=extra_env, work_dir=work_dir)
            failure = run.failure
            grads = None
            if failure is None:
                try:
                    grads = load_grads(grads_path)
                except Exception as exc:  # missing or unreadable: whatever the child did, it is not a result
                    failure = Failure(kind=FailureKind.crashed, message=f"the numerics run left no readable gradient file ({type(exc).__name__}: {exc})")
        progress("numerics", done, 2)
        if failure is not None:
            if side == "baseline":
                raise _baseline_failed("numerics check", failure)
            return verdict(FAILURE_REASONS[failure.kind], _failure_message(failure, "the numerics check"),
                           "numerics", failure=failure, baseline_versions=sides["baseline"][0].versions,
                           candidate_versions=run.versions)
        sides[side] = (run, report, grads)
    (base_run, base_report, base_grads), (cand_run, cand_report, cand_grads) = sides["baseline"], sides["candidate"]
    findings = check_probes(base_report, cand_report)
    numerics = compare_numerics(base_report, cand_report, tolerance, baseline_grads=base_grads, candidate_grads=cand_grads)
    versions = {"baseline_versions": base_run.versions, "candidate_versions": cand_run.versions}
    if findings:
        return verdict(VerdictReason(findings[0].kind.value), _findings_message(findings, numerics), "numerics",
                       findings=findings, numerics=numerics, **versions)
    if not numerics.passed:
        return verdict(VerdictReason.numerics_mismatch, numerics.message, "numerics", numerics=numerics, **versions)
    if emulated_speed:
        return verdict(VerdictReason.speed_unmeasured_numerics_ok,
                       f"{numerics.message}. Speed unmeasured: {backend} runs under emulation here; measure on hardware "
                       "(`trainbridge verify`) before accepting.", "numerics", numerics=numerics, **versions)

    # --- timing -------------------------------------------------------------------------------
    marks["numerics_end"] = time.monotonic()
    steps = steps_per_round or baseline.config.steps
    timed = {"baseline": baseline.with_overrides(seed=timing_seed, steps=steps)}
    timed["candidate"] = Workload(root=candidate.root, config=timed["baseline"].config)
    base_rounds: list[list[float]] = []
    cand_rounds: list[list[float]] = []
    orders: list[str] = []
    progress("timing", 0, rounds)
    planned = rounds
    index = 0
    while index < planned:
        order = ("baseline", "candidate") if index % 2 == 0 else ("candidate", "baseline")
        runs: dict[str, RunResult] = {}
        for side in order:
            run = run_workload(timed[side], backend=backend, mode="measure", extra_env=extra_env, work_dir=work_dir)
            if run.failure is None and not run.step_times_s:
                run.failure = Failure(kind=FailureKind.crashed, message="the run finished without any measured step time")
            if run.failure is not None:
                if side == "baseline":
                    raise _baseline_failed(f"timing round {index}", run.failure)
                return verdict(FAILURE_REASONS[run.failure.kind], _failure_message(run.failure, f"timing round {index}"),
                               "timing", failure=run.failure, numerics=numerics, baseline_rounds=base_rounds,
                               candidate_rounds=cand_rounds, round_order=orders, **versions)
            runs[side] = run
        orders.append("AB" if order[0] == "baseline" else "BA")
        base_rounds.append(runs["baseline"].step_times_s)
        cand_rounds.append(runs["candidate"].step_times_s)
        progress("timing", index + 1, planned)
        gamed = check_timed_losses(index, runs["baseline"].losses, runs["candidate"].losses, tolerance.timed_loss_rtol, tolerance.loss_atol)
        if gamed:
            return verdict(VerdictReason.skipped_work, gamed[0].message, "timing", findings=gamed, numerics=numerics,
                           baseline_rounds=base_rounds, candidate_rounds=cand_rounds, round_order=orders, **versions)
        index += 1
        if index == rounds and max_rounds > rounds and wants_more_rounds(decide_speed(base_rounds, cand_rounds, min_gain, confidence)):
            planned = max_rounds  # inconclusive, but a gain or loss of min_gain shows: the second look (stats.gate_decision)

    # --- decision -----------------------------------------------------------------------------
    speed = gate_decision(base_rounds, cand_rounds, first=rounds, min_gain=min_gain, confidence=confidence)
    reason = _SPEED_REASONS[speed.outcome]
    return verdict(reason, f"{speed.message}; {numerics.message}", "done", speed=speed, ratio=speed.ratio,
                   ratio_ci=(speed.ci_low, speed.ci_high), numerics=numerics, baseline_rounds=base_rounds,
                   candidate_rounds=cand_rounds, round_order=orders, **versions)


def _failure_message(failure: Failure, where: str) -> str:
    text = f"the candidate failed in {where} ({failure.kind}): {failure.message}"
    if failure.traceback_tail:
        last = failure.traceback_tail.strip().splitlines()[-1]
        if last not in text:
            text += f" | {last}"
    return text


def _findings_message(findings: list[Finding], numerics: NumericsResult) -> str:
    listed = "; ".join(f.message for f in findings)
    return f"gate-gaming signs: {listed} (numerics alone: {'match' if numerics.passed else 'mismatch'})"


def _baseline_failed(where: str, failure: Failure) -> GateError:
    return GateError(f"the baseline failed in the {where} ({failure.kind}: {failure.message}); the gate cannot judge a "
                     "candidate against it. Check that the run branch head still runs (`trainbridge measure`), and "
                     f"that the machine has the memory and time it needs.{' | ' + failure.traceback_tail.strip().splitlines()[-1] if failure.traceback_tail else ''}")
