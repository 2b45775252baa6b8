"""The profiler gate: is the candidate numerically the baseline, and is it faster?

1. **Configuration.** Both sides run under the baseline's trainbridge.toml; a candidate that
   changes it (seed, steps, entry, threads) is rejected as ``tampered_inputs``.
2. **Rounds.** Each round runs both sides once, in alternating order (AB, BA, ...), each in a fresh
   child on a seed and batch indices drawn fresh for that round (unknowable to the candidate in
   advance; both sides of a round get the same). Every child does exactly the same thing, whether
   its round is the first or a later one: the numerics probe on the freshly built parts, then
   warm-up, measured and one cool-down step driven and timed by this process over the control
   channel (sandbox/child/step_driver.py), then the parameters' changes over those steps. Nothing tells the
   code under test whether it is being checked or timed: it is always both. With ``pairing``
   "paired" (the CPU default: `default_pairing`) both children of a round are alive at once and
   their timed steps alternate one by one, the side that leads swapping every round; "sequential"
   runs one child after the other.
3. **Checks of every round**, cheapest and most decisive first: a failure of the candidate becomes
   the matching typed rejection (crashed, timed_out, out_of_memory, import_error); its conduct while
   timed (`conduct`: the control channel, its own clock against the gate's, cores, priority,
   processes that outlive it, files written into its worktree, and in a paired round what it did
   while the baseline was timed and to the baseline); gate-gaming signs in its probe
   (`integrity.check_probes`); the probe's gradients and losses (`numerics`); the losses of every
   timed step and each parameter's change over them against the baseline's (the timed steps are
   checked as hard as the probe), at tolerances no tighter than ten times the baseline's own drift
   (the first round also runs the baseline under another thread count: `drift`). The first round's
   numerics are the verdict's numerics; with
   ``emulated_speed`` (NPU emulation on a host without an NPU) the gate stops after it:
   ``speed_unmeasured_numerics_ok``. A candidate whose first round does not match the baseline is
   also compared with a ``reference`` where the caller gives one, run alone on the same inputs
   (`check_against_reference`): the recipe's precision reference (the original region computed in
   higher precision), or the verified pending head a candidate stacks on.
4. **Decision** on the per-round medians of the parent-timed measured steps, by the sequential
   rule (`sequential.SequentialGate`): a look at 6, 8, 10, ... rounds up to ``max_rounds`` (the
   first decides only when all its rounds agree, the later ones share the rest of the error
   budget), stopping at the first look that decides either way or shows the rest cannot
   (futility). A round in which the baseline got far fewer cores than on a quiet round is left out
   and measured again; once the machine is seen contended the children run under
   OMP_WAIT_POLICY=PASSIVE (`quiet`).
5. **Children** start from a fork server that imported torch, dynamo and the harness once (entry
   mode, on the CPU: sandbox/child/fork_server.py), kept warm across the gates of one process, each child
   still a fresh process per side and round; ``spawn`` "exec" (or TRAINBRIDGE_GATE_SPAWN=exec)
   starts a new interpreter for each, as before. The verdict records which. The probe's training
   steps (`PROBE_STEPS`) count towards a child's warm-up (`gate_warmup`), and the baseline's drift
   is measured once per baseline program (`DRIFT_CACHE`).

A failure of the *baseline* is not the candidate's fault: it raises `GateError`. So does a baseline
that does not repeat itself on the gate's seed beyond rounding (`drift.not_repeating`: widened to
such a drift, the tolerances would pass anything).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainbridge.agents.profiler import conduct, quiet, tamper
from trainbridge.agents.profiler.drift import MARGIN as DRIFT_MARGIN
from trainbridge.agents.profiler.drift import (DriftCache, GateDrift, capped_note, capped_widening, not_repeating, timed_drift,
                                               zero_gradient_params)
from trainbridge.agents.profiler.integrity import (Finding, FindingKind, check_config, check_probes, check_timed_deltas,
                                                   check_timed_losses)
from trainbridge.agents.profiler.loss_resolution import at_loss_resolution
from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance, compare_numerics
from trainbridge.agents.profiler.probe_report import ProbeReport, ProbeReportError
from trainbridge.agents.profiler.sequential import SequentialGate, looks
from trainbridge.agents.profiler.stats import SpeedOutcome, median_ratio, paired_ratios
from trainbridge.agents.profiler.verdict import FAILURE_REASONS, DeviceKernels, Verdict, VerdictReason
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.child.fork_server import SpawnKind
from trainbridge.sandbox.results import Failure, FailureKind, RunResult
from trainbridge.sandbox.runner import run_workload, run_workload_pair
from trainbridge.sandbox.scratch import scratch_dir
from trainbridge.sandbox.random_alignment import ALIGNED_NOTE
from trainbridge.sandbox.child.step_driver import StepPlan
from trainbridge.sandbox.evidence import EvidenceMismatch, load_evidence
from trainbridge.sandbox.workload import Workload
from trainbridge.settings import SettingsError, settings

# (phase, done, total[, ratio=...]); phases "numerics", "timing". After each timed round the gate passes `ratio`, the running
# candidate/baseline ratio (`running_ratio`), to a callback that takes that keyword (or **kwargs); (phase, done, total)
# callbacks get the three as before (`progress_caller`)
GateProgress = Callable[..., None]
Pairing = Literal["paired", "sequential"]
PAIRINGS = ("paired", "sequential")
SEED_LIMIT = 2**31 - 1
DRIFT_CACHE = DriftCache()  # the baseline's drift, measured once per baseline program in this process (drift.py)
MEASURED_S_PER_CHILD = 0.8  # gate_steps: measured time per child past which long steps are cut
MIN_MEASURED_STEPS = 6
COOLDOWN_STEPS = 1  # after the measured steps: work a candidate defers past its last measured reply lands here
PROBE_STEPS = 2  # the probe's full training steps per child (run_gate's numerics_steps): the timed steps' losses, checked at the
# probe's own tolerance in every round, carry the trajectory on; two keep every probe check (a loss object returned twice)
_SPEED_REASONS = {
    SpeedOutcome.accepted: VerdictReason.accepted,
    SpeedOutcome.slower: VerdictReason.slower,
    SpeedOutcome.not_significant: VerdictReason.not_significant,
}


class GateError(RuntimeError):
    """The gate could not judge the candidate (the baseline itself failed, or bad arguments)."""


def gate_steps(configured: int, step_s: float | None) -> int:
    """Measured steps per gate child: the workload's `steps`, cut for long steps to what
    `MEASURED_S_PER_CHILD` of the baseline's step time (`step_s`, the run's baseline measurement) needs,
    at least `MIN_MEASURED_STEPS`. A round's noise here is mostly between children (a fresh process
    runs a few percent faster or slower all through), so measured time past ~0.8 s buys little and
    costs every round: re-deciding the recorded llama rounds (benchmarks/gate_settings.py,
    benchmarks/results/2026-12-02-gate-settings-llama.md), 6 measured steps instead of 8 keep A/A false
    accepts at 3% and power for a 5% gain or slowdown at 94-95%, for 0.83 of the cost per candidate
    (4 steps lose power for a slowdown: 81%). Unknown step time (tests, benchmarks): the workload's `steps`."""
    if step_s is None or not step_s > 0 or configured <= MIN_MEASURED_STEPS:
        return configured
    wanted = math.ceil(MEASURED_S_PER_CHILD / step_s)
    wanted += wanted % 2  # an even count: a candidate alternating fast and slow steps gets their middle (stats.round_level)
    return max(MIN_MEASURED_STEPS, min(configured, wanted))


