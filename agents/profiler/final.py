"""The run's end-to-end figure: the final head against the original, and against torch.compile of
the original, measured interleaved in one go (the gate's ratios are per commit; this is the whole).

Each round runs one fresh sandbox child per arm -- original (eager), final head (eager), original
under `torch.compile` -- in an order rotated from round to round, all with the round's seed; on the
CPU the children are forked from the run's warm server, as the gate's are (sandbox/child/fork_server.py).
Ratios are medians of per-round ratios with a bootstrap interval, as the gate computes them. A
failing compiled arm does not spoil the rest: it is reported and left out.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.agents.profiler.stats import paired_ratio_ci
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import Workload

ORIGINAL, FINAL, COMPILED = "original", "final", "original_compiled"


class RatioCI(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(description="median of per-round step-time ratios (< 1: the first arm is faster)")
    ci_low: float
    ci_high: float


class FinalComparison(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rounds: int
    confidence: float
    order: list[list[str]] = Field(default_factory=list, description="arm order per round")
    samples: dict[str, list[list[float]]] = Field(default_factory=dict, description="step times (s) per arm and round")
    median_step_s: dict[str, float] = Field(default_factory=dict, description="median of round medians per arm")
    final_vs_original: RatioCI | None = None
    final_vs_compiled: RatioCI | None = None
    compiled_vs_original: RatioCI | None = None
    failures: dict[str, str] = Field(default_factory=dict, description="arms that failed, with why")


class FinalComparisonError(RuntimeError):
    """The original or the final head failed to run: there is no end-to-end figure."""


def compare_final(original: Workload, final: Workload, *, backend: str = "cpu", rounds: int = 6, with_compile: bool = True,
                  confidence: float = 0.95, on_round: Callable[[int, int], None] | None = None,
                  rng: random.Random | None = None, round_fits: Callable[[float], bool] | None = None) -> FinalComparison:
    """`round_fits(seconds)`: asked before every round after the first with the time a round has taken so far; False
    ends the comparison there (`rounds` then says how many ran): a run's budget holds whatever it had estimated."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rng = rng or random.SystemRandom()
    arms = [ORIGINAL, FINAL] + ([COMPILED] if with_compile else [])
    final = Workload(root=final.root, config=original.config)  # both under the original's settings, like the gate
    result = FinalComparison(rounds=rounds, confidence=confidence, samples={arm: [] for arm in arms})
    with fork_server.serving(fork_server.default_spawn(backend), keep_warm=True):  # fresh children, forked as the gate's are
        _measure_rounds(result, arms, original, final, backend=backend, on_round=on_round, rng=rng, round_fits=round_fits)
    for arm, per_round in result.samples.items():
        result.median_step_s[arm] = statistics.median(statistics.median(r) for r in per_round)
    base = result.samples[ORIGINAL]
    result.final_vs_original = RatioCI(**_ratio(base, result.samples[FINAL], confidence))
    if COMPILED in result.samples:
        compiled = result.samples[COMPILED]
        result.final_vs_compiled = RatioCI(**_ratio(compiled, result.samples[FINAL], confidence))
        result.compiled_vs_original = RatioCI(**_ratio(base, compiled, confidence))
    return result


def _measure_rounds(result: FinalComparison, arms: list[str], original: Workload, final: Workload, *, backend: str,
                    on_round: Callable[[int, int], None] | None, rng: random.Random,
                    round_fits: Callable[[float], bool] | None = None) -> None:
    """`result.rounds` rounds of one fresh child per arm, in an order rotated from round to round; a
    compiled arm that fails is left out (and said), an eager one raises FinalComparisonError. Fewer when
    `round_fits` says the next round does not fit (`result.rounds` is then the rounds run)."""
    started = time.monotonic()
    for index in range(result.rounds):
        if index and round_fits is not None and not round_fits((time.monotonic() - started) / index):
            result.rounds = index
            break
        live = [arm for arm in arms if arm not in result.failures]
        shift = index % len(live)
        order = live[shift:] + live[:shift]
        seed = rng.randrange(1, 2**31 - 1)
        for arm in order:
            workload = (final if arm == FINAL else original).with_overrides(seed=seed)
            run = run_workload(workload, backend=backend, mode="measure", extra_request={"compile": arm == COMPILED})
            if run.failure is not None or not run.step_times_s:
                why = f"{run.failure.kind}: {run.failure.message}" if run.failure else "no measured step"
                if arm != COMPILED:
                    raise FinalComparisonError(f"the {arm} program failed in the final comparison ({why})")
                result.failures[arm] = why
                result.samples.pop(arm, None)
                continue
            result.samples[arm].append(run.step_times_s)
        result.order.append(order)
        if on_round is not None:
            on_round(index + 1, result.rounds)


def _ratio(reference, other, confidence: float) -> dict[str, float]:
    ratio, low, high = paired_ratio_ci(reference, other, confidence=confidence)
    return {"ratio": ratio, "ci_low": low, "ci_high": high}
