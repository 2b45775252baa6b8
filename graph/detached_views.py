"""Read-only, detached worktrees of a run's commits (the pending NPU head, the original base) that
the analyst or the final comparison read; never committed to, removed with the run's workspace."""

from __future__ import annotations

from pathlib import Path

from trainbridge.tools.git.ops import run_git as _git  # the one git runner: hooks off (no post-checkout here)


def detached_view(workspace, name: str, sha: str) -> Path:
    """`workspace.root/<name>` checked out, detached, at `sha` (created, or moved there)."""
    path = workspace.root / name
    if (path / ".git").exists():
        _git(path, "checkout", "-q", "--detach", "-f", sha)
    else:
        _git(workspace.repo.root, "worktree", "add", "-q", "--detach", str(path), sha)
    return path


def remove_view(workspace, name: str) -> None:
    path = workspace.root / name
    if path.exists():
        _git(workspace.repo.root, "worktree", "remove", "--force", str(path))
