"""Paired rounds: both sides of a gate round alive at once, their timed steps alternated.

What is checked here: the parent really alternates the two children step by step and times each on
its own clock; it accounts the CPU each used while the *other* was timed; the conduct check turns
that, and anything done to the baseline, into `tampered_resources`; a fault of one child ends the
pair without being blamed on the other; sequential pairing still judges. (The planted cheats that
slow the other side are in tests/fixtures/redteam/cheats/partner_*.py, run by test_gate_red_team.py.)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from trainbridge.agents.profiler import conduct
from trainbridge.agents.profiler.gate import GateError, default_pairing, run_gate
from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.sandbox.isolation import scrubbed_env
from trainbridge.sandbox.results import ChildWatch, RunResult
from trainbridge.sandbox.child.step_driver import ChildSpec, StepPlan, drive_pair
from trainbridge.sandbox.workload import load_workload

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"
REDTEAM_BASE = Path(__file__).parent / "fixtures" / "redteam" / "base"


def watched(**watch) -> RunResult:
    return RunResult(mode="entry", backend="cpu", device="cpu", seed=1, threads=1, warmup_steps=0, timing_source="parent",
                     step_times_s=[0.02] * 8, watch=ChildWatch(**watch))


def test_partner_check_flags_work_while_the_baseline_is_timed_and_anything_done_to_it():
    base = watched(idle_cpu_s=0.004, idle_wall_s=0.5)
    assert conduct.check_partner(base, watched(idle_cpu_s=0.010, idle_wall_s=0.5), "r") == []  # spin-waits of a few ms
    finding, = conduct.check_partner(base, watched(idle_cpu_s=0.30, idle_wall_s=0.5), "r")
    assert finding.kind.value == "tampered_resources" and "300 ms of CPU during the 500 ms" in finding.message
    stopped = watched(idle_cpu_s=0.0, idle_wall_s=0.5, interference=["the child was stopped by signal SIGSTOP by another process"])
    finding, = conduct.check_partner(stopped, watched(idle_cpu_s=0.0, idle_wall_s=0.5), "r")
    assert "the baseline was stopped by signal SIGSTOP" in finding.message
    assert conduct.check_partner(watched(), watched(), "r") == []  # sequential rounds: nothing to compare


def _spec(tmp_path: Path, name: str) -> ChildSpec:
    workload = load_workload(REDTEAM_BASE)
    config = workload.config
    request = {"mode": "measure", "root": str(workload.root), "entry": config.entry, "pythonpath": [], "backend": "cpu",
               "seed": 0, "threads": 1}
    return ChildSpec(argv=[sys.executable, "-m", "trainbridge.sandbox.harness"], request=request, plan=StepPlan.sequential(1, 4),
                     cwd=workload.root, env=scrubbed_env(threads=1, seed=0), preexec_fn=None, timeout_s=120,
                     stdout_path=tmp_path / f"{name}.out", stderr_path=tmp_path / f"{name}.err")


def test_a_pair_alternates_its_steps_and_accounts_what_each_did_while_the_other_was_timed(tmp_path):
    first, second = drive_pair(_spec(tmp_path, "a"), _spec(tmp_path, "b"))
    for out in (first, second):
        assert out.failure is None and out.result is not None and not out.interrupted
        assert len(out.step_times_s) == 4 and len(out.cooldown_times_s) == 1
    assert first.losses == second.losses  # same seed, same batches, same program
    # the replies on the parent's clock: A B | B A | A B | ... (who leads swaps every step)
    merged = "".join(who for _, who in sorted([(t, "A") for t, _ in first.clock_pairs] + [(t, "B") for t, _ in second.clock_pairs]))
    assert merged == "ABBAABBAABBA", merged  # 1 warm-up, 4 measured, 1 cool-down step each
    for out in (first, second):
        watch = out.watch
        assert watch.idle_wall_s and watch.idle_cpu_s is not None and watch.cpu_s and watch.wall_s
        assert watch.idle_cpu_s < 0.5 * watch.idle_wall_s  # an honest idle side waits on its pipe
        assert watch.interference == []


def test_one_childs_fault_ends_the_pair_and_marks_the_other_interrupted(tmp_path):
    broken = _spec(tmp_path, "broken")
    broken = ChildSpec(**{**broken.__dict__, "request": {**broken.request, "entry": "step:no_such_function"}})
    first, second = drive_pair(_spec(tmp_path, "a"), broken)
    assert second.failure is not None and second.interrupted is None
    assert first.interrupted and "other side" in first.interrupted and first.step_times_s == []


def test_a_candidate_that_fails_in_a_paired_round_is_rejected_for_its_own_failure():
    verdict = run_gate(load_workload(WORKLOADS / "tiny"), load_workload(WORKLOADS / "tiny_crashes"), rounds=2, rng=random.Random(5))
    assert verdict.pairing == "paired" and verdict.reason == VerdictReason.crashed, verdict.message
    with pytest.raises(GateError, match="baseline failed"):
        run_gate(load_workload(WORKLOADS / "tiny_crashes"), load_workload(WORKLOADS / "tiny"), rounds=2, rng=random.Random(5))


def test_sequential_pairing_still_judges_and_a_bad_choice_is_an_error(monkeypatch):
    verdict = run_gate(load_workload(WORKLOADS / "tiny"), load_workload(WORKLOADS / "tiny_wrong_math"), rounds=2,
                       rng=random.Random(5), pairing="sequential")
    assert verdict.pairing == "sequential" and verdict.reason == VerdictReason.numerics_mismatch
    assert default_pairing("cpu") == "paired" and default_pairing("npu") == "sequential"
    monkeypatch.setenv("TRAINBRIDGE_GATE_PAIRING", "sequential")
    assert default_pairing("cpu") == "sequential"
    monkeypatch.setenv("TRAINBRIDGE_GATE_PAIRING", "both")
    with pytest.raises(GateError, match="choose one of paired, sequential"):
        default_pairing("cpu")


SPIN_AFTER_OWN_STEP = '''
import threading as _threading
import time as _time

_honest_build = build
_stepped = _threading.Event()


def _spin_after_steps():  # like a threading runtime that spin-waits for a while after a parallel region
    while True:
        _stepped.wait()
        _stepped.clear()
        until = _time.perf_counter() + 0.003
        while _time.perf_counter() < until:
            pass


_threading.Thread(target=_spin_after_steps, daemon=True).start()


def build(device, seed):
    parts = _honest_build(device, seed)
    honest = parts["train_step"]

    def train_step(model, optimizer, batch):
        loss = honest(model, optimizer, batch)
        _stepped.set()
        return loss

    parts["train_step"] = train_step
    return parts
'''


def test_spin_waits_right_after_a_sides_own_step_are_not_work_against_its_partner(tmp_path):
    """Found on nanoGPT with a regional torch.compile: compiled code's threads spin a few ms (~4) after
    each step, into the partner's next step. Over the partner's second step in a row (A B *B* A ...)
    nothing may run; right after a side's own step, SPIN_PER_STEP_S per step is allowed."""
    import shutil

    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    shutil.copytree(REDTEAM_BASE, baseline)
    shutil.copytree(REDTEAM_BASE, candidate)
    step = candidate / "step.py"
    step.write_text(step.read_text() + SPIN_AFTER_OWN_STEP, encoding="utf-8")
    verdict = run_gate(load_workload(baseline), load_workload(candidate), rounds=2, max_rounds=2, rng=random.Random(9))
    assert verdict.reason in (VerdictReason.not_significant, VerdictReason.slower), verdict.message
