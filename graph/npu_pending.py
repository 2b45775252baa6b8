"""The pending branch of an NPU run without an NPU: rewrites whose numerics passed on the emulation
wait there (one commit each, stacked) for `trainbridge verify` on an NPU host; and the detached view
of its head the analyst reads."""

from __future__ import annotations

from pathlib import Path

from trainbridge.agents.coder.candidate import Candidate
from trainbridge.graph.context import RunContext
from trainbridge.sandbox.backends import npu_emulated

PENDING_VIEW = "pending-view"
PENDING_REFERENCE_VIEW = "pending-reference"
PENDING_REFERENCE = ("the verified pending head it stacks on (a rewrite there computes in higher precision than the original "
                     "and was verified against its precision reference)")


def pending_head(ctx: RunContext, workspace) -> str | None:
    """On an emulated NPU, numerics-verified rewrites wait on the pending branch instead of the run
    branch: later candidates start from its content so the rewrites stack (and verify replays them)."""
    if not (ctx.config.target == "npu" and npu_emulated()):
        return None
    from trainbridge.tools.git.ops import side_branch_name

    return workspace.ref_sha(side_branch_name(ctx.config.run_id, "pending-npu"))


def stack_on_pending(ctx: RunContext, workspace, candidate: Candidate) -> tuple[str, str]:
    """Put the candidate's tree (run head + earlier pending rewrites + this one, see `make_candidate`'s
    overlay) on the pending branch as one commit whose parent is the pending head, so each pending
    commit holds exactly one rewrite. Idempotent: a resumed decide finds the tree already there."""
    from trainbridge.tools.git.ops import side_branch_name

    branch = side_branch_name(ctx.config.run_id, "pending-npu")
    repo = workspace.repo.root
    with workspace.locked():  # the workspace lock and the trainbridge/ prefix check, like every ref we move
        head = pending_head(ctx, workspace)
        tree = workspace.git(repo, "rev-parse", f"{candidate.sha}^{{tree}}")
        if head is not None and workspace.git(repo, "rev-parse", f"{head}^{{tree}}") == tree:
            return branch, head
        message = workspace.git(repo, "log", "-1", "--format=%B", candidate.sha)
        new = workspace.git(repo, "commit-tree", tree, "-p", head or candidate.base_sha, "-m", message)
        workspace.update_ref(branch, new, head or "", f"pending {candidate.name}")
    return branch, new


def pending_view(workspace, sha: str) -> Path:
    """A detached worktree at the pending head, for the analyst to read (never committed to)."""
    from trainbridge.graph.detached_views import detached_view

    return detached_view(workspace, PENDING_VIEW, sha)


def precision_on_pending(state) -> bool:
    """Whether a rewrite on the pending branch passed only against its recipe's precision reference: its program
    then follows another trajectory than the original, by design, and so does every candidate that stacks on it."""
    return any(v.get("pending_branch") and v.get("precision_reference") == "matched_reference"
               for v in state.get("verdicts") or [])


def pending_reference(ctx: RunContext, workspace, state, *, view: str = PENDING_REFERENCE_VIEW) -> Path | None:
    """The gate's reference for a candidate that stacks on a pending branch holding such a rewrite (see
    `precision_on_pending`): a detached worktree at the pending head, verified itself, which the candidate must match
    where it no longer matches the original (agents/profiler/gate.py, `check_against_reference`); `view`: its folder's
    name (one per gate slot: a gate removes its reference's side folders when it ends). None otherwise."""
    head = pending_head(ctx, workspace)
    if head is None or not precision_on_pending(state):
        return None
    from trainbridge.graph.detached_views import detached_view

    return detached_view(workspace, view, head)
