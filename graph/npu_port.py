"""The first commit of an NPU run: the port of the CUDA program (tools/porting) as a reviewable commit
on the run branch, before the baseline is measured on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainbridge.graph.context import RunContext

PORT_CANDIDATE = "port-npu"


def port_to_npu(ctx: RunContext, workspace) -> dict[str, Any]:
    """First commit of an NPU run: the explicit, reviewable port (device strings, torch.cuda, nccl,
    `import torch_npu`). Not a speed candidate: it is what makes the program run on the target at all,
    and the baseline below is measured on it. Idempotent: a re-run finds nothing left to port."""
    from trainbridge.tools.porting import port_repo
    from trainbridge.tools.porting.cli import write_port

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
