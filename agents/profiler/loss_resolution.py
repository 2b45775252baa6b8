"""The resolution of the baseline's loss: a loss that is itself a bf16 or fp16 number cannot be compared more
finely than its own rounding.

Modded-NanoGPT's late records sum a bf16 loss over 2048 tokens: at the zero-initialised head it is 22400, a bf16
number whose neighbours are 22272 and 22528 (0.57% apart). Any rewrite that rounds differently (a fused kernel
computing in fp32) moves such a loss by a whole ulp or two, and a loss tolerance of 1e-3 then rejects the rewrite
or passes it by chance (record 39's norm helper: verified in one run, judged "computes something else" on the
timed loss 22400 in the next). The exact value was 2048 * ln(50304) = 22171.6: a fused cross-entropy gave 22144.

The dtype is read from the baseline's loss values alone (the candidate cannot choose it): values that are all
exactly representable in bf16 (8 significant bits) or fp16 (11) are losses of that dtype, since an fp32 loss lands
on such a value by chance with odds of about 2^-16 (bf16) each. The loss tolerances are then at least `ULPS` ulps
of that dtype at the value's magnitude; the gradient checks are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainbridge.agents.profiler.numerics import NumericsTolerance

ULPS = 2  # the original and the rewrite each round the loss once: two ulps apart at most, where their exact values are close
MIN_VALUES = 2  # non-zero values needed to call a loss low-precision (zeros are representable in every dtype)
# dtype -> (significant bits, including the implicit one): the relative spacing of its numbers is at most 2^(1 - bits)
_BITS = {"bfloat16": 8, "float16": 11}


def _representable(value: float, bits: int) -> bool:
    mantissa, _ = math.frexp(value)  # value = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    scaled = mantissa * 2 ** bits
    return scaled == int(scaled)


def loss_dtype(values: Sequence[float]) -> str | None:
    """'bfloat16' or 'float16' when every finite non-zero value is exactly one of that dtype's numbers (and at least
    `MIN_VALUES` are), else None (an fp32 or fp64 loss)."""
    finite = [v for v in values if math.isfinite(v) and v != 0.0]
    if len(finite) < MIN_VALUES:
        return None
    for name, bits in _BITS.items():  # bf16 first: its grid is the coarser (a bf16 value within fp16's range is on both)
        if all(_representable(v, bits) for v in finite):
            return name
    return None


def loss_rtol_floor(dtype: str) -> float:
    """`ULPS` ulps of `dtype` relative to a value, at the widest spacing (just above a power of two)."""
    return ULPS * 2.0 ** (1 - _BITS[dtype])


def at_loss_resolution(tolerance: NumericsTolerance, baseline_losses: Sequence[float]) -> tuple[NumericsTolerance, str | None]:
    """The tolerance with its loss checks no finer than the baseline loss's own resolution, and a note saying so
    (None when the loss is full precision or the tolerance was already as wide)."""
    dtype = loss_dtype(baseline_losses)
    if dtype is None:
        return tolerance, None
    floor = loss_rtol_floor(dtype)
    if tolerance.loss_rtol >= floor and tolerance.timed_loss_rtol >= floor:
        return tolerance, None
    widened = tolerance.model_copy(update={"loss_rtol": max(tolerance.loss_rtol, floor),
                                           "timed_loss_rtol": max(tolerance.timed_loss_rtol, floor)})
    return widened, (f"the baseline's loss is a {dtype} number ({', '.join(f'{v:g}' for v in list(baseline_losses)[:3])}): "
                     f"losses compared to {ULPS} of its ulps ({floor:.3g} relative), gradients as before")