def gate_warmup(warmup: int, numerics_steps: int) -> int:
    """The untimed steps a gate child runs after its probe: the workload's warm-up less the probe's
    own full training steps (they warm the same caches, allocator and optimizer state). None are left
    when the probe covers the warm-up: a first timed step that is still a little slow (gpt2: 1.06 times
    the others' median, over 14 children) hardly moves the median of the child's steps, and falls on
    both sides of a round alike."""
    return max(0, warmup - numerics_steps)


@dataclass(frozen=True)
class RoundInputs:
    """What both sides of one round are given: drawn fresh per round."""

    seed: int
    probe_indices: list[int]
    warmup: list[int]
    measured: list[int]
    cooldown: list[int]

    @classmethod
    def draw(cls, rng: random.Random, *, numerics_steps: int, warmup: int, steps: int, index_range: int) -> "RoundInputs":
        """`warmup`: the workload's warm-up steps; the probe's `numerics_steps` full training steps run
        first in every child and count towards it (`gate_warmup`)."""
        warmup = gate_warmup(warmup, numerics_steps)
        timed = [rng.randrange(index_range) for _ in range(warmup + steps + COOLDOWN_STEPS)]
        return cls(seed=rng.randrange(1, SEED_LIMIT), probe_indices=rng.sample(range(index_range), numerics_steps),
                   warmup=timed[:warmup], measured=timed[warmup:warmup + steps], cooldown=timed[warmup + steps:])


@dataclass
class SideRun:
    """One side of one round: the run, its probe report, its first-step gradients, its parameter
    changes over the timed steps, and the files it wrote into its worktree."""

    run: RunResult
    report: ProbeReport | None = None
    grads: dict | None = None
    deltas: dict | None = None
    unchanged: list[str] | None = None
    written: list[str] | None = None
    forged: list[str] = field(default_factory=list)  # its evidence files that are not what it reported (sandbox/evidence.py)


def run_side(workload: Workload, inputs: RoundInputs, *, backend: str, extra_env: dict[str, str] | None,
             work_dir: Path | None, label: str) -> SideRun:
    """One gate child for one side of a round (a fresh scratch folder, gone before the other side runs)."""
    with scratch_dir(f"trainbridge-gate-{label}-", work_dir) as tmp:
        before = tamper.digest_tree(workload.root)
        run = run_workload(workload.with_overrides(seed=inputs.seed), backend=backend, mode="gate", plan=_plan(inputs, tmp),
                           extra_env=extra_env, work_dir=work_dir)
        return _side(run, tmp, tamper.changed(before, tamper.digest_tree(workload.root)))


