"""The user's repository: `open_repo` validates the checkout and describes it; TrainBridge never writes
to it (its working tree, index, current branch, other branches and config stay byte-identical)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from trainbridge.records import Record
from trainbridge.tools.git.errors import UnsafeReason, UnsafeRepoState
from trainbridge.tools.git.runner import run_git, run_git_status

# Variables that would point our git commands at another repository, index or object store.
_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                  "GIT_COMMON_DIR", "GIT_NAMESPACE")


class UserRepo(Record):
    """The user's checkout as `open_repo` found it. TrainBridge never writes to it."""

    root: Path = Field(description="top of the working tree")
    git_dir: Path = Field(description="this checkout's git folder (a linked worktree has its own)")
    common_dir: Path = Field(description="the git folder shared by all worktrees: objects, refs")
    head_sha: str
    branch: str | None = Field(description="current branch, None when HEAD is detached")
    notes: list[str] = Field(default_factory=list, description="things the user should know, e.g. uncommitted work")


_IN_PROGRESS: tuple[tuple[str, UnsafeReason, str, str], ...] = (
    ("rebase-merge", UnsafeReason.rebasing, "a rebase is in progress",
     "Finish it (`git rebase --continue`) or abort it (`git rebase --abort`), then run TrainBridge again."),
    ("rebase-apply/applying", UnsafeReason.applying_mailbox, "`git am` is in progress",
     "Finish it (`git am --continue`) or abort it (`git am --abort`), then run TrainBridge again."),
    ("rebase-apply", UnsafeReason.rebasing, "a rebase (apply backend) is in progress",
     "Finish it (`git rebase --continue`) or abort it (`git rebase --abort`), then run TrainBridge again."),
    ("MERGE_HEAD", UnsafeReason.merging, "a merge is in progress",
     "Finish it (resolve conflicts, then `git commit`) or abort it (`git merge --abort`), then run TrainBridge again."),
    ("CHERRY_PICK_HEAD", UnsafeReason.cherry_picking, "a cherry-pick is in progress",
     "Finish it (`git cherry-pick --continue`) or abort it (`git cherry-pick --abort`), then run TrainBridge again."),
    ("REVERT_HEAD", UnsafeReason.reverting, "a revert is in progress",
     "Finish it (`git revert --continue`) or abort it (`git revert --abort`), then run TrainBridge again."),
    ("sequencer", UnsafeReason.sequencer, "a multi-commit cherry-pick or revert is in progress",
     "Finish it (`git cherry-pick --continue`) or stop it (`git cherry-pick --quit`), then run TrainBridge again."),
    ("BISECT_START", UnsafeReason.bisecting, "a bisect is in progress",
     "End it with `git bisect reset`, then run TrainBridge again."),
)


def _check_environment() -> None:
    set_vars = [name for name in _LOCATION_VARS if os.environ.get(name)]
    if set_vars:
        raise UnsafeRepoState(UnsafeReason.git_environment,
                              f"{', '.join(set_vars)} set in the environment would point TrainBridge's git commands "
                              "at another repository or index (is it running inside a git hook?).",
                              f"Unset {', '.join(set_vars)} and run again.")


def open_repo(path: str | Path) -> UserRepo:
    """Validate the user's checkout and describe it; refuses states where HEAD is not a clear base."""
    _check_environment()
    path = Path(path).expanduser()
    not_a_repo = UnsafeRepoState(UnsafeReason.not_a_repo, f"{path} is not inside a git repository.",
                                 "Pass your project's git checkout, or make one: `git init && git add -A && "
                                 "git commit -m 'initial'`.")
    if not path.is_dir():
        raise not_a_repo
    status, out, _ = run_git_status(path, "rev-parse", "--is-bare-repository", "--absolute-git-dir", "--git-common-dir")
    if status != 0:
        raise not_a_repo
    bare, git_dir_text, common_text = out.splitlines()
    git_dir = Path(git_dir_text)
    common_dir = Path(os.path.realpath(path / common_text))  # relative to `path` when git says so
    status, top, _ = run_git_status(path, "rev-parse", "--show-toplevel")
    if bare == "true" or status != 0 or not top:
        raise UnsafeRepoState(UnsafeReason.bare, f"{git_dir} is a bare repository (no working tree).",
                              "Clone it (`git clone <bare-repo> <dir>`) and pass that checkout.")
    root = Path(top)
    for marker, kind, what, remedy in _IN_PROGRESS:
        if (git_dir / marker).exists():
            raise UnsafeRepoState(kind, f"In {root}, {what}: HEAD is not a finished commit "
                                  "TrainBridge can start from.", remedy)
    found, branch_name, _ = run_git_status(root, "symbolic-ref", "-q", "--short", "HEAD")
    branch = branch_name if found == 0 else None
    status, head_sha, _ = run_git_status(root, "rev-parse", "--verify", "-q", "HEAD^{commit}")
    if status != 0:
        has_commits = bool(run_git(root, "for-each-ref", "--count=1", "refs/heads/"))
        what = (f"branch '{branch or 'HEAD'}' has no commits yet (an orphan branch)" if has_commits
                else "the repository has no commits yet")
        raise UnsafeRepoState(UnsafeReason.no_commits, f"In {root}, {what}.",
                              "Commit your code first (`git add -A && git commit -m 'baseline'`) or switch to a "
                              "branch that has commits; TrainBridge starts from a commit.")
    notes = []
    if branch is None:
        notes.append(f"HEAD is detached at {head_sha[:12]}; the run starts from that commit.")
    status = run_git(root, "--no-optional-locks", "status", "--porcelain=v1", "-z", "--no-renames",
                  "--untracked-files=normal")
    entries = [e for e in status.split("\0") if len(e) > 3 and e[2] == " "]
    untracked = sum(1 for e in entries if e.startswith("??"))
    changed = len(entries) - untracked
    if changed or untracked:
        notes.append(f"Uncommitted changes ({changed} changed, {untracked} untracked file(s)) are not part of the "
                     f"run: it starts from the last commit {head_sha[:12]} (HEAD). TrainBridge never touches them; "
                     "commit them first if the run should include them.")
    if (root / ".gitmodules").exists():
        notes.append("Submodules are not checked out in TrainBridge's worktrees.")
    return UserRepo(root=root, git_dir=git_dir, common_dir=common_dir, head_sha=head_sha, branch=branch, notes=notes)


def new_repository(root: Path, message: str, *, branch: str = "main") -> str:
    """Make the folder `root` (one TrainBridge wrote: a port's copy) a git repository whose first commit holds its files
    (the ones its .gitignore does not leave out); returns that commit's SHA."""
    from trainbridge.tools.git.runner import run_git

    run_git(root, "init", "-q", f"--initial-branch={branch}")
    run_git(root, "add", "-A")
    run_git(root, "commit", "-q", "--allow-empty", "-m", message)
    return run_git(root, "rev-parse", "HEAD")


def commit_everything(root: Path, message: str) -> str | None:
    """Commit every change in the repository at `root` (one TrainBridge made, never the user's); its SHA, or None
    when nothing changed."""
    from trainbridge.tools.git.runner import run_git

    run_git(root, "add", "-A")
    if not run_git(root, "status", "--porcelain", "--untracked-files=all"):
        return None
    run_git(root, "commit", "-q", "-m", message)
    return run_git(root, "rev-parse", "HEAD")
