"""`trainbridge rm <run-id>` (issue 27): a failed run's branches, worktrees and folder go, with one command; the
user's branches, checkout, index and uncommitted work stay exactly as they were."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.graph.runs import RunError, remove_run
from trainbridge.graph.state import RunConfig, RunPaths
from trainbridge.tools.git.ops import RunWorkspace, open_repo
from trainbridge.tests.git_ops_support import edit, no_global_git_identity, snapshot, user  # noqa: F401


def _recorded_run(repo, tmp_path: Path, run_id: str) -> RunPaths:
    """A run as a failed one leaves it: its folder with run.json, the run branch, a candidate's branch and worktree."""
    home = tmp_path / "home" / "runs"
    paths = RunPaths(run_id, home)
    paths.dir.mkdir(parents=True)
    config = RunConfig(repo=repo.working_tree_dir, run_id=run_id, workspace_dir=str(paths.workspace))
    paths.config.write_text(config.model_dump_json(), encoding="utf-8")
    ws = RunWorkspace.create_run(open_repo(repo.working_tree_dir), run_id, workspace_root=paths.workspace)
    cand = ws.start_candidate("c1")
    edit(Path(cand.path), "1e-6", "1e-5")
    ws.commit_candidate("c1", "trainbridge: a candidate")
    (paths.dir / "report").mkdir()
    return paths


def test_rm_removes_the_runs_branches_worktrees_and_folder_and_nothing_of_the_user(user, tmp_path):
    before = snapshot(user)
    paths = _recorded_run(user, tmp_path, "failed-run")
    assert any(b.startswith("trainbridge/failed-run") for b in user.git.branch("--list", "trainbridge/*").split())
    removal = remove_run("failed-run", root=paths.dir.parent)
    assert sorted(removal.git.removed_branches) == ["trainbridge/failed-run", "trainbridge/failed-run.cand/c1"]
    assert len(removal.git.removed_worktrees) == 2 and removal.git.kept_branches == {}
    assert not paths.dir.exists()
    assert user.git.branch("--list", "trainbridge/*") == ""
    assert "failed-run" not in user.git.worktree("list")
    assert snapshot(user) == before  # the feature branch, the staged and unstaged changes, the untracked file
    with pytest.raises(RunError, match="no run 'failed-run'"):
        remove_run("failed-run", root=paths.dir.parent)


def test_a_run_branch_the_user_checked_out_stays_and_is_named(user, tmp_path):
    paths = _recorded_run(user, tmp_path, "looked-at")
    mine = tmp_path / "my-look"
    user.git.worktree("add", "--force", str(mine), "trainbridge/looked-at")  # the user looks at the run's result
    removal = remove_run("looked-at", root=paths.dir.parent)
    assert removal.git.removed_branches == ["trainbridge/looked-at.cand/c1"]
    assert list(removal.git.kept_branches) == ["trainbridge/looked-at"] and str(mine) in removal.git.kept_branches["trainbridge/looked-at"]
    assert mine.is_dir() and not paths.dir.exists()


def test_rm_on_the_command_line_asks_and_says_what_it_removed(user, tmp_path):
    paths = _recorded_run(user, tmp_path, "cli-run")
    env = {"TRAINBRIDGE_HOME": str(paths.dir.parent.parent), "HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    asked = subprocess.run([sys.executable, "-m", "trainbridge", "rm", "cli-run"], input="n\n", capture_output=True,
                           text=True, env=env, timeout=120)
    assert asked.returncode == 1 and paths.dir.exists() and "nothing removed" in asked.stderr  # it exited 1 without a word
    done = subprocess.run([sys.executable, "-m", "trainbridge", "rm", "cli-run", "--yes", "--json", "-"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)  # --json -: the removal's record and nothing else on stdout
    assert record["removed_branches"] == ["trainbridge/cli-run", "trainbridge/cli-run.cand/c1"] and len(record["removed_worktrees"]) == 2
    assert "removed 2 worktree(s) and 2 branch(es): trainbridge/cli-run, trainbridge/cli-run.cand/c1" in done.stderr
    assert not paths.dir.exists()
    again = subprocess.run([sys.executable, "-m", "trainbridge", "rm", "cli-run", "--yes"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert again.returncode == 2 and "no run 'cli-run'" in again.stderr