def run_pair(workloads: tuple[Workload, Workload], inputs: RoundInputs, *, backend: str, extra_env: dict[str, str] | None,
             work_dir: Path | None, orphans_to: int = 1) -> tuple[SideRun, SideRun]:
    """Both sides of a round in two gate children alive at once, their timed steps alternated
    (`workloads[0]` leads: sandbox/child/step_driver.py, `drive_pair`); escaped processes count against
    `workloads[orphans_to]`."""
    with scratch_dir("trainbridge-gate-a-", work_dir) as tmp_a, scratch_dir("trainbridge-gate-b-", work_dir) as tmp_b:
        before = [tamper.digest_tree(w.root) for w in workloads]
        runs = run_workload_pair(tuple(w.with_overrides(seed=inputs.seed) for w in workloads), (_plan(inputs, tmp_a), _plan(inputs, tmp_b)),
                                 backend=backend, extra_env=extra_env, orphans_to=orphans_to, work_dir=work_dir)
        sides = [_side(run, tmp, tamper.changed(b, tamper.digest_tree(w.root)))
                 for run, tmp, b, w in zip(runs, (tmp_a, tmp_b), before, workloads)]
        return sides[0], sides[1]


def _plan(inputs: RoundInputs, tmp: Path) -> StepPlan:
    return StepPlan(warmup=inputs.warmup, measured=inputs.measured, cooldown=inputs.cooldown,
                    probe={"seed": inputs.seed, "batch_indices": inputs.probe_indices, "grads_path": str(tmp / "grads.pt")},
                    deltas_path=tmp / "deltas.pt")


def _side(run: RunResult, tmp: Path, written: list[str]) -> SideRun:
    """What a gate child left, once it parses (its scratch folder `tmp` still exists)."""
    side = SideRun(run=run, written=written)
    if run.failure is None and not run.step_times_s:
        run.failure = Failure(kind=FailureKind.crashed, message="the run finished without any measured step time")
    if run.failure is not None:
        return side
    try:  # whatever the child left behind is only a result once it parses
        side.report = ProbeReport.from_run(run)
        side.grads = _evidence(side, tmp / "grads.pt", side.report.grads_sha256)
        final = run.extra.get("final") or {}
        side.unchanged = [str(n) for n in final.get("unchanged_params", [])]
        side.deltas = _evidence(side, tmp / "deltas.pt", final.get("deltas_sha256"))
    except (ProbeReportError, ValueError, OSError, RuntimeError) as exc:
        run.failure = Failure(kind=FailureKind.crashed, message=f"the gate run left no readable probe, gradient or parameter "
                              f"file ({type(exc).__name__}: {exc})"[:2000])
    return side


def _evidence(side: SideRun, path: Path, sha256: str | None) -> dict | None:
    """An evidence file of `side`, checked against the digest the child reported over its own channel; a file
    that is not what it reported is kept out of the comparison and noted in `side.forged`."""
    try:
        return load_evidence(path, sha256)
    except EvidenceMismatch as exc:
        side.forged.append(str(exc))
        return None


