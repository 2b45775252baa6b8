"""The red team: planted candidates that try to fool the gate, each rejected with the reason that names
what it did (or, where the trick finds nothing to exploit, simply not accepted).

Each cheat is a file in tests/fixtures/redteam/cheats/: a header (`# class:`, `# expect:`) and the
lines appended to the victim's step.py (tests/fixtures/redteam/base/). Add a file when a new way in
is found; the test picks it up.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import uuid
from pathlib import Path

import pytest

from trainbridge.agents.profiler.gate import run_gate
from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.sandbox.workload import load_workload

REDTEAM = Path(__file__).parent / "fixtures" / "redteam"
CHEATS = sorted((REDTEAM / "cheats").glob("*.py"))
NOT_ACCEPTED = {VerdictReason.not_significant, VerdictReason.slower}

pytestmark = pytest.mark.slow


def _header(path: Path, key: str) -> str:
    match = re.search(rf"^# {key}: (.+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} needs a '# {key}:' line"
    return match.group(1).strip()


def plant(tmp_path: Path, cheat: Path) -> tuple[Path, Path]:
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    shutil.copytree(REDTEAM / "base", baseline)
    shutil.copytree(REDTEAM / "base", candidate)
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    code = cheat.read_text().replace("{MARKER}", str(marker))
    step = candidate / "step.py"
    step.write_text(step.read_text() + "\n\n# --- planted ---\n" + code, encoding="utf-8")
    return baseline, candidate


@pytest.mark.parametrize("cheat", CHEATS, ids=[c.stem for c in CHEATS])
def test_planted_cheat_is_rejected_with_its_reason(tmp_path, cheat):
    expect = _header(cheat, "expect")
    if cheat.stem == "raised_priority" and os.geteuid() != 0:
        pytest.skip("raising a priority needs root here; the check itself is tested in test_gate_conduct.py")
    baseline, candidate = plant(tmp_path, cheat)
    verdict = run_gate(load_workload(baseline), load_workload(candidate), rounds=2, max_rounds=2, rng=random.Random(7))
    assert not verdict.accepted, verdict.message
    if expect == "not_accepted":
        assert verdict.reason in NOT_ACCEPTED, verdict.message
    else:
        assert verdict.reason == VerdictReason(expect), f"{cheat.stem}: got {verdict.reason}: {verdict.message}"
        assert verdict.findings and verdict.findings[0].kind.value == expect, verdict.findings


def test_every_cheat_names_its_class_and_expectation():
    assert len(CHEATS) >= 15
    classes = {_header(c, "class") for c in CHEATS}
    for needed in ("clock rebinding (time)", "clock rebinding (the harness module)", "clock rebinding (torch functions around the timer)",
                   "mode sniffing (argv)", "mode sniffing (files)", "work skipped only when timed (call-stack sniffing)",
                   "work cached across steps", "thread-count games", "process-priority games", "writing to the harness's output",
                   "reading the gate's seed"):
        assert needed in classes, needed
    for cheat in CHEATS:
        expect = _header(cheat, "expect")
        assert expect == "not_accepted" or expect in VerdictReason.__members__, (cheat.name, expect)
