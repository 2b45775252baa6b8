"""NPU runs: the port commit that opens them, and the pending branch where rewrites whose numerics
passed on the emulation wait (one commit each, stacked) for `trainbridge verify` on an NPU host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainbridge.agents.coder.candidate import Candidate
from trainbridge.graph.context import RunContext


def emulated_npu(ctx: RunContext) -> bool:
    """No usable NPU here: the sandbox gives `npu` children the torch_npu emulation (the device maps to
    the CPU), so their numerics are real but their times are never NPU speed."""
    from trainbridge.sandbox.backends import probe

    return not probe("npu").available


PORT_CANDIDATE = "port-npu"
PENDING_VIEW = "pending-view"


def port_to_npu(ctx: RunContext, workspace) -> dict[str, Any]:
    """First commit of an NPU run: the explicit, reviewable port (device strings, torch.cuda, nccl,
    `import torch_npu`). Not a speed candidate: it is what makes the program run on the target at all,
    and the baseline below is measured on it. Idempotent: a re-run finds nothing left to port."""
    from trainbridge.tools.porting import port_repo
    from trainbridge.tools.porting_cli import write_port

    cand = workspace.start_candidate(PORT_CANDIDATE)
    result = port_repo(Path(cand.path))
    written = write_port(Path(cand.path), result)
    blocking = [f"{s.file}:{s.line} {s.category}" for s in result.skipped if s.blocking]
    commit = workspace.commit_candidate(PORT_CANDIDATE, f"trainbridge: port to the NPU ({len(result.changes)} change(s))\n\n"
                                        f"Not ported (manual work): {', '.join(blocking) or 'nothing'}.")
    if commit.empty:
        workspace.reject_candidate(PORT_CANDIDATE)
        return {"commit": None, "files": [], "not_ported": blocking}
    accepted = workspace.accept_candidate(PORT_CANDIDATE)
    ctx.say(f"ported to the NPU: {len(written)} file(s), commit {accepted.sha[:12]}")
    return {"commit": accepted.sha, "files": written, "not_ported": blocking}


def pending_head(ctx: RunContext, workspace) -> str | None:
    """On an emulated NPU, numerics-verified rewrites wait on the pending branch instead of the run
    branch: later candidates start from its content so the rewrites stack (and verify replays them)."""
    if not (ctx.config.target == "npu" and emulated_npu(ctx)):
        return None
    from trainbridge.tools.git_ops import side_branch_name

    return workspace.ref_sha(side_branch_name(ctx.config.run_id, "pending-npu"))


def stack_on_pending(ctx: RunContext, workspace, candidate: Candidate) -> tuple[str, str]:
    """Put the candidate's tree (run head + earlier pending rewrites + this one, see `make_candidate`'s
    overlay) on the pending branch as one commit whose parent is the pending head, so each pending
    commit holds exactly one rewrite. Idempotent: a resumed decide finds the tree already there."""
    from trainbridge.tools.git_ops import side_branch_name

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
    from trainbridge.graph.views import detached_view

    return detached_view(workspace, PENDING_VIEW, sha)
