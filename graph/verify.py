"""`trainbridge verify <run-id>`: measure on NPU hardware the commits a run could only check numerically.

Without an NPU the loop verifies numerics under the CPU emulation and pushes such candidates to
`trainbridge/<run>.pending-npu` (verdict "speed unmeasured"). On an NPU host, `verify_run` replays
that branch's commits in order, each as a fresh candidate on the current run-branch head, through
the full profiler gate with real timing. Accepted ones are fast-forwarded onto the run branch
(one commit each, message kept, new trailer `verify-<candidate>`); the rest are dropped. Every
decision goes to `<run dir>/verify.json` and to the knowledge base. When every pending commit is
decided the pending branch is deleted. On a host without a usable NPU it refuses with the availability check's
reason: speed on an NPU is only ever claimed from an NPU.

Crash-safe like the loop: decisions already in verify.json are skipped, a replay is committed with
the same candidate name each time (the git layer deduplicates it), and a commit already accepted
before a crash is recognised by its trailer on the run branch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from trainbridge.records import Record

PENDING_SUFFIX = "pending-npu"
REPLAY_PREFIX = "verify-"
Decision = Literal["accepted", "rejected", "conflict", "already_applied"]


class VerifyRefused(RuntimeError):
    """Verification cannot run here (no usable NPU); the message carries the availability check's reason."""


class VerifyError(RuntimeError):
    """Verification stopped (unknown run, missing branch, baseline failing); the message says what to do."""


class ReplayOutcome(Record):
    pending_sha: str
    candidate: str | None = Field(description="the original candidate (its TrainBridge-Candidate trailer)")
    replay: str = Field(description="candidate name of the replay on the run branch")
    intent_id: str | None = None
    category: str | None = None
    recipe_id: str | None = None
    decision: Decision
    reason: str = Field(description="the gate's verdict reason, or conflict / already_applied")
    message: str
    ratio: float | None = Field(default=None, description="measured candidate/baseline step time (< 1 is faster)")
    ratio_ci: tuple[float, float] | None = None
    run_sha: str | None = Field(default=None, description="the commit on the run branch, when accepted")
    diff: str = ""
    verdict: dict[str, Any] | None = None


class VerifyReport(Record):
    run_id: str
    backend: str
    availability_reason: str
    pending_branch: str
    run_head_before: str
    run_head_after: str
    outcomes: list[ReplayOutcome] = Field(default_factory=list, description="every decision so far, in replay order")
    pending_dropped: bool = False
    record_path: str


def verify_run(
    run_id: str,
    *,
    root: Path | None = None,
    backend: str = "npu",
    availability: Callable[[str], Any] | None = None,
    gate: Callable[..., Any] | None = None,
    rounds: int | None = None,
    min_gain: float | None = None,
    confidence: float = 0.95,
    kb: Any = "default",
    say: Callable[[str], None] = lambda message: None,
) -> VerifyReport:
    """Replay `trainbridge/<run_id>.pending-npu` through the full gate on `backend` (see module doc).

    `availability(backend) -> Availability` decides whether the hardware is real (default:
    sandbox.backends.availability); `gate` defaults to agents.profiler.gate.run_gate; rounds and
    min_gain default to the run's settings. `kb=None` records no knowledge-base outcomes.
    """
    from trainbridge.graph.runs import load_config
    from trainbridge.sandbox.backends import availability as default_availability

    config, paths = load_config(run_id, root)
    found = (availability or default_availability)(backend)
    if not found.available:
        raise VerifyRefused(f"cannot verify run {run_id} here: {backend} is not usable: {found.reason}. Speed on "
                            f"an NPU is only measured on an NPU: run `trainbridge verify {run_id}` on an NPU host.")
    from trainbridge.graph.runs import run_lock

    with run_lock(paths):  # never while `run`/`resume`/`review` drive the same run's worktrees
        return _verify(config, paths, found, gate=gate, rounds=rounds, min_gain=min_gain, confidence=confidence,
                       kb=kb, say=say, root=root, backend=backend)


