"""Opening the user's repository (real temporary repositories, no mocks of git): what is noted,
what is refused and why, and the names of our branches. Helpers: tests/git_ops_support.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import git
import pytest

from trainbridge.tools.git.ops import (
    RunWorkspace,
    UnsafeReason,
    UnsafeRepoState,
    candidate_branch_name,
    open_repo,
    run_branch_name,
    side_branch_name,
)
from trainbridge.tests.git_ops_support import (  # noqa: F401 (fixtures)
    init_repo,
    no_global_git_identity,
    snapshot,
    try_git,
    user,
)


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
