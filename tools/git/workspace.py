"""`RunWorkspace`: the run branch and its candidates, each in its own worktree under a workspace folder
outside the user's checkout. Crash-safety and idempotency are described in tools/git/ops.py.

The branch operations (create the run, start/commit/diff/accept/reject a candidate, push one to a
side branch) stay in one class: they share the trailer bookkeeping and the "already done?" checks
that make each of them safe to repeat, so candidate-branch and run-branch operations do not split
apart cleanly. The folders, the lock and the recovery of what a killed process left behind do:
they are `WorkspaceFolders` (tools/git/worktrees.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from trainbridge.tools.git.errors import (
    CandidateConflict,
    CandidateNotFound,
    GitCommandFailed,
    GitOpsError,
    NotFastForward,
    NothingToAccept,
    UnsafeReason,
    UnsafeRepoState,
)
from trainbridge.tools.git.names import (
    BRANCH_PREFIX,
    TRAILER_CANDIDATE,
    TRAILER_RUN,
    candidate_branch_name,
    check_run_id,
    run_branch_name,
    side_branch_name,
)
from trainbridge.tools.git.records import (
    AcceptResult,
    CandidateWorkspace,
    CleanupResult,
    CommitResult,
    RemovalResult,
    PushResult,
    RejectResult,
    RunInfo,
)
from trainbridge.tools.git.repo import UserRepo
from trainbridge.tools.git.runner import (
    Commit,
    GitIdentity,
    commits,
    is_under,
    ref_sha,
    run_git,
    run_git_status,
    worktrees,
)
from trainbridge.tools.git.worktrees import WorkspaceFolders


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
        if is_under(self.root, repo.root) or is_under(repo.root, self.root) or is_under(self.root, repo.common_dir):
            raise UnsafeRepoState(UnsafeReason.workspace_location,
                                  f"Workspace {self.root} overlaps the repository at {repo.root}; TrainBridge's "
                                  "worktrees would show up in (or swallow) your checkout.",
                                  "Choose a workspace directory outside the repository, "
                                  "e.g. ~/.trainbridge/runs/<run-id>.")
        self.identity = identity or GitIdentity()
        self.folders = WorkspaceFolders(repo, self.run_id, self.root, self.identity,
                                        stale_lock_age_s=stale_lock_age_s, lock_timeout_s=lock_timeout_s)
        self.branch = run_branch_name(run_id)
        self.worktree = self.root / "run"
        self.info: RunInfo | None = None
        self.made_shas: list[str] = []

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
            self.folders.ensure_worktree(branch, self._cand_path(name))
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
            self.folders.ensure_worktree(branch, path)
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
                self.folders.ensure_worktree(branch, path)
                index = Path(self.git(path, "rev-parse", "--absolute-git-dir")) / "trainbridge-diff.index"
                env = {"GIT_INDEX_FILE": str(index)}
                try:
                    self.git(path, "read-tree", "HEAD", env=env)
                    self.git(path, "add", "-A", env=env)
                    target = self.git(path, "write-tree", env=env)
                finally:
                    index.unlink(missing_ok=True)
            return run_git(self.repo.root, "diff", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/",
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
            self.folders.ensure_worktree(side, path)
            self.git(path, "reset", "-q", "--hard", "HEAD")
            fast_forward = self._is_ancestor(side_head, current)
            if fast_forward:
                self.git(path, "merge", "-q", "--ff-only", current)
            else:
                status, _, err = run_git_status(path, "cherry-pick", current, identity=self.identity)
                if status != 0:
                    conflicts = self.git(path, "diff", "--name-only", "--diff-filter=U").split()
                    self.git(path, "reset", "-q", "--hard", "HEAD")
                    if conflicts:
                        raise CandidateConflict(f"Candidate {name} does not apply on {side}: conflicts in "
                                                f"{', '.join(conflicts)}.", "Redo the candidate on that branch's "
                                                "head, or keep it on its own branch.", conflicts)
                    if "empty" not in err:
                        raise GitCommandFailed(["cherry-pick", current], status, err)
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
            for worktree in worktrees(self.repo.root):
                if is_under(worktree.path, self.root):
                    self.folders.remove_worktree(worktree)
                    removed.append(worktree.path)
            for folder in (self.root / "candidates", self.root / "branches"):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return CleanupResult(removed_worktrees=removed, kept_branches=self._run_branches())

    def remove_run(self) -> RemovalResult:
        """Remove every worktree of this run and every branch of it (`trainbridge/<run-id>` and the names under it),
        except a branch that a checkout of the user's has checked out (kept, and said why). Never another branch."""
        removed = self.cleanup().removed_worktrees
        held = {w.ref.removeprefix("refs/heads/"): w.path for w in worktrees(self.repo.root) if w.ref}
        gone, kept = [], {}
        for branch in self._run_branches():
            if branch in held:
                kept[branch] = f"checked out at {held[branch]}"
                continue
            self.update_ref(branch, None, self.ref_sha(branch) or "", f"trainbridge rm {self.run_id}")
            gone.append(branch)
        return RemovalResult(removed_worktrees=removed, removed_branches=gone, kept_branches=kept)

    def _run_branches(self) -> list[str]:
        refs = run_git(self.repo.root, "for-each-ref", "--format=%(refname:short)", f"refs/heads/{self.branch}",
                       f"refs/heads/{self.branch}.*", f"refs/heads/{self.branch}.*/*").split()
        return sorted(set(refs))

    @property
    def head_sha(self) -> str:
        return self._run_head()

    @property
    def recovered(self) -> list[str]:
        """What the recoveries on taking the lock cleared, in words."""
        return self.folders.recovered

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """The workspace's exclusive lock (tools/git/worktrees.py); every branch move happens under it."""
        return self.folders.locked()

    # -- internals -------------------------------------------------------------------------

    def _create(self, base: str) -> RunInfo:
        if base.startswith("-"):
            raise ValueError(f"base {base!r} is not a revision")
        with self.locked():
            status, base_sha, _ = run_git_status(self.repo.root, "rev-parse", "--verify", "-q", f"{base}^{{commit}}")
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
            created_worktree = self.folders.ensure_worktree(self.branch, self.worktree)
            self._sync_run_worktree()
            if not recorded:
                run_file.write_text(json.dumps({"run_id": self.run_id, "repo": str(self.repo.root),
                                                "base_sha": base_sha}))
            return RunInfo(run_id=self.run_id, branch=self.branch, base_sha=recorded.get("base_sha", base_sha),
                           head_sha=head, worktree=self.worktree, created_branch=created_branch,
                           created_worktree=created_worktree, notes=list(self.repo.notes))

    def _remove_candidate(self, name: str) -> str | None:
        branch = candidate_branch_name(self.run_id, name)
        self.folders.remove_path(self._cand_path(name))
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
        run_git(self.repo.root, "update-ref", "-m", f"trainbridge: {why}", *args, identity=self.identity)

    def git(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
        """Run git in `cwd` (one of this run's worktrees or the repository) as this run's identity."""
        return run_git(cwd, *args, identity=self.identity, env=env)

    def ref_sha(self, branch: str) -> str | None:
        return ref_sha(self.repo.root, branch)

    def _run_head(self) -> str:
        head = self.ref_sha(self.branch)
        if head is None:
            raise GitOpsError(f"Run branch {self.branch} does not exist.", "Call RunWorkspace.create_run first.")
        return head

    def _merge_base(self, a: str, b: str) -> str:
        return run_git(self.repo.root, "merge-base", a, b)

    def _is_commit(self, sha: str) -> bool:
        return run_git_status(self.repo.root, "cat-file", "-e", f"{sha}^{{commit}}")[0] == 0

    def _is_ancestor(self, a: str, b: str) -> bool:
        return run_git_status(self.repo.root, "merge-base", "--is-ancestor", a, b)[0] == 0

    def _changed_files(self, a: str, b: str) -> list[str]:
        return [f for f in run_git(self.repo.root, "diff", "--name-only", "--no-renames", a, b).split("\n") if f]

    def _cand_path(self, name: str) -> Path:
        return self.root / "candidates" / name

    def _state_file(self, name: str) -> Path:
        return self.root / "git-state" / f"{name}.previous"
