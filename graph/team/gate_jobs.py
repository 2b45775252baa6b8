"""One gate as a job: a typed request (which two commits, how to judge them) in, a typed verdict out.

The same request runs in three places: in the run's process (one gate at a time, the default), in a
child process pinned to one slot of this host (`--devices`: graph/team/fanout.py), or as a Ray task on
the host that holds a free device (`--ray`: graph/team/ray_gates.py). Between processes only JSON
travels: the request names worktrees and commits, never objects the candidate could have touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.graph.team.devices import Slot

WORKER_MODULE = "trainbridge.graph.team.gate_worker"


class GateJob(BaseModel):
    """What one gate judges: the candidate worktree against the baseline worktree (both at the commits
    named here), with the run's gate settings."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(description="place in its batch: verdicts are merged in this order, not in finishing order")
    candidate: dict[str, Any]  # the coder's Candidate dump
    baseline_root: str
    baseline_sha: str
    candidate_root: str
    candidate_sha: str
    target: str
    numerics: dict[str, Any] | None = None  # the recipe's Numerics (by alias), None for an LLM patch
    rounds: int
    max_rounds: int | None
    min_gain: float
    launch: str | None = None
    slot: int = 0
    baseline_step_s: float | None = None  # the run's baseline step time: the gate sizes its children's steps by it
    reference_root: str | None = None  # the recipe's precision reference worktree (agents/coder/precision_reference.py)
    reference_what: str | None = None  # what the reference is, when not the recipe's (the pending head: graph/npu_pending.py)
    reference_name: str | None = None  # its candidate name, dropped once the batch is decided


class GateJobError(RuntimeError):
    """A gate process died or answered nothing readable (not a verdict on the candidate)."""


def judge_job(job: GateJob, *, baseline_root: Path | None = None, candidate_root: Path | None = None) -> dict[str, Any]:
    """Run the gate for `job` in this process; the verdict as JSON. The roots default to the job's own
    (a Ray worker passes the worktrees it checked out from the bundle instead; the precision reference is not in
    the bundle, so a candidate judged there goes without it, and a precision change stays rejected)."""
    from trainbridge.agents.profiler.judge import judge_candidate
    from trainbridge.knowledge.schema import Numerics
    from trainbridge.records import SourceSpan

    numerics = Numerics.model_validate(job.numerics) if job.numerics is not None else None
    verdict = judge_candidate(baseline_root or Path(job.baseline_root), candidate_root or Path(job.candidate_root),
                              target=job.target, recipe_numerics=numerics, rounds=job.rounds, max_rounds=job.max_rounds,
                              min_gain=job.min_gain, launch=job.launch, baseline_step_s=job.baseline_step_s,
                              sites=[SourceSpan.model_validate(s) for s in job.candidate.get("sites", [])],
                              reference_root=Path(job.reference_root) if job.reference_root and baseline_root is None else None,
                              reference_what=job.reference_what)
    return verdict.model_dump(mode="json")


def judge_on_slot(job: GateJob, slot: Slot, *, timeout_s: float | None = None, extra_env: dict[str, str] | None = None,
                  worker: list[str] | None = None) -> dict[str, Any]:
    """Run the gate for `job` in a child process pinned to `slot`'s cores and seeing only its device
    (the gate's own sandbox children inherit both); the verdict as JSON. `worker`: the argv that
    takes JOB.json VERDICT.json (default: this package's gate worker)."""
    cores = set(slot.cores)
    env = {**os.environ, **slot.env(), **(extra_env or {})}
    from trainbridge.sandbox.scratch import scratch_dir

    with scratch_dir(f"trainbridge-gate-slot{slot.index}-") as folder:  # its owner's pid: a later sweep removes it
        request, answer = Path(folder) / "job.json", Path(folder) / "verdict.json"
        request.write_text(job.model_dump_json(), encoding="utf-8")
        argv = worker or [sys.executable, "-m", WORKER_MODULE]
        done = subprocess.run([*argv, str(request), str(answer)], env=env,
                              capture_output=True, text=True, timeout=timeout_s, preexec_fn=_pinned(cores))
        if done.returncode != 0 or not answer.is_file():
            end_orphans()
            raise GateJobError(f"the gate process for {job.candidate.get('name')} on {slot.label} exited {done.returncode}: "
                               f"{done.stderr.strip()[-2000:]}")
        return read_verdict(answer.read_text(encoding="utf-8"))


def end_orphans() -> list[int]:
    """End the sandbox children of gate processes that died (a killed run, a lost Ray worker): they
    run in sessions of their own, so their gate's death does not reach them, and they would hold the
    slot's cores for a while. Found by their output files, in scratch folders whose owner is gone."""
    import signal

    from trainbridge.sandbox.scratch import OWNER_FILE

    dead = []
    for folder in Path(tempfile.gettempdir()).glob("trainbridge-run-*"):
        try:
            owner = int((folder / OWNER_FILE).read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
            dead.append(f"{folder}{os.sep}")
    ended = []
    for entry in Path("/proc").iterdir() if dead else ():
        if not entry.name.isdigit():
            continue
        try:
            output = os.readlink(entry / "fd" / "1")
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"trainbridge.sandbox.harness" in argv and output.startswith(tuple(dead)):
            try:
                os.killpg(int(entry.name), signal.SIGKILL)  # it leads its own process group
                ended.append(int(entry.name))
            except OSError:
                pass
    return ended


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pinned(cores: set[int]):
    """The child's first act: take the slot's cores, and die with the process that waits for it (a
    killed run or Ray worker leaves no gate running unseen: PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    def apply() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG

    return apply


def read_verdict(text: str) -> dict[str, Any]:
    """A verdict as JSON, validated as the gate's Verdict record (anything else is a GateJobError)."""
    from pydantic import ValidationError

    from trainbridge.agents.profiler.verdict import Verdict

    try:
        return Verdict.model_validate(json.loads(text)).model_dump(mode="json")
    except (ValueError, ValidationError) as exc:
        raise GateJobError(f"the gate answered no verdict: {str(exc)[:500]}") from None
