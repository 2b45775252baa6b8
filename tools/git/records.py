"""What the run workspace's operations return (typed records)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from trainbridge.records import Record


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


class RemovalResult(Record):
    """What `RunWorkspace.remove_run` removed, and the run branches it left because a checkout of the user's holds
    them."""

    removed_worktrees: list[Path]
    removed_branches: list[str]
    kept_branches: dict[str, str]  # branch -> why it stays
