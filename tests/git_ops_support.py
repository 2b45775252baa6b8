"""Shared helpers of the git-operation tests (tests/test_git_*.py): a user's checkout in a temporary
repository, its byte-level snapshot, a run workspace on it. Real git, no mocks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import git
import pytest

from trainbridge.tools.git.ops import RunWorkspace, open_repo


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
