"""Calibrate numerics tolerances against the reference's own drift (runs sandbox children).

The baseline is probed as configured and again under perturbations that change rounding but not
the math: another thread count (reductions split differently) and, optionally, torch.compile
(Inductor reorders and fuses). How far the baseline moves from itself is its natural noise; a
candidate cannot be asked to be closer than that. `widen_tolerance` turns the drift into
tolerances with a safety margin.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance, compare_numerics, widen_tolerance
from trainbridge.agents.profiler.probe_run import run_probe
from trainbridge.sandbox.workload import Workload

Variant = Literal["threads", "compile"]


class CalibrationError(RuntimeError):
    """A calibration run of the baseline failed."""


class ToleranceCalibration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tolerance: NumericsTolerance
    base: NumericsTolerance
    margin: float
    drifts: dict[str, NumericsResult]
    seed: int
    batch_indices: list[int]
    message: str


def calibrate_tolerance(
    workload: Workload,
    *,
    backend: str = "cpu",
    base: NumericsTolerance | None = None,
    variants: Sequence[Variant] = ("threads",),
    margin: float = 10.0,
    numerics_steps: int = 3,
    rng: random.Random | None = None,
    extra_env: dict[str, str] | None = None,
    work_dir: Path | None = None,
) -> ToleranceCalibration:
    """Probe `workload` as configured and under each variant (same seed and batches); return
    tolerances at least `margin` times the observed drift."""
    base = base or NumericsTolerance()
    rng = rng or random.SystemRandom()
    seed = rng.randrange(1, 2**31 - 1)
    indices = rng.sample(range(256), numerics_steps)
    drifts: dict[str, NumericsResult] = {}
    with tempfile.TemporaryDirectory(prefix="trainbridge-calibrate-", dir=work_dir) as tmp:
        reference = _probe(workload, "reference", Path(tmp), backend, seed, indices, False, extra_env, work_dir)
        for variant in variants:
            if variant == "threads":
                threads = 1 if workload.config.threads > 1 else 2
                perturbed, compile_ = workload.with_overrides(threads=threads), False
                label = f"threads={threads} vs {workload.config.threads}"
            elif variant == "compile":
                perturbed, compile_, label = workload, True, "torch.compile vs eager"
            else:
                raise ValueError(f"unknown calibration variant {variant!r}: choose 'threads' or 'compile'")
            report = _probe(perturbed, variant, Path(tmp), backend, seed, indices, compile_, extra_env, work_dir)
            drifts[label] = compare_numerics(reference, report, base)
    tolerance = widen_tolerance(base, list(drifts.values()), margin)
    lines = [f"{label}: {d.message}" for label, d in drifts.items()]
    message = (f"tolerances from the baseline's own drift x{margin:g}: grad cosine >= {tolerance.grad_cosine_min:.6g}, "
               f"grad rtol {tolerance.grad_rtol:.3g}, loss rtol {tolerance.loss_rtol:.3g}. " + " | ".join(lines))
    return ToleranceCalibration(tolerance=tolerance, base=base, margin=margin, drifts=drifts, seed=seed,
                                batch_indices=indices, message=message)


def _probe(workload, name, tmp, backend, seed, indices, compile_, extra_env, work_dir):
    run, report = run_probe(workload, backend=backend, seed=seed, batch_indices=indices, grads_path=tmp / f"{name}.pt",
                            compile=compile_, extra_env=extra_env, work_dir=work_dir)
    if report is None:
        failure = run.failure
        raise CalibrationError(f"calibration run {name!r} of {workload.root} failed ({failure.kind}: {failure.message})")
    return report
