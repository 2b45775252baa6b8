"""A bf16 or fp16 loss is compared no finer than its own ulps (agents/profiler/loss_resolution.py): the late
Modded-NanoGPT records sum a bf16 loss (22400 at the zero-initialised head, neighbours 22272 and 22528), and a
rewrite that rounds differently moved it by an ulp or two, which a 1e-3 loss tolerance rejected or passed by chance."""

from __future__ import annotations

import torch

from trainbridge.agents.profiler.loss_resolution import ULPS, at_loss_resolution, loss_dtype, loss_rtol_floor
from trainbridge.agents.profiler.numerics import NumericsTolerance, compare_losses


def test_the_dtype_is_read_from_the_values():
    torch.manual_seed(0)
    assert loss_dtype([22400.0, 22144.0, 22528.0]) == "bfloat16"
    assert loss_dtype((torch.randn(6) * 10).bfloat16().float().tolist()) == "bfloat16"
    assert loss_dtype((torch.randn(6) * 10).half().float().tolist()) == "float16"
    assert loss_dtype((torch.randn(6) * 10).tolist()) is None  # fp32: not all on the coarse grid
    assert loss_dtype([0.0, 0.0, 3.0]) is None  # one non-zero value says nothing
    assert loss_dtype([float("nan"), 2.5]) is None


def test_a_bf16_loss_widens_only_the_loss_checks_and_says_so():
    tolerance = NumericsTolerance(loss_rtol=1e-3, timed_loss_rtol=1e-3)
    widened, note = at_loss_resolution(tolerance, [22400.0, 22400.0, 22272.0])
    assert widened.loss_rtol == widened.timed_loss_rtol == loss_rtol_floor("bfloat16") == ULPS * 2.0 ** -7
    assert (widened.grad_rtol, widened.grad_cosine_min, widened.timed_delta_cosine_min) == (
        tolerance.grad_rtol, tolerance.grad_cosine_min, tolerance.timed_delta_cosine_min)
    assert "bfloat16" in note and "22400" in note
    # record 39: the baseline's 22400 against a rewrite's 22144 (two ulps) passes now, three ulps do not
    assert not compare_losses([22400.0], [22144.0], widened.loss_rtol, widened.loss_atol)
    assert compare_losses([22400.0], [22016.0], widened.loss_rtol, widened.loss_atol)
    assert compare_losses([22400.0], [22144.0], tolerance.loss_rtol, tolerance.loss_atol)  # before: rejected


def test_a_full_precision_loss_or_a_wide_tolerance_is_left_alone():
    tolerance = NumericsTolerance()
    assert at_loss_resolution(tolerance, [2.3456789, 2.3012345]) == (tolerance, None)
    wide = NumericsTolerance(loss_rtol=0.05, timed_loss_rtol=0.05)
    assert at_loss_resolution(wide, [22400.0, 22272.0]) == (wide, None)
