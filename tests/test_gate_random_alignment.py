"""Numerics that stay honest with randomness (issue 30, item 2): a regional compile of a model with dropout
draws its masks from Inductor's generator unless random ops are aligned; the gate aligns them on both sides
(sandbox/random_alignment.py), so an honest compile passes and a wrong one is still caught."""

from __future__ import annotations

import random
from pathlib import Path

from trainbridge.agents.profiler.gate import run_gate
from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.sandbox.random_alignment import ALIGNED_NOTE
from trainbridge.sandbox.workload import load_workload

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def gate(candidate: str):
    return run_gate(load_workload(WORKLOADS / "tiny_dropout"), load_workload(WORKLOADS / candidate), rounds=2, max_rounds=2,
                    rng=random.Random(11))


def test_an_honest_regional_compile_under_dropout_passes_numerics_and_says_how_randomness_was_aligned():
    verdict = gate("tiny_dropout_compiled")
    # without alignment this failed as numerics_mismatch (compiled dropout drew other masks: gradient cosine ~0.4)
    assert verdict.reason != VerdictReason.numerics_mismatch, verdict.message
    assert verdict.numerics is not None and verdict.numerics.passed
    assert verdict.numerics.grad_cosine_min > 0.9999 and ALIGNED_NOTE in verdict.numerics.message


def test_a_wrong_regional_compile_under_dropout_is_still_caught():
    verdict = gate("tiny_dropout_compiled_wrong")
    assert verdict.reason == VerdictReason.numerics_mismatch and not verdict.accepted
    assert verdict.numerics.grad_cosine_min < 0.9999 and "cosine" in verdict.message
