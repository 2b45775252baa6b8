"""Run and candidate git operations on real temporary repositories (no mocks of git): the full cycle
of a candidate from its worktree to the run branch or a pending branch. Helpers: tests/git_ops_support.py."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

import git
import pytest

from trainbridge.tools.git.ops import (
    CandidateConflict,
    CandidateNotFound,
    GitIdentity,
    NotFastForward,
    UnsafeReason,
    UnsafeRepoState,
    WorkspaceBusy,
)
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


# ---------------------------------------------------------------- the full cycle


def test_full_cycle_leaves_the_users_repository_untouched(user, tmp_path):
    before = snapshot(user)
    base = user.head.commit.hexsha
    ws = workspace(user, tmp_path)
    assert ws.info.created_branch and ws.info.created_worktree and ws.info.base_sha == base
    assert not _under_checkout(ws.worktree, user)
    # the run worktree has the committed code, not the user's uncommitted edits
    assert (ws.worktree / "model.py").read_text() == MODEL and not (ws.worktree / "notes.txt").exists()

    cand = ws.start_candidate("rmsnorm")
    assert cand.branch == "trainbridge/run1.cand/rmsnorm" and cand.base_sha == base
    edit(cand.path, "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)", "torch.rms_norm(x, x.shape[-1:])")
    made = ws.commit_candidate("rmsnorm", "Use fused rms_norm")
    assert made.created and not made.empty and made.files == ["model.py"]
    commit = user.commit(made.sha)
    assert (commit.author.name, commit.author.email) == ("TrainBridge", "trainbridge@localhost")
    assert commit.committer.name == "TrainBridge"
    assert commit.trailers_dict["TrainBridge-Candidate"] == ["rmsnorm"]
    assert commit.trailers_dict["TrainBridge-Run"] == ["run1"]
    accepted = ws.accept_candidate("rmsnorm")
    assert accepted.sha == made.sha and accepted.previous_head == base and not accepted.already_accepted
    assert "torch.rms_norm" in (ws.worktree / "model.py").read_text()
    assert not cand.path.exists() and "trainbridge/run1.cand/rmsnorm" not in branches(user)

    cand2 = ws.start_candidate("readme")
    assert cand2.base_sha == made.sha
    edit(cand2.path, "line two", "line 2", file="README.md")
    rejected_sha = ws.commit_candidate("readme", "Touch README").sha
    assert ws.reject_candidate("readme").deleted_sha == rejected_sha

    ws.start_candidate("pending")
    (ws.root / "candidates" / "pending" / "fused.py").write_text("FUSED = True\n")
    pending = ws.commit_candidate("pending", "Needs NPU timing")
    pushed = ws.push_to_branch("pending", "pending-npu")
    assert pushed.created and pushed.sha == pending.sha and pushed.fast_forward and pushed.candidate_removed
    cleaned = ws.cleanup()

    assert snapshot(user) == before
    run_commits = commits_between(user, base, "trainbridge/run1")
    assert [c.hexsha for c in run_commits] == [made.sha]
    assert branches(user) == {"main", "feature", "trainbridge/run1", "trainbridge/run1.pending-npu"}
    assert cleaned.kept_branches == ["trainbridge/run1", "trainbridge/run1.pending-npu"]
    assert {p.name for p in cleaned.removed_worktrees} == {"run", "pending-npu"}
    assert [w for w in user.git.worktree("list", "--porcelain").split("\n\n") if "trainbridge" in w] == []
    assert not (ws.root / "run").exists() and not (ws.root / "candidates").exists()
    assert set(ws.made_shas) == {made.sha, rejected_sha, pending.sha}


def _under_checkout(path: Path, repo: git.Repo) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(repo.working_tree_dir))


def test_committing_the_same_candidate_again_makes_no_duplicate(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    first = ws.commit_candidate("c1", "eps")
    again = ws.commit_candidate("c1", "eps (retry)")
    assert again.sha == first.sha and not again.created and not again.empty
    # killed between `reset --soft` and `commit`: the next call commits exactly once
    user.git.update_ref("refs/heads/trainbridge/run1.cand/c1", first.base_sha)
    redone = ws.commit_candidate("c1", "eps")
    assert redone.created and redone.replaced == []
    # a further edit (e.g. a review edit) is folded into the single candidate commit
    edit(cand.path, "1e-5", "1e-4")
    amended = ws.commit_candidate("c1", "eps 1e-4")
    assert amended.created and amended.replaced == [redone.sha]
    assert len(commits_between(user, first.base_sha, "trainbridge/run1.cand/c1")) == 1
    ws.accept_candidate("c1")
    assert len(commits_between(user, first.base_sha, "trainbridge/run1")) == 1


def test_a_candidate_without_changes_gives_a_typed_empty_result(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("noop")
    (cand.path / "model.py").write_text(MODEL)  # rewritten with identical bytes
    result = ws.commit_candidate("noop", "nothing")
    assert result.empty and result.sha is None and not result.created
    assert user.heads["trainbridge/run1.cand/noop"].commit.hexsha == cand.base_sha


def test_a_restarted_attempt_with_the_same_edit_gets_back_the_same_commit(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    (cand.path / "new_file.py").write_text("X = 1\n")
    first = ws.commit_candidate("c1", "eps")
    again = ws.start_candidate("c1")  # e.g. the coder node re-runs after a crash
    assert again.reset_from == first.sha
    assert (again.path / "model.py").read_text() == MODEL and not (again.path / "new_file.py").exists()
    edit(again.path, "1e-6", "1e-5")
    (again.path / "new_file.py").write_text("X = 1\n")
    redo = ws.commit_candidate("c1", "eps")
    assert redo.sha == first.sha and not redo.created
    ws.start_candidate("c1")
    edit(again.path, "1e-6", "1e-7")
    assert ws.commit_candidate("c1", "other eps").sha != first.sha


def test_accept_refuses_a_non_fast_forward_and_the_candidate_can_be_redone(user, tmp_path):
    ws = workspace(user, tmp_path)
    base = ws.head_sha
    a, b = ws.start_candidate("a"), ws.start_candidate("b")
    edit(a.path, "1e-6", "1e-5")
    edit(b.path, "line two", "line 2", file="README.md")
    ws.commit_candidate("a", "a")
    b_first = ws.commit_candidate("b", "b")
    ws.accept_candidate("a")
    head_after_a = ws.head_sha
    with pytest.raises(NotFastForward) as caught:
        ws.accept_candidate("b")
    assert "start_candidate('b')" in caught.value.remedy
    assert ws.head_sha == head_after_a and user.heads["trainbridge/run1.cand/b"].commit.hexsha == b_first.sha
    redo = ws.start_candidate("b")
    assert redo.base_sha == head_after_a
    edit(redo.path, "line two", "line 2", file="README.md")
    b_second = ws.commit_candidate("b", "b")
    assert b_second.sha != b_first.sha
    ws.accept_candidate("b")
    run = commits_between(user, base, "trainbridge/run1")
    assert [c.trailers_dict["TrainBridge-Candidate"] for c in run] == [["b"], ["a"]]
    assert all(len(c.parents) == 1 for c in run)
    assert "1e-5" in (ws.worktree / "model.py").read_text() and "line 2" in (ws.worktree / "README.md").read_text()


def test_accept_again_after_a_crash_reports_already_accepted(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    made = ws.commit_candidate("c1", "eps")
    user.git.update_ref("refs/heads/trainbridge/run1", made.sha)  # killed right after moving the run branch
    resumed = ws.accept_candidate("c1")
    assert resumed.already_accepted and resumed.sha == made.sha
    assert "trainbridge/run1.cand/c1" not in branches(user) and not cand.path.exists()
    assert ws.accept_candidate("c1").already_accepted
    assert ws.commit_candidate("c1", "eps").already_accepted
    assert len(commits_between(user, made.base_sha, "trainbridge/run1")) == 1
    with pytest.raises(CandidateNotFound):
        ws.accept_candidate("never-started")


def test_create_run_is_idempotent_across_processes(user, tmp_path):
    base = user.head.commit.hexsha
    first = workspace(user, tmp_path)
    cand = first.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    made = first.commit_candidate("c1", "eps")
    first.accept_candidate("c1")
    (first.worktree / "model.py").write_text("garbage left by a killed profiler\n")
    second = workspace(user, tmp_path)  # a new process resuming the run
    assert not second.info.created_branch and not second.info.created_worktree
    assert second.info.head_sha == made.sha and second.info.base_sha == base and second.head_sha == made.sha
    assert "1e-5" in (second.worktree / "model.py").read_text()
    shutil.rmtree(second.worktree)  # someone deleted the run worktree: it comes back
    third = workspace(user, tmp_path)
    assert third.info.created_worktree and (third.worktree / "model.py").exists()


def test_create_run_refuses_a_run_branch_unrelated_to_the_base(user, tmp_path):
    workspace(user, tmp_path)
    other = git.Repo.init(tmp_path / "unrelated")
    (tmp_path / "unrelated" / "other.py").write_text("OTHER = 1\n")
    other.git.add("-A")
    other.git.execute(["git", "-c", "user.name=Bob", "-c", "user.email=bob@example.com", "commit", "-m", "other"])
    other.git.branch("-M", "main")
    user.git.fetch(other.working_tree_dir, "main:refs/heads/trainbridge/run2")
    with pytest.raises(UnsafeRepoState) as caught:
        workspace(user, tmp_path, run_id="run2")
    assert caught.value.kind == UnsafeReason.unrelated_run_branch
    user.git.switch("feature")
    with pytest.raises(UnsafeRepoState) as caught:
        workspace(user, tmp_path)  # HEAD moved to another line of history since run1 started
    assert caught.value.kind == UnsafeReason.unrelated_run_branch and "started from" in caught.value.reason


def test_a_stale_index_lock_in_our_worktree_is_cleared_but_not_the_users(user, tmp_path):
    ws = workspace(user, tmp_path, stale_lock_age_s=1.0)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    admin = Path(ws.folders.admin_dir(cand.path))
    (admin / "index.lock").write_text("")  # git killed during `git add`
    old = time.time() - 60
    os.utime(admin / "index.lock", (old, old))
    users_lock = Path(user.git_dir) / "index.lock"
    users_lock.write_text("")
    os.utime(users_lock, (old, old))
    ref_lock = Path(user.git_dir) / "refs" / "heads" / "trainbridge" / "run1.lock"
    ref_lock.write_text("")  # killed while moving the run branch; a fresh lock is waited on until stale
    made = ws.commit_candidate("c1", "eps")
    assert made.created and not (admin / "index.lock").exists()
    assert ws.accept_candidate("c1").sha == made.sha and not ref_lock.exists()
    assert users_lock.exists()
    assert any("index.lock" in r for r in ws.recovered) and any("run1.lock" in r for r in ws.recovered)


def test_a_second_process_on_the_same_workspace_is_told_it_is_busy(user, tmp_path):
    ws = workspace(user, tmp_path, lock_timeout_s=0.2)
    with open(ws.root / ".git-ops.lock", "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        other.write("4242")
        other.flush()
        with pytest.raises(WorkspaceBusy) as caught:
            ws.start_candidate("c1")
    assert "4242" in caught.value.reason
    ws.start_candidate("c1")


def test_push_to_a_pending_branch_fast_forwards_then_cherry_picks_and_is_idempotent(user, tmp_path):
    ws = workspace(user, tmp_path)
    base = ws.head_sha
    a, b = ws.start_candidate("a"), ws.start_candidate("b")
    edit(a.path, "1e-6", "1e-5")
    edit(b.path, "line two", "line 2", file="README.md")
    a_sha, b_sha = ws.commit_candidate("a", "a").sha, ws.commit_candidate("b", "b").sha
    first = ws.push_to_branch("a", "pending-npu", remove_candidate=False)
    assert first.fast_forward and first.sha == a_sha and not first.candidate_removed
    second = ws.push_to_branch("b", "pending-npu")
    assert second.created and not second.fast_forward and second.sha not in (a_sha, b_sha)
    assert second.sha in ws.made_shas and second.candidate_removed
    assert ws.push_to_branch("b", "pending-npu").sha == second.sha  # again: found by its trailer
    assert not ws.push_to_branch("a", "pending-npu").created
    pending = commits_between(user, base, "trainbridge/run1.pending-npu")
    assert [c.trailers_dict["TrainBridge-Candidate"] for c in pending] == [["b"], ["a"]]
    assert ws.head_sha == base and branches(user) >= {"trainbridge/run1.pending-npu"}
    assert not {"trainbridge/run1.cand/a", "trainbridge/run1.cand/b"} & branches(user)


def test_push_that_conflicts_is_reported_with_the_paths(user, tmp_path):
    ws = workspace(user, tmp_path)
    a, b = ws.start_candidate("a"), ws.start_candidate("b")
    edit(a.path, "1e-6", "1e-5")
    edit(b.path, "1e-6", "1e-7")
    ws.commit_candidate("a", "a")
    ws.commit_candidate("b", "b")
    ws.push_to_branch("a", "pending-npu")
    with pytest.raises(CandidateConflict) as caught:
        ws.push_to_branch("b", "pending-npu")
    assert caught.value.paths == ["model.py"]
    assert "trainbridge/run1.cand/b" in branches(user)
    side = ws.root / "branches" / "pending-npu"
    assert not (Path(ws.folders.admin_dir(side)) / "CHERRY_PICK_HEAD").exists()


def test_hooks_do_not_run_and_the_identity_is_configurable(user, tmp_path):
    ran = tmp_path / "hooks-ran"
    ran.mkdir()
    for name in ("pre-commit", "post-commit", "post-checkout", "reference-transaction"):
        hook = Path(user.git_dir) / "hooks" / name
        hook.write_text(f"#!/bin/sh\ntouch {ran / name}\nexit 1\n")
        hook.chmod(0o755)
    ws = workspace(user, tmp_path, identity=GitIdentity(name="Bot", email="bot@example.org"))
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    commit = user.commit(ws.commit_candidate("c1", "eps").sha)
    assert (commit.author.name, commit.author.email, commit.committer.email) == ("Bot", "bot@example.org",
                                                                                  "bot@example.org")
    assert list(ran.iterdir()) == []


def test_a_run_branch_checked_out_by_the_user_is_never_moved(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    ws.commit_candidate("c1", "eps")
    ws.cleanup()
    other = tmp_path / "users-own-worktree"
    user.git.worktree("add", str(other), "trainbridge/run1")
    with pytest.raises(UnsafeRepoState) as caught:
        workspace(user, tmp_path)
    assert caught.value.kind == UnsafeReason.branch_checked_out and str(other) in caught.value.reason
    assert other.exists() and (other / "model.py").read_text() == MODEL


def test_candidate_diff_against_the_run_head(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    assert ws.candidate_diff("c1") == ""
    uncommitted = ws.candidate_diff("c1", include_uncommitted=True)
    assert "--- a/model.py\n+++ b/model.py\n" in uncommitted and "+    return" in uncommitted and "1e-5" in uncommitted
    ws.commit_candidate("c1", "eps")
    assert ws.candidate_diff("c1") == uncommitted
    assert not any(p.name.endswith(".index") for p in Path(ws.folders.admin_dir(cand.path)).iterdir()
                   if p.name != "index")


def test_commits_made_by_someone_else_on_a_candidate_are_not_rewritten(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    worktree = git.Repo(cand.path)
    worktree.git.commit("-am", "my own fix")
    mine = worktree.head.commit.hexsha
    with pytest.raises(UnsafeRepoState) as caught:
        ws.commit_candidate("c1", "eps")
    assert caught.value.kind == UnsafeReason.foreign_commit and mine[:12] in caught.value.reason
    assert user.heads["trainbridge/run1.cand/c1"].commit.hexsha == mine


def test_worktrees_removed_by_cleanup_come_back_for_the_next_operation(user, tmp_path):
    ws = workspace(user, tmp_path)
    cand = ws.start_candidate("c1")
    edit(cand.path, "1e-6", "1e-5")
    made = ws.commit_candidate("c1", "eps")
    ws.cleanup()
    assert not cand.path.exists() and "trainbridge/run1.cand/c1" in branches(user)
    assert ws.commit_candidate("c1", "eps").sha == made.sha and cand.path.exists()
    assert ws.accept_candidate("c1").sha == made.sha
