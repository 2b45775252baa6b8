"""The red team: planted candidates that try to fool the gate, each rejected with the reason that names
what it did (or, where the trick finds nothing to exploit, simply not accepted).

Each cheat is a file in tests/fixtures/redteam/cheats/: a header (`# class:`, `# expect:`, and optionally
`# names:`, what the first finding's message must name, and `# confined:`, the verdict where the gate's children are
confined and the filesystem refuses what the cheat tries, and `# contended: not_faster`, a cheat that may find no free
core on a loaded machine and is then only checked not to look faster) and the lines appended to the victim's step.py
(tests/fixtures/redteam/base/). `{MARKER}` becomes a path outside both worktrees, `{PACKAGE_FILE}` the name
of a file that does not exist in the installed package's folder (with the editable install, this
checkout): the test removes that file afterwards, whatever the verdict. Add a file when a new way in is
found; the test picks it up.
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
from trainbridge.agents.profiler.tamper import package_root
from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.sandbox import confinement
from trainbridge.sandbox.child import fork_server, self_confinement
from trainbridge.sandbox.workload import load_workload

REDTEAM = Path(__file__).parent / "fixtures" / "redteam"
CHEATS = sorted((REDTEAM / "cheats").glob("*.py"))
NOT_ACCEPTED = {VerdictReason.not_significant, VerdictReason.slower}
NOT_FASTER = 0.97  # `# contended: not_faster`: a cheat that found nothing to exploit did not look even 3% faster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def warm_fork_servers():
    """The module's gates fork their children from the same servers, as the gates of one run do (graph/runs.py opens
    a `fork_server.warm_scope` around a run): a server holds no state of any child, so each child is as fresh as in a
    gate of its own, and the module pays the servers' start (interpreter and `import torch`) once, not per cheat.
    Whether a child confines itself is asked per fork, so the unconfined reruns below are unconfined all the same."""
    with fork_server.warm_scope():
        yield


def _header(path: Path, key: str) -> str:
    match = re.search(rf"^# {key}: (.+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} needs a '# {key}:' line"
    return match.group(1).strip()


def plant(tmp_path: Path, cheat: Path, package_file: str = "") -> tuple[Path, Path]:
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    shutil.copytree(REDTEAM / "base", baseline)
    shutil.copytree(REDTEAM / "base", candidate)
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    code = cheat.read_text().replace("{MARKER}", str(marker)).replace("{PACKAGE_FILE}", package_file)
    step = candidate / "step.py"
    step.write_text(step.read_text() + "\n\n# --- planted ---\n" + code, encoding="utf-8")
    return baseline, candidate


def children_confined(scratch: Path) -> bool:
    """Whether a gate's children run confined here: forked ones confine themselves where the host lets a process
    (sandbox/child/self_confinement.py), else they are exec'd under bubblewrap where it is usable."""
    return confinement.wanted() and (self_confinement.probe([str(scratch)]) is None or confinement.bubblewrap().usable)


def _expected(cheat: Path, confined: bool) -> str:
    """The verdict a cheat gets: `# confined:` where children are confined and the cheat says what its attempt then
    comes to (the filesystem refuses it, so the gate judges what is left), else `# expect:`."""
    match = re.search(r"^# confined: (\S+)", cheat.read_text(), re.MULTILINE)
    return match.group(1) if confined and match else _header(cheat, "expect")


def _came_to_nothing(cheat: Path, verdict) -> bool:
    """`# contended: not_faster`: a cheat whose trick needs a free core (burning one while its partner steps) finds
    none on a machine others load, and slows only itself. Its verdict is then not_significant or slower with the
    candidate not measured faster; a burn that did slow the partner shows as a lower ratio and still fails here."""
    match = re.search(r"^# contended: not_faster$", cheat.read_text(), re.MULTILINE)
    return bool(match) and verdict.reason in NOT_ACCEPTED and verdict.ratio is not None and verdict.ratio >= NOT_FASTER


@pytest.mark.parametrize("cheat", CHEATS, ids=[c.stem for c in CHEATS])
def test_planted_cheat_is_rejected_with_its_reason(tmp_path, cheat):
    confined = children_confined(tmp_path)
    expect = _expected(cheat, confined)
    if cheat.stem == "raised_priority" and os.geteuid() != 0:
        pytest.skip("raising a priority needs root here; the check itself is tested in test_gate_conduct.py")
    planted = package_root() / f"redteam_planted_{uuid.uuid4().hex}.py"  # only a cheat that writes into the package creates it
    baseline, candidate = plant(tmp_path, cheat, planted.name)
    try:
        verdict = run_gate(load_workload(baseline), load_workload(candidate), rounds=2, max_rounds=2, rng=random.Random(7))
        assert not verdict.accepted, verdict.message
        if _came_to_nothing(cheat, verdict):
            return
        if "|" in expect:  # a prevented attempt that may still be caught at what is left of it (its polling's CPU)
            allowed = {reason for part in expect.split("|")
                       for reason in (NOT_ACCEPTED if part == "not_accepted" else {VerdictReason(part)})}
            assert verdict.reason in allowed, f"{cheat.stem}: got {verdict.reason}: {verdict.message}"
        elif expect == "not_accepted":
            assert verdict.reason in NOT_ACCEPTED, verdict.message
        else:
            assert verdict.reason == VerdictReason(expect), f"{cheat.stem}: got {verdict.reason}: {verdict.message}"
            if expect == _header(cheat, "expect"):  # caught in the act: a finding names it (a prevented attempt has none)
                assert verdict.findings and verdict.findings[0].kind.value == expect, verdict.findings
        names = re.search(r"^# names: (.+)$", cheat.read_text(), re.MULTILINE)
        if names and expect == _header(cheat, "expect"):
            assert names.group(1).strip().replace("{PACKAGE_FILE}", planted.name) in verdict.findings[0].message, verdict.findings
        if confined:
            assert not planted.exists(), f"{cheat.stem} wrote into the installed package although its children are confined"
    finally:
        planted.unlink(missing_ok=True)


