"""The gate on script-mode workloads: an unmodified nanoGPT-style script against an identical copy and a changed one."""

from __future__ import annotations

import random
import shutil

import pytest

from script_repos import nanogpt_repo
from trainbridge.agents.profiler.gate import RoundInputs, judge_conduct, judge_timed, run_gate, run_pair, run_side
from trainbridge.agents.profiler.numerics import compare_numerics
from trainbridge.sandbox.workload import load_workload

TOML = '''launch = "python train.py --batch_size=2 --block_size=16 --n_layer=2 --n_embd=32 --n_head=2 --compile=False"
data = ["data/"]
warmup_steps = 1
steps = 2
timeout_s = 180
'''


def _pair(tmp_path, change: tuple[str, str] | None = None):
    baseline = nanogpt_repo(tmp_path / "baseline", TOML)
    candidate = tmp_path / "candidate"
    shutil.copytree(baseline, candidate)
    if change is not None:
        model = candidate / "model.py"
        text = model.read_text(encoding="utf-8")
        assert change[0] in text
        model.write_text(text.replace(change[0], change[1]), encoding="utf-8")
    return load_workload(baseline), load_workload(candidate)


def _round(baseline, candidate, seed: int):
    inputs = RoundInputs.draw(random.Random(seed), numerics_steps=2, warmup=1, steps=2, index_range=256)
    base = run_side(baseline, inputs, backend="cpu", extra_env=None, work_dir=None, label="baseline")
    cand = run_side(candidate, inputs, backend="cpu", extra_env=None, work_dir=None, label="candidate")
    assert base.run.failure is None and cand.run.failure is None, (base.run.failure, cand.run.failure)
    return inputs, base, cand


def test_a_gate_round_of_an_identical_copy_matches_in_numerics_conduct_and_timed_steps(tmp_path):
    baseline, candidate = _pair(tmp_path)
    inputs, base, cand = _round(baseline, candidate, seed=5)
    assert base.report.seed == inputs.seed and len(base.report.losses) == 2
    assert len(base.grads) == len(base.report.param_names) > 10 and base.report.no_grad_params == []
    assert base.report.param_names[0].startswith("GPT.")  # named after the module that holds them
    numerics = compare_numerics(base.report, cand.report, baseline_grads=base.grads, candidate_grads=cand.grads)
    assert numerics.passed, numerics.problems
    assert numerics.grad_max_abs_diff == 0.0 and base.run.losses == cand.run.losses
    assert judge_conduct(base, cand, baseline.config.threads, "round 0") == []
    assert judge_timed(0, base, cand, numerics.tolerance) == []
    assert base.unchanged == [] and set(base.deltas) == set(base.report.trainable)
    assert base.written == [] and cand.written == []  # nothing written into either worktree


def test_a_gate_round_catches_a_candidate_that_changes_the_numerics(tmp_path):
    wrong_scale = ("(1.0 / math.sqrt(k.size(-1)))", "(1.0 / k.size(-1))")  # a "rewrite" with the attention scale wrong
    baseline, candidate = _pair(tmp_path, wrong_scale)
    _, base, cand = _round(baseline, candidate, seed=6)
    numerics = compare_numerics(base.report, cand.report, baseline_grads=base.grads, candidate_grads=cand.grads)
    assert not numerics.passed and any("gradient of" in p or "loss" in p for p in numerics.problems)


def test_a_paired_gate_round_runs_two_script_children_side_by_side(tmp_path):
    baseline, candidate = _pair(tmp_path)
    inputs = RoundInputs.draw(random.Random(9), numerics_steps=2, warmup=1, steps=2, index_range=256)
    base, cand = run_pair((baseline, candidate), inputs, backend="cpu", extra_env=None, work_dir=None)
    assert base.run.failure is None and cand.run.failure is None, (base.run.failure, cand.run.failure)
    numerics = compare_numerics(base.report, cand.report, baseline_grads=base.grads, candidate_grads=cand.grads)
    assert numerics.passed and base.run.losses == cand.run.losses
    assert judge_conduct(base, cand, baseline.config.threads, "paired round") == []
    assert judge_timed(1, base, cand, numerics.tolerance) == []


def test_a_pair_whose_candidate_cannot_start_reports_both_sides(tmp_path):
    from trainbridge.sandbox.runner import run_workload_pair
    from trainbridge.sandbox.child.step_driver import StepPlan

    baseline, candidate = _pair(tmp_path)
    (candidate.root / "train.py").unlink()
    plan = StepPlan.sequential(1, 1)
    base, cand = run_workload_pair((baseline, candidate), (plan, plan))
    assert cand.failure is not None and "'train.py' of launch line" in cand.failure.message
    assert base.failure is not None and base.interrupted


@pytest.mark.slow
def test_run_gate_judges_a_script_mode_copy_with_matching_numerics(tmp_path):
    baseline, candidate = _pair(tmp_path)
    verdict = run_gate(baseline, candidate, rounds=2, steps_per_round=2, numerics_steps=2, rng=random.Random(1))
    assert verdict.numerics is not None and verdict.numerics.passed
    assert verdict.reason.value in ("not_significant", "accepted", "slower")  # speed is not asserted
