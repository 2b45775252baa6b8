"""What the git layer refuses or fails at: each error says what (`reason`) and what to do (`remedy`)."""

from __future__ import annotations

from enum import StrEnum


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
    """`git <args>` exited non-zero; `args` is what followed `git`."""

    def __init__(self, args: list[str], status: int, stderr: str) -> None:
        self.args_, self.status, self.stderr = list(args), status, stderr
        super().__init__(f"`git {' '.join(self.args_)}` failed (exit {status}): {stderr.strip()}",
                         "Fix what git reports above and run again; the operation is safe to repeat.")