def default_pairing(backend: str) -> Pairing:
    """"paired" on the CPU (two children side by side fit in host memory, and halve the noise of a
    round on this kind of machine: benchmarks/gate_calibration.py); "sequential" on accelerators,
    where two processes would share one device's memory. TRAINBRIDGE_GATE_PAIRING overrides."""
    try:
        chosen = settings().GATE_PAIRING
    except SettingsError as exc:
        raise GateError(f"{exc} (choose one of {', '.join(PAIRINGS)})") from None
    if chosen:
        return chosen
    return "paired" if backend == "cpu" else "sequential"


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
    numerics_steps: int = PROBE_STEPS,
    batch_index_range: int = 256,
    rng: random.Random | None = None,
    extra_env: dict[str, str] | None = None,
    on_progress: GateProgress | None = None,
    work_dir: Path | None = None,
    pairing: Pairing | None = None,
    spawn: SpawnKind | None = None,
    determinism=None,
    watched: tuple[Path, ...] = (),
    harness_before: dict | None = None,
    reference: Workload | None = None,
    reference_what: str | None = None,
) -> Verdict:
    """Judge `candidate` against `baseline` (see the module doc). `rng` only for reproducible tests:
    by default seeds and batch indices come from the operating system's entropy. `spawn`: how the
    gate's entry-mode children start ("fork-server": forked from a server that imported torch and the
    harness once, sandbox/child/fork_server.py; "exec": a new interpreter each; default
    `fork_server.default_spawn`, TRAINBRIDGE_GATE_SPAWN overrides); the verdict records it. `determinism`: the
    run's sandbox/script_determinism.DeterminismReport; when the program is not repeatable, the numerics are the
    checks two runs of it still share (agents/profiler/nondeterministic.py) and the verdict says so. The installed
    tool, its environment's start-up files and the files in `watched` (the run's state) are hashed before
    and after (`harness_before`: the caller's digest, taken earlier: agents/profiler/tamper.py); any change
    is `tampered_harness`, whatever the gate decided, and so it is when the baseline failed meanwhile. `reference`:
    a program the candidate may match instead of the baseline, `reference_what` saying what it is (default: the
    baseline with the rewritten region computed in higher precision, a recipe's precision_reference made by
    agents/coder/precision_reference.py; the run also passes the verified pending head a candidate stacks on, where a
    rewrite there was verified against its precision reference): a candidate whose numerics check fails against the
    baseline passes it when it matches the reference (`check_against_reference`)."""
    try:
        kind = spawn or fork_server.default_spawn(backend)
    except ValueError as exc:
        raise GateError(str(exc)) from exc
    started = time.monotonic()
    before = harness_before if harness_before is not None else tamper.harness_digest(watched)
    hashing_s = time.monotonic() - started
    with fork_server.serving(kind, work_dir=work_dir, keep_warm=True) as pool:
        fallbacks_before = len(pool.fallbacks) if pool is not None else 0
        try:
            verdict = _run_gate(baseline, candidate, backend=backend, rounds=rounds, max_rounds=max_rounds,
                                steps_per_round=steps_per_round, min_gain=min_gain, tolerance=tolerance, emulated_speed=emulated_speed,
                                confidence=confidence, numerics_steps=numerics_steps, batch_index_range=batch_index_range, rng=rng,
                                extra_env=extra_env, on_progress=on_progress, work_dir=work_dir, pairing=pairing,
                                determinism=determinism, reference=reference, reference_what=reference_what)
        except GateError as exc:
            found = tamper.harness_findings(before, tamper.harness_digest(watched))
            if not found:
                raise
            verdict = Verdict(accepted=False, reason=VerdictReason.tampered_harness, phase="numerics", backend=backend,
                              message=f"{found[0].message} (and the gate could not finish: {exc})", findings=found,
                              wall_s=time.monotonic() - started)
        hashed = time.monotonic()
        verdict = harness_checked(verdict, tamper.harness_findings(before, tamper.harness_digest(watched)))
        seconds = {**verdict.phase_seconds}
        seconds["integrity"] = round(seconds.get("integrity", 0.0) + hashing_s + time.monotonic() - hashed, 3)
        return verdict.model_copy(update={"spawn": pool.describe(since=fallbacks_before) if pool is not None else "exec",
                                          "phase_seconds": seconds})


def harness_checked(verdict: Verdict, found: list[Finding]) -> Verdict:
    """`verdict`, or `tampered_harness` when the harness changed over the gate (`found`) whatever it decided."""
    if not found:
        return verdict
    return verdict.model_copy(update={"accepted": False, "reason": VerdictReason.tampered_harness, "findings": [*found, *verdict.findings],
                                      "message": f"gate-gaming signs: {found[0].message} (the gate's own decision: "
                                                 f"{verdict.reason.value}: {verdict.message})"})


