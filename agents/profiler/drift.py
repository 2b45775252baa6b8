"""The baseline's own drift, measured inside the gate, and the tolerances it allows (parent side).

Two honest programs that differ only in rounding drift apart as they train: hardly at all for a
transformer on fp32 (1e-7 after a dozen steps), by percents for a small CNN with batch norm. The
gate's first round therefore runs the baseline a second time on the same seed and batches with
another thread count (reductions split differently: rounding changes, the math does not) and
widens every tolerance to `margin` times what it sees: the probe's (`numerics.widen_tolerance`)
and the timed steps' losses and parameter changes. A candidate is never asked to be closer to the
baseline than the baseline is to itself; where the baseline is stable, the tolerances stay tight. A
parameter whose change the baseline does not reproduce at all, or whose gradient is a true zero
(`noise_params`), is judged only on whether it changes, not on its direction.

No drift widens a check past its cap (`CEILINGS`, `FLOORS`: the reasoning is beside each): a
drift that large is no rounding, or the measurement was forged (a candidate that copied its own
evidence over the reference's lowered the change-cosine floor to 1e-6), and ten times it would
pass a candidate that computes something else. A recipe's own wider tolerance stands. When a cap
binds, `GateDrift.capped` says which and the verdict's message repeats it.

The drift is the baseline's alone (the candidate plays no part in it), so a gate whose baseline is
the same program as an earlier gate's, file for file and setting for setting, reuses that gate's
measurement instead of running the reference child again (`DriftCache`, kept for the process: a
run judges many candidates against one head); the verdict says so (`reused`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance, rel_diff, widen_tolerance

MARGIN = 10.0
NOISE_COSINE = 0.5  # a parameter whose change the baseline itself reproduces with a lower cosine is rounding noise
ZERO_GRADIENT = 1e-6  # a gradient whose largest entry is below this share of the model's largest is rounding noise (gpt2: the key
# biases sit at 1e-10 to 4e-10 of the largest, the smallest real gradient, a query bias, at 2.9e-4)
NOT_ROUNDING = 0.05  # a probe loss drift above this is no rounding (the bundled examples drift by 0 to 6e-6 over 3 steps)

# Caps: how far the drift may widen each check (the gate's defaults in numerics.NumericsTolerance are 1e-4, 1e-3, 0.9999, 1e-4,
# 0.99 and 0.1). The probe compares one step's gradients on identical weights and batch, and two steps' losses: rounding moves
# them by 1e-7 to 1e-5 relative in the bundled examples, so its caps sit about three orders of magnitude above that and below
# what a lower precision gives (bf16 rounds each product to 2^-8 = 0.4%).
LOSS_RTOL_CAP = 0.01  # the probe's losses
GRAD_RTOL_CAP = 0.01  # a gradient's largest difference, as a share of its largest entry
GRAD_COSINE_FLOOR = 0.999  # a parameter's first-step gradient against the baseline's (2.6 degrees apart)
# The timed steps run up to a dozen steps further, over which a chaotic program (batch norm on a small CNN) drifts by percents:
# resnet_classify's drift was 1.65% on the loss and 0.984 on the worst parameter's change, which ten times widened to 16.5% and
# a 0.84 floor, and a candidate switching to bf16 passed six rounds. The caps keep three to six times resnet's own drift.
TIMED_LOSS_RTOL_CAP = NOT_ROUNDING  # 5%: the probe's own line between rounding and a different computation
TIMED_DELTA_COSINE_FLOOR = 0.9  # a parameter's change over the timed steps: 26 degrees apart at most (resnet's drift: 10)
TIMED_DELTA_NORM_RTOL_CAP = 0.25  # the size of that change: halved gradients (a forgery the issue saw) differ by 50%
CEILINGS = {"loss_rtol": LOSS_RTOL_CAP, "grad_rtol": GRAD_RTOL_CAP, "timed_loss_rtol": TIMED_LOSS_RTOL_CAP,
            "timed_delta_norm_rtol": TIMED_DELTA_NORM_RTOL_CAP}
FLOORS = {"grad_cosine_min": GRAD_COSINE_FLOOR, "timed_delta_cosine_min": TIMED_DELTA_COSINE_FLOOR}


class TimedDrift(BaseModel):
    """How far two runs on the same inputs ended apart over their timed steps."""

    model_config = ConfigDict(extra="forbid")

    loss_max_rel_diff: float
    delta_cosine_min: float
    delta_norm_max_rel_diff: float
    noise_params: list[str] = []  # parameters whose change the baseline does not reproduce (cosine < NOISE_COSINE): not judged by
    # direction or size (e.g. an attention key's bias, whose true gradient is zero: AdamW turns its rounding noise into full steps)


class GateDrift(BaseModel):
    """What the reference run showed, and the tolerances the gate used after it."""

    model_config = ConfigDict(extra="forbid")

    perturbation: str
    probe: NumericsResult
    timed: TimedDrift
    margin: float
    tolerance: NumericsTolerance
    reused: bool = False  # measured by an earlier gate on the same baseline (`DriftCache`)
    capped: list[str] = []  # the checks whose widening a cap bound (`cap_widening`), with what the drift asked for


@dataclass
class DriftCache:
    """Drift measurements by baseline fingerprint (what `fingerprint` in the gate hashes: the files,
    the settings, the backend and the round's shape); the least recently used beyond `size` is dropped."""

    size: int = 8
    entries: OrderedDict = field(default_factory=OrderedDict)

    def get(self, key: str, tolerance: NumericsTolerance) -> GateDrift | None:
        """The cached drift for `key`, its tolerances widened from this gate's own `tolerance`."""
        found = self.entries.get(key)
        if found is None:
            return None
        self.entries.move_to_end(key)
        widened, capped = capped_widening(tolerance, found.probe, found.timed, found.margin)
        return found.model_copy(update={"tolerance": widened, "capped": capped, "reused": True})

    def put(self, key: str, drift: GateDrift) -> None:
        self.entries[key] = drift
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def zero_gradient_params(grads: dict | None) -> frozenset[str]:
    """Parameters whose first-step gradient is rounding noise around a true zero: its largest entry
    is below `ZERO_GRADIENT` times the largest entry of any parameter's (an attention key's bias:
    softmax ignores what it adds). One run shows it, however its noise happens to fall."""
    sizes = {name: float(g.detach().abs().max()) for name, g in (grads or {}).items() if hasattr(g, "numel") and g.numel()}
    largest = max(sizes.values(), default=0.0)
    if not math.isfinite(largest) or largest == 0.0:
        return frozenset()
    return frozenset(name for name, size in sizes.items() if size < ZERO_GRADIENT * largest)


def timed_drift(base_losses: list[float], other_losses: list[float], base_deltas: dict, other_deltas: dict,
                zero_gradients: frozenset[str] = frozenset()) -> TimedDrift:
    """How far the baseline's timed steps move from themselves under another thread count. A parameter
    goes to `noise_params` when the two runs' changes of it point apart (cosine < `NOISE_COSINE`), or
    when its gradient is a true zero (`zero_gradients`): then whether its noise happened to agree this
    once says nothing about the next run."""
    pairs = [(b, o) for b, o in zip(base_losses, other_losses) if math.isfinite(b) and math.isfinite(o)]
    loss = max((rel_diff(b, o) for b, o in pairs), default=0.0)
    cosine, norm = 1.0, 0.0
    noise: list[str] = []
    for name, base in base_deltas.items():
        other = other_deltas.get(name)
        if other is None or tuple(other.shape) != tuple(base.shape):
            continue
        b, o = base.double().reshape(-1), other.double().reshape(-1)
        b_norm, o_norm = float(b.norm()), float(o.norm())
        if b_norm == 0.0 or o_norm == 0.0:
            continue
        own = float(b @ o) / (b_norm * o_norm)
        if own < NOISE_COSINE or name in zero_gradients:
            noise.append(name)  # the baseline does not reproduce its own change here: rounding noise, no direction to judge
            continue
        cosine = min(cosine, own)
        norm = max(norm, abs(o_norm - b_norm) / b_norm)
    return TimedDrift(loss_max_rel_diff=loss, delta_cosine_min=cosine, delta_norm_max_rel_diff=norm, noise_params=sorted(noise))


def not_repeating(probe: NumericsResult, perturbation: str) -> str | None:
    """Why the baseline's drift is no rounding drift, or None: on the same seed and batches, its
    probe losses differ by more than `NOT_ROUNDING` (the data order or the initialisation comes from
    an unseeded source). Widening the tolerances to such a drift would let any candidate pass."""
    drift = probe.loss_max_rel_diff
    if drift is None or not math.isfinite(drift) or drift <= NOT_ROUNDING:
        return None
    return (f"the baseline does not repeat itself: run twice on the gate's seed and batches ({perturbation}), its losses "
            f"differ by up to {100 * drift:.3g}% over {len(probe.baseline_losses)} steps, where rounding moves them by far "
            f"less than {100 * NOT_ROUNDING:g}%; something it draws is not seeded (its data order, e.g. random.Random() "
            "without a seed, or its initialisation), so no candidate can be compared with it. Seed it, or let `trainbridge "
            "run` check its repeatability first: the gate then judges it by what two runs still share")


def widen_for_drift(base: NumericsTolerance, probe: NumericsResult, timed: TimedDrift, margin: float = MARGIN) -> NumericsTolerance:
    """`base`, widened to `margin` times the drift of the probe and of the timed steps (never tightened),
    no check past its cap (`cap_widening`)."""
    return capped_widening(base, probe, timed, margin)[0]


def capped_widening(base: NumericsTolerance, probe: NumericsResult, timed: TimedDrift,
                    margin: float = MARGIN) -> tuple[NumericsTolerance, list[str]]:
    """`widen_for_drift`'s tolerances, and which caps bound them."""
    widened = widen_tolerance(base, [probe], margin)
    widened = widened.model_copy(update={
        "timed_loss_rtol": max(widened.timed_loss_rtol, margin * timed.loss_max_rel_diff),
        "timed_delta_cosine_min": max(min(widened.timed_delta_cosine_min, 1.0 - margin * (1.0 - timed.delta_cosine_min)), 1e-6),
        "timed_delta_norm_rtol": max(widened.timed_delta_norm_rtol, margin * timed.delta_norm_max_rel_diff),
    })
    return cap_widening(base, widened)


def cap_widening(base: NumericsTolerance, widened: NumericsTolerance) -> tuple[NumericsTolerance, list[str]]:
    """`widened` held to each check's cap (`CEILINGS`, `FLOORS`), where `base` (the gate's or a recipe's
    tolerance, before any drift) is not already wider; the capped checks, described."""
    update: dict[str, float] = {}
    notes: list[str] = []
    own = {"timed_loss_rtol": max(base.timed_loss_rtol, base.loss_rtol)}  # the probe's loss tolerance carries to the timed steps
    for name, cap in CEILINGS.items():
        limit = max(own.get(name, getattr(base, name)), cap)
        if getattr(widened, name) > limit:
            notes.append(f"{name} {getattr(widened, name):.3g} capped at {limit:.3g}")
            update[name] = limit
    for name, floor in FLOORS.items():
        limit = min(getattr(base, name), floor)
        if getattr(widened, name) < limit:
            notes.append(f"{name} {getattr(widened, name):.3g} capped at {limit:.3g}")
            update[name] = limit
    return widened.model_copy(update=update), notes


def capped_note(drift: GateDrift | None) -> str:
    """What the verdict's message says when a cap bound the drift's widening ('' when none did)."""
    if drift is None or not drift.capped:
        return ""
    return (f"; the baseline's own drift ({drift.perturbation}) asked for wider tolerances than the caps allow, so the caps "
            f"were used: {', '.join(drift.capped)}")
