"""`trainbridge verify`: replaying a run's pending-npu commits through the gate, in a real temporary
git repository. The refusal uses this machine's real availability check (no NPU here). The replay logic runs
with an injected availability check that calls the npu backend real, so the gate's children time the step on
the CPU (through the emulation): with a scripted gate for the git logic, and with the real gate
on a tiny workload (slow)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainbridge.agents.profiler.numerics import NumericsTolerance
from trainbridge.agents.profiler.verdict import Verdict, VerdictReason
from trainbridge.graph.runs import RunError
from trainbridge.graph.state import RunConfig, RunPaths
from trainbridge.graph.verify import VerifyRefused, replay_name, verify_run
from trainbridge.sandbox.backends import Availability
from trainbridge.tests.host import needs_no_torch_npu
from trainbridge.tools.git.ops import RunWorkspace, open_repo

RUN = "r1"
RECIPE = "rmsnorm-npu-rms-norm"  # a seed recipe: its numerics class sets the gate's tolerance
STEP = '''import time

import torch

SLOW_S = 0.05  # deliberate waste the first rewrite removes


def build(device, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(64, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()

    def batch(step):
        rows = torch.arange(16) + (step * 16) % 48
        return inputs[rows].to(device), targets[rows].to(device)

    def loss_fn(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean() * 1.0  # scale

    def train_step(model, optimizer, batch):
        if SLOW_S:
            time.sleep(SLOW_S)
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    return {"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, "train_step": train_step}
'''
FAST = ("SLOW_S = 0.05", "SLOW_S = 0.0")
WRONG = ("* 1.0  # scale", "* 1.5  # scale")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}
REAL_NPU = lambda name: Availability(True, "test: the npu backend is treated as real (timing runs on the CPU)")  # noqa: E731


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "core.hooksPath=/dev/null", *args], cwd=cwd, check=True, capture_output=True,
                          text=True, env={**os.environ, **GIT_ENV}).stdout.strip()


def _message(name: str) -> str:
    return (f"trainbridge: test rewrite {name}\n\nIntent rmsnorm-{name} (rmsnorm) at step.py:3.\n"
            f"Recipe {RECIPE} (seed); numerics class tolerance.")


def make_run(tmp_path: Path, pending: list[tuple[str, tuple[str, str]]], *, conflict: bool = False):
    """A user repo with the tiny workload, a run whose pending-npu branch holds `pending` (made like the
    loop makes them: candidate from the run head, pushed to the side branch)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "step.py").write_text(STEP)
    (repo / "trainbridge.toml").write_text('entry = "step:build"\nwarmup_steps = 1\nsteps = 3\ntimeout_s = 180\n')
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "tiny workload")
    runs = tmp_path / "runs"
    config = RunConfig(repo=str(repo), run_id=RUN, target="npu", kb_dir=str(tmp_path / "kb"), gate_rounds=4)
    paths = RunPaths(RUN, runs)
    paths.dir.mkdir(parents=True)
    paths.config.write_text(config.model_dump_json())
    workspace = RunWorkspace.create_run(open_repo(repo), RUN, "HEAD", workspace_root=paths.workspace)
    for name, (old, new) in pending:
        cand = workspace.start_candidate(name)
        path = Path(cand.path) / "step.py"
        path.write_text(path.read_text().replace(old, new))
        workspace.commit_candidate(name, _message(name))
        workspace.push_to_branch(name, "pending-npu")
    if conflict:  # a commit that only applies on top of the one before it (built by hand on the side branch)
        side = workspace.root / "branches" / "pending-npu"
        (side / "step.py").write_text((side / "step.py").read_text().replace("* 1.5  # scale", "* 2.0  # scale"))
        _git(side, "commit", "-q", "-am", _message("c3") + f"\n\nTrainBridge-Candidate: c3\nTrainBridge-Run: {RUN}")
    return repo, runs, workspace


class ScriptedGate:
    """Accepts a candidate unless its step.py has the wrong scale; records what it was shown."""

    def __init__(self, fail_on_call: int | None = None):
        self.calls: list[dict] = []
        self.fail_on_call = fail_on_call

    def __call__(self, baseline, candidate, **kwargs):
        self.calls.append({"baseline": (baseline.root / "step.py").read_text(), "candidate": (candidate.root / "step.py").read_text(),
                           "baseline_root": baseline.root, **kwargs})
        if self.fail_on_call == len(self.calls):
            raise RuntimeError("simulated crash in the middle of a gate")
        wrong = "* 1.5" in self.calls[-1]["candidate"]
        reason = VerdictReason.numerics_mismatch if wrong else VerdictReason.accepted
        return Verdict(accepted=not wrong, reason=reason, message="scripted: " + reason, backend=kwargs["backend"],
                       phase="numerics" if wrong else "done", ratio=None if wrong else 0.8,
                       ratio_ci=None if wrong else (0.75, 0.85), candidate_versions={"torch_npu": "2.13.0"})