def _run_gate(baseline: Workload, candidate: Workload, *, backend: str, rounds: int, max_rounds: int | None,
              steps_per_round: int | None, min_gain: float, tolerance: NumericsTolerance | None, emulated_speed: bool,
              confidence: float, numerics_steps: int, batch_index_range: int, rng: random.Random | None,
              extra_env: dict[str, str] | None, on_progress: GateProgress | None, work_dir: Path | None,
              pairing: Pairing | None, determinism, reference: Workload | None = None,
              reference_what: str | None = None) -> Verdict:
    max_rounds = rounds if max_rounds is None else max_rounds
    if rounds < 1 or max_rounds < rounds or numerics_steps < 1 or batch_index_range < numerics_steps:
        raise GateError(f"need rounds >= 1 (got {rounds}), max_rounds >= rounds (got {max_rounds}), numerics_steps >= 1 (got {numerics_steps}) and "
                        f"batch_index_range >= numerics_steps (got {batch_index_range})")
    if baseline.config.mode == "command":
        raise GateError(f"{baseline.root}: the gate checks numerics through the gradients of the training step; command-mode "
                        "workloads give no access to them. Use launch = \"python train.py ...\" (script mode) or entry = "
                        "\"module:function\" in trainbridge.toml (see README, 'The workload contract').")
    started = time.monotonic()
    rng = rng or random.SystemRandom()
    tolerance = tolerance or NumericsTolerance()
    progress = progress_caller(on_progress)
    steps = steps_per_round or baseline.config.steps
    pairing = pairing or default_pairing(backend)
    if pairing not in PAIRINGS:
        raise GateError(f"pairing {pairing!r}: choose one of {', '.join(PAIRINGS)}")

    def draw() -> RoundInputs:
        return RoundInputs.draw(rng, numerics_steps=numerics_steps, warmup=baseline.config.warmup_steps, steps=steps,
                                index_range=batch_index_range)

    round_inputs: list[RoundInputs] = [draw()]
    marks: dict[str, float] = {}
    base_rounds: list[list[float]] = []
    cand_rounds: list[list[float]] = []
    orders: list[str] = []
    state: dict = {"pairing": pairing}
    loss_note: str | None = None  # set at the numerics check: a bf16 loss compared at its own resolution
    nondeterministic = determinism is not None and not determinism.repeatable

    def verdict(reason: VerdictReason, message: str, phase: str, **fields) -> Verdict:
        now = time.monotonic()
        numerics_end = marks.get("numerics_end", now)
        seconds = {"numerics": round(numerics_end - started, 3)}
        if "numerics_end" in marks:
            seconds["timing"] = round(now - numerics_end, 3)
        if "integrity" in marks:
            seconds["integrity"] = round(marks["integrity"], 3)
        timing = {"baseline_rounds": base_rounds, "candidate_rounds": cand_rounds, "round_order": orders} if base_rounds else {}
        message += capped_note(state.get("drift"))
        return Verdict(accepted=reason == VerdictReason.accepted, reason=reason, message=message, phase=phase, backend=backend,
                       wall_s=now - started, phase_seconds=seconds, numerics_seed=round_inputs[0].seed,
                       timing_seed=round_inputs[1].seed if len(round_inputs) > 1 else None,
                       round_seeds=[r.seed for r in round_inputs[: max(len(orders), 1)]], **{**state, **timing, **fields})

    tampered = check_config(baseline.config, candidate.config)
    if tampered:
        return verdict(VerdictReason.tampered_inputs, tampered[0].message, "config", findings=tampered)
    candidate = Workload(root=candidate.root, config=baseline.config)
    workloads = {"baseline": baseline, "candidate": candidate}
    apart = () if candidate.root.resolve() == baseline.root.resolve() else (candidate.root,)  # a candidate inside the baseline's folder

    def baseline_tree() -> dict:
        hashing = time.monotonic()
        tree = tamper.digest_tree(baseline.root, exclude=apart)
        marks["integrity"] = marks.get("integrity", 0.0) + time.monotonic() - hashing
        return tree

    # the reference runs after the candidate's first round: unchanged since the gate began, or not compared at all
    reference_before = tamper.digest_tree(reference.root) if reference is not None else None
    seq = SequentialGate(looks(rounds, max_rounds), min_gain=min_gain, confidence=confidence)
    base_env = {**fork_server.prewarm_env((baseline.root, candidate.root)), **(extra_env or {})}
    if quiet.contended_at_start() and "OMP_WAIT_POLICY" not in base_env:
        state["wait_policy"] = "passive from the start: the load average was above the cores"
    env_now = (lambda: {**base_env, **quiet.PASSIVE_ENV} if "wait_policy" in state else base_env or None)

    progress("numerics", 0, 2)
    planned, index = seq.schedule[0], 0
    while index < planned:
        inputs = round_inputs[index]
        order = ("baseline", "candidate") if index % 2 == 0 else ("candidate", "baseline")
        where = "the numerics check" if index == 0 else f"timing round {index}"
        phase = "numerics" if index == 0 else "timing"
        baseline_before = baseline_tree()
        if pairing == "paired":
            pair = run_pair((workloads[order[0]], workloads[order[1]]), inputs, backend=backend, extra_env=env_now(),
                            work_dir=work_dir, orphans_to=order.index("candidate"))
            sides = dict(zip(order, pair))
        else:
            sides = {}
            for side in order:
                sides[side] = run_side(workloads[side], inputs, backend=backend, extra_env=env_now(), work_dir=work_dir, label=side)
                if sides[side].run.failure is not None:
                    break
        if index == 0:
            progress("numerics", 2, 2)
        if "candidate" in sides:  # the baseline's worktree, bytecode caches included, over the round (agents/profiler/tamper.py)
            moved = tamper.baseline_findings(baseline.root, baseline_before, baseline_tree(), sides["candidate"].written or [], where)
            if moved:
                return verdict(VerdictReason.tampered_harness, moved[0].message, phase, findings=moved)
        forged = [Finding(kind=FindingKind.tampered_harness, message=f"{where}: the {name}'s evidence was rewritten after it "
                          f"reported it: {message}") for name, side in sides.items() for message in side.forged]
        if forged:
            return verdict(VerdictReason.tampered_harness, forged[0].message, phase, findings=forged)
        failed = _failed_side(sides, where)
        if failed is not None:
            reason, message, findings = failed
            return verdict(reason, message, phase, findings=findings, failure=sides["candidate"].run.failure,
                           candidate_versions=sides["candidate"].run.versions)
        base, cand = sides["baseline"], sides["candidate"]
        state.update(baseline_versions=base.run.versions, candidate_versions=cand.run.versions)
        if index == 0:  # a bf16 loss is compared no finer than its own ulps (agents/profiler/loss_resolution.py)
            tolerance, loss_note = at_loss_resolution(tolerance, [base.report.grad_loss, *base.report.losses])
        if index == 0 and base.run.kernels_per_step is not None and cand.run.kernels_per_step is not None:
            state["device_kernels"] = DeviceKernels(baseline=base.run.kernels_per_step, candidate=cand.run.kernels_per_step)
        found = judge_conduct(base, cand, baseline.config.threads, where)
        if index == 0 and not found and not nondeterministic:  # drift of a nondeterministic program is its data order
            key = drift_key(baseline, backend, env_now(), inputs)
            state["drift"] = DRIFT_CACHE.get(key, tolerance)
            if state["drift"] is None:
                state["drift"] = measure_drift(baseline, base, inputs, tolerance, backend=backend, extra_env=env_now(),
                                               work_dir=work_dir)
                DRIFT_CACHE.put(key, state["drift"])
            tolerance = state["drift"].tolerance
        if nondeterministic:
            from trainbridge.agents.profiler.nondeterministic import compare_structure

            numerics = compare_structure(base.report, cand.report, tolerance, determinism, baseline_grads=base.grads or {},
                                         candidate_grads=cand.grads or {})
        else:
            numerics = compare_numerics(base.report, cand.report, tolerance, baseline_grads=base.grads, candidate_grads=cand.grads)
        numerics = with_random_note(numerics, base.report, cand.report)
        if loss_note:
            numerics = numerics.model_copy(update={"message": f"{numerics.message} ({loss_note})"})
        drift = state.get("drift")
        noise = frozenset(drift.timed.noise_params) if drift is not None else frozenset()
        timed = None
        if index == 0 and reference is not None and not found and not nondeterministic:
            timed = judge_timed(index, base, cand, tolerance, noise=noise)
            if not numerics.passed or timed:
                moved = tamper.changed(reference_before, tamper.digest_tree(reference.root))
                if moved:  # only where no confinement kept the candidate's writes in its own folders
                    message = f"{where}: the reference's worktree changed while the candidate ran: {', '.join(moved[:5])}"
                    return verdict(VerdictReason.tampered_harness, message, phase,
                                   findings=[Finding(kind=FindingKind.tampered_harness, message=message)])
                checked = check_against_reference(reference, cand, inputs, tolerance, numerics, timed, noise=noise,
                                                  backend=backend, extra_env=env_now(), work_dir=work_dir,
                                                  what=reference_what or RECIPE_REFERENCE)
                numerics, timed = checked.numerics, checked.timed
                state["precision_reference"] = checked.outcome
        if index == 0:
            state["numerics"] = numerics
        if found:
            return verdict(VerdictReason(found[0].kind.value), _findings_message(found, numerics), phase, findings=found)
        if not numerics.passed:
            message = numerics.message if index == 0 else f"{where}: {numerics.message}"
            return verdict(VerdictReason.numerics_mismatch, message, phase, **({} if index == 0 else {"numerics": numerics}))
        found = timed if timed is not None else judge_timed(index, base, cand, tolerance, nondeterministic=nondeterministic,
                                                            noise=noise)
        if found:
            return verdict(VerdictReason(found[0].kind.value), _findings_message(found, numerics), phase, findings=found)
        if index == 0:
            marks["numerics_end"] = time.monotonic()
            if emulated_speed:
                kernels = f"; {state['device_kernels'].describe()}" if state.get("device_kernels") else ""
                return verdict(VerdictReason.speed_unmeasured_numerics_ok,
                               f"{numerics.message}{kernels}. Speed unmeasured: {backend} runs under emulation here; measure on "
                               "hardware (`trainbridge verify`) before accepting.", "numerics")
            progress("timing", 0, rounds)
        orders.append("AB" if order[0] == "baseline" else "BA")
        base_rounds.append(base.run.step_times_s)
        cand_rounds.append(cand.run.step_times_s)
        index += 1
        speed = seq.add_round(base.run.step_times_s, cand.run.step_times_s,
                              base.run.watch.cores_used if base.run.watch is not None else None)
        state["busy_rounds"] = seq.busy  # left out and measured again (agents/profiler/quiet.py)
        if "wait_policy" not in state and "OMP_WAIT_POLICY" not in base_env and quiet.contended_round(
                seq.baseline_cores, [statistics.median(r) for r in seq.baseline_rounds], max_rounds):
            state["wait_policy"] = f"passive from round {index}: the machine was contended in round {index - 1}"
        planned = index + seq.rounds_to_next_look()  # the sequential rule's next look (agents/profiler/sequential.py)
        progress("timing", index, planned, ratio=running_ratio(seq))
        if index < planned:
            round_inputs.append(draw())

    assert speed is not None  # the loop ends only when the sequential rule has stopped
    reason = _SPEED_REASONS[speed.outcome]
    busy_note = quiet.describe(seq.baseline_cores, state["busy_rounds"], max_rounds)
    if "wait_policy" in state:
        busy_note += f"; OpenMP wait policy {state['wait_policy']}"
    return verdict(reason, f"{speed.message}{busy_note}; {state['numerics'].message}", "done", speed=speed, ratio=speed.ratio,
                   ratio_ci=(speed.ci_low, speed.ci_high))


