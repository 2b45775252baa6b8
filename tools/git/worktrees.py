"""`WorkspaceFolders`: the folders of one run's workspace outside the user's checkout, and the lock
that guards them. It holds the per-workspace lock (an flock, re-entrant in one object), clears what
a killed TrainBridge process left behind in our worktrees and our refs (stale git locks, an
interrupted merge or cherry-pick), and checks branches out into worktrees or removes them, never
touching a folder that is not ours. `RunWorkspace` (tools/git/workspace.py) moves the branches.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from trainbridge.tools.git.errors import UnsafeReason, UnsafeRepoState, WorkspaceBusy
from trainbridge.tools.git.names import BRANCH_PREFIX
from trainbridge.tools.git.repo import UserRepo
from trainbridge.tools.git.runner import GitIdentity, Worktree, is_under, run_git, run_git_status, worktrees

IN_OUR_WORKTREE_STATE = ("MERGE_HEAD", "CHERRY_PICK_HEAD", "sequencer")  # what our own commands can leave


class WorkspaceFolders:
    """The worktrees of run `run_id` under `root` (a folder outside `repo`), behind one lock.

    `recovered` lists, in words, what each recovery cleared (a removed stale lock, an ended merge)."""

    def __init__(self, repo: UserRepo, run_id: str, root: Path, identity: GitIdentity, *,
                 stale_lock_age_s: float, lock_timeout_s: float) -> None:
        self.repo, self.run_id, self.root, self.identity = repo, run_id, root, identity
        self.stale_lock_age_s, self.lock_timeout_s = stale_lock_age_s, lock_timeout_s
        self.recovered: list[str] = []
        self._lock_depth = 0

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive per-workspace lock (re-entrant in this object); recovers stale git locks on entry."""
        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        (self.root / "git-state").mkdir(parents=True, exist_ok=True)
        handle = open(self.root / ".git-ops.lock", "a+")  # noqa: SIM115 - held across the with-body
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    handle.close()
                    raise WorkspaceBusy(f"Another TrainBridge process (pid {holder}) is using workspace {self.root}.",
                                        "Wait for it to finish or stop it; one process per run.") from None
                time.sleep(0.05)
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock_depth = 1
        try:
            self._recover()
            yield
        finally:
            self._lock_depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def ensure_worktree(self, branch: str, path: Path) -> bool:
        """Have `branch` checked out at `path`; returns whether a worktree was (re)created."""
        ref = f"refs/heads/{branch}"
        path = Path(os.path.realpath(path))
        for worktree in worktrees(self.repo.root):
            if worktree.ref == ref and worktree.path != path:
                if not (is_under(worktree.path, self.root) and worktree.prunable):
                    raise UnsafeRepoState(UnsafeReason.branch_checked_out,
                                          f"Branch {branch} is checked out at {worktree.path}; TrainBridge moves it "
                                          "and would change that checkout.",
                                          f"Switch that checkout to another branch (`git switch -`) or remove it "
                                          f"(`git worktree remove {worktree.path}`), then run again.")
                self.remove_worktree(worktree)
            elif worktree.path == path:
                if worktree.ref == ref and not worktree.locked and not worktree.prunable:
                    return False
                self.remove_worktree(worktree)
        if path.exists():
            self.remove_leftover(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        run_git(self.repo.root, "worktree", "add", "-q", str(path), branch, identity=self.identity)
        return True

    def remove_worktree(self, worktree: Worktree) -> None:
        if not is_under(worktree.path, self.root):
            raise AssertionError(f"refusing to remove {worktree.path}: not in {self.root}")
        status, _, _ = run_git_status(self.repo.root, "worktree", "remove", "--force", "--force", str(worktree.path),
                                      identity=self.identity)
        if status != 0:  # older git cannot remove a worktree whose folder is gone: drop only its admin entry
            for admin in (self.repo.common_dir / "worktrees").glob("*"):
                gitdir = admin / "gitdir"
                if gitdir.is_file() and Path(os.path.realpath(gitdir.read_text().strip())).parent == worktree.path:
                    shutil.rmtree(admin)
        if worktree.path.exists():
            self.remove_leftover(worktree.path)

    def remove_path(self, path: Path) -> None:
        """Remove whatever worktree of ours is at `path`, and the folder."""
        path = Path(os.path.realpath(path))
        for worktree in worktrees(self.repo.root):
            if worktree.path == path:
                self.remove_worktree(worktree)
        if path.exists():
            self.remove_leftover(path)

    def remove_leftover(self, path: Path) -> None:
        """Remove an empty folder or a half-made worktree of ours; anything else is refused."""
        if not is_under(path, self.root):
            raise AssertionError(f"refusing to remove {path}: not in {self.root}")
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif (path / ".git").is_file() and self._points_into_repo(path):
            shutil.rmtree(path)
        else:
            raise UnsafeRepoState(UnsafeReason.workspace_location,
                                  f"{path} exists and is not a TrainBridge worktree of {self.repo.root}.",
                                  "Move it away or choose another workspace directory.")

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Clear what a killed TrainBridge left behind, only in our worktrees and our refs."""
        for worktree in worktrees(self.repo.root):
            if not is_under(worktree.path, self.root) or worktree.prunable:
                continue
            admin = self.admin_dir(worktree.path)
            if admin is None:
                continue
            for name in ("index.lock", "HEAD.lock"):
                self._clear_stale(admin / name)
            if any((admin / marker).exists() for marker in IN_OUR_WORKTREE_STATE):
                if (admin / "sequencer").exists():
                    run_git_status(worktree.path, "cherry-pick", "--quit", identity=self.identity)
                run_git(worktree.path, "reset", "-q", "--merge", identity=self.identity)
                self.recovered.append(f"ended an interrupted merge/cherry-pick in {worktree.path}")
        heads = self.repo.common_dir / "refs" / "heads" / BRANCH_PREFIX.rstrip("/")
        for lock in [heads / f"{self.run_id}.lock", *heads.glob(f"{self.run_id}.*.lock"),
                     *heads.glob(f"{self.run_id}.*/**/*.lock")]:
            self._clear_stale(lock)

    def _clear_stale(self, lock: Path) -> None:
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                return
            if age >= self.stale_lock_age_s:
                lock.unlink(missing_ok=True)
                self.recovered.append(f"removed stale {lock}")
                return
            time.sleep(min(0.1, self.stale_lock_age_s - age))

    def admin_dir(self, worktree: Path) -> Path | None:
        """The git admin folder of a linked worktree of this repository, read from its `.git` file."""
        dot_git = worktree / ".git"
        if not dot_git.is_file():
            return None
        text = dot_git.read_text(errors="replace").strip()
        if not text.startswith("gitdir:"):
            return None
        admin = Path(os.path.realpath(worktree / text.removeprefix("gitdir:").strip()))
        return admin if is_under(admin, self.repo.common_dir / "worktrees") else None

    def _points_into_repo(self, path: Path) -> bool:
        text = (path / ".git").read_text(errors="replace").strip().removeprefix("gitdir:").strip()
        return is_under(path / text, self.repo.common_dir / "worktrees")