def _run_log(repo: Path) -> list[str]:
    return _git(repo, "log", "--format=%H %s", f"trainbridge/{RUN}").splitlines()


def _refs(repo: Path) -> list[str]:
    return _git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/").splitlines()


@needs_no_torch_npu
def test_refuses_without_an_npu_with_the_availability_reason(tmp_path):
    repo, runs, workspace = make_run(tmp_path, [("c1", FAST)])
    refs_before, head_before = _refs(repo), workspace.head_sha
    with pytest.raises(VerifyRefused) as refused:
        verify_run(RUN, root=runs, kb=None)
    message = str(refused.value)
    assert "torch_npu is not installed" in message and f"trainbridge verify {RUN}" in message and "NPU host" in message
    assert _refs(repo) == refs_before and workspace.head_sha == head_before
    assert not (runs / RUN / "verify.json").exists()
    with pytest.raises(RunError, match="no run 'nope'"):
        verify_run("nope", root=runs, availability=REAL_NPU)


def test_replays_in_order_accepts_fast_forward_drops_the_rest_and_records(tmp_path):
    from trainbridge.knowledge.store import KnowledgeBase

    repo, runs, workspace = make_run(tmp_path, [("c1", FAST), ("c2", WRONG)], conflict=True)
    user_head, head_before = _git(repo, "rev-parse", "HEAD"), workspace.head_sha
    kb = KnowledgeBase(tmp_path / "kb")
    gate = ScriptedGate()
    report = verify_run(RUN, root=runs, availability=REAL_NPU, gate=gate, kb=kb)

    assert [(o.candidate, o.decision, o.reason) for o in report.outcomes] == [
        ("c1", "accepted", "accepted"), ("c2", "rejected", "numerics_mismatch"), ("c3", "conflict", "conflict")]
    assert "step.py" in report.outcomes[2].message
    # in order, each against the head as it stands: c2 is gated on top of the accepted c1
    assert len(gate.calls) == 2
    assert FAST[0] in gate.calls[0]["baseline"] and FAST[1] in gate.calls[0]["candidate"]
    assert FAST[1] in gate.calls[1]["baseline"] and FAST[1] in gate.calls[1]["candidate"] and WRONG[1] in gate.calls[1]["candidate"]
    assert all(c["backend"] == "npu" and c["emulated_speed"] is False and c["rounds"] == 4 for c in gate.calls)
    assert isinstance(gate.calls[0]["tolerance"], NumericsTolerance)
    # the run branch gained exactly the accepted commit, as a fast-forward of the old head
    log = _run_log(repo)
    assert len(log) == 2 and log[1].split()[0] == head_before
    accepted = log[0].split()[0]
    assert report.outcomes[0].run_sha == accepted == report.run_head_after
    body = _git(repo, "log", "-1", "--format=%B", accepted)
    assert "trainbridge: test rewrite c1" in body and "Measured on npu" in body
    assert f"TrainBridge-Candidate: {replay_name('c1', accepted)}" in body and "TrainBridge-Candidate: c1\n" not in body
    assert FAST[1] in _git(repo, "show", f"trainbridge/{RUN}:step.py") and WRONG[0] in _git(repo, "show", f"trainbridge/{RUN}:step.py")
    # the pending branch and every replay candidate are gone; the user's checkout is untouched
    assert report.pending_dropped and _refs(repo) == ["main", f"trainbridge/{RUN}"]
    assert _git(repo, "rev-parse", "HEAD") == user_head and _git(repo, "status", "--porcelain") == ""
    # decisions on disk and in the knowledge base
    saved = json.loads((runs / RUN / "verify.json").read_text())["outcomes"]
    assert [o["decision"] for o in saved] == ["accepted", "rejected", "conflict"] and saved[0]["ratio"] == 0.8
    outcomes = {o.intent_id: o for o in kb.outcomes_for(category="rmsnorm")}
    assert outcomes["rmsnorm-c1"].verdict == "accepted" and outcomes["rmsnorm-c1"].ratio == 0.8
    assert outcomes["rmsnorm-c1"].backend == "npu" and outcomes["rmsnorm-c1"].recipe_id == RECIPE
    assert outcomes["rmsnorm-c2"].verdict.startswith("numerics_mismatch") and outcomes["rmsnorm-c3"].verdict.startswith("conflict")
    # a second verify has nothing left to do
    again = verify_run(RUN, root=runs, availability=REAL_NPU, gate=gate, kb=None)
    assert len(gate.calls) == 2 and again.run_head_after == accepted and len(again.outcomes) == 3


