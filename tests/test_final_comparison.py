"""The run's end-to-end comparison on real sandbox runs: original, final head and torch.compile of the original."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from trainbridge.agents.profiler.final import COMPILED, FINAL, ORIGINAL, FinalComparisonError, compare_final
from trainbridge.sandbox.workload import load_workload

MLP = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "mlp"


def _slowed(tmp: Path, factor: float) -> Path:
    dest = tmp / "slow"
    shutil.copytree(MLP, dest)
    step = dest / "step.py"
    text = step.read_text(encoding="utf-8")
    assert "SLOWDOWN = 0.0" in text
    step.write_text(text.replace("SLOWDOWN = 0.0", f"SLOWDOWN = {factor}"), encoding="utf-8")
    return dest


@pytest.mark.slow
def test_final_comparison_measures_three_arms_interleaved(tmp_path):
    rounds = []
    result = compare_final(load_workload(MLP), load_workload(_slowed(tmp_path, 1.0)), rounds=3, rng=random.Random(1),
                           on_round=lambda done, total: rounds.append((done, total)))
    assert rounds == [(1, 3), (2, 3), (3, 3)] and result.failures == {}
    assert [sorted(order) for order in result.order] == [sorted([ORIGINAL, FINAL, COMPILED])] * 3
    assert len({tuple(order) for order in result.order}) == 3  # the order rotates
    assert all(len(result.samples[arm]) == 3 for arm in (ORIGINAL, FINAL, COMPILED))
    # the planted 2x slowdown shows as a ratio near 2 with an interval around it. The band is wide on
    # purpose: the arms are interleaved, but with 3 rounds one round hit by another process's burst
    # on a loaded 2-core machine moves the median (1.6-2.4 failed there); 1.4-2.8 still tells a 2x
    # slowdown from no change and from the compiled arm.
    final = result.final_vs_original
    assert final.ci_low <= final.ratio <= final.ci_high and 1.4 < final.ratio < 2.8
    # the 2x-slowed final head is slower than torch.compile of the original. Not "> 1.2": at load 4.6
    # on 2 cores the compiled arm's median wandered to 1.19x the original (CI 0.82-2.11), leaving
    # final / compiled at 1.14 although nothing was wrong.
    assert result.compiled_vs_original is not None and result.final_vs_compiled.ratio > 1.0
    assert result.final_vs_compiled.ci_low <= result.final_vs_compiled.ratio <= result.final_vs_compiled.ci_high
    assert result.median_step_s[FINAL] > result.median_step_s[ORIGINAL]


def test_a_failing_final_head_is_an_error_not_a_figure(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(MLP, broken)
    (broken / "step.py").write_text("raise RuntimeError('the final head does not import')\n", encoding="utf-8")
    with pytest.raises(FinalComparisonError, match="the final program failed"):
        compare_final(load_workload(MLP), load_workload(broken), rounds=1, with_compile=False, rng=random.Random(2))
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        compare_final(load_workload(MLP), load_workload(MLP), rounds=0)
