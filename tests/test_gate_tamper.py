"""Integrity checks between gates (agents/profiler/tamper.py): the baseline's worktree over a round,
bytecode caches included, and the installed tool, its environment's start-up files and the run's state
over a gate. The red team plants the same tricks in real gates (tests/fixtures/redteam/cheats/)."""

from __future__ import annotations

import importlib.util
import marshal
import os
import py_compile
import subprocess
import sys
from pathlib import Path

from trainbridge.agents.profiler import tamper
from trainbridge.agents.profiler.integrity import Finding, FindingKind
from trainbridge.agents.profiler.verdict import Verdict, VerdictReason
from trainbridge.agents.profiler.gate import harness_checked

SOURCE = "def step():\n    return 'honest'\n"


def plant_bytecode(source: Path, body: str) -> Path:
    """A bytecode cache of other code whose header carries `source`'s modification time and size."""
    stat = source.stat()
    code = compile(body, str(source), "exec", dont_inherit=True)
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
    cache = Path(importlib.util.cache_from_source(str(source)))
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(header + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(code))
    return cache


def absolute(root: Path) -> dict:
    return {str(root / rel): sig for rel, sig in tamper.digest_tree(root).items()}


def test_a_planted_bytecode_cache_is_what_python_loads_and_the_baseline_check_names_it(tmp_path):
    source = tmp_path / "step.py"
    source.write_text(SOURCE)
    before = tamper.digest_tree(tmp_path)
    cache = plant_bytecode(source, "def step():\n    return 'poisoned'\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    ran = subprocess.run([sys.executable, "-c", "import step; print(step.step())"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True)
    assert ran.stdout.strip() == "poisoned"  # the threat is real: the source is untouched, the cache wins
    assert source.read_text() == SOURCE and not tamper.bytecode_matches_source(cache)
    found, = tamper.baseline_findings(tmp_path, before, tamper.digest_tree(tmp_path), [], "timing round 3")
    assert found.kind == FindingKind.tampered_harness
    assert "timing round 3" in found.message and "__pycache__/step." in found.message and str(tmp_path) in found.message
    # the program's own outputs are not tampering where the candidate writes them too; code and bytecode always are
    assert tamper.baseline_findings(tmp_path, before, tamper.digest_tree(tmp_path), [cache.relative_to(tmp_path).as_posix()], "r")


def test_the_baseline_check_sees_a_rewrite_that_keeps_size_and_modification_time(tmp_path):
    source = tmp_path / "step.py"
    source.write_text(SOURCE)
    (tmp_path / "log.txt").write_text("round 0\n")
    before = tamper.digest_tree(tmp_path)
    stat = source.stat()
    source.write_text(SOURCE.replace("honest", "sneaky"))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    (tmp_path / "log.txt").write_text("round 1\n")
    after = tamper.digest_tree(tmp_path)
    assert tamper.changed(before, after) == ["log.txt", "step.py"]
    found, = tamper.baseline_findings(tmp_path, before, after, ["log.txt"], "the numerics check")
    assert "step.py" in found.message and "log.txt" not in found.message
    assert tamper.baseline_findings(tmp_path, before, tamper.digest_tree(tmp_path), ["log.txt", "step.py"], "r")  # source: always


def test_a_candidate_folder_inside_the_baseline_is_left_to_its_own_check(tmp_path):
    (tmp_path / "step.py").write_text(SOURCE)
    inner = tmp_path / "candidate"
    inner.mkdir()
    before = tamper.digest_tree(tmp_path, exclude=[inner])
    (inner / "step.py").write_text(SOURCE)
    assert tamper.changed(before, tamper.digest_tree(tmp_path, exclude=[inner])) == []


def test_harness_bytecode_is_fine_only_when_it_is_the_compiled_source(tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / "gate.py").write_text(SOURCE)
    (package / "judge.py").write_text(SOURCE)
    honest = Path(py_compile.compile(str(package / "judge.py"), doraise=True))
    before = absolute(package)
    assert tamper.harness_findings(before, absolute(package)) == []
    py_compile.compile(str(package / "gate.py"), doraise=True)  # what Python writes itself on import: not tampering
    honest.unlink()  # a removed cache is recompiled from source
    (honest.parent / f"{honest.name}.140234").write_bytes(b"half-written")  # the interpreter's temporary file: never loaded
    assert tamper.harness_findings(before, absolute(package)) == []
    plant_bytecode(package / "gate.py", "VERDICT = 'accepted'\n")
    (package / "redteam_planted.py").write_text("VERDICT = 'accepted'\n")
    found, = tamper.harness_findings(before, absolute(package))
    assert found.kind == FindingKind.tampered_harness
    assert "gate.cpython-" in found.message and "redteam_planted.py" in found.message and "judge.cpython" not in found.message


def test_the_harness_digest_covers_the_package_and_the_environments_start_up_files(tmp_path):
    state = tmp_path / "run.json"
    state.write_text("{}")
    digest = tamper.harness_digest([state])
    root = tamper.package_root()
    assert str(root / "agents" / "profiler" / "gate.py") in digest and str(root / "__init__.py") in digest
    assert not any("/.git/" in path for path in digest)
    for folder in tamper.site_dirs():
        for pth in folder.glob("*.pth"):
            assert str(pth) in digest
    assert str(state.resolve()) in digest
    state.write_text('{"rounds": 1}')
    found, = tamper.harness_findings(digest, tamper.harness_digest([state]))
    assert "run.json" in found.message


def test_a_changed_harness_overrides_whatever_the_gate_decided():
    accepted = Verdict(accepted=True, reason=VerdictReason.accepted, message="1.5x faster", backend="cpu", phase="done")
    assert harness_checked(accepted, []) is accepted
    plant = Finding(kind=FindingKind.tampered_harness, message="over the gate: /x/gate.py changed")
    checked = harness_checked(accepted, [plant])
    assert not checked.accepted and checked.reason == VerdictReason.tampered_harness
    assert checked.findings == [plant] and "/x/gate.py" in checked.message and "1.5x faster" in checked.message
