"""Git operations for a TrainBridge run: run branch, candidate branches, worktrees.

The user's repository is never modified where they can see it: their working tree, index,
current branch, other branches and config stay byte-identical. TrainBridge only
- reads the user's checkout (plumbing, and `status` with `--no-optional-locks` so that not even
  the index's stat cache is rewritten),
- creates, moves and deletes refs under ``refs/heads/trainbridge/`` (every write is checked
  against that prefix, so nothing else can be reset, deleted or rewritten),
- adds linked worktrees under a workspace directory the caller gives, outside the user's tree
  (git keeps their admin files in ``.git/worktrees/``).

Branch names and the run-id rule: tools/git_names.py (re-exported here).

Every git call is an argument list through GitPython, with a fixed identity in the environment
and ``-c`` (CI has no global identity; the user's config is never written), hooks off, commit
signing off and automatic gc/maintenance off (our commands never run housekeeping on the user's
repository).

Crash-safety (a process killed at any point; calling the same operation again completes it):
- One TrainBridge process at a time per workspace: an ``flock`` on ``<workspace>/.git-ops.lock``
  (released by the kernel when the holder dies). Holding it, any ``index.lock``/``HEAD.lock``
  in the git admin folder of one of *our* worktrees, or a ``.lock`` of one of this run's refs,
  was left by a killed git and is removed once it is ``stale_lock_age_s`` old (a git child of a
  killed parent may still be finishing). Lock files anywhere else are never touched.
- Commits carry the trailers ``TrainBridge-Candidate: <name>`` and ``TrainBridge-Run: <id>``.
  `commit_candidate` stages everything, writes the tree, and reuses the candidate's existing
  commit when it has the same parent and tree (killed after the commit: no duplicate); it
  otherwise squashes its own earlier commits into one (killed between ``reset --soft`` and
  ``commit``: the next call commits once). A previous attempt's commit is remembered by
  `start_candidate`, so redoing the same edit after a restart gives back the same SHA.
- `accept_candidate` moves the run ref with a compare-and-swap ``update-ref`` and then deletes
  the candidate; a candidate already reachable from the run head, or already deleted but found
  by its trailer in the run's history, is reported as already accepted.
- `push_to_branch` finds an earlier push by the trailer on the side branch.
- Worktrees left half-made (locked "initializing", directory deleted, wrong branch) are removed
  and re-added; interrupted cherry-picks in our worktrees are reset.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import git
from pydantic import Field

from trainbridge.records import Record
from trainbridge.tools.git_names import (  # noqa: F401 - re-exported: the git layer's names
    BRANCH_PREFIX,
    RUN_ID_RULE,
    TRAILER_CANDIDATE,
    TRAILER_RUN,
    candidate_branch_name,
    check_name,
    check_run_id,
    run_branch_name,
    side_branch_name,
)

# Variables that would point our git commands at another repository, index or object store.
_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                  "GIT_COMMON_DIR", "GIT_NAMESPACE")
_SAFE_CONFIG = ("-c", "gc.auto=0", "-c", "maintenance.auto=false", "-c", "core.hooksPath=/dev/null",
                "-c", "commit.gpgsign=false", "-c", "core.fsmonitor=false", "-c", "advice.detachedHead=false",
                "-c", "log.showSignature=false", "-c", "color.ui=false", "-c", "core.quotePath=false",
                # output we parse must not depend on the user's config: diffs always say a/ and b/,
                # never colour, never relative to a subdirectory, never through an external driver
                "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "diff.relative=false",
                "-c", "diff.external=", "-c", "color.diff=false", "-c", "color.status=false",
                "-c", "color.branch=false", "-c", "core.pager=cat", "-c", "tag.gpgSign=false")
_IN_OUR_WORKTREE_STATE = ("MERGE_HEAD", "CHERRY_PICK_HEAD", "sequencer")  # what our own commands can leave


# ---------------------------------------------------------------- errors


class UnsafeReason(StrEnum):
    not_a_repo = "not_a_repo"
    bare = "bare"
    no_commits = "no_commits"
    merging = "merging"
    rebasing = "rebasing"
    applying_mailbox = "applying_mailbox"
    cherry_picking = "cherry_picking"
    reverting = "reverting"
    sequencer = "sequencer"
    bisecting = "bisecting"
    git_environment = "git_environment"
    workspace_location = "workspace_location"
    branch_checked_out = "branch_checked_out"
    unrelated_run_branch = "unrelated_run_branch"
    foreign_commit = "foreign_commit"


class GitOpsError(Exception):
    """A git operation TrainBridge refused or could not do: `reason` says what, `remedy` what to do."""

    def __init__(self, reason: str, remedy: str) -> None:
        super().__init__(f"{reason} {remedy}")
        self.reason, self.remedy = reason, remedy


class UnsafeRepoState(GitOpsError):
    def __init__(self, kind: UnsafeReason, reason: str, remedy: str) -> None:
        super().__init__(reason, remedy)
        self.kind = kind


class NotFastForward(GitOpsError):
    pass


class CandidateNotFound(GitOpsError):
    pass


class NothingToAccept(GitOpsError):
    pass


class CandidateConflict(GitOpsError):
    def __init__(self, reason: str, remedy: str, paths: list[str]) -> None:
        super().__init__(reason, remedy)
        self.paths = paths


class WorkspaceBusy(GitOpsError):
    pass


class GitCommandFailed(GitOpsError):
    def __init__(self, argv: list[str], status: int, stderr: str) -> None:
        super().__init__(f"`{' '.join(argv)}` failed (exit {status}): {stderr.strip()}",
                         "Fix what git reports above and run again; the operation is safe to repeat.")
        self.argv, self.status, self.stderr = argv, status, stderr


# ---------------------------------------------------------------- typed results


class GitIdentity(Record):
    name: str = "TrainBridge"
    email: str = "trainbridge@localhost"


class RunInfo(Record):
    run_id: str
    branch: str
    base_sha: str
    head_sha: str
    worktree: Path
    created_branch: bool
    created_worktree: bool
    notes: list[str] = Field(default_factory=list)


class CandidateWorkspace(Record):
    run_id: str
    name: str
    branch: str
    path: Path = Field(description="the candidate's own worktree; edit files here")
    base_sha: str = Field(description="run head the candidate starts from")
    reset_from: str | None = Field(default=None, description="head of a reused candidate before it was reset")


class CommitResult(Record):
    candidate: str
    branch: str
    base_sha: str
    sha: str | None = Field(description="the candidate commit; None when there was nothing to commit")
    created: bool = Field(description="True when this call made a new commit")
    empty: bool = Field(description="True when the worktree has no changes against the base")
    already_accepted: bool = False
    replaced: list[str] = Field(default_factory=list, description="earlier TrainBridge commits squashed away")
    files: list[str] = Field(default_factory=list)


class AcceptResult(Record):
    candidate: str
    sha: str
    previous_head: str
    run_head: str
    already_accepted: bool


class RejectResult(Record):
    candidate: str
    deleted_sha: str | None
    existed: bool


class PushResult(Record):
    candidate: str
    branch: str
    sha: str | None
    source_sha: str | None
    created: bool
    fast_forward: bool = False
    empty: bool = False
    candidate_removed: bool = False


class CleanupResult(Record):
    removed_worktrees: list[Path]
    kept_branches: list[str]


# ---------------------------------------------------------------- running git


def run_git(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
            strip: bool = True) -> str:
    """The one door to git: `git <args>` in `cwd` with hooks, signing, housekeeping and the user's
    output-shaping config off, as `identity`; its stdout, or GitCommandFailed."""
    return _git(cwd, *args, identity=identity, env=env, strip=strip)


def run_git_status(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
                   strip: bool = True) -> tuple[int, str, str]:
    """As `run_git`, returning (exit status, stdout, stderr) instead of raising."""
    return _git_status(cwd, *args, identity=identity, env=env, strip=strip)


def _git(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
         strip: bool = True) -> str:
    status, out, err = _git_status(cwd, *args, identity=identity, env=env, strip=strip)
    if status != 0:
        raise GitCommandFailed(["git", *args], status, err)
    return out


def _git_status(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
                strip: bool = True) -> tuple[int, str, str]:
    ident = identity or GitIdentity()
    argv = ["git", *_SAFE_CONFIG, "-c", f"user.name={ident.name}", "-c", f"user.email={ident.email}", *args]
    full_env = {"GIT_AUTHOR_NAME": ident.name, "GIT_AUTHOR_EMAIL": ident.email, "GIT_COMMITTER_NAME": ident.name,
                "GIT_COMMITTER_EMAIL": ident.email, "GIT_TERMINAL_PROMPT": "0", "GIT_EDITOR": "true",
                "GIT_SEQUENCE_EDITOR": "true", "GIT_MERGE_AUTOEDIT": "no", **(env or {})}
    return git.Git(str(cwd)).execute(argv, env=full_env, with_extended_output=True, with_exceptions=False,
                                     strip_newline_in_stdout=strip)


def ref_sha(repo_root: Path, branch: str) -> str | None:
    """The commit branch `refs/heads/<branch>` points at in the repository, None when it does not exist."""
    status, out, _ = _git_status(repo_root, "rev-parse", "--verify", "-q", f"refs/heads/{branch}")
    return out if status == 0 else None


def _under(path: Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


# ---------------------------------------------------------------- the user's repository


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
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise UnsafeRepoState(UnsafeReason.not_a_repo, f"{path} is not inside a git repository.",
                              "Pass your project's git checkout, or make one: `git init && git add -A && "
                              "git commit -m 'initial'`.") from None
    with contextlib.closing(repo):
        if repo.bare or repo.working_tree_dir is None:
            raise UnsafeRepoState(UnsafeReason.bare, f"{repo.git_dir} is a bare repository (no working tree).",
                                  "Clone it (`git clone <bare-repo> <dir>`) and pass that checkout.")
        git_dir, common_dir = Path(repo.git_dir), Path(repo.common_dir)
        for marker, kind, what, remedy in _IN_PROGRESS:
            if (git_dir / marker).exists():
                raise UnsafeRepoState(kind, f"In {repo.working_tree_dir}, {what}: HEAD is not a finished commit "
                                      "TrainBridge can start from.", remedy)
        if not repo.head.is_valid():
            branch = repo.head.reference.name if not repo.head.is_detached else "HEAD"
            has_commits = bool(_git(Path(repo.working_tree_dir), "for-each-ref", "--count=1", "refs/heads/"))
            what = (f"branch '{branch}' has no commits yet (an orphan branch)" if has_commits
                    else "the repository has no commits yet")
            raise UnsafeRepoState(UnsafeReason.no_commits, f"In {repo.working_tree_dir}, {what}.",
                                  "Commit your code first (`git add -A && git commit -m 'baseline'`) or switch to a "
                                  "branch that has commits; TrainBridge starts from a commit.")
        root = Path(repo.working_tree_dir)
        head_sha = repo.head.commit.hexsha
        branch = None if repo.head.is_detached else repo.head.reference.name
    notes = []
    if branch is None:
        notes.append(f"HEAD is detached at {head_sha[:12]}; the run starts from that commit.")
    status = _git(root, "--no-optional-locks", "status", "--porcelain=v1", "-z", "--no-renames",
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


# ---------------------------------------------------------------- commits and worktrees (helpers)


@dataclass(frozen=True)
class Commit:
    """One commit as `commits` reads it."""

    sha: str
    parents: tuple[str, ...]
    tree: str
    message: str

    def candidate(self) -> str | None:
        """The TrainBridge-Candidate trailer of the message's last paragraph, if any."""
        last = self.message.strip().split("\n\n")[-1]
        match = re.search(rf"^{TRAILER_CANDIDATE}: *(\S+) *$", last, re.MULTILINE)
        return match.group(1) if match else None


