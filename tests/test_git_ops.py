"""Run and candidate git operations on real temporary repositories (no mocks of git)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import git
import pytest

from trainbridge.tools.git_ops import (
    CandidateConflict,
    CandidateNotFound,
    GitIdentity,
    NotFastForward,
    RunWorkspace,
    UnsafeReason,
    UnsafeRepoState,
    WorkspaceBusy,
    candidate_branch_name,
    open_repo,
    run_branch_name,
    side_branch_name,
)

MODEL = "import torch\n\n\ndef rms(x):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"


@pytest.fixture(autouse=True)
def no_global_git_identity(tmp_path, monkeypatch):
    """Like CI: no global or system git config, no identity; only the test repos' local config."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
                 "GIT_NAMESPACE", "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(name, raising=False)


def init_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    (root / "model.py").write_text(MODEL)
    (root / "README.md").write_text("# demo\nline two\n")
    (root / "data.txt").write_text("1 2 3\n")
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    return repo


def try_git(repo: git.Repo, *args: str) -> int:
    """Run a git command expected to stop half-way (conflict); returns its exit status."""
    return repo.git.execute(["git", *args], with_exceptions=False, with_extended_output=True)[0]


@pytest.fixture
def user(tmp_path) -> git.Repo:
    """A user's checkout with another branch, a staged change, an unstaged change and an untracked file."""
    repo = init_repo(tmp_path / "user")
    root = Path(repo.working_tree_dir)
    repo.git.switch("-c", "feature")
    (root / "README.md").write_text("# demo\nfeature line\n")
    repo.git.commit("-am", "feature work")
    repo.git.switch("main")
    (root / "data.txt").write_text("1 2 3 4\n")
    repo.git.add("data.txt")
    (root / "model.py").write_text(MODEL + "# my uncommitted note\n")
    (root / "notes.txt").write_text("untracked scratch\n")
    stamp = time.time() + 5  # stale stat data: any command that refreshes the index would rewrite it
    os.utime(root / "README.md", (stamp, stamp))
    return repo


def snapshot(repo: git.Repo) -> dict:
    root, gitdir = Path(repo.working_tree_dir), Path(repo.git_dir)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] != ".git":
            files[rel.as_posix()] = (path.read_bytes(), path.stat().st_mtime_ns)
    refs = [line for line in repo.git.for_each_ref("--format=%(refname) %(objectname)").splitlines()
            if not line.startswith("refs/heads/trainbridge/")]
    return {"files": files, "refs": refs, **{name: (gitdir / name).read_bytes() for name in ("index", "HEAD", "config")}}


def workspace(repo: git.Repo, tmp_path: Path, run_id: str = "run1", **options) -> RunWorkspace:
    return RunWorkspace.create_run(open_repo(repo.working_tree_dir), run_id, workspace_root=tmp_path / "tb" / run_id,
                                   **options)


def edit(cand_path: Path, old: str, new: str, file: str = "model.py") -> None:
    target = cand_path / file
    target.write_text(target.read_text().replace(old, new))


def commits_between(repo: git.Repo, base: str, head: str) -> list[git.Commit]:
    return list(repo.iter_commits(f"{base}..{head}"))


def branches(repo: git.Repo) -> set[str]:
    return {head.name for head in repo.heads}


# ---------------------------------------------------------------- opening the user's repository


def test_snapshot_notices_an_index_refresh(user, tmp_path):
    """The byte-identity checks below can fail: a plain `git status` rewrites this fixture's index."""
    copy = git.Repo(shutil.copytree(user.working_tree_dir, tmp_path / "copy", symlinks=True))
    before = snapshot(copy)
    subprocess.run(["git", "status"], cwd=copy.working_tree_dir, check=True, capture_output=True)
    assert snapshot(copy)["index"] != before["index"]


def test_open_repo_notes_uncommitted_changes_without_touching_them(user):
    before = snapshot(user)
    info = open_repo(user.working_tree_dir)
    assert info.head_sha == user.head.commit.hexsha and info.branch == "main"
    note = " ".join(info.notes)
    assert "2 changed, 1 untracked" in note and "not part of the run" in note and info.head_sha[:12] in note
    assert snapshot(user) == before


def test_open_repo_clean_detached_and_from_a_subfolder(tmp_path):
    repo = init_repo(tmp_path / "clean")
    (Path(repo.working_tree_dir) / "pkg").mkdir()
    assert open_repo(Path(repo.working_tree_dir) / "pkg").notes == []
    repo.git.switch("--detach", "HEAD")
    info = open_repo(repo.working_tree_dir)
    assert info.branch is None and "detached" in info.notes[0]


def _bare(tmp_path):
    return git.Repo.init(tmp_path / "bare.git", bare=True).git_dir


def _empty(tmp_path):
    return git.Repo.init(tmp_path / "empty").working_tree_dir


def _orphan(tmp_path):
    repo = init_repo(tmp_path / "orphan")
    repo.git.switch("--orphan", "fresh")
    return repo.working_tree_dir


def _plain_dir(tmp_path):
    (tmp_path / "plain").mkdir()
    return tmp_path / "plain"


