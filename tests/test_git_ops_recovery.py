"""What goes wrong around the git operations (real temporary repositories, no mocks of git): a kill
between any two git commands, a user's git config that would change what we commit or diff, and
half-made or foreign worktree folders. Helpers: tests/git_ops_support.py."""

from __future__ import annotations

import git
import pytest

from trainbridge.tools.git.ops import UnsafeReason, UnsafeRepoState, candidate_branch_name
from trainbridge.tests.git_ops_support import (  # noqa: F401 (fixtures)
    MODEL,
    branches,
    commits_between,
    edit,
    no_global_git_identity,
    snapshot,
    user,
    workspace,
)


class _Killed(BaseException):
    """Stands in for SIGKILL between two git commands: nothing of ours catches it, the flock is released."""


def _kill_after(monkeypatch, calls: int) -> list[int]:
    from trainbridge.tools.git import runner as git_runner

    real, count = git_runner._git_status, [0]

    def counting(*args, **kwargs):
        result = real(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            raise _Killed
        return result

    monkeypatch.setattr(git_runner, "_git_status", counting)  # the one place a git process starts
    return count


@pytest.mark.parametrize("operation", ["commit", "accept", "push"])
def test_killed_between_any_two_git_commands_the_retry_completes_without_duplicates(user, tmp_path, monkeypatch,
                                                                                   operation):
    ws = workspace(user, tmp_path)
    calls = None
    for kill_at in range(1, 100):
        name = f"c{kill_at}"
        run_head = ws.head_sha
        cand = ws.start_candidate(name)
        (cand.path / f"{name}.py").write_text(f"N = {kill_at}\n")
        if operation != "commit":
            ws.commit_candidate(name, name)
        do = {"commit": lambda: ws.commit_candidate(name, name), "accept": lambda: ws.accept_candidate(name),
              "push": lambda: ws.push_to_branch(name, "pending")}[operation]
        with monkeypatch.context() as patch:
            count = _kill_after(patch, kill_at)
            try:
                do()
                calls = count[0]
            except _Killed:
                pass
        retried = do()
        if operation == "commit":
            assert retried.sha is not None and do().sha == retried.sha
            mine = commits_between(user, run_head, candidate_branch_name("run1", name))
            ws.accept_candidate(name)
        elif operation == "accept":
            assert retried.sha == ws.head_sha and (ws.worktree / f"{name}.py").exists()
            assert git.Repo(ws.worktree).git.status("--porcelain") == ""
            mine = commits_between(user, run_head, "trainbridge/run1")
        else:
            mine = [c for c in commits_between(user, run_head, "trainbridge/run1.pending")
                    if c.trailers_dict["TrainBridge-Candidate"] == [name]]
            assert retried.sha == mine[0].hexsha and candidate_branch_name("run1", name) not in branches(user)
        assert len(mine) == 1 and mine[0].trailers_dict["TrainBridge-Candidate"] == [name]
        assert set(mine[0].stats.files) == {f"{name}.py"}
        if calls is not None:
            break
    assert calls is not None and calls >= 5, "every kill point was exercised"


def test_the_users_git_config_cannot_change_what_we_commit_or_diff(user, tmp_path):
    with user.config_writer() as config:
        config.set_value("commit", "gpgsign", "true")
        config.set_value("gpg", "program", "/bin/false")
        config.set_value("commit", "cleanup", "strip")
        config.set_value("diff", "noprefix", "true")
        config.set_value("diff", "external", "/bin/false")
        config.set_value("color", "ui", "always")
        config.set_value("log", "showSignature", "true")
    before = snapshot(user)
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    (cand.path / "données.py").write_text("X = 1\n")
    made = ws.commit_candidate("c1", "# not a comment: keep me")
    assert made.files == ["données.py", "model.py"]
    assert user.commit(made.sha).message.startswith("# not a comment: keep me")
    diff = ws.candidate_diff("c1")
    assert "--- a/model.py\n+++ b/model.py\n" in diff and "\x1b[" not in diff
    assert ws.accept_candidate("c1").sha == made.sha
    assert snapshot(user) == before


def test_half_made_or_foreign_worktree_folders(user, tmp_path):
    ws = workspace(user, tmp_path)
    path = ws.root / "candidates" / "c1"
    user.git.branch("trainbridge/run1.cand/c1", ws.head_sha)
    user.git.worktree("add", "--lock", "--reason", "initializing", str(path), "trainbridge/run1.cand/c1")
    (path / "model.py").write_text("half checked out\n")  # killed during `git worktree add`
    cand = ws.start_candidate("c1")
    assert (cand.path / "model.py").read_text() == MODEL
    assert "locked" not in user.git.worktree("list", "--porcelain").split(str(path))[1].split("\n\n")[0]
    foreign = ws.root / "candidates" / "c2"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("not ours\n")
    with pytest.raises(UnsafeRepoState) as caught:
        ws.start_candidate("c2")
    assert caught.value.kind == UnsafeReason.workspace_location and (foreign / "precious.txt").exists()
    (foreign / "precious.txt").unlink()  # an empty folder is fine
    assert ws.start_candidate("c2").path.exists()