@dataclass(frozen=True)
class _Worktree:
    path: Path
    ref: str | None
    locked: bool
    prunable: bool


def commits(cwd: Path, *revs: str) -> list[Commit]:
    """The commits `git log <revs>` lists in `cwd`, newest first."""
    out = _git(cwd, "log", "--format=%H%x00%P%x00%T%x00%B%x1e", *revs, "--")
    commits = []
    for record in out.split("\x1e"):
        if record.strip():
            sha, parents, tree, message = record.lstrip("\n").split("\0", 3)
            commits.append(Commit(sha, tuple(parents.split()), tree, message))
    return commits


def _worktrees(cwd: Path) -> list[_Worktree]:
    result = []
    for block in _git(cwd, "worktree", "list", "--porcelain").split("\n\n"):
        fields = [line.partition(" ") for line in block.splitlines() if line]
        info = {key: value for key, _, value in fields}
        if "worktree" in info:
            path = Path(os.path.realpath(info["worktree"]))  # git < 2.31 does not say "prunable" itself
            result.append(_Worktree(path, info.get("branch"), "locked" in info,
                                    "prunable" in info or not (path / ".git").exists()))
    return result


class RunWorkspace:
    """The run branch and its candidates, each in its own worktree under `workspace_root`.

    Build it with `RunWorkspace.create_run(...)`; calling that again for the same run id (in this
    or another process) reuses the branch and worktree, which is how a resumed run continues: pass
    the recorded `info.base_sha` as `base` when the user's HEAD may have moved since. Candidate
    names identify commits (by trailer) for idempotency, so keep them unique within a run.
    """

    def __init__(self, repo: UserRepo, run_id: str, workspace_root: Path, *, identity: GitIdentity | None = None,
                 stale_lock_age_s: float = 5.0, lock_timeout_s: float = 10.0) -> None:
        self.repo, self.run_id = repo, check_run_id(run_id)
        self.root = Path(os.path.realpath(Path(workspace_root).expanduser()))
        if _under(self.root, repo.root) or _under(repo.root, self.root) or _under(self.root, repo.common_dir):
            raise UnsafeRepoState(UnsafeReason.workspace_location,
                                  f"Workspace {self.root} overlaps the repository at {repo.root}; TrainBridge's "
                                  "worktrees would show up in (or swallow) your checkout.",
                                  "Choose a workspace directory outside the repository, "
                                  "e.g. ~/.trainbridge/runs/<run-id>.")
        self.identity = identity or GitIdentity()
        self.stale_lock_age_s, self.lock_timeout_s = stale_lock_age_s, lock_timeout_s
        self.branch = run_branch_name(run_id)
        self.worktree = self.root / "run"
        self.info: RunInfo | None = None
        self.recovered: list[str] = []
        self.made_shas: list[str] = []
        self._lock_depth = 0

    # -- public API ------------------------------------------------------------------------

    @classmethod
    def create_run(cls, repo: UserRepo, run_id: str, base: str = "HEAD", *, workspace_root: Path,
                   **options) -> RunWorkspace:
        workspace = cls(repo, run_id, workspace_root, **options)
        workspace.info = workspace._create(base)
        return workspace

    def start_candidate(self, name: str) -> CandidateWorkspace:
        """Branch + worktree for candidate `name` at the run head; a reused one is reset to it."""
        branch = candidate_branch_name(self.run_id, name)
        with self.locked():
            run_head = self._run_head()
            current = self.ref_sha(branch)
            if current is None:
                self.update_ref(branch, run_head, "", f"start candidate {name}")
            self._ensure_worktree(branch, self._cand_path(name))
            reset_from = None
            if current is not None:
                if current != run_head:
                    reset_from = current
                    last = commits(self.repo.root, "-1", current)[0]
                    if last.candidate() == name:
                        self._state_file(name).write_text(current)
                self.git(self._cand_path(name), "reset", "-q", "--hard", run_head)
                self.git(self._cand_path(name), "clean", "-fdq")
            return CandidateWorkspace(run_id=self.run_id, name=name, branch=branch, path=self._cand_path(name),
                                      base_sha=run_head, reset_from=reset_from)

    def commit_candidate(self, name: str, message: str) -> CommitResult:
        """Commit everything in the candidate's worktree as one commit; safe to call again."""
        branch = candidate_branch_name(self.run_id, name)
        with self.locked():
            run_head = self._run_head()
            current = self.ref_sha(branch)
            if current is None:
                found = self._find_in_run(name)
                if found:
                    return CommitResult(candidate=name, branch=branch, base_sha=found.parents[0], sha=found.sha,
                                        created=False, empty=False, already_accepted=True)
                raise self._not_found(name)
            path = self._cand_path(name)
            self._ensure_worktree(branch, path)
            base = self._merge_base(current, run_head)
            if current == base != run_head:
                found = self._find_in_run(name)
                if found is not None and found.sha == current:  # accepted; killed before the candidate was removed
                    return CommitResult(candidate=name, branch=branch, base_sha=found.parents[0], sha=current,
                                        created=False, empty=False, already_accepted=True)
            above = commits(self.repo.root, current, "--not", base)
            self._refuse_foreign(name, above)
            self.git(path, "add", "-A")
            tree = self.git(path, "write-tree")
            previous = self._state_file(name)
            reusable = above[:1] if len(above) == 1 else []
            if previous.exists() and self._is_commit(previous.read_text().strip()):
                reusable += commits(self.repo.root, "-1", previous.read_text().strip())
            for commit in reusable:
                if commit.tree == tree and commit.parents == (base,) and commit.candidate() == name:
                    if commit.sha != current:
                        self.git(path, "reset", "-q", "--soft", commit.sha)
                    return CommitResult(candidate=name, branch=branch, base_sha=base, sha=commit.sha, created=False,
                                        empty=False, files=self._changed_files(base, commit.sha))
            if current != base:
                self.git(path, "reset", "-q", "--soft", base)
            if tree == self.git(path, "rev-parse", f"{base}^{{tree}}"):
                return CommitResult(candidate=name, branch=branch, base_sha=base, sha=None, created=False,
                                    empty=True, replaced=[c.sha for c in above])
            body = "\n".join(line for line in message.strip().splitlines()
                             if not line.startswith((f"{TRAILER_CANDIDATE}:", f"{TRAILER_RUN}:")))
            trailers = f"{TRAILER_CANDIDATE}: {name}\n{TRAILER_RUN}: {self.run_id}"
            self.git(path, "commit", "-q", "--no-verify", "--cleanup=whitespace", "-m",
                     body or f"TrainBridge candidate {name}", "-m", trailers)
            sha = self.git(path, "rev-parse", "HEAD")
            self.made_shas.append(sha)
            return CommitResult(candidate=name, branch=branch, base_sha=base, sha=sha, created=True, empty=False,
                                replaced=[c.sha for c in above], files=self._changed_files(base, sha))

    def candidate_diff(self, name: str, *, include_uncommitted: bool = False) -> str:
        """Unified diff of the candidate against the run head it started from."""
        branch = candidate_branch_name(self.run_id, name)
        with self.locked():
            current = self.ref_sha(branch)
            if current is None:
                raise self._not_found(name)
            base = self._merge_base(current, self._run_head())
            target = current
            if include_uncommitted:
                path = self._cand_path(name)
                self._ensure_worktree(branch, path)
                index = Path(self.git(path, "rev-parse", "--absolute-git-dir")) / "trainbridge-diff.index"
                env = {"GIT_INDEX_FILE": str(index)}
                try:
                    self.git(path, "read-tree", "HEAD", env=env)
                    self.git(path, "add", "-A", env=env)
                    target = self.git(path, "write-tree", env=env)
                finally:
                    index.unlink(missing_ok=True)
            return _git(self.repo.root, "diff", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/",
                        base, target, identity=self.identity, strip=False)

    def accept_candidate(self, name: str) -> AcceptResult:
        """Fast-forward the run branch to the candidate's commit, then delete the candidate."""
        branch = candidate_branch_name(self.run_id, name)
        with self.locked():
            run_head = self._run_head()
            current = self.ref_sha(branch)
            if current is None:
                found = self._find_in_run(name)
                if found is None:
                    raise self._not_found(name)
                self._sync_run_worktree()
                return AcceptResult(candidate=name, sha=found.sha, previous_head=found.parents[0], run_head=run_head,
                                    already_accepted=True)
            if self._is_ancestor(current, run_head):
                found = self._find_in_run(name)
                if found is None or found.sha != current:
                    raise NothingToAccept(f"Candidate {name} has no commit on top of the run head.",
                                          "Edit its worktree and call commit_candidate first, or reject it.")
                self._sync_run_worktree()
                self._remove_candidate(name)
                return AcceptResult(candidate=name, sha=current, previous_head=found.parents[0], run_head=run_head,
                                    already_accepted=True)
            if not self._is_ancestor(run_head, current):
                raise NotFastForward(f"Run branch {self.branch} moved to {run_head[:12]} after candidate {name} "
                                     f"started from {self._merge_base(current, run_head)[:12]}; accepting it "
                                     "would not be a fast-forward.",
                                     f"Call start_candidate({name!r}) to redo it on the new run head, or reject it.")
            self._refuse_foreign(name, commits(self.repo.root, current, "--not", run_head), single=True)
            self.update_ref(self.branch, current, run_head, f"accept candidate {name}")
            self._sync_run_worktree()
            self._remove_candidate(name)
            return AcceptResult(candidate=name, sha=current, previous_head=run_head, run_head=current,
                                already_accepted=False)

    def reject_candidate(self, name: str) -> RejectResult:
        """Delete the candidate's worktree and branch (whatever state they are in)."""
        with self.locked():
            deleted = self._remove_candidate(name)
            return RejectResult(candidate=name, deleted_sha=deleted, existed=deleted is not None)

    def push_to_branch(self, name: str, suffix: str = "pending-npu", *, remove_candidate: bool = True) -> PushResult:
        """Put the candidate's commit on the run-owned side branch `<run branch>.<suffix>`."""
        side = side_branch_name(self.run_id, suffix)
        branch = candidate_branch_name(self.run_id, name)
        with self.locked():
            run_head = self._run_head()
            side_head = self.ref_sha(side)
            current = self.ref_sha(branch)
            done = next((c for c in commits(self.repo.root, side_head, "--not", run_head)
                         if c.candidate() == name), None) if side_head else None
            if done is not None:
                removed = remove_candidate and self._remove_candidate(name) is not None
                return PushResult(candidate=name, branch=side, sha=done.sha, source_sha=current, created=False,
                                  candidate_removed=removed)
            if current is None:
                raise self._not_found(name)
            base = self._merge_base(current, run_head)
            self._refuse_foreign(name, commits(self.repo.root, current, "--not", base), single=True)
            if side_head is None:
                self.update_ref(side, run_head, "", f"create {suffix} branch")
                side_head = run_head
            path = self.root / "branches" / suffix
            self._ensure_worktree(side, path)
            self.git(path, "reset", "-q", "--hard", "HEAD")
            fast_forward = self._is_ancestor(side_head, current)
            if fast_forward:
                self.git(path, "merge", "-q", "--ff-only", current)
            else:
                status, _, err = _git_status(path, "cherry-pick", current, identity=self.identity)
                if status != 0:
                    conflicts = self.git(path, "diff", "--name-only", "--diff-filter=U").split()
                    self.git(path, "reset", "-q", "--hard", "HEAD")
                    if conflicts:
                        raise CandidateConflict(f"Candidate {name} does not apply on {side}: conflicts in "
                                                f"{', '.join(conflicts)}.", "Redo the candidate on that branch's "
                                                "head, or keep it on its own branch.", conflicts)
                    if "empty" not in err:
                        raise GitCommandFailed(["git", "cherry-pick", current], status, err)
                    return PushResult(candidate=name, branch=side, sha=None, source_sha=current, created=False,
                                      empty=True)
            sha = self.git(path, "rev-parse", "HEAD")
            if not fast_forward:
                self.made_shas.append(sha)
            removed = remove_candidate and self._remove_candidate(name) is not None
            return PushResult(candidate=name, branch=side, sha=sha, source_sha=current, created=True,
                              fast_forward=fast_forward, candidate_removed=removed)

    def cleanup(self) -> CleanupResult:
        """Remove every worktree of this run (their branches stay)."""
        with self.locked():
            removed = []
            for worktree in _worktrees(self.repo.root):
                if _under(worktree.path, self.root):
                    self._remove_worktree(worktree)
                    removed.append(worktree.path)
            for folder in (self.root / "candidates", self.root / "branches"):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            refs = _git(self.repo.root, "for-each-ref", "--format=%(refname:short)", f"refs/heads/{self.branch}",
                        f"refs/heads/{self.branch}.*", f"refs/heads/{self.branch}.*/*").split()
            return CleanupResult(removed_worktrees=removed, kept_branches=sorted(set(refs)))

    @property
    def head_sha(self) -> str:
        return self._run_head()

    # -- internals -------------------------------------------------------------------------

    def _create(self, base: str) -> RunInfo:
        if base.startswith("-"):
            raise ValueError(f"base {base!r} is not a revision")
        with self.locked():
            status, base_sha, _ = _git_status(self.repo.root, "rev-parse", "--verify", "-q", f"{base}^{{commit}}")
            if status != 0:
                raise GitOpsError(f"Base {base!r} is not a commit in {self.repo.root}.",
                                  "Pass a branch, tag or commit SHA that exists.")
            run_file = self.root / "git-state" / "run.json"
            recorded = json.loads(run_file.read_text()) if run_file.exists() else {}
            if recorded and recorded.get("repo") != str(self.repo.root):
                raise UnsafeRepoState(UnsafeReason.workspace_location,
                                      f"Workspace {self.root} belongs to the repository at {recorded.get('repo')}.",
                                      "Use another workspace directory for this repository.")
            head = self.ref_sha(self.branch)
            created_branch = head is None
            if head is None:
                self.update_ref(self.branch, base_sha, "", f"create run from {base}")
                head = base_sha
            elif not self._is_ancestor(base_sha, head):
                hint = f" It was started from {recorded['base_sha'][:12]}." if recorded.get("base_sha") else ""
                raise UnsafeRepoState(UnsafeReason.unrelated_run_branch,
                                      f"Branch {self.branch} exists at {head[:12]}, which does not descend from the "
                                      f"base {base_sha[:12]}.{hint}",
                                      "To resume that run pass the base it was started from; to start afresh pick a "
                                      f"new run id (or delete the branch: `git branch -D {self.branch}`).")
            created_worktree = self._ensure_worktree(self.branch, self.worktree)
            self._sync_run_worktree()
            if not recorded:
                run_file.write_text(json.dumps({"run_id": self.run_id, "repo": str(self.repo.root),
                                                "base_sha": base_sha}))
            return RunInfo(run_id=self.run_id, branch=self.branch, base_sha=recorded.get("base_sha", base_sha),
                           head_sha=head, worktree=self.worktree, created_branch=created_branch,
                           created_worktree=created_worktree, notes=list(self.repo.notes))

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

    def _recover(self) -> None:
        """Clear what a killed TrainBridge left behind, only in our worktrees and our refs."""
        for worktree in _worktrees(self.repo.root):
            if not _under(worktree.path, self.root) or worktree.prunable:
                continue
            admin = self._admin_dir(worktree.path)
            if admin is None:
                continue
            for name in ("index.lock", "HEAD.lock"):
                self._clear_stale(admin / name)
            if any((admin / marker).exists() for marker in _IN_OUR_WORKTREE_STATE):
                if (admin / "sequencer").exists():
                    _git_status(worktree.path, "cherry-pick", "--quit", identity=self.identity)
                self.git(worktree.path, "reset", "-q", "--merge")
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

    def _admin_dir(self, worktree: Path) -> Path | None:
        """The git admin folder of a linked worktree of this repository, read from its `.git` file."""
        dot_git = worktree / ".git"
        if not dot_git.is_file():
            return None
        text = dot_git.read_text(errors="replace").strip()
        if not text.startswith("gitdir:"):
            return None
        admin = Path(os.path.realpath(worktree / text.removeprefix("gitdir:").strip()))
        return admin if _under(admin, self.repo.common_dir / "worktrees") else None

    def _ensure_worktree(self, branch: str, path: Path) -> bool:
        """Have `branch` checked out at `path`; returns whether a worktree was (re)created."""
        ref = f"refs/heads/{branch}"
        path = Path(os.path.realpath(path))
        for worktree in _worktrees(self.repo.root):
            if worktree.ref == ref and worktree.path != path:
                if not (_under(worktree.path, self.root) and worktree.prunable):
                    raise UnsafeRepoState(UnsafeReason.branch_checked_out,
                                          f"Branch {branch} is checked out at {worktree.path}; TrainBridge moves it "
                                          "and would change that checkout.",
                                          f"Switch that checkout to another branch (`git switch -`) or remove it "
                                          f"(`git worktree remove {worktree.path}`), then run again.")
                self._remove_worktree(worktree)
            elif worktree.path == path:
                if worktree.ref == ref and not worktree.locked and not worktree.prunable:
                    return False
                self._remove_worktree(worktree)
        if path.exists():
            self._remove_leftover(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _git(self.repo.root, "worktree", "add", "-q", str(path), branch, identity=self.identity)
        return True

    def _remove_worktree(self, worktree: _Worktree) -> None:
        if not _under(worktree.path, self.root):
            raise AssertionError(f"refusing to remove {worktree.path}: not in {self.root}")
        status, _, _ = _git_status(self.repo.root, "worktree", "remove", "--force", "--force", str(worktree.path),
                                   identity=self.identity)
        if status != 0:  # older git cannot remove a worktree whose folder is gone: drop only its admin entry
            for admin in (self.repo.common_dir / "worktrees").glob("*"):
                gitdir = admin / "gitdir"
                if gitdir.is_file() and Path(os.path.realpath(gitdir.read_text().strip())).parent == worktree.path:
                    shutil.rmtree(admin)
        if worktree.path.exists():
            self._remove_leftover(worktree.path)

    def _remove_leftover(self, path: Path) -> None:
        if not _under(path, self.root):
            raise AssertionError(f"refusing to remove {path}: not in {self.root}")
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif (path / ".git").is_file() and self._points_into_repo(path):
            shutil.rmtree(path)
        else:
            raise UnsafeRepoState(UnsafeReason.workspace_location,
                                  f"{path} exists and is not a TrainBridge worktree of {self.repo.root}.",
                                  "Move it away or choose another workspace directory.")

    def _points_into_repo(self, path: Path) -> bool:
        text = (path / ".git").read_text(errors="replace").strip().removeprefix("gitdir:").strip()
        return _under(path / text, self.repo.common_dir / "worktrees")

    def _remove_candidate(self, name: str) -> str | None:
        branch = candidate_branch_name(self.run_id, name)
        path = Path(os.path.realpath(self._cand_path(name)))
        for worktree in _worktrees(self.repo.root):
            if worktree.path == path:
                self._remove_worktree(worktree)
        if path.exists():
            self._remove_leftover(path)
        current = self.ref_sha(branch)
        if current is not None:
            self.update_ref(branch, None, current, f"remove candidate {name}")
        self._state_file(name).unlink(missing_ok=True)
        return current

    def _sync_run_worktree(self) -> None:
        if (self.worktree / ".git").exists():
            self.git(self.worktree, "reset", "-q", "--hard", "HEAD")

    def _refuse_foreign(self, name: str, commits: list[Commit], *, single: bool = False) -> None:
        foreign = [c.sha[:12] for c in commits if c.candidate() != name]
        if foreign:
            raise UnsafeRepoState(UnsafeReason.foreign_commit,
                                  f"Candidate {name} has commits TrainBridge did not make for it "
                                  f"({', '.join(foreign)}); TrainBridge never rewrites commits it did not make.",
                                  "Move those commits to a branch of your own, then reject or restart the candidate.")
        if single and len(commits) != 1:
            raise NothingToAccept(f"Candidate {name} has {len(commits)} commits on top of its base, not one.",
                                  "Call commit_candidate, which leaves exactly one commit.")

    def _find_in_run(self, name: str) -> Commit | None:
        recorded = json.loads((self.root / "git-state" / "run.json").read_text())
        return next((c for c in commits(self.repo.root, self._run_head(), "--not", recorded["base_sha"])
                     if c.candidate() == name), None)

    def _not_found(self, name: str) -> CandidateNotFound:
        return CandidateNotFound(f"Run {self.run_id} has no candidate {name!r} (branch "
                                 f"{candidate_branch_name(self.run_id, name)} does not exist).",
                                 f"Call start_candidate({name!r}) first.")

    def update_ref(self, branch: str, new: str | None, old: str, why: str) -> None:
        """Compare-and-swap a branch we own: create (old=""), move, or delete (new=None)."""
        if not branch.startswith(BRANCH_PREFIX):
            raise AssertionError(f"refusing to write {branch}: only {BRANCH_PREFIX}* refs are TrainBridge's")
        args = ["-d", f"refs/heads/{branch}", old] if new is None else [f"refs/heads/{branch}", new, old]
        _git(self.repo.root, "update-ref", "-m", f"trainbridge: {why}", *args, identity=self.identity)

    def git(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
        """Run git in `cwd` (one of this run's worktrees or the repository) as this run's identity."""
        return _git(cwd, *args, identity=self.identity, env=env)

    def ref_sha(self, branch: str) -> str | None:
        return ref_sha(self.repo.root, branch)

    def _run_head(self) -> str:
        head = self.ref_sha(self.branch)
        if head is None:
            raise GitOpsError(f"Run branch {self.branch} does not exist.", "Call RunWorkspace.create_run first.")
        return head

    def _merge_base(self, a: str, b: str) -> str:
        return _git(self.repo.root, "merge-base", a, b)

    def _is_commit(self, sha: str) -> bool:
        return _git_status(self.repo.root, "cat-file", "-e", f"{sha}^{{commit}}")[0] == 0

    def _is_ancestor(self, a: str, b: str) -> bool:
        return _git_status(self.repo.root, "merge-base", "--is-ancestor", a, b)[0] == 0

    def _changed_files(self, a: str, b: str) -> list[str]:
        return [f for f in _git(self.repo.root, "diff", "--name-only", "--no-renames", a, b).split("\n") if f]

    def _cand_path(self, name: str) -> Path:
        return self.root / "candidates" / name

    def _state_file(self, name: str) -> Path:
        return self.root / "git-state" / f"{name}.previous"
