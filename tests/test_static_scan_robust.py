"""Issue 30, item 3: no exception escapes a detector. On code nobody here has read, one pattern that
raises loses its own findings at that place; the scan, the other detectors and the other files go on,
and the failure is reported."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainbridge.agents.analyst.static import patterns
from trainbridge.agents.analyst.static.scan import scan_repo_result, scan_source

ROTARY_BY_INDEX = textwrap.dedent("""
    import torch


    def rotate_pairs(x, cos, sin):
        x1, x2 = x[..., 0], x[..., 1]          # integer indices, not slices
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        return torch.stack([y1, y2], -1)


    def rotate_interleaved(x, cos, sin):
        x1, x2 = x[..., ::2], x[..., 1::2]
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        return torch.stack([y1, y2], -1).flatten(-2)
""")

GELU = textwrap.dedent("""
    import math
    import torch


    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
""")


def test_a_rotary_on_integer_indices_is_no_crash_and_both_rotations_are_found():
    # it raised "not enough values to unpack (expected at least 4, got 3)" and lost the whole repository;
    # x[..., 0] / x[..., 1] are the two entries of a trailing pair axis: a rotation like the interleaved one
    intents = scan_source(ROTARY_BY_INDEX, "rotary.py", target="npu")
    assert [(str(i.category), i.spans[0].function) for i in intents] == [("rope", "rotate_pairs"), ("rope", "rotate_interleaved")]


@pytest.fixture
def raising_rope(monkeypatch):
    """The rope pattern raises wherever it looks in rotary.py: a detector bug on unseen code."""
    def broken(ctx, expr):
        if ctx.file.relpath == "rotary.py":
            raise IndexError("a detector bug")
        return None

    swapped = tuple(p.__class__(p.category, broken, p.gain, p.whole_function) if str(p.category) == "rope" else p
                    for p in patterns.EXPRESSION_PATTERNS)
    monkeypatch.setattr("trainbridge.agents.analyst.static.scan.EXPRESSION_PATTERNS", swapped)


def test_a_detector_that_raises_loses_only_its_own_findings(tmp_path: Path, raising_rope):
    (tmp_path / "rotary.py").write_text(ROTARY_BY_INDEX)
    (tmp_path / "act.py").write_text(GELU)
    result = scan_repo_result(tmp_path, target="npu")
    assert [str(i.category) for i in result.intents] == ["gelu"]  # the other detector, in the other file
    assert result.detector_failures and {f.detector for f in result.detector_failures} == {"rope"}
    failure = result.detector_failures[0]
    assert failure.file == "rotary.py" and failure.line and "IndexError: a detector bug" in failure.error
    assert len(result.detector_failures) == 1 and failure.places > 1  # once per detector and file, with a count
    assert "the scan went on" in failure.describe() and "rotary.py:" in failure.describe()


def test_analyze_static_reports_the_failed_detector(tmp_path: Path, raising_rope):
    from trainbridge.agents.analyst.analyze import analyze_repo
    from trainbridge.sandbox.workload import Workload, WorkloadConfig

    (tmp_path / "rotary.py").write_text(ROTARY_BY_INDEX)
    (tmp_path / "act.py").write_text(GELU)
    workload = Workload(root=tmp_path, config=WorkloadConfig(launch="python act.py"))
    analysis = analyze_repo(workload, static_only=True, backend="npu")
    assert any("static detector rope failed on rotary.py:" in note for note in analysis.notes), analysis.notes
    assert [str(i.category) for i in analysis.intents] == ["gelu"]