def _verify(config, paths, availability, *, gate, rounds, min_gain, confidence, kb, say, root, backend) -> VerifyReport:
    from trainbridge.graph.context import RunContext

    run_id = config.run_id
    context = RunContext(config=config, paths=paths, say=say)
    knowledge = context.kb if kb == "default" else kb
    workspace = _open_workspace(context)
    side = f"{workspace.branch}.{PENDING_SUFFIX}"
    record_path = paths.dir / "verify.json"
    decided = _load_record(record_path)
    head_before = workspace.head_sha
    report = VerifyReport(run_id=run_id, backend=backend, availability_reason=availability.reason, pending_branch=side,
                          run_head_before=head_before, run_head_after=head_before, outcomes=list(decided.values()),
                          record_path=str(record_path))
    pending_head = workspace.ref_sha(side)
    if pending_head is None:
        say(f"nothing to verify: {side} does not exist")
        return report
    from trainbridge.tools.git.ops import commits

    pending = list(reversed(commits(workspace.repo.root, pending_head, "--not", head_before)))
    known = _known_candidates(run_id, root)
    for commit in pending:
        if commit.sha in decided:
            continue
        outcome = _replay(workspace, commit, known, knowledge, backend=backend, gate=gate, confidence=confidence,
                          rounds=rounds or config.gate_rounds, min_gain=config.min_gain if min_gain is None else min_gain,
                          say=say, workload=config.workload)
        decided[commit.sha] = outcome
        report.outcomes.append(outcome)
        _save_record(record_path, decided)
        _record_outcome(knowledge, config, backend, outcome)
    if all(c.sha in decided for c in pending):
        report.pending_dropped = _drop_pending(workspace, side, pending_head)
    report.run_head_after = workspace.head_sha
    _save_record(record_path, decided)
    return report


# --- one replay ---------------------------------------------------------------------------------


def _replay(workspace, commit, known: dict[str, dict], knowledge, *, backend: str, gate, confidence: float, rounds: int,
            min_gain: float, say, workload=None) -> ReplayOutcome:
    from trainbridge.agents.profiler.gate import GateError, run_gate
    from trainbridge.sandbox.workload import load_workload
    from trainbridge.tools.git.ops import NothingToAccept

    workload = workload or load_workload  # the run's own way of loading a worktree (RunConfig.workload)

    original = commit.candidate()
    name = replay_name(original, commit.sha)
    meta = {**_meta_from_message(commit.message), **known.get(original or "", {})}
    base = {"pending_sha": commit.sha, "candidate": original, "replay": name, **meta}
    cand = workspace.start_candidate(name)
    picked, error = _cherry_pick(Path(cand.path), commit.sha, workspace.identity)
    if not picked:
        workspace.reject_candidate(name)
        say(f"{commit.sha[:12]} ({original}): does not apply on the run head: dropped")
        return ReplayOutcome(**base, decision="conflict", reason="conflict",
                             message=f"does not apply on the run branch head {workspace.head_sha[:12]}: {error}")
    message = f"{commit.message.strip()}\n\nMeasured on {backend} by `trainbridge verify` (replay of {commit.sha[:12]})."
    committed = workspace.commit_candidate(name, message)
    if committed.already_accepted:
        return ReplayOutcome(**base, decision="accepted", reason="accepted", message="accepted before an interruption",
                             run_sha=committed.sha)
    if committed.empty:
        try:
            found = workspace.accept_candidate(name)
            return ReplayOutcome(**base, decision="accepted", reason="accepted", message="accepted before an interruption",
                                 run_sha=found.sha)
        except NothingToAccept:
            workspace.reject_candidate(name)
            return ReplayOutcome(**base, decision="already_applied", reason="already_applied",
                                 message="the change is already on the run branch")
    diff = workspace.candidate_diff(name)
    tolerance = _tolerance(knowledge, meta.get("recipe_id"))
    say(f"gate: {name} on {backend}, {rounds} interleaved rounds")
    try:
        verdict = (gate or run_gate)(workload(workspace.worktree), workload(Path(cand.path)), backend=backend,
                                     rounds=rounds, min_gain=min_gain, tolerance=tolerance, emulated_speed=False,
                                     confidence=confidence)
    except GateError as exc:
        workspace.reject_candidate(name)
        raise VerifyError(f"stopped at {commit.sha[:12]} ({original}): {exc}") from exc
    fields = {"reason": str(verdict.reason), "message": verdict.message, "ratio": verdict.ratio,
              "ratio_ci": verdict.ratio_ci, "diff": diff, "verdict": verdict.model_dump(mode="json")}
    if verdict.accepted:
        accepted = workspace.accept_candidate(name)
        say(f"accepted {name}: {verdict.message[:120]}")
        return ReplayOutcome(**base, decision="accepted", run_sha=accepted.sha, **fields)
    workspace.reject_candidate(name)
    say(f"dropped {name}: {verdict.reason} ({verdict.message[:120]})")
    return ReplayOutcome(**base, decision="rejected", **fields)


