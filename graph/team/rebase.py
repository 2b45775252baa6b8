"""Carry an accepted candidate that was judged against an older run head onto the new head.

Two gates judged at once both judged against the same head. When the first is accepted, the run
branch moves and the second's measurement no longer describes what it would add: its patch is
applied again on the new head (a new commit on its candidate branch, same name), and the caller
gates it again. When the patch no longer applies, the coder makes the candidate again from its
recipe on the new head (`recode`), and that is gated whole.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from trainbridge.agents.coder.candidate import Candidate
from trainbridge.tools.git.ops import run_git, run_git_status


def rebase_candidate(workspace, candidate: Candidate) -> Candidate | None:
    """`candidate`'s patch as a commit on the run head (its branch reset there first); None when the
    patch does not apply there (conflicts, or it is already in the head)."""
    message = run_git(workspace.repo.root, "log", "-1", "--format=%B", candidate.sha, identity=workspace.identity)
    started = workspace.start_candidate(candidate.name)
    path = Path(started.path)
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False, encoding="utf-8") as handle:
        handle.write(candidate.diff if candidate.diff.endswith("\n") else candidate.diff + "\n")
        patch = Path(handle.name)
    try:
        status, _, _ = run_git_status(path, "apply", "--whitespace=nowarn", str(patch), identity=workspace.identity)
    finally:
        patch.unlink(missing_ok=True)
    if status != 0:
        workspace.reject_candidate(candidate.name)
        return None
    result = workspace.commit_candidate(candidate.name, message)
    if result.sha is None:  # the head already holds this change
        workspace.reject_candidate(candidate.name)
        return None
    return candidate.model_copy(update={"sha": result.sha, "base_sha": result.base_sha, "branch": result.branch,
                                        "diff": workspace.candidate_diff(candidate.name), "files": result.files,
                                        "worktree": str(path)})


def carry_forward(workspace, candidate: Candidate, recode: Callable[[], Candidate | None]) -> tuple[Candidate | None, str]:
    """The candidate on the new run head and how it got there ("rebased" or "recoded"), or (None, why)."""
    moved = rebase_candidate(workspace, candidate)
    if moved is not None:
        return moved, "rebased"
    remade = recode()
    if remade is not None:
        return remade, "recoded"
    return None, "its patch does not apply on the new run head and its recipe no longer fits there"
