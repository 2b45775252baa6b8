"""The numerics checks the gate can still make on a program whose two identical runs differ.

A script-mode program that is not repeatable under one seed (sandbox/script/determinism.py: an
unseeded generator, loader workers, a seed from the clock) gives the baseline and the candidate
different batches even on the gate's common seed, so their gradients and per-step losses cannot
be compared. What still holds for two runs of the same program, and is checked instead:

- the parameters: the same names and shapes, gradients for the same ones, all finite;
- the gradient scale: the global gradient norm of the probe's first step within a factor of
  `GRAD_SCALE_FACTOR` of the baseline's (a rewrite that drops or rescales gradients shows);
- the loss level: the median of the probe's losses within a band set by how far the program's
  two identical runs drifted apart: the widest of `LEVEL_SPREADS` times their largest step-by-step
  difference, `LEVEL_RANGES` times the range of all their losses, and `LEVEL_RTOL` of the
  baseline's median. One pair of runs can agree by chance on its few steps (an unseeded 16-row
  batch's loss has a spread near its mean), so the range of all the losses they saw keeps the band
  from collapsing: on a simulation of the test fixture (8 losses, 2-3 probe steps a side) two
  identical programs fall outside the step-difference band alone in 0.5% of gates, outside this one
  in under 0.05%;
- over the timed steps: the same parameters change (agents/profiler/integrity.check_timed_deltas
  without its direction and size checks), and every loss is finite.

The verdict's numerics message says that this weaker check is what was made, and why.
"""

from __future__ import annotations

import math
import statistics

from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance
from trainbridge.agents.profiler.probe_report import ProbeReport

GRAD_SCALE_FACTOR = 4.0
LEVEL_SPREADS = 3.0
LEVEL_RANGES = 3.0
LEVEL_RTOL = 0.05
MAX_LISTED = 5


def level_band(baseline_median: float, determinism) -> float:
    """How far the candidate's median probe loss may sit from the baseline's."""
    first, second = determinism.losses
    spread = max((abs(a - b) for a, b in zip(first, second) if math.isfinite(a) and math.isfinite(b)), default=0.0)
    seen = [x for x in (*first, *second) if math.isfinite(x)]
    covered = max(seen) - min(seen) if seen else 0.0
    return max(LEVEL_SPREADS * spread, LEVEL_RANGES * covered, LEVEL_RTOL * abs(baseline_median), 1e-6)


def compare_structure(baseline: ProbeReport, candidate: ProbeReport, tolerance: NumericsTolerance, determinism, *,
                      baseline_grads: dict, candidate_grads: dict) -> NumericsResult:
    """The checks of the module doc on the first round's probes (`determinism`: the run's DeterminismReport)."""
    problems: list[str] = []
    missing = [n for n in baseline.param_names if n not in set(candidate.param_names)]
    extra = [n for n in candidate.param_names if n not in set(baseline.param_names)]
    if missing or extra:
        problems.append(f"the candidate's parameters differ from the baseline's (missing {missing[:MAX_LISTED]}, new "
                        f"{extra[:MAX_LISTED]}): a rewrite must keep the model's named parameters")
    reshaped = [n for n in baseline.param_names if n in candidate.param_shapes and baseline.param_shapes.get(n) != candidate.param_shapes[n]]
    problems += [f"parameter {n!r} has shape {candidate.param_shapes[n]}, the baseline's {baseline.param_shapes[n]}" for n in reshaped[:MAX_LISTED]]
    no_grad = sorted(set(baseline_grads) - set(candidate_grads))
    if no_grad:
        problems.append(f"no gradient in the candidate for {no_grad[:MAX_LISTED]}, which the baseline's step gives one")
    nonfinite = [n for n, g in candidate_grads.items() if not bool(g.isfinite().all())]
    if nonfinite:
        problems.append(f"non-finite gradients in the candidate for {nonfinite[:MAX_LISTED]}")
    base_norm, cand_norm = _global_norm(baseline_grads), _global_norm(candidate_grads)
    if base_norm > 0 and not nonfinite and not (base_norm / GRAD_SCALE_FACTOR <= cand_norm <= base_norm * GRAD_SCALE_FACTOR):
        problems.append(f"the candidate's gradient norm {cand_norm:.4g} is not within a factor of {GRAD_SCALE_FACTOR:g} of the "
                        f"baseline's {base_norm:.4g}")
    if not all(math.isfinite(x) for x in candidate.losses):
        problems.append(f"non-finite losses in the candidate's probe: {candidate.losses}")
    base_median = statistics.median(baseline.losses) if baseline.losses else math.nan
    cand_median = statistics.median(candidate.losses) if candidate.losses else math.nan
    band = level_band(base_median, determinism) if math.isfinite(base_median) else math.inf
    if math.isfinite(cand_median) and math.isfinite(base_median) and abs(cand_median - base_median) > band:
        problems.append(f"the candidate's loss level {cand_median:.6g} (median of the probe's steps) is {abs(cand_median - base_median):.3g} "
                        f"from the baseline's {base_median:.6g}, beyond the band of {band:.3g} that two identical runs allow")
    checked = (f"nondeterministic program ({_cause(determinism)}): gradients and losses on the gate's seed are not comparable, "
               "so numerics were checked only as far as two runs of it still agree: parameter names and shapes, which "
               f"parameters get gradients, finite gradients and losses, the gradient norm within a factor of {GRAD_SCALE_FACTOR:g} "
               f"({cand_norm:.4g} vs {base_norm:.4g}), the median probe loss within {band:.3g} ({cand_median:.6g} vs {base_median:.6g}), "
               "and the same parameters changing over the timed steps")
    message = f"numerics mismatch: {'; '.join(problems)} [{checked}]" if problems else checked
    return NumericsResult(passed=not problems, message=message, problems=problems, seed=baseline.seed,
                          batch_indices=baseline.batch_indices, tolerance=tolerance, baseline_losses=baseline.losses,
                          candidate_losses=candidate.losses, baseline_grad_loss=baseline.grad_loss,
                          candidate_grad_loss=candidate.grad_loss, missing_params=missing, extra_params=extra)


def _global_norm(grads: dict) -> float:
    total = sum(float(g.double().pow(2).sum()) for g in grads.values())
    return math.sqrt(total) if math.isfinite(total) else math.inf


def _cause(determinism) -> str:
    causes = list(determinism.likely_causes or [])
    step = determinism.first_difference_step
    where = f"two identical runs differ from step {step}" if step is not None else "two identical runs differ"
    return f"{where}; likely cause: {'; '.join(causes[:3])}" if causes else f"{where}; cause not found in the script"