PREVENTED = [c for c in CHEATS if re.search(r"^# confined: ", c.read_text(), re.MULTILINE)]


@pytest.mark.parametrize("cheat", PREVENTED, ids=[c.stem for c in PREVENTED])
def test_a_cheat_confinement_prevents_is_still_caught_unconfined(tmp_path, cheat, monkeypatch):
    """Where nothing confines the children (TRAINBRIDGE_CONFINE=0 here; a host without user namespaces run with
    --unconfined), what confinement prevents is caught after the fact, with its reason."""
    monkeypatch.setenv(confinement.CONFINE_ENV, "0")
    confinement.bubblewrap.cache_clear()
    try:
        assert not children_confined(tmp_path)
        test_planted_cheat_is_rejected_with_its_reason(tmp_path, cheat)
    finally:
        monkeypatch.delenv(confinement.CONFINE_ENV)
        confinement.bubblewrap.cache_clear()


def test_every_cheat_names_its_class_and_expectation():
    assert len(CHEATS) >= 20
    classes = {_header(c, "class") for c in CHEATS}
    for needed in ("clock rebinding (time)", "clock rebinding (the harness module)", "clock rebinding (torch functions around the timer)",
                   "mode sniffing (argv)", "mode sniffing (files)", "work skipped only when timed (call-stack sniffing)",
                   "work cached across steps", "thread-count games", "process-priority games", "writing to the harness's output",
                   "reading the gate's seed", "slowing the other side (paired rounds)",
                   "writing into the other side's files (bytecode cache)", "writing into the installed tool",
                   "overwriting the other side's evidence"):
        assert needed in classes, needed
    for cheat in CHEATS:
        for expect in {_expected(cheat, False), _expected(cheat, True)}:
            for part in expect.split("|"):
                assert part == "not_accepted" or part in VerdictReason.__members__, (cheat.name, expect)


SNIFFER = '''
import json as _json
import os as _os
import sys as _sys

_honest_build = build


def _observe(where):
    frames, frame = [], _sys._getframe(1)
    while frame is not None:
        frames.append(frame.f_code.co_name)
        frame = frame.f_back
    harness = _sys.modules.get("trainbridge.sandbox.harness")
    seen = {
        "where": where,
        "argv": _sys.argv,
        "env": {k: v for k, v in _os.environ.items() if k != "PYTHONHASHSEED"},
        "cwd": sorted(_os.listdir(".")),
        "stack": frames,
        "harness_globals": sorted(vars(harness)) if harness else None,
        "modules": sorted(m for m in _sys.modules if m.startswith("trainbridge")),
        "fds": sorted(_os.listdir("/proc/self/fd")),
    }
    with open("{LOG}", "a") as handle:
        handle.write(_json.dumps(seen) + "\\n")


def build(device, seed):
    _observe("build")
    parts = _honest_build(device, seed)
    honest = parts["train_step"]
    calls = [0]

    def train_step(model, optimizer, batch):
        calls[0] += 1
        if calls[0] == 3:  # the first timed step, after the probe's two (PROBE_STEPS)
            _observe("first timed step")
        return honest(model, optimizer, batch)

    parts["train_step"] = train_step
    return parts
'''


def test_a_gate_child_cannot_tell_the_numerics_round_from_a_timing_round(tmp_path):
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    log = confinement.cache_dir(candidate) / "observed.jsonl"  # its side's folder: a confined child may write there
    shutil.copytree(REDTEAM / "base", baseline)
    shutil.copytree(REDTEAM / "base", candidate)
    step = candidate / "step.py"
    step.write_text(step.read_text() + SNIFFER.replace("{LOG}", str(log)), encoding="utf-8")
    verdict = run_gate(load_workload(baseline), load_workload(candidate), rounds=2, max_rounds=2, rng=random.Random(11))
    assert not verdict.accepted and verdict.reason in NOT_ACCEPTED, verdict.message
    import json

    seen = [json.loads(line) for line in log.read_text().splitlines()]
    confinement.remove_side(candidate)
    by_place: dict[str, list[dict]] = {}
    for entry in seen:
        by_place.setdefault(entry["where"], []).append(entry)
    assert {k: len(v) for k, v in by_place.items()} == {"build": 2, "first timed step": 2}  # round 0 and round 1
    for place, entries in by_place.items():
        first, second = entries
        assert first == second, f"{place}: a gate child can tell its round: " + str(
            {k: (first[k], second[k]) for k in first if first[k] != second[k]})
    assert not any("measure" in a or "numerics" in a for a in seen[0]["argv"])