def test_verify_waits_for_no_one_while_the_run_holds_its_lock(tmp_path):
    from trainbridge.graph.runs import run_lock
    from trainbridge.graph.state import RunPaths

    repo, runs, workspace = make_run(tmp_path, [("c1", FAST)])
    gate = ScriptedGate()
    with run_lock(RunPaths(RUN, runs)):  # `trainbridge resume` of the same run is driving its worktrees
        with pytest.raises(RunError, match="is already running"):
            verify_run(RUN, root=runs, availability=REAL_NPU, gate=gate, kb=None)
    assert gate.calls == [] and workspace.head_sha == _git(repo, "rev-parse", f"trainbridge/{RUN}")
    assert len(verify_run(RUN, root=runs, availability=REAL_NPU, gate=gate, kb=None).outcomes) == 1  # free again: it runs


@pytest.mark.parametrize("lose_record", [False, True])
def test_an_interrupted_verify_resumes_without_duplicates(tmp_path, lose_record):
    repo, runs, workspace = make_run(tmp_path, [("c1", FAST), ("c2", WRONG)])
    head_before = workspace.head_sha
    with pytest.raises(RuntimeError, match="simulated crash"):
        verify_run(RUN, root=runs, availability=REAL_NPU, gate=ScriptedGate(fail_on_call=2), kb=None)
    assert len(_run_log(repo)) == 2  # c1 was accepted before the crash
    record = runs / RUN / "verify.json"
    if lose_record:  # killed after the fast-forward, before the decision was written
        record.unlink()
    gate = ScriptedGate()
    report = verify_run(RUN, root=runs, availability=REAL_NPU, gate=gate, kb=None)
    assert len(gate.calls) == 1 and WRONG[1] in gate.calls[0]["candidate"]  # only c2 is gated again
    assert [(o.candidate, o.decision) for o in report.outcomes] == [("c1", "accepted"), ("c2", "rejected")]
    if lose_record:
        assert report.outcomes[0].message == "accepted before an interruption"
    log = _run_log(repo)
    assert len(log) == 2 and log[1].split()[0] == head_before  # one replay commit, no duplicate
    assert report.pending_dropped and _refs(repo) == ["main", f"trainbridge/{RUN}"]


def test_replay_names_are_valid_candidate_names():
    assert replay_name("rmsnorm-abc-rmsnorm-npu-rms-norm", "f" * 40) == "verify-rmsnorm-abc-rmsnorm-npu-rms-norm"
    assert replay_name(None, "0123456789abcdef" * 2 + "01234567") == "verify-0123456789ab"
    long = replay_name("x" * 200, "a" * 40)
    assert len(long) == 100 and long.startswith("verify-x")
    assert replay_name("a..b.lock", "a" * 40) == "verify-a_b"


@pytest.mark.slow
def test_real_gate_times_the_replays_on_the_cpu_and_keeps_only_the_faster_one(tmp_path):
    repo, runs, workspace = make_run(tmp_path, [("c1", FAST), ("c2", WRONG)])
    head_before = workspace.head_sha
    # 4 rounds at 80% confidence is the least the signed-rank test can accept with; the first rewrite
    # removes a 50 ms sleep per step, far beyond the noise
    report = verify_run(RUN, root=runs, availability=REAL_NPU, kb=None, rounds=4, confidence=0.8)
    first, second = report.outcomes
    assert first.decision == "accepted", first.message
    assert first.ratio is not None and first.ratio < 0.9 and first.ratio_ci[1] < 1.0
    # rounds the machine was busy in are measured again and kept in the record (agents/profiler/quiet.py)
    busy = first.verdict["busy_rounds"]
    assert len(first.verdict["baseline_rounds"]) == 4 + len(busy) and first.verdict["candidate_versions"]["torch_npu_mode"] == "emulated"
    assert second.decision == "rejected" and second.reason == "numerics_mismatch" and second.ratio is None
    log = _run_log(repo)
    assert len(log) == 2 and log[1].split()[0] == head_before and log[0].split()[0] == first.run_sha
    assert report.pending_dropped