@pytest.mark.parametrize(("make", "kind", "says"), [
    (_plain_dir, UnsafeReason.not_a_repo, "git init"),
    (_bare, UnsafeReason.bare, "git clone"),
    (_empty, UnsafeReason.no_commits, "no commits yet"),
    (_orphan, UnsafeReason.no_commits, "'fresh' has no commits yet"),
])
def test_open_repo_refuses_repositories_without_a_base(tmp_path, make, kind, says):
    with pytest.raises(UnsafeRepoState) as caught:
        open_repo(make(tmp_path))
    assert caught.value.kind == kind and says in str(caught.value)


def _conflicting(tmp_path) -> git.Repo:
    """main and `other` both change README's second line."""
    repo = init_repo(tmp_path / "conflict")
    root = Path(repo.working_tree_dir)
    repo.git.switch("-c", "other")
    (root / "README.md").write_text("# demo\nother\n")
    repo.git.commit("-am", "other")
    repo.git.switch("main")
    (root / "README.md").write_text("# demo\nmain\n")
    repo.git.commit("-am", "main")
    return repo


def _am(repo: git.Repo) -> int:
    patch = Path(repo.working_tree_dir).parent / "other.patch"
    patch.write_text(repo.git.format_patch("-1", "other", "--stdout") + "\n")
    return try_git(repo, "am", str(patch))


def _revert(repo: git.Repo) -> int:
    (Path(repo.working_tree_dir) / "README.md").write_text("# demo\nmain again\n")
    repo.git.commit("-am", "again")
    return try_git(repo, "revert", "--no-edit", "HEAD~1")


@pytest.mark.parametrize(("start", "kind", "remedy"), [
    (lambda r: try_git(r, "merge", "other"), UnsafeReason.merging, "git merge --abort"),
    (lambda r: try_git(r, "rebase", "--merge", "other"), UnsafeReason.rebasing, "git rebase --abort"),
    (lambda r: try_git(r, "rebase", "--apply", "other"), UnsafeReason.rebasing, "git rebase --abort"),
    (_am, UnsafeReason.applying_mailbox, "git am --abort"),
    (lambda r: try_git(r, "cherry-pick", "other"), UnsafeReason.cherry_picking, "git cherry-pick --abort"),
    (_revert, UnsafeReason.reverting, "git revert --abort"),
    (lambda r: try_git(r, "bisect", "start"), UnsafeReason.bisecting, "git bisect reset"),
], ids=["merge", "rebase-merge", "rebase-apply", "am", "cherry-pick", "revert", "bisect"])
def test_open_repo_refuses_operations_in_progress(tmp_path, start, kind, remedy):
    repo = _conflicting(tmp_path)
    open_repo(repo.working_tree_dir)  # fine before
    start(repo)
    with pytest.raises(UnsafeRepoState) as caught:
        open_repo(repo.working_tree_dir)
    assert caught.value.kind == kind and remedy in caught.value.remedy
    assert "in progress" in caught.value.reason


def test_git_location_variables_in_the_environment_are_refused(user, monkeypatch):
    monkeypatch.setenv("GIT_INDEX_FILE", str(Path(user.git_dir) / "index"))
    with pytest.raises(UnsafeRepoState) as caught:
        open_repo(user.working_tree_dir)
    assert caught.value.kind == UnsafeReason.git_environment and "Unset GIT_INDEX_FILE" in str(caught.value)


def test_workspace_inside_the_checkout_is_refused(user):
    with pytest.raises(UnsafeRepoState) as caught:
        RunWorkspace.create_run(open_repo(user.working_tree_dir), "run1",
                                workspace_root=Path(user.working_tree_dir) / ".trainbridge")
    assert caught.value.kind == UnsafeReason.workspace_location
    assert not (Path(user.working_tree_dir) / ".trainbridge").exists()


def test_branch_names_never_collide_as_ref_paths():
    names = [run_branch_name("r1"), candidate_branch_name("r1", "rms.model-1"), side_branch_name("r1", "pending-npu")]
    assert names == ["trainbridge/r1", "trainbridge/r1.cand/rms.model-1", "trainbridge/r1.pending-npu"]
    for bad in ("a.b", "a/b", "-x", ""):
        with pytest.raises(ValueError):
            run_branch_name(bad)
    for bad in ("x..y", "x.lock", "a/b"):
        with pytest.raises(ValueError):
            candidate_branch_name("r1", bad)
    with pytest.raises(ValueError):
        side_branch_name("r1", "cand")


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
    admin = Path(ws._admin_dir(cand.path))
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
    assert not (Path(ws._admin_dir(side)) / "CHERRY_PICK_HEAD").exists()


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
    assert not any(p.name.endswith(".index") for p in Path(ws._admin_dir(cand.path)).iterdir()
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


class _Killed(BaseException):
    """Stands in for SIGKILL between two git commands: nothing of ours catches it, the flock is released."""


def _kill_after(monkeypatch, calls: int) -> list[int]:
    from trainbridge.tools import git_runner

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
