"""The report's NPU kernels per step (issue 25, item 4): the original against the pending head, from the run's
state, and nothing claimed where nothing was counted."""

from __future__ import annotations

from trainbridge.tools.report.npu_kernels import npu_kernels_line


def _verdict(reason: str, baseline: int, candidate: int, sha: str | None = None) -> dict:
    return {"reason": reason, "sha": sha, "gate": {"device_kernels": {"baseline": baseline, "candidate": candidate}}}


def test_before_and_the_pending_head_with_the_reference_beside_them():
    state = {"baseline_kernels": 748, "reference_kernels": {"forward": 40, "backward": 61},
             "verdicts": [_verdict("speed_unmeasured_numerics_ok", 748, 700, "a" * 40),
                          _verdict("numerics_mismatch", 748, 600),  # rejected: not on the pending head
                          _verdict("speed_unmeasured_numerics_ok", 748, 651, "b" * 40)]}
    line = npu_kernels_line(state)
    assert line.startswith("**NPU kernels per step 748 \u2192 651, \u221213%**") and "`bbbbbbbbbbbb`" in line
    assert "speed unmeasured" in line and "40 + 61 kernels" in line


def test_nothing_pending_says_so_and_nothing_counted_says_nothing():
    assert "no rewrite is pending" in npu_kernels_line({"baseline_kernels": 748, "verdicts": []})
    assert npu_kernels_line({"baseline_kernels": None, "verdicts": [{"reason": "accepted", "gate": {}}]}) is None
    # an older state without the baseline's count: the first gate's baseline stands in
    line = npu_kernels_line({"verdicts": [_verdict("speed_unmeasured_numerics_ok", 900, 450, "c" * 40)]})
    assert "900 \u2192 450, \u221250%" in line
