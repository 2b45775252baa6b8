"""Numerics comparison of a candidate against the baseline (parent side, pure functions).

Two probes (sandbox/numerics_probe.py) ran on the same fresh seed and batches. The candidate passes
when:

- its parameters are the baseline's (same names, same shapes) and every parameter that got a
  gradient in the baseline got one in the candidate (a fused op without a registered backward
  silently returns None);
- per parameter, the first-step gradients point the same way (cosine >= ``grad_cosine_min``, the
  original work's 0.9999) and agree elementwise (max |diff| <= ``grad_atol + grad_rtol * max|g|``);
  a parameter whose gradients both lie within ``grad_atol`` of each other passes either way (the
  cosine of two near-zero vectors is noise);
- the forward loss of the first batch and the loss of every train_step agree within
  ``loss_atol + loss_rtol * |baseline|``.

Tolerances should not be tighter than the reference's own drift (a different thread count, or
torch.compile, moves losses too): `widen_tolerance` turns measured drift into tolerances, and
`trainbridge.agents.profiler.calibration` measures it.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.agents.profiler.probe_report import ProbeReport

MAX_LISTED = 5


class NumericsTolerance(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grad_cosine_min: float = Field(default=0.9999, gt=0.0, le=1.0)
    grad_rtol: float = Field(default=1e-3, ge=0.0, description="max-abs grad diff relative to the baseline grad's max-abs")
    grad_atol: float = Field(default=1e-7, ge=0.0)
    loss_rtol: float = Field(default=1e-4, ge=0.0)
    loss_atol: float = Field(default=1e-6, ge=0.0)
    timed_loss_rtol: float = Field(default=1e-4, ge=0.0, description="losses of the timed steps of both sides: the probe's tolerance "
                                   "unless the baseline's own drift widens it (agents/profiler/drift.py)")
    timed_delta_cosine_min: float = Field(default=0.99, gt=0.0, le=1.0, description="per parameter: cosine of its change over the timed "
                                          "steps, candidate vs baseline")
    timed_delta_norm_rtol: float = Field(default=0.1, ge=0.0, description="per parameter: relative difference of the size of that change")


class ParamGradDiff(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int]
    cosine: float
    max_abs_diff: float
    baseline_max_abs: float
    passed: bool


class NumericsResult(BaseModel):
    """Figures of one comparison, and whether the candidate passed."""

    model_config = ConfigDict(extra="forbid")

    passed: bool
    message: str
    problems: list[str] = Field(default_factory=list)
    seed: int
    batch_indices: list[int]
    tolerance: NumericsTolerance
    baseline_losses: list[float]
    candidate_losses: list[float]
    baseline_grad_loss: float
    candidate_grad_loss: float
    loss_max_abs_diff: float | None = None
    loss_max_rel_diff: float | None = None
    grad_cosine_min: float | None = None
    grad_cosine_min_param: str | None = None
    grad_max_abs_diff: float | None = None
    grad_max_abs_diff_param: str | None = None
    missing_params: list[str] = Field(default_factory=list, description="in the baseline, not in the candidate")
    extra_params: list[str] = Field(default_factory=list, description="in the candidate, not in the baseline")
    params: list[ParamGradDiff] = Field(default_factory=list)


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def within(baseline: float, candidate: float, rtol: float, atol: float) -> bool:
    if not (math.isfinite(baseline) and math.isfinite(candidate)):
        return baseline == candidate
    return abs(candidate - baseline) <= atol + rtol * abs(baseline)


def rel_diff(baseline: float, candidate: float) -> float:
    if not (math.isfinite(baseline) and math.isfinite(candidate)):
        return 0.0 if baseline == candidate else math.inf
    return abs(candidate - baseline) / max(abs(baseline), 1e-12)


def grad_diff(name: str, base, cand, tolerance: NumericsTolerance) -> ParamGradDiff:
    """Cosine and max-abs difference of two gradients of one parameter (float64)."""
    b, c = base.detach().double().reshape(-1), cand.detach().double().reshape(-1)
    b_norm, c_norm = float(b.norm()), float(c.norm())
    max_abs = float((c - b).abs().max()) if b.numel() else 0.0
    base_max = float(b.abs().max()) if b.numel() else 0.0
    if not (math.isfinite(max_abs) and math.isfinite(b_norm) and math.isfinite(c_norm)):
        cosine, max_abs = math.nan, math.inf
    elif b_norm == 0.0 and c_norm == 0.0:
        cosine = 1.0
    elif b_norm == 0.0 or c_norm == 0.0:
        cosine = 0.0
    else:
        cosine = float(b @ c) / (b_norm * c_norm)
    negligible = max_abs <= tolerance.grad_atol
    passed = negligible or (cosine >= tolerance.grad_cosine_min and max_abs <= tolerance.grad_atol + tolerance.grad_rtol * base_max)
    return ParamGradDiff(name=name, shape=list(base.shape), cosine=cosine, max_abs_diff=max_abs, baseline_max_abs=base_max, passed=passed)


def compare_gradients(baseline: dict, candidate: dict, expected: list[str], tolerance: NumericsTolerance) -> tuple[list[ParamGradDiff], list[str]]:
    """Per-parameter differences for the names in `expected` (both sides' parameters); problems."""
    problems: list[str] = []
    diffs: list[ParamGradDiff] = []
    lost = [n for n in expected if n in baseline and n not in candidate]
    if lost:
        problems.append(f"no gradient reached {_listed(lost)} in the candidate, while the baseline has one "
                        "(a fused op without a registered backward returns None: wrap it in an autograd.Function)")
    gained = [n for n in expected if n in candidate and n not in baseline]
    if gained:
        problems.append(f"the candidate produced gradients for {_listed(gained)}, which get none in the baseline")
    for name in expected:
        if name not in baseline or name not in candidate:
            continue
        base, cand = baseline[name], candidate[name]
        if tuple(base.shape) != tuple(cand.shape):
            problems.append(f"gradient of {name!r} has shape {tuple(cand.shape)} in the candidate, {tuple(base.shape)} in the baseline")
            continue
        diffs.append(grad_diff(name, base, cand, tolerance))
    failing = [d for d in diffs if not d.passed]
    for d in sorted(failing, key=lambda d: (d.cosine if math.isfinite(d.cosine) else -2.0))[:MAX_LISTED]:
        problems.append(f"gradient of {d.name!r}: cosine {d.cosine:.6f} (minimum {tolerance.grad_cosine_min}), max abs diff "
                        f"{d.max_abs_diff:.3g} against a largest baseline entry of {d.baseline_max_abs:.3g} "
                        f"(allowed {tolerance.grad_atol + tolerance.grad_rtol * d.baseline_max_abs:.3g})")
    if len(failing) > MAX_LISTED:
        problems.append(f"... {len(failing) - MAX_LISTED} more parameters' gradients differ")
    return diffs, problems


def compare_losses(baseline: list[float], candidate: list[float], rtol: float, atol: float, what: str = "train_step loss") -> list[str]:
    """Problems (empty when the trajectories agree step by step)."""
    if len(baseline) != len(candidate):
        return [f"{what}: {len(candidate)} values from the candidate, {len(baseline)} from the baseline"]
    problems = []
    for step, (b, c) in enumerate(zip(baseline, candidate)):
        if not math.isfinite(c) and math.isfinite(b):
            problems.append(f"{what} at step {step} is {c} in the candidate (baseline {b:.6g})")
            break
        if not within(b, c, rtol, atol):
            problems.append(f"{what} at step {step}: {c:.8g} vs baseline {b:.8g}, relative diff {rel_diff(b, c):.3g} "
                            f"(tolerance {rtol:.3g} relative + {atol:.3g} absolute)")
            break
    return problems


def load_grads(path: Path) -> dict:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: the numerics probe's gradient file is missing; was it deleted before comparing?") from exc


def compare_numerics(
    baseline: ProbeReport,
    candidate: ProbeReport,
    tolerance: NumericsTolerance | None = None,
    *,
    baseline_grads: dict | None = None,
    candidate_grads: dict | None = None,
) -> NumericsResult:
    """Compare two probe reports of the same seed and batches. Gradients come from the reports'
    files unless given (the gate loads each side's file as soon as that side's child has exited,
    from a path of its own choosing, so a candidate cannot overwrite the baseline's)."""
    tolerance = tolerance or NumericsTolerance()
    if baseline.seed != candidate.seed or baseline.batch_indices != candidate.batch_indices:
        raise ValueError(f"probes ran on different inputs: seed {baseline.seed} vs {candidate.seed}, "
                         f"batches {baseline.batch_indices} vs {candidate.batch_indices}; run both with the same request")
    problems: list[str] = []
    base_names, cand_names = set(baseline.param_names), set(candidate.param_names)
    missing = [n for n in baseline.param_names if n not in cand_names]
    extra = [n for n in candidate.param_names if n not in base_names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_listed(missing)}")
        if extra:
            parts.append(f"new {_listed(extra)}")
        problems.append(f"the candidate's parameters differ from the baseline's ({'; '.join(parts)}): a rewrite must keep "
                        "model.named_parameters() so that checkpoints and optimizer state still fit")
    shared = [n for n in baseline.param_names if n in cand_names]
    reshaped = [n for n in shared if baseline.param_shapes.get(n) != candidate.param_shapes.get(n)]
    for name in reshaped[:MAX_LISTED]:
        problems.append(f"parameter {name!r} has shape {candidate.param_shapes.get(name)} in the candidate, "
                        f"{baseline.param_shapes.get(name)} in the baseline")
    expected = [n for n in shared if n not in reshaped]
    if baseline_grads is None:
        baseline_grads = load_grads(baseline.grads_path)
    if candidate_grads is None:
        candidate_grads = load_grads(candidate.grads_path)
    diffs, grad_problems = compare_gradients(baseline_grads, candidate_grads, expected, tolerance)
    problems += grad_problems
    problems += compare_losses([baseline.grad_loss], [candidate.grad_loss], tolerance.loss_rtol, tolerance.loss_atol, "forward loss of loss_fn")
    problems += compare_losses(baseline.losses, candidate.losses, tolerance.loss_rtol, tolerance.loss_atol)
    result = NumericsResult(
        passed=not problems,
        message="",
        problems=problems,
        seed=baseline.seed,
        batch_indices=baseline.batch_indices,
        tolerance=tolerance,
        baseline_losses=baseline.losses,
        candidate_losses=candidate.losses,
        baseline_grad_loss=baseline.grad_loss,
        candidate_grad_loss=candidate.grad_loss,
        missing_params=missing,
        extra_params=extra,
        params=diffs,
    )
    _fill_figures(result, baseline, candidate)
    result.message = _summary(result)
    return result


def _fill_figures(result: NumericsResult, baseline: ProbeReport, candidate: ProbeReport) -> None:
    pairs = list(zip([baseline.grad_loss, *baseline.losses], [candidate.grad_loss, *candidate.losses]))
    if pairs:
        result.loss_max_abs_diff = max(abs(c - b) if math.isfinite(b) and math.isfinite(c) else math.inf for b, c in pairs)
        result.loss_max_rel_diff = max(rel_diff(b, c) for b, c in pairs)
    if result.params:
        worst_cos = min(result.params, key=lambda d: d.cosine if math.isfinite(d.cosine) else -2.0)
        worst_abs = max(result.params, key=lambda d: d.max_abs_diff)
        result.grad_cosine_min, result.grad_cosine_min_param = worst_cos.cosine, worst_cos.name
        result.grad_max_abs_diff, result.grad_max_abs_diff_param = worst_abs.max_abs_diff, worst_abs.name


def _summary(result: NumericsResult) -> str:
    figures = []
    if result.grad_cosine_min is not None:
        figures.append(f"min gradient cosine {result.grad_cosine_min:.6f} ({result.grad_cosine_min_param})")
        figures.append(f"max gradient abs diff {result.grad_max_abs_diff:.3g} ({result.grad_max_abs_diff_param})")
    if result.loss_max_rel_diff is not None:
        figures.append(f"max loss rel diff {result.loss_max_rel_diff:.3g} over {len(result.baseline_losses)} steps")
    where = f"seed {result.seed}, batches {result.batch_indices}"
    if result.passed:
        return f"numerics match ({where}): " + ", ".join(figures)
    return f"numerics mismatch ({where}): " + "; ".join(result.problems) + (" | " + ", ".join(figures) if figures else "")


def widen_tolerance(base: NumericsTolerance, drifts: list[NumericsResult], margin: float = 10.0) -> NumericsTolerance:
    """Tolerances no tighter than `margin` times the drift the reference shows against itself
    (each drift: the baseline compared with the baseline under other threads / torch.compile)."""
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1, got {margin}")
    cos_gap, grad_rel, loss_rel = 1.0 - base.grad_cosine_min, base.grad_rtol, base.loss_rtol
    for drift in drifts:
        for d in drift.params:
            if math.isfinite(d.cosine):
                cos_gap = max(cos_gap, margin * (1.0 - d.cosine))
            if d.baseline_max_abs > 0 and math.isfinite(d.max_abs_diff):
                grad_rel = max(grad_rel, margin * d.max_abs_diff / d.baseline_max_abs)
        if drift.loss_max_rel_diff is not None and math.isfinite(drift.loss_max_rel_diff):
            loss_rel = max(loss_rel, margin * drift.loss_max_rel_diff)
    return base.model_copy(update={
        "grad_cosine_min": max(1.0 - cos_gap, 1e-6),
        "grad_rtol": grad_rel,
        "loss_rtol": loss_rel,
        "timed_loss_rtol": max(base.timed_loss_rtol, loss_rel),
    })
