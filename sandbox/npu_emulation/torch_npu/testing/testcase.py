"""TestCase with assertRtolEqual (the rule is described in torch_npu.testing's package doc)."""

from __future__ import annotations

import unittest
from collections.abc import Sequence
from numbers import Number

import numpy as np
import torch

_MIN16, _MIN = 6e-8, 1e-9


def _as_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, Number):
        return np.array(x)
    return x


def rtol_equal(expected, actual, prec: float = 1e-4, prec16: float = 1e-3, auto_trans_dtype: bool = False) -> str | None:
    """None when `actual` passes against `expected`, else the reason."""
    if isinstance(expected, Sequence) and isinstance(actual, Sequence) and not isinstance(expected, str):
        for e, a in zip(expected, actual):
            why = rtol_equal(e, a, prec, prec16, auto_trans_dtype)
            if why:
                return why
        return None
    if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
        if auto_trans_dtype:
            expected = expected.to(actual.dtype)
        if expected.dtype == torch.bfloat16 and actual.dtype == torch.bfloat16:
            if expected.shape != actual.shape:
                return f"shape error: {tuple(expected.shape)} vs {tuple(actual.shape)}"
            ok = torch.allclose(expected.detach().cpu(), actual.detach().cpu(), rtol=prec16, atol=prec16)
            return None if ok else f"bfloat16 values differ beyond rtol=atol={prec16}"
    x, y = _as_numpy(expected), _as_numpy(actual)
    if x.shape != y.shape:
        return f"shape error: {x.shape} vs {y.shape}"
    if x.dtype != y.dtype:
        return f"dtype error: {x.dtype} vs {y.dtype}"
    if x.dtype == np.bool_:
        return None if np.equal(x, y).all() else "bool values differ"
    if x.dtype == np.float16:
        tol, minimum = prec16, _MIN16
    elif x.dtype in (np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64):
        tol, minimum = prec, _MIN
    else:
        return f"unsupported dtype {x.dtype}"
    x64, y64 = np.atleast_1d(x.astype(np.float64)), np.atleast_1d(y.astype(np.float64))
    nan = np.isnan(x64)
    if not np.array_equal(nan, np.isnan(y64)):
        return "NaNs at different places"
    diff = np.abs(y64 - x64)
    diff[nan] = 0
    rel = diff / (np.maximum(np.abs(x64), np.abs(y64)) + minimum)
    bad_abs, bad_rel = int((diff > tol).sum()), int((rel > tol).sum())
    limit = x.size * tol
    if bad_abs and bad_rel and bad_abs > limit and bad_rel > limit:
        return (f"{bad_rel} of {x.size} elements beyond rtol {tol} and {bad_abs} beyond atol {tol} "
                f"(max abs diff {diff.max():.3g}, allowed count {limit:.3g})")
    return None


def assert_rtol_equal(expected, actual, prec: float = 1e-4, prec16: float = 1e-3, auto_trans_dtype: bool = False):
    why = rtol_equal(expected, actual, prec, prec16, auto_trans_dtype)
    if why:
        raise AssertionError(why)


class TestCase(unittest.TestCase):
    def assertRtolEqual(self, x, y, prec=1.e-4, prec16=1.e-3, auto_trans_dtype=False, message=None):  # noqa: N802
        why = rtol_equal(x, y, prec, prec16, auto_trans_dtype)
        if why:
            self.fail(message or why)


def run_tests():
    unittest.main()
