"""Statistics of the A/B speed gate: pure functions over per-round step times.

The design, and why:

- **Paired rounds.** The gate runs baseline and candidate in alternating order (AB BA AB ...), one
  fresh child per side per round; under the CPU default the two children of a round are alive at
  once and their steps alternate (agents/profiler/gate.py), so round i's two sides ran
  milliseconds apart and the machine's drift (other jobs, thermal state) hits both alike. The
  unit of evidence is the per-round ratio ``median(candidate steps of round i) / median(baseline
  steps of round i)`` (`round_level`): the median inside a round discards single-step hiccups (a
  page fault, a context switch). Not the mean of the faster half, though it decides better on
  honest rounds (benchmarks/results/2026-12-02-round-level-llama.md): a candidate that defers each
  odd step's optimizer update to the start of the next step keeps every loss and every parameter
  change, makes half its steps fast and the other half slow by as much, and the faster half would
  show the fast ones alone; the median of an even number of steps sits between them, at the honest
  cost (`tests/test_profiler_gate.py`).
- **Log scale.** Ratios are analysed as ``d_i = log(ratio_i)``, so 0.9x and 1/0.9x are symmetric
  and the result is a ratio again after ``exp``.
- **Point estimate: the median of the d_i.** Robust to a round that a neighbour's job slowed
  down; in simulations with 10% outlier rounds it kept nominal coverage where the mean did not
  (mean: 0.86-0.92 at n=6..30, median: 0.93-0.95).
- **Confidence interval: percentile bootstrap of that median** with a seeded RNG (so a verdict is
  reproducible from its samples). With few rounds the bootstrap distribution of a median is
  discrete and the interval errs wide, which is the safe side for a gate.
- **Second guard: the exact Wilcoxon signed-rank test** on the d_i (one-sided, in the direction
  claimed). A speed-up is accepted only when the whole interval lies below 1, the signed-rank
  test agrees at the same level, and the estimated gain reaches ``min_gain``. A slowdown is called
  when the whole interval lies above 1 and the test agrees. Everything else is not significant.
  The exact test cannot reach p < 0.025 with fewer than 6 rounds, so with 95% confidence at least
  6 rounds are needed to accept anything: fewer rounds always give ``not_significant``.
- **Looks.** The gate decides by the sequential rule of agents/profiler/sequential.py: a look
  every few rounds, each one `decide_speed` at a level chosen for the whole schedule, stopping as
  soon as a look decides. `gate_decision` (one look, and a second over more rounds when the first
  is inconclusive but promising) is the rule it replaced, kept for comparisons on recorded samples.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from enum import StrEnum
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_RESAMPLES = 4000


class SpeedOutcome(StrEnum):
    accepted = "accepted"  # significantly faster by at least min_gain
    slower = "slower"  # significantly slower
    not_significant = "not_significant"  # anything else (including a significant gain below min_gain)


class SpeedDecision(BaseModel):
    """The speed half of a verdict: candidate/baseline step-time ratio (< 1 means faster)."""

    model_config = ConfigDict(extra="forbid")

    outcome: SpeedOutcome
    ratio: float = Field(description="median over rounds of candidate/baseline ratios of round medians (stats.round_level)")
    ci_low: float
    ci_high: float
    confidence: float
    n: int = Field(description="number of paired rounds")
    min_gain: float
    p_faster: float = Field(description="one-sided exact Wilcoxon signed-rank p-value for 'candidate faster'")
    p_slower: float = Field(description="one-sided exact Wilcoxon signed-rank p-value for 'candidate slower'")
    round_ratios: list[float]
    message: str
    # the sequential rule's record (agents/profiler/sequential.py), None for a single decision
    look_rounds: list[int] | None = Field(default=None, description="rounds at each look taken, the last one decided")
    schedule: list[int] | None = Field(default=None, description="rounds at which the gate would have looked")
    nominal_level: float | None = Field(default=None, description="one-sided level used at every look")
    stopped: str | None = Field(default=None, description="decided, futility, or last look")

    @property
    def gain(self) -> float:
        """Estimated fraction of step time saved (negative when slower)."""
        return 1.0 - self.ratio


def round_level(samples: Sequence[float]) -> float:
    """One side's step time in one round: the median of its measured steps (see the module doc for why
    not the mean of their faster half)."""
    return statistics.median(samples)


def round_levels(rounds: Sequence[Sequence[float]]) -> list[float]:
    """The level (`round_level`) of each round; a round without samples is an error."""
    out = []
    for index, samples in enumerate(rounds):
        if not samples:
            raise ValueError(f"round {index} has no step-time samples")
        out.append(round_level(samples))
    return out


def paired_ratios(baseline_rounds: Sequence[Sequence[float]], candidate_rounds: Sequence[Sequence[float]]) -> list[float]:
    """candidate/baseline ratio of round medians (`round_level`), round by round."""
    if len(baseline_rounds) != len(candidate_rounds):
        raise ValueError(f"unpaired rounds: {len(baseline_rounds)} baseline vs {len(candidate_rounds)} candidate")
    base, cand = round_levels(baseline_rounds), round_levels(candidate_rounds)
    bad = [i for i, (b, c) in enumerate(zip(base, cand)) if not (b > 0 and c > 0 and math.isfinite(b) and math.isfinite(c))]
    if bad:
        raise ValueError(f"round(s) {bad} have a non-positive or non-finite step time")
    return [c / b for b, c in zip(base, cand)]


def bootstrap_ci(
    values: Sequence[float],
    statistic=statistics.median,
    *,
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over `values`, reproducible through `seed`."""
    if not values:
        raise ValueError("bootstrap of an empty sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    return _quantile(stats, tail), _quantile(stats, 1.0 - tail)


def _quantile(ordered: Sequence[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(math.floor(position))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def wilcoxon_signed_rank(differences: Sequence[float]) -> tuple[float, float]:
    """Exact one-sided p-values (p_less, p_greater) of the signed-rank test that the differences
    are centred on 0. Zeros are dropped (Wilcoxon's convention); tied magnitudes get average ranks,
    and the null distribution is enumerated exactly over those (doubled, integer) ranks."""
    nonzero = [d for d in differences if d != 0.0]
    n = len(nonzero)
    if n == 0:
        return 1.0, 1.0
    doubled = _doubled_average_ranks([abs(d) for d in nonzero])
    w_plus = sum(r for r, d in zip(doubled, nonzero) if d > 0)  # in doubled units
    counts = _signed_rank_null(tuple(sorted(doubled)))
    total = float(2**n)
    cumulative_le = sum(c for w, c in enumerate(counts) if w <= w_plus) / total
    cumulative_ge = sum(c for w, c in enumerate(counts) if w >= w_plus) / total
    return cumulative_le, cumulative_ge  # small W+ means negative differences: 'less'


def _doubled_average_ranks(magnitudes: list[float]) -> list[int]:
    order = sorted(range(len(magnitudes)), key=magnitudes.__getitem__)
    ranks = [0] * len(magnitudes)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and magnitudes[order[j + 1]] == magnitudes[order[i]]:
            j += 1
        doubled = (i + 1) + (j + 1)  # twice the average of ranks i+1..j+1
        for k in range(i, j + 1):
            ranks[order[k]] = doubled
        i = j + 1
    return ranks


@lru_cache(maxsize=64)
def signed_rank_tail_tables(n: int) -> tuple[list[float], list[float]]:
    """(P(W+ <= w), P(W+ >= w)) for w = 0 .. n(n+1)/2 under the null, ranks 1..n without ties."""
    counts = [c for c in _signed_rank_null(tuple(range(2, 2 * n + 1, 2)))[::2]]  # doubled ranks: every other entry
    total = float(2**n)
    le, running = [], 0
    for c in counts:
        running += c
        le.append(running / total)
    ge = [1.0 - (le[w - 1] if w > 0 else 0.0) for w in range(len(counts))]
    return le, ge


@lru_cache(maxsize=256)
def _signed_rank_null(doubled_ranks: tuple[int, ...]) -> list[int]:
    """counts[w] = number of sign assignments whose positive ranks sum (doubled) to w."""
    counts = [1]
    for rank in doubled_ranks:
        grown = counts + [0] * rank
        for w, c in enumerate(counts):
            if c:
                grown[w + rank] += c
        counts = grown
    return counts


def decide_speed(
    baseline_rounds: Sequence[Sequence[float]],
    candidate_rounds: Sequence[Sequence[float]],
    min_gain: float = 0.01,
    confidence: float = 0.95,
    *,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
) -> SpeedDecision:
    """Accept a faster candidate, call a slower one, or say the data do not decide (see module doc)."""
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    ratios = paired_ratios(baseline_rounds, candidate_rounds)
    if not ratios:
        raise ValueError("no rounds to decide on")
    logs = [math.log(r) for r in ratios]
    ratio, ci_low, ci_high = _median_ratio_ci(logs, confidence, seed, resamples)
    p_faster, p_slower = wilcoxon_signed_rank(logs)
    alpha = (1.0 - confidence) / 2.0
    n = len(ratios)
    figures = f"ratio {ratio:.4f} ({100 * (1 - ratio):+.2f}% gain), {100 * confidence:g}% CI [{ci_low:.4f}, {ci_high:.4f}], {n} paired rounds"
    if ci_high < 1.0 and p_faster < alpha and ratio <= 1.0 - min_gain:
        outcome, message = SpeedOutcome.accepted, f"faster: {figures}, signed-rank p={p_faster:.3g}"
    elif ci_low > 1.0 and p_slower < alpha:
        outcome, message = SpeedOutcome.slower, f"slower: {figures}, signed-rank p={p_slower:.3g}"
    else:
        outcome = SpeedOutcome.not_significant
        if ci_high < 1.0 and p_faster < alpha:
            why = f"faster, but the estimated gain is below the required {100 * min_gain:g}%"
        elif n < _min_rounds(alpha):
            why = f"{n} rounds cannot reach significance at {100 * confidence:g}% (need at least {_min_rounds(alpha)})"
        elif ci_high < 1.0:
            why = f"the interval lies below 1, but the signed-rank test does not confirm a gain (p={p_faster:.3g} >= {alpha:g})"
        elif ci_low > 1.0:
            why = f"the interval lies above 1, but the signed-rank test does not confirm a slowdown (p={p_slower:.3g} >= {alpha:g})"
        elif p_faster < alpha:
            why = "the signed-rank test favours the candidate, but the interval includes no change"
        elif p_slower < alpha:
            why = "the signed-rank test favours the baseline, but the interval includes no change"
        else:
            why = "the interval includes no change and the signed-rank test finds no direction"
        message = f"not significant ({why}): {figures}, signed-rank p(faster)={p_faster:.3g}, p(slower)={p_slower:.3g}"
    return SpeedDecision(
        outcome=outcome,
        ratio=ratio,
        ci_low=ci_low,
        ci_high=ci_high,
        confidence=confidence,
        n=n,
        min_gain=min_gain,
        p_faster=p_faster,
        p_slower=p_slower,
        round_ratios=ratios,
        message=message,
    )


def paired_ratio_ci(
    baseline_rounds: Sequence[Sequence[float]],
    candidate_rounds: Sequence[Sequence[float]],
    *,
    confidence: float = 0.95,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
) -> tuple[float, float, float]:
    """(ratio, low, high): the median per-round candidate/baseline ratio and its bootstrap interval,
    computed on the log scale as `decide_speed` does."""
    logs = [math.log(r) for r in paired_ratios(baseline_rounds, candidate_rounds)]
    if not logs:
        raise ValueError("no rounds to compare")
    return _median_ratio_ci(logs, confidence, seed, resamples)


def median_ratio(ratios: Sequence[float]) -> float:
    """The gate's point estimate of per-round ratios: exp of their median log, as `decide_speed` reports it (from the same
    logs: `_median_ratio_ci`), without the interval's resampling (the gate's running ratio, said after each round)."""
    return math.exp(statistics.median([math.log(r) for r in ratios]))


def _median_ratio_ci(logs: Sequence[float], confidence: float, seed: int, resamples: int) -> tuple[float, float, float]:
    """exp of the median log-ratio and of its percentile-bootstrap interval."""
    low, high = bootstrap_ci(logs, confidence=confidence, resamples=resamples, seed=seed)
    return math.exp(statistics.median(logs)), math.exp(low), math.exp(high)


def wants_more_rounds(decision: SpeedDecision) -> bool:
    """An inconclusive look whose estimate already shows the gain asked for, or a loss as large: worth
    more rounds (a gain may be confirmed; a loss called `slower` is clearer evidence for the
    knowledge base than `not_significant`)."""
    margin = max(decision.min_gain, 0.01)
    return decision.outcome == SpeedOutcome.not_significant and abs(decision.ratio - 1.0) >= margin


def gate_decision(
    baseline_rounds: Sequence[Sequence[float]],
    candidate_rounds: Sequence[Sequence[float]],
    *,
    first: int,
    min_gain: float = 0.01,
    confidence: float = 0.95,
) -> SpeedDecision:
    """The previous rule (the gate now uses agents/profiler/sequential.py): at most two looks, after `first` rounds, and -- only when that look
    `wants_more_rounds` -- again over all the rounds given. Two looks at the same level could at worst
    double the false-accept rate; the calibration benchmark measures the rate this procedure has."""
    if first < 1:
        raise ValueError(f"first look needs at least 1 round, got {first}")
    decision = decide_speed(baseline_rounds[:first], candidate_rounds[:first], min_gain, confidence)
    if len(baseline_rounds) <= first or not wants_more_rounds(decision):
        return decision
    return decide_speed(baseline_rounds, candidate_rounds, min_gain, confidence)


def _min_rounds(alpha: float) -> int:
    """Fewest rounds for which the exact one-sided signed-rank test can reach p < alpha."""
    n = 1
    while 0.5**n >= alpha:
        n += 1
    return n
