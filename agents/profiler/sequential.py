"""Sequential stopping for the speed gate: a look every few rounds, stopping as soon as the data decide.

The gate used to take one look after `rounds` rounds and, when that was inconclusive but promising,
one more over `max_rounds`. Here it looks at 6, 8, 10, ... rounds up to the last look and stops at
the first look that decides, either way; close calls go on. What keeps the calibrated error rates:

- **Levels chosen for the whole schedule** (a group-sequential design). The decision at a look is
  `stats.decide_speed` (the exact signed-rank test on the per-round log ratios, the bootstrap
  interval, the minimum gain) at a nominal one-sided level instead of alpha. The first look (6
  rounds) decides only when every one of its rounds points the same way (`unanimous_level`: the
  exact test's smallest p-value, 2**-6, whose chance under the null is 1.6% of the 2.5%), so a
  clear result stops after 6 rounds; every later look gets one level `c`, set so that, when the
  candidate is no faster (no slower), the probability that *any* look calls it faster (slower) is
  at most alpha = (1 - confidence) / 2 (`look_levels`). The signed-rank statistics of all looks
  have a joint null distribution that does not depend on the data's distribution (independent,
  symmetric, continuous per-round differences: every sign is a fair coin, independent of the order
  of the magnitudes, which is a uniformly random permutation), so the levels are computed once per
  schedule, by simulating that null with a fixed seed. When the first look is too short for a
  unanimous look to fit the budget, every look gets one level (`nominal_level`, Pocock). The
  interval is a second guard at the same level: it can only make the gate more cautious.
- **Futility** (stop early, not significant): at a look before the last, when even the current
  trend continued to the last look would cross the boundary with probability below
  `FUTILITY_POWER` (conditional power, normal approximation on the log ratios). Stopping for
  futility never accepts, so it cannot raise the false-accept rate; it costs a little power,
  which benchmarks/gate_calibration.py measures.
- **Busy rounds** (agents/profiler/quiet.py) are left out before a look counts its rounds: a look
  at n rounds means n kept rounds.

`SequentialGate` is the whole rule as a state machine fed one round at a time: `run_gate` feeds it
live rounds, benchmarks/gate_calibration.py feeds it recorded ones (`replay`), so both decide
exactly alike.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from trainbridge.agents.profiler import quiet
from trainbridge.agents.profiler.stats import SpeedDecision, SpeedOutcome, decide_speed, signed_rank_tail_tables

FIRST_LOOK = 6  # the fewest rounds at which the exact signed-rank test can reach p < 0.025
LOOK_EVERY = 2
FUTILITY_POWER = 0.2  # benchmarks/results/2026-12-02-round-level-llama.md: 7.9 rounds for no effect instead of 9.2, power 91% for a 5% effect
FIRST_SPEND = 0.75  # the most of alpha a unanimous first look may spend (look_levels)
NULL_SIMULATIONS = 40_000
NULL_SEED = 20261201


def looks(rounds: int, max_rounds: int) -> tuple[int, ...]:
    """The rounds at which the gate decides: from `FIRST_LOOK` (or `rounds`, when fewer) every
    `LOOK_EVERY` rounds, and always at `max_rounds`, the last."""
    if rounds < 1 or max_rounds < rounds:
        raise ValueError(f"need 1 <= rounds <= max_rounds, got {rounds} and {max_rounds}")
    start = min(rounds, FIRST_LOOK)
    points = list(range(start, max_rounds + 1, LOOK_EVERY))
    if not points or points[-1] != max_rounds:
        points.append(max_rounds)
    return tuple(points)


@lru_cache(maxsize=64)
def nominal_level(schedule: tuple[int, ...], alpha: float) -> float:
    """The one-sided level `c` used at every look of `schedule`: under the null, the chance that
    some look's exact signed-rank p-value falls below `c` is at most `alpha` (simulated with a fixed
    seed; a single look is the plain test, `c = alpha`)."""
    if len(schedule) == 1:
        return alpha
    rng = random.Random(NULL_SEED)
    last = schedule[-1]
    tables = {n: signed_rank_tail_tables(n)[0] for n in schedule}  # P(W+ <= w), continuous ranks 1..n
    minima = []
    for _ in range(NULL_SIMULATIONS):
        magnitudes = [rng.random() for _ in range(last)]
        negative = [rng.random() < 0.5 for _ in range(last)]
        smallest = 1.0
        for n in schedule:
            order = sorted(range(n), key=magnitudes.__getitem__)
            w_plus = sum(rank for rank, i in enumerate(order, start=1) if not negative[i])
            smallest = min(smallest, tables[n][w_plus])
        minima.append(smallest)
    minima.sort()
    # the largest level with P(min p < c) <= alpha: every simulated minimum below it is one of the first floor(alpha * S)
    return minima[int(alpha * len(minima))]


def unanimous_level(n: int) -> float:
    """The one-sided level at which the exact signed-rank test on `n` rounds decides only when every
    round points the same way (p = 2**-n is the only p-value below it; its chance under the null is 2**-n)."""
    return 2.0 ** (1 - n)


@lru_cache(maxsize=64)
def look_levels(schedule: tuple[int, ...], alpha: float, first_unanimous: bool = True) -> tuple[float, ...]:
    """The one-sided level of each look of `schedule`. With `first_unanimous` (when the first look is
    long enough that a unanimous first look costs at most `FIRST_SPEND` of `alpha`): the first look
    decides only when all its rounds agree (`unanimous_level`), spending 2**-n of alpha, and every later
    look gets one level `c`, the largest with P(first look or any later look rejects) <= alpha under
    the null (simulated as `nominal_level`, jointly with the first look). Otherwise every look gets
    `nominal_level` (Pocock)."""
    if len(schedule) == 1:
        return (alpha,)
    first = schedule[0]
    spend = 2.0 ** -first
    if not first_unanimous or spend > FIRST_SPEND * alpha:
        return (nominal_level(schedule, alpha),) * len(schedule)
    rng = random.Random(NULL_SEED)
    last = schedule[-1]
    tables = {n: signed_rank_tail_tables(n)[0] for n in schedule}
    budget = int(alpha * NULL_SIMULATIONS)
    rest: list[float] = []
    for _ in range(NULL_SIMULATIONS):
        magnitudes = [rng.random() for _ in range(last)]
        negative = [rng.random() < 0.5 for _ in range(last)]
        ps = []
        for n in schedule:
            order = sorted(range(n), key=magnitudes.__getitem__)
            w_plus = sum(rank for rank, i in enumerate(order, start=1) if not negative[i])
            ps.append(tables[n][w_plus])
        if ps[0] < unanimous_level(first):
            budget -= 1  # rejected at the first look whatever the later levels
        else:
            rest.append(min(ps[1:]))
    rest.sort()
    later = rest[budget] if 0 <= budget < len(rest) else 0.0
    return (unanimous_level(first), *([later] * (len(schedule) - 1)))


def conditional_power(logs: Sequence[float], last: int, level: float) -> float:
    """The chance that the current trend, continued to `last` rounds, ends beyond the boundary in
    its own direction (normal approximation: z of the mean log ratio, information fraction n/last)."""
    n = len(logs)
    if n >= last:
        return 1.0
    spread = statistics.stdev(logs) if n > 1 else 0.0
    mean = statistics.fmean(logs)
    if spread == 0.0:
        return 1.0 if mean != 0.0 else 0.0
    z_now = abs(mean) / (spread / math.sqrt(n))
    share = n / last
    z_bound = statistics.NormalDist().inv_cdf(1.0 - level)
    return 1.0 - statistics.NormalDist().cdf((z_bound - z_now / math.sqrt(share)) / math.sqrt(1.0 - share))


@dataclass
class SequentialGate:
    """The gate's speed rule fed one round at a time; `decision` is set once it stops."""

    schedule: tuple[int, ...]
    min_gain: float = 0.01
    confidence: float = 0.95
    baseline_rounds: list[list[float]] = field(default_factory=list)
    candidate_rounds: list[list[float]] = field(default_factory=list)
    baseline_cores: list[float | None] = field(default_factory=list)
    looks_taken: list[int] = field(default_factory=list)
    decision: SpeedDecision | None = None
    stopped: str | None = None  # "decided", "futility", "last look"

    @property
    def levels(self) -> tuple[float, ...]:
        return look_levels(self.schedule, (1.0 - self.confidence) / 2.0)

    @property
    def level(self) -> float:
        """The level of the looks after the first (the futility rule's boundary)."""
        return self.levels[-1]

    @property
    def busy(self) -> list[int]:
        return quiet.busy_rounds(self.baseline_cores, self.schedule[-1])

    def kept(self) -> tuple[list[list[float]], list[list[float]]]:
        busy = set(self.busy)
        return ([r for i, r in enumerate(self.baseline_rounds) if i not in busy],
                [r for i, r in enumerate(self.candidate_rounds) if i not in busy])

    def rounds_to_next_look(self) -> int:
        """How many more rounds before the next look (0 once stopped)."""
        if self.decision is not None:
            return 0
        kept = len(self.kept()[0])
        return max(1, min((n for n in self.schedule if n > kept), default=kept + 1) - kept)

    def add_round(self, baseline: list[float], candidate: list[float], baseline_cores: float | None) -> SpeedDecision | None:
        """Record one round; the final decision when this round ends the gate, else None."""
        if self.decision is not None:
            raise ValueError("the gate has already stopped")
        self.baseline_rounds.append(list(baseline))
        self.candidate_rounds.append(list(candidate))
        self.baseline_cores.append(baseline_cores)
        base, cand = self.kept()
        n = len(base)
        due = [look for look in self.schedule if look <= n and look not in self.looks_taken]
        if not due:
            return None
        self.looks_taken.append(max(due))
        decision = self._decide(base, cand, final=n >= self.schedule[-1])
        if decision is not None:
            self.decision = decision
        return self.decision

    def _decide(self, base, cand, *, final: bool) -> SpeedDecision | None:
        level = self.levels[self.schedule.index(self.looks_taken[-1])]
        decision = decide_speed(base, cand, self.min_gain, 1.0 - 2.0 * level)
        look = f"look {len(self.looks_taken)} of {len(self.schedule)} at {len(base)} rounds, one-sided level {level:.4g} per look"
        if decision.outcome != SpeedOutcome.not_significant:
            self.stopped = "decided"
        elif final:
            self.stopped = "last look"
        else:
            logs = [math.log(r) for r in decision.round_ratios]
            power = conditional_power(logs, self.schedule[-1], self.level)
            if power >= FUTILITY_POWER:
                return None  # close: go on
            self.stopped = "futility"
            look += f"; stopped for futility (conditional power {power:.2f} < {FUTILITY_POWER:g})"
        return decision.model_copy(update={"message": f"{decision.message} [sequential: {look}]", "look_rounds": list(self.looks_taken),
                                           "schedule": list(self.schedule), "nominal_level": level, "stopped": self.stopped})


def replay(baseline_rounds: Sequence[Sequence[float]], candidate_rounds: Sequence[Sequence[float]],
           baseline_cores: Sequence[float | None] | None, *, rounds: int, max_rounds: int, min_gain: float = 0.01,
           confidence: float = 0.95) -> SequentialGate:
    """Feed recorded rounds to a fresh `SequentialGate` until it stops (or the rounds run out), as the
    gate would have: benchmarks/gate_calibration.py decides with this."""
    gate = SequentialGate(looks(rounds, max_rounds), min_gain=min_gain, confidence=confidence)
    cores = list(baseline_cores) if baseline_cores is not None else [None] * len(baseline_rounds)
    for base, cand, core in zip(baseline_rounds, candidate_rounds, cores):
        if gate.add_round(base, cand, core) is not None:
            break
    return gate
