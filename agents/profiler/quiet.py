"""Whether a gate round ran on a quiet machine: rounds measured while something else took the cores
are measured again instead of deciding the verdict.

On a small host a second process beside a measurement can slow a step many times over (OpenMP
threads spin-waiting for a descheduled sibling: the llama example's 125 ms step took 5.8 s). The
kernel tells when that happens: the baseline's timed steps got fewer cores than on a quiet round
(`ChildWatch.cores_used`, CPU time over wall time of its own steps). Only the baseline's figure
decides: the candidate could lower its own on purpose to have the rounds it lost dropped, while
what it does to the baseline is checked separately (`conduct.check_partner`).

OpenMP's default wait policy makes that many times worse: idle threads spin for their sibling
instead of sleeping. benchmarks/wait_policy.py measured a paired llama round beside one busy process
at ~150 s with the default policy and ~8 s with OMP_WAIT_POLICY=PASSIVE (quiet: 4.5 s against
5.4 s, passive threads wake later). So the gate's children run with the default policy on a quiet
machine and with PASSIVE (`PASSIVE_ENV`) from the moment the gate sees contention: a load average
above the cores when it starts (`contended_at_start`), or a round that was busy or whose baseline
steps took `SLOW_ROUND_FACTOR` times the gate's quickest round (`contended_round`). Both sides of a
round always share one policy, so every round's ratio stays a like-for-like comparison; the verdict
says when the gate switched.

A round is *busy* when the baseline used less than `BUSY_SHARE` of the most cores it used on any
round of this gate. Its times are left out of the decision and one more round is run in its place,
at most `MAX_EXTRA_SHARE` times the planned rounds (beyond that the busy rounds count: the gate
does not wait for ever); the verdict lists the busy rounds and the load average, so a reader knows
the machine was not quiet.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

BUSY_SHARE = 0.75
MAX_EXTRA_SHARE = 0.5
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SLOW_ROUND_FACTOR = 3.0
LOAD_MARGIN = 0.5  # load average above the cores by this much: someone else is computing


def contended_at_start(cpus: int | None = None) -> bool:
    """True when the 1-minute load average exceeds the cores (plus `LOAD_MARGIN`) as a gate starts."""
    try:
        one = os.getloadavg()[0]
    except (OSError, AttributeError):
        return False
    return one > (cpus or os.cpu_count() or 1) + LOAD_MARGIN


def contended_round(baseline_cores: Sequence[float | None], baseline_medians: Sequence[float], planned: int) -> bool:
    """True when the latest round was busy, or its baseline's median step took `SLOW_ROUND_FACTOR` times
    the quickest round's of this gate."""
    last = len(baseline_medians) - 1
    if last < 0:
        return False
    if last in busy_rounds(baseline_cores, max(planned, 2 * len(baseline_cores))):
        return True
    return baseline_medians[last] > SLOW_ROUND_FACTOR * min(baseline_medians)


def busy_rounds(baseline_cores: Sequence[float | None], planned: int) -> list[int]:
    """Indices of the rounds whose baseline got less than `BUSY_SHARE` of the most cores it got on
    any round (None: not measurable, never busy); at most `planned * MAX_EXTRA_SHARE` of them, the
    busiest first. Pure, so that benchmarks/gate_calibration.py decides exactly as the gate does."""
    known = [c for c in baseline_cores if c is not None and math.isfinite(c)]
    if not known:
        return []
    quiet = max(known)
    busy = [i for i, c in enumerate(baseline_cores) if c is not None and math.isfinite(c) and c < BUSY_SHARE * quiet]
    busy.sort(key=lambda i: baseline_cores[i])
    return sorted(busy[: int(planned * MAX_EXTRA_SHARE)])


def describe(baseline_cores: Sequence[float | None], busy: Sequence[int], planned: int) -> str:
    """A clause for the verdict's message (empty when every round was quiet)."""
    if not busy:
        return ""
    quiet = max(c for c in baseline_cores if c is not None and math.isfinite(c))
    shown = ", ".join(f"round {i} ({baseline_cores[i]:.2f})" for i in busy[:4]) + (", ..." if len(busy) > 4 else "")
    capped = ", the most this gate re-measures" if len(busy) >= int(planned * MAX_EXTRA_SHARE) else ""
    return (f"; the machine was busy in {len(busy)} round(s), measured again{capped}: the baseline's steps got fewer cores "
            f"than the {quiet:.2f} of a quiet round in {shown}{_load()}")


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except (OSError, AttributeError):
        return ""
    return f"; load average {one:.2f} (1 min), {five:.2f} (5 min)"