def replay_name(original: str | None, sha: str) -> str:
    """`verify-<candidate>` (a valid, unique candidate name), or `verify-<sha12>` without a trailer."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", original or sha[:12]).strip(".")[: 100 - len(REPLAY_PREFIX)]
    while stem.endswith((".", ".lock")) or ".." in stem:
        stem = stem.replace("..", "_").removesuffix(".lock").rstrip(".")
    return REPLAY_PREFIX + (stem or sha[:12])


def _cherry_pick(path: Path, sha: str, identity) -> tuple[bool, str]:
    """Apply `sha`'s change to the candidate worktree without committing; undo it all on failure."""
    from trainbridge.tools.git.ops import run_git_status

    status, _, err = run_git_status(path, "cherry-pick", "--no-commit", sha, identity=identity)
    if status == 0:
        return True, ""
    _, unmerged, _ = run_git_status(path, "diff", "--name-only", "--diff-filter=U", identity=identity)
    for undo in (("cherry-pick", "--quit"), ("reset", "-q", "--hard", "HEAD"), ("clean", "-fdq")):
        run_git_status(path, *undo, identity=identity)
    if unmerged.split():
        return False, f"conflicts in {', '.join(unmerged.split())}"
    return False, (err or "").strip().splitlines()[0] if (err or "").strip() else f"git cherry-pick exited with {status}"


# --- helpers --------------------------------------------------------------------------------------


def _open_workspace(context):
    from trainbridge.tools.git.ops import RunWorkspace, ref_sha, run_branch_name

    repo = context.user_repo
    branch = run_branch_name(context.config.run_id)
    if ref_sha(repo.root, branch) is None:
        raise VerifyError(f"{repo.root} has no branch {branch}: run {context.config.run_id} made no run branch there "
                          "(was it started on another clone?)")
    # the run branch itself as the base: create_run then reuses the branch and its recorded base
    return RunWorkspace.create_run(repo, context.config.run_id, branch, workspace_root=context.paths.workspace)


def _drop_pending(workspace, side: str, expected: str) -> bool:
    """Delete the pending branch (compare-and-swap on the head we replayed) and the run's worktrees."""
    workspace.cleanup()  # the pending branch's worktree must go before its branch
    if workspace.ref_sha(side) != expected:
        return False  # something was pushed meanwhile: keep it for the next verify
    with workspace.locked():
        workspace.update_ref(side, None, expected, "pending commits verified on hardware")
    return True


def _meta_from_message(message: str) -> dict[str, str]:
    """Intent, category and recipe from the coder's commit message (agents/coder/candidate.py)."""
    found: dict[str, str] = {}
    intent = re.search(r"^Intent (\S+) \((\w+)\) at ", message, re.MULTILINE)
    recipe = re.search(r"^Recipe (\S+) \(", message, re.MULTILINE)
    if intent:
        found["intent_id"], found["category"] = intent.group(1), intent.group(2)
    if recipe:
        found["recipe_id"] = recipe.group(1)
    return found


def _known_candidates(run_id: str, root: Path | None) -> dict[str, dict]:
    """Candidate name -> intent, category and recipe from the run's checkpointed verdicts (when any)."""
    from trainbridge.graph.runs import run_status
    from trainbridge.graph.state import RunPaths

    if not RunPaths(run_id, root).checkpoints.is_file():
        return {}
    try:
        verdicts = run_status(run_id, root)["state"].get("verdicts") or []
    except Exception:  # no checkpoint yet, or one from an older schema: the commit messages still say
        return {}
    return {v["candidate"]: {k: v[k] for k in ("intent_id", "category", "recipe_id") if v.get(k)}
            for v in verdicts if v.get("candidate")}


def _tolerance(knowledge, recipe_id: str | None):
    if knowledge is None or not recipe_id:
        return None
    from trainbridge.agents.profiler.judge import tolerance_for

    recipe = knowledge.get_recipe(recipe_id)
    return tolerance_for(recipe.numerics) if recipe is not None else None


def _record_outcome(knowledge, config, backend: str, outcome: ReplayOutcome) -> None:
    if knowledge is None or not outcome.intent_id or not outcome.category or outcome.decision == "already_applied":
        return
    from trainbridge.knowledge.schema import Outcome
    from trainbridge.records import IntentCategory

    if outcome.category not in IntentCategory.__members__.values():
        return
    verdict = "accepted" if outcome.decision == "accepted" else f"{outcome.reason}: {outcome.message}"[:2000]
    versions = (outcome.verdict or {}).get("candidate_versions") or {}
    knowledge.record_outcome(Outcome(
        id=f"outcome-{config.run_id}-{outcome.replay}", run_id=config.run_id, intent_id=outcome.intent_id,
        category=outcome.category, recipe_id=outcome.recipe_id, diff=outcome.diff, verdict=verdict,
        ratio=outcome.ratio, ratio_ci=outcome.ratio_ci, backend=backend, versions=versions))


def _load_record(path: Path) -> dict[str, ReplayOutcome]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {item["pending_sha"]: ReplayOutcome.model_validate(item) for item in data.get("outcomes", [])}


def _save_record(path: Path, decided: dict[str, ReplayOutcome]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"outcomes": [o.model_dump(mode="json") for o in decided.values()]}, indent=2), encoding="utf-8")
    os.replace(tmp, path)
