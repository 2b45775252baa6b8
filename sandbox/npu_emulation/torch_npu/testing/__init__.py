"""torch_npu.testing stand-in: enough of Ascend's test utilities to run their op tests on the emulation.

`rtol_equal` restates the acceptance rule of torch_npu.testing.testcase.TestCase.assertRtolEqual
(Ascend/pytorch): with d = |actual - expected| and r = d / (max(|expected|, |actual|) + m), the check
fails only when both the absolute and the relative test fail on more than `size * prec` elements
(m = 6e-8 for float16, 1e-9 otherwise; prec16 for float16, prec for other types; bfloat16 pairs use
allclose(rtol=prec16, atol=prec16)); shapes and dtypes must match; NaNs must sit at the same places.
"""

from .testcase import TestCase, assert_rtol_equal, rtol_equal, run_tests

__all__ = ["TestCase", "assert_rtol_equal", "rtol_equal", "run_tests"]
