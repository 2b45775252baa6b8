"""Signs that a candidate games the gate rather than doing the same work faster (parent side).

Each check compares the candidate's probe facts with the baseline's, so a workload that
legitimately leaves a parameter alone, or reuses a batch, is not flagged: only behaviour the
baseline does not show counts. Findings come in two kinds:

- ``skipped_work``: the candidate's train_step skips or caches work: a step that updates fewer
  parameters than the baseline's, the same loss object returned twice, the same loss value for
  different batches, or (from the timed runs) losses that differ from the baseline's only when
  timed;
- ``tampered_inputs``: the candidate changes what the gate feeds it: batch contents differ from
  the baseline's for the same seed and index, ``batch(i)`` is no longer repeatable, or the
  workload configuration (seed, steps, threads, entry) differs;
- ``tampered_timing``, ``tampered_resources``, ``tampered_harness``: how the candidate behaved while
  it was timed, from the kernel's side and the control channel (`conduct`).

The timed steps of every round are checked as hard as the probe: same seed and batches on both
sides, so the loss of every timed step and each parameter's change over the timed steps must agree
(`check_timed_run`); work done differently only when timed shows there.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from trainbridge.agents.profiler.numerics import MAX_LISTED, compare_losses
from trainbridge.agents.profiler.probe_report import ProbeReport
from trainbridge.sandbox.workload import WorkloadConfig


class FindingKind(StrEnum):
    skipped_work = "skipped_work"
    tampered_inputs = "tampered_inputs"
    tampered_timing = "tampered_timing"
    tampered_resources = "tampered_resources"
    tampered_harness = "tampered_harness"


class Finding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: FindingKind
    message: str


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:MAX_LISTED]) + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def check_probes(baseline: ProbeReport, candidate: ProbeReport) -> list[Finding]:
    """Findings from two probe reports of the same seed and batches (empty: nothing suspicious)."""
    findings: list[Finding] = []
    differing = [
        i for i, (b, c) in enumerate(zip(baseline.batch_hashes, candidate.batch_hashes)) if b is not None and b != c
    ]
    if differing or len(baseline.batch_hashes) != len(candidate.batch_hashes):
        shown = [baseline.batch_indices[i] for i in differing]
        findings.append(Finding(kind=FindingKind.tampered_inputs, message=(
            f"batch(i) returns different data in the candidate for index(es) {shown} (seed {baseline.seed}): "
            "a rewrite must not change the data pipeline")))
    if baseline.batch_repeatable and not candidate.batch_repeatable:
        findings.append(Finding(kind=FindingKind.tampered_inputs, message=(
            "batch(i) is no longer repeatable in the candidate (two calls with the same index gave different data)")))
    for step, (b_unchanged, c_unchanged) in enumerate(zip(baseline.unchanged_params, candidate.unchanged_params)):
        skipped = [n for n in c_unchanged if n not in set(b_unchanged) and n in set(baseline.trainable)]
        if skipped:
            findings.append(Finding(kind=FindingKind.skipped_work, message=(
                f"train_step {step} left {len(skipped)} parameter(s) unchanged that the baseline updates ({_names(skipped)}): "
                "the optimizer step was skipped, or the parameters were replaced by new tensor objects")))
            break
    for step, (b_same, c_same) in enumerate(zip(baseline.same_loss_object, candidate.same_loss_object)):
        if c_same and not b_same:
            findings.append(Finding(kind=FindingKind.skipped_work, message=(
                f"train_step {step} returned the same loss object as an earlier step: results are cached across steps")))
            break
    repeats = _repeated_losses(candidate)
    if repeats and not _repeated_losses(baseline):
        step = repeats[0]
        findings.append(Finding(kind=FindingKind.skipped_work, message=(
            f"train_step {step} returned exactly the loss of step {step - 1} ({candidate.losses[step]!r}) for a different batch, "
            "while the baseline's losses differ: results are cached across steps")))
    return findings


def _repeated_losses(report: ProbeReport) -> list[int]:
    """Steps whose loss equals the previous step's bit for bit although their batches differ."""
    out = []
    for step in range(1, len(report.losses)):
        different_batch = report.batch_hashes[step] is None or report.batch_hashes[step] != report.batch_hashes[step - 1]
        if different_batch and report.losses[step] == report.losses[step - 1]:
            out.append(step)
    return out


