"""Re-analysis skips the run's own rewrites: lines added since the base, in a category already landed."""

from __future__ import annotations

import subprocess

from trainbridge.agents.analyst.own_rewrites import added_lines, is_own_rewrite, split_own_rewrites, verdict_landed
from trainbridge.records import Intent, IntentSource, SourceSpan


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True)


def _intent(category: str, file: str, start: int, end: int) -> Intent:
    spans = [SourceSpan(file=file, line_start=start, line_end=end)]
    return Intent(id=Intent.make_id(category, spans), category=category, spans=spans, confidence=0.9, source=IntentSource.runtime)


def test_added_lines_and_own_rewrites(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    original = [f"line {i}" for i in range(1, 11)]
    (repo / "pkg" / "model.py").write_text("\n".join(original) + "\n")
    (repo / "other.py").write_text("a\nb\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    # a rewrite: a helper inserted at the top (2 lines), line 5 replaced by two lines, other.py untouched
    rewritten = ["import helper", ""] + original[:4] + ["fused(x)", "  # fused"] + original[5:]
    (repo / "pkg" / "model.py").write_text("\n".join(rewritten) + "\n")
    _git(repo, "commit", "-qam", "rewrite")

    added = added_lines(repo, base)
    assert added == {"pkg/model.py": {1, 2, 7, 8}}
    assert is_own_rewrite(_intent("rmsnorm", "pkg/model.py", 7, 8), added, {"rmsnorm"})
    assert not is_own_rewrite(_intent("rmsnorm", "pkg/model.py", 7, 9), added, {"rmsnorm"})  # reaches an old line
    assert not is_own_rewrite(_intent("silu", "pkg/model.py", 7, 7), added, {"rmsnorm"})  # another category
    assert not is_own_rewrite(_intent("rmsnorm", "other.py", 1, 1), added, {"rmsnorm"})
    assert added_lines(repo, "HEAD") == {}


def test_added_lines_ignore_the_users_diff_config(tmp_path):
    """A user's diff.noprefix (or colour, mnemonic prefixes, an external diff driver) once made the
    parser find nothing, and re-analysis proposed the run's own rewrites again."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text("a\nb\nc\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    (repo / "model.py").write_text("a\nfused(b)\nc\n")
    _git(repo, "commit", "-qam", "rewrite")
    for key, value in {"diff.noprefix": "true", "diff.mnemonicPrefix": "true", "color.ui": "always",
                       "color.diff": "always", "diff.external": "false", "diff.relative": "true"}.items():
        _git(repo, "config", key, value)
    assert added_lines(repo, base) == {"model.py": {2}}


def test_split_own_rewrites_parts_an_analysis_by_what_landed(tmp_path):
    """The analyst node's filter: only categories whose verdict landed (accepted, or pending on the NPU
    branch) count, and git is not asked at all when nothing landed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text("a\nb\nc\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    (repo / "model.py").write_text("a\nfused(b)\nnorm(c)\n")
    _git(repo, "commit", "-qam", "rewrite")
    gelu, norm, old = _intent("gelu", "model.py", 2, 2), _intent("rmsnorm", "model.py", 3, 3), _intent("gelu", "model.py", 1, 1)
    verdicts = [{"category": "gelu", "accepted": True}, {"category": "rmsnorm", "accepted": False, "reason": "slower"}]
    found = split_own_rewrites([gelu, norm, old], repo, base, verdicts)
    assert found.own == [gelu] and found.kept == [norm, old]
    pending = [{"category": "rmsnorm", "accepted": False, "reason": "speed_unmeasured_numerics_ok"}]
    assert split_own_rewrites([gelu, norm], repo, base, pending).own == [norm]
    assert verdict_landed(pending[0]) and not verdict_landed(verdicts[1]) and not verdict_landed({})
    nothing = split_own_rewrites([gelu, norm], tmp_path / "not-a-repo", base, verdicts[1:])  # no git call: no error
    assert nothing.own == [] and nothing.kept == [gelu, norm]