def progress_caller(on_progress: GateProgress | None) -> Callable[..., None]:
    """`on_progress` as the gate calls it, (phase, done, total, ratio=...): the ratio reaches only a callback that takes a
    `ratio` keyword or **kwargs; one of (phase, done, total), or *args, is called with those three as it always was."""
    if on_progress is None:
        return lambda phase, done, total, ratio=None: None
    try:
        params = inspect.signature(on_progress).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        params = ()
    if any(p.kind is p.VAR_KEYWORD or (p.name == "ratio" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)) for p in params):
        return on_progress
    return lambda phase, done, total, ratio=None: on_progress(phase, done, total)


def running_ratio(seq: SequentialGate) -> float | None:
    """The candidate/baseline ratio so far, as the speed decision estimates it (stats.decide_speed): exp of the median
    per-round log ratio of round medians, over the rounds the gate keeps (busy ones left out); None before any."""
    try:
        ratios = paired_ratios(*seq.kept())
    except ValueError:  # a round without a positive, finite median: the decision says so; progress says nothing
        return None
    return median_ratio(ratios) if ratios else None


def drift_key(baseline: Workload, backend: str, extra_env: dict[str, str] | None, inputs: RoundInputs) -> str:
    """What the baseline's drift depends on: its files (size and modification time of each, bytecode
    caches aside), its settings, the backend, the extra environment and how many steps a round times."""
    files = sorted((path, size_mtime) for path, size_mtime in conduct.snapshot_tree(baseline.root).items()
                   if "__pycache__" not in path.split("/"))
    shape = (len(inputs.probe_indices), len(inputs.warmup), len(inputs.measured), len(inputs.cooldown))
    blob = json.dumps([str(baseline.root.resolve()), files, baseline.config.model_dump(mode="json"), backend,
                       sorted((extra_env or {}).items()), shape], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def drift_threads(threads: int) -> int:
    """The thread count of the drift's reference child, for a baseline that runs on `threads`."""
    return 1 if threads > 1 else 2


def measure_drift(baseline: Workload, base: SideRun, inputs: RoundInputs, tolerance: NumericsTolerance, *, backend: str,
                  extra_env: dict[str, str] | None, work_dir: Path | None) -> GateDrift:
    """The baseline once more on the round's inputs under another thread count: its drift from itself
    widens the tolerances (agents/profiler/drift.py)."""
    threads = drift_threads(baseline.config.threads)
    ref = run_side(baseline.with_overrides(threads=threads), inputs, backend=backend, extra_env=extra_env, work_dir=work_dir,
                   label="reference")
    if ref.run.failure is not None:
        raise _baseline_failed(f"reference run with {threads} thread(s)", ref.run.failure)
    probe = compare_numerics(base.report, ref.report, tolerance, baseline_grads=base.grads, candidate_grads=ref.grads)
    perturbation = f"threads={threads} vs {baseline.config.threads}"
    unrepeatable = not_repeating(probe, perturbation)
    if unrepeatable is not None:
        raise GateError(unrepeatable)
    timed = timed_drift([*base.run.losses, *base.run.cooldown_losses], [*ref.run.losses, *ref.run.cooldown_losses],
                        base.deltas or {}, ref.deltas or {}, zero_gradient_params(base.grads))
    widened, capped = capped_widening(tolerance, probe, timed, DRIFT_MARGIN)
    return GateDrift(perturbation=perturbation, probe=probe, timed=timed, margin=DRIFT_MARGIN, tolerance=widened, capped=capped)


def _failed_side(sides: dict[str, SideRun], where: str) -> tuple[VerdictReason, str, list[Finding]] | None:
    """The round's failure, if any: the baseline's own raises GateError (not the candidate's fault);
    the candidate's becomes its typed rejection. A side stopped only because its partner failed
    (`interrupted`) is not a failure of its own."""
    base, cand = sides.get("baseline"), sides.get("candidate")
    if base is not None and base.run.failure is not None and not base.run.interrupted:
        raise _baseline_failed(where.removeprefix("the "), base.run.failure)
    if cand is None:
        return None
    early = conduct.check_protocol(cand.run, where)
    if early:
        return VerdictReason.tampered_harness, early[0].message, early
    failure = cand.run.failure
    if failure is not None and not cand.run.interrupted:
        message = _failure_message(failure, where)
        if failure.kind == FailureKind.forbidden_call:  # reaching for another process is conduct, named like the other checks'
            return FAILURE_REASONS[failure.kind], message, [Finding(kind=FindingKind.tampered_resources, message=message)]
        return FAILURE_REASONS[failure.kind], message, []
    return None


def judge_conduct(base: SideRun, cand: SideRun, threads: int, where: str) -> list[Finding]:
    """How the candidate behaved while judged, and gate-gaming signs in its probe (empty: clean)."""
    findings = conduct.check_partner(base.run, cand.run, where)
    findings += conduct.check_clock(cand.run, where)
    findings += conduct.check_replaced(base.run, cand.run, where)
    findings += conduct.check_resources(base.run, cand.run, threads, where)
    findings += conduct.check_written_files(set(base.written or []), cand.written or [], where)
    return findings or check_probes(base.report, cand.report)


def judge_timed(index: int, base: SideRun, cand: SideRun, tolerance: NumericsTolerance, *, nondeterministic: bool = False,
                noise: frozenset[str] = frozenset()) -> list[Finding]:
    """The timed steps against the baseline's: every loss, and each parameter's change (empty: clean). For a
    nondeterministic program only which parameters change is compared (their batches differ)."""
    timed_base = [*base.run.losses, *base.run.cooldown_losses]
    timed_cand = [*cand.run.losses, *cand.run.cooldown_losses]
    if nondeterministic:
        return check_timed_deltas(index, base.unchanged or [], cand.unchanged or [], base.deltas or {}, cand.deltas or {},
                                  -1.0, float("inf"))
    findings = check_timed_losses(index, timed_base, timed_cand, tolerance.timed_loss_rtol, tolerance.loss_atol)
    return findings or check_timed_deltas(index, base.unchanged or [], cand.unchanged or [], base.deltas or {}, cand.deltas or {},
                                          tolerance.timed_delta_cosine_min, tolerance.timed_delta_norm_rtol, noise)


@dataclass
class ReferenceCheck:
    """The numerics check's outcome once the candidate was also compared with the precision reference: `numerics`
    and `timed` (the timed steps' findings) are what the gate goes on with; `outcome` says which way it went."""

    numerics: NumericsResult
    timed: list[Finding]
    outcome: Literal["matched_reference", "differs_from_both", "reference_failed"]


RECIPE_REFERENCE = "the original region computed in higher precision (the recipe's precision reference)"


def check_against_reference(reference: Workload, cand: SideRun, inputs: RoundInputs, tolerance: NumericsTolerance,
                            numerics: NumericsResult, timed: list[Finding], *, noise: frozenset[str], backend: str,
                            extra_env: dict[str, str] | None, work_dir: Path | None,
                            what: str = RECIPE_REFERENCE) -> ReferenceCheck:
    """The candidate against the baseline computed in higher precision (`reference`, run alone on the round's
    inputs), when it did not match the baseline itself (`numerics`, `timed`: that comparison). It passes when the
    same checks, at the same tolerances, pass against the reference: the candidate then computes the original
    region more exactly, not something else (a rewrite that skips or changes work differs from both). A reference
    that fails or whose evidence is not what it reported leaves the baseline comparison standing. `what`: what the
    reference is, as the verdict's message says it."""
    against = numerics.message if not numerics.passed else _findings_message(timed, numerics)
    ref = run_side(reference, inputs, backend=backend, extra_env=extra_env, work_dir=work_dir, label="reference")
    if ref.run.failure is not None or ref.forged or ref.report is None:
        why = ref.run.failure.message if ref.run.failure is not None else "its evidence was not what it reported"
        note = f"; {what} could not be compared ({why[:300]})"
        return ReferenceCheck(numerics.model_copy(update={"message": numerics.message + note}), timed, "reference_failed")
    ref_numerics = with_random_note(compare_numerics(ref.report, cand.report, tolerance, baseline_grads=ref.grads,
                                                     candidate_grads=cand.grads), ref.report, cand.report)
    ref_timed = judge_timed(0, ref, cand, tolerance, noise=noise) if ref_numerics.passed else []
    if ref_numerics.passed and not ref_timed:
        message = f"{what} and the candidate agree: {ref_numerics.message}; against the original as it rounds: {against}"
        return ReferenceCheck(ref_numerics.model_copy(update={"message": message}), [], "matched_reference")
    differs = ref_numerics.message if not ref_numerics.passed else _findings_message(ref_timed, ref_numerics)
    note = f"; nor does it match {what}: {differs}"
    if not numerics.passed:
        return ReferenceCheck(numerics.model_copy(update={"message": numerics.message + note}), timed, "differs_from_both")
    return ReferenceCheck(numerics, [t.model_copy(update={"message": t.message + note}) for t in timed], "differs_from_both")


def with_random_note(numerics: NumericsResult, *reports: ProbeReport | None) -> NumericsResult:
    """`numerics` saying how random ops were aligned, where a side compiled a graph (sandbox/random_alignment.py)."""
    if not any(report is not None and report.random_aligned for report in reports):
        return numerics
    return numerics.model_copy(update={"message": f"{numerics.message}; {ALIGNED_NOTE}"})


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