def check_config(baseline: WorkloadConfig, candidate: WorkloadConfig) -> list[Finding]:
    """The candidate's trainbridge.toml must equal the baseline's: it sets seeds, steps and the entry."""
    base, cand = baseline.model_dump(), candidate.model_dump()
    changed = [key for key in base if base[key] != cand.get(key)]
    if not changed:
        return []
    detail = ", ".join(f"{key}: {base[key]!r} -> {cand.get(key)!r}" for key in changed)
    return [Finding(kind=FindingKind.tampered_inputs, message=(
        f"the candidate changes trainbridge.toml ({detail}): seeds, steps and the entry belong to the gate"))]


def check_timed_losses(round_index: int, baseline: list[float], candidate: list[float], rtol: float, atol: float) -> list[Finding]:
    """The timed runs of both sides used the same seed and batches, so their losses must agree too:
    a candidate that only does the work when it is not being timed shows here."""
    problems = compare_losses(baseline, candidate, rtol, atol, what=f"loss of timed round {round_index}")
    return [Finding(kind=FindingKind.skipped_work, message=(
        f"the timed run computes something else than the checked run: {problems[0]}"))] if problems else []


def check_timed_deltas(round_index: int, baseline_unchanged: list[str], candidate_unchanged: list[str],
                       baseline_deltas: dict, candidate_deltas: dict, cosine_min: float, norm_rtol: float,
                       noise: frozenset[str] = frozenset()) -> list[Finding]:
    """Each trainable parameter's change over the timed steps of one round, candidate against baseline
    (same seed and batches): a parameter the baseline moves must move, in the same direction and by
    about as much. Parameters whose baseline change is zero, or rounding noise the baseline does not
    reproduce itself (`noise`, from the gate's drift), are not judged by direction."""
    skipped = [n for n in candidate_unchanged if n not in set(baseline_unchanged) and n in baseline_deltas]
    if skipped:
        return [Finding(kind=FindingKind.skipped_work, message=(
            f"timed round {round_index}: the timed steps left {len(skipped)} parameter(s) unchanged that the baseline's update "
            f"({_names(skipped)}): work was skipped while timed"))]
    missing = [n for n in baseline_deltas if n not in candidate_deltas]
    if missing:
        return [Finding(kind=FindingKind.skipped_work, message=(
            f"timed round {round_index}: no change reported for {_names(missing)}, which the baseline trains"))]
    worst = None
    for name, base in baseline_deltas.items():
        cand = candidate_deltas[name]
        if tuple(base.shape) != tuple(cand.shape):
            return [Finding(kind=FindingKind.skipped_work, message=(
                f"timed round {round_index}: parameter {name!r} has shape {tuple(cand.shape)}, the baseline's {tuple(base.shape)}"))]
        if name in noise:
            continue
        b, c = base.double().reshape(-1), cand.double().reshape(-1)
        b_norm, c_norm = float(b.norm()), float(c.norm())
        if b_norm == 0.0:
            continue
        cosine = float(b @ c) / (b_norm * c_norm) if c_norm > 0 else 0.0
        norm_error = abs(c_norm - b_norm) / b_norm
        if cosine < cosine_min or norm_error > norm_rtol:
            score = min(cosine, 1.0 - norm_error)
            if worst is None or score < worst[0]:
                worst = (score, name, cosine, norm_error)
    if worst is None:
        return []
    _, name, cosine, norm_error = worst
    return [Finding(kind=FindingKind.skipped_work, message=(
        f"timed round {round_index}: the timed steps change {name!r} differently from the baseline (cosine of the changes "
        f"{cosine:.5f}, minimum {cosine_min}; size differs by {norm_error:.2%}, at most {norm_rtol:.0%}): the timed run "
        "computes something else than the checked run"))]
