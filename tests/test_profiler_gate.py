"""The profiler gate: statistics on synthetic samples, numerics and integrity checks on real probe
data, and the whole gate on small real workloads in sandbox children. Nothing here asserts speed."""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from trainbridge.agents.profiler.calibration import calibrate_tolerance
from trainbridge.agents.profiler.gate import GateError, run_gate
from trainbridge.agents.profiler.integrity import FindingKind, check_config, check_probes, check_timed_losses
from trainbridge.agents.profiler.numerics import NumericsTolerance, compare_numerics, widen_tolerance
from trainbridge.agents.profiler.probe_report import ProbeReport
from trainbridge.agents.profiler.stats import (
    gate_decision,
    wants_more_rounds,
    SpeedOutcome,
    bootstrap_ci,
    decide_speed,
    paired_ratios,
    round_level,
    wilcoxon_signed_rank,
)
from trainbridge.agents.profiler.verdict import Verdict, VerdictReason
from trainbridge.sandbox.backends import Backend
from trainbridge.sandbox.numerics_probe import content_hash, run_numerics
from trainbridge.sandbox.workload import load_workload

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def synthetic_rounds(rng: random.Random, n: int, factor: float, noise: float = 0.03, steps: int = 5, drift: float = 0.05):
    """Paired rounds: each round shares a machine-state factor (drift), each step has its own noise."""
    base, cand = [], []
    for _ in range(n):
        shared = math.exp(rng.gauss(0, drift))
        base.append([shared * math.exp(rng.gauss(0, noise)) for _ in range(steps)])
        cand.append([shared * factor * math.exp(rng.gauss(0, noise)) for _ in range(steps)])
    return base, cand


# --- stats ------------------------------------------------------------------------------------

def test_a_round_level_is_the_median_of_its_steps_and_alternating_fast_and_slow_steps_gain_nothing():
    assert round_level([5.0, 1.0, 3.0, 100.0]) == 4.0  # an interrupted step (100) does not move it far
    assert round_level([4.0]) == 4.0
    # a candidate that defers every odd step's optimizer update to the next step keeps every loss and
    # parameter change: half its steps are fast, half slow by as much. Its rounds must read as the honest cost
    # (a faster-half mean would read 0.8 here)
    honest, deferring = [1.0] * 6, [0.8, 1.2, 0.8, 1.2, 0.8, 1.2]
    assert paired_ratios([honest, honest], [deferring, list(reversed(deferring))]) == [pytest.approx(1.0)] * 2


def test_paired_ratios_are_ratios_of_round_medians():
    assert paired_ratios([[1.0, 2.0, 9.0], [4.0]], [[1.0, 1.0, 1.0], [2.0]]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="unpaired"):
        paired_ratios([[1.0]], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="no step-time samples"):
        paired_ratios([[]], [[1.0]])


def test_wilcoxon_matches_brute_force_enumeration():
    for diffs in ([-0.3, -0.1, 0.2, -0.5, -0.05, -0.4, 0.01], [0.1, 0.1, -0.1, 0.2, 0.3, -0.05], [-1.0] * 6):
        magnitudes = sorted(abs(d) for d in diffs)
        ranks = {m: sum(i + 1 for i, x in enumerate(magnitudes) if x == m) / magnitudes.count(m) for m in magnitudes}
        observed = sum(ranks[abs(d)] for d in diffs if d > 0)
        sums = [sum(ranks[abs(d)] for d, s in zip(diffs, signs) if s) for signs in itertools.product([0, 1], repeat=len(diffs))]
        p_less, p_greater = wilcoxon_signed_rank(diffs)
        assert p_less == pytest.approx(sum(s <= observed + 1e-9 for s in sums) / len(sums))
        assert p_greater == pytest.approx(sum(s >= observed - 1e-9 for s in sums) / len(sums))
    assert wilcoxon_signed_rank([-1.0] * 6)[0] == pytest.approx(1 / 64)


def test_bootstrap_ci_is_reproducible_and_covers_the_true_ratio():
    values = [0.1, 0.3, -0.2, 0.05, 0.0]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    rng, covered, trials = random.Random(11), 0, 150
    for trial in range(trials):
        base, cand = synthetic_rounds(rng, 12, 0.97)
        decision = decide_speed(base, cand, min_gain=0.0, seed=trial, resamples=800)
        covered += decision.ci_low <= 0.97 <= decision.ci_high
    assert covered / trials >= 0.9, f"95% interval covered the truth in only {covered}/{trials} trials"


def test_a_a_comparison_is_rarely_accepted_and_a_fixed_one_is_not_significant():
    rng = random.Random(5)
    accepted = 0
    for trial in range(150):
        base, cand = synthetic_rounds(rng, 10, 1.0)
        accepted += decide_speed(base, cand, min_gain=0.01, seed=trial, resamples=800).outcome == SpeedOutcome.accepted
    assert accepted / 150 < 0.05
    base, cand = synthetic_rounds(random.Random(1), 10, 1.0)
    decision = decide_speed(base, cand)
    assert decision.outcome == SpeedOutcome.not_significant
    assert decision.ci_low < 1.0 < decision.ci_high and "not significant" in decision.message


def test_not_significant_message_names_the_check_that_failed():
    """Ten rounds 2% faster and two far slower: the bootstrap interval of the median lies below 1,
    but the two largest ranks carry the sign, so the signed-rank test does not confirm the gain."""
    base = [[0.1] * 3] * 12
    cand = [[0.098] * 3] * 10 + [[0.15] * 3] * 2
    decision = decide_speed(base, cand, min_gain=0.01)
    assert decision.outcome == SpeedOutcome.not_significant
    assert decision.ci_high < 1.0 and decision.p_faster >= 0.025
    assert "signed-rank test does not confirm a gain" in decision.message and "includes no change" not in decision.message
    neutral = decide_speed([[0.1]] * 8, [[0.1 * r] for r in (0.99, 1.01, 0.98, 1.02, 1.0, 0.995, 1.005, 1.0)])
    assert "the interval includes no change and the signed-rank test finds no direction" in neutral.message


def test_second_look_only_for_promising_inconclusive_first_looks():
    # first 8 rounds: 3% faster but three rounds the other way -> inconclusive, promising; 8 more clean rounds decide
    first_base, first_cand = [[0.1]] * 8, [[0.097]] * 5 + [[0.101]] * 3
    more_base, more_cand = [[0.1]] * 8, [[0.097]] * 8
    one_look = decide_speed(first_base, first_cand, min_gain=0.01)
    assert one_look.outcome == SpeedOutcome.not_significant and wants_more_rounds(one_look)
    two_looks = gate_decision(first_base + more_base, first_cand + more_cand, first=8, min_gain=0.01)
    assert two_looks.outcome == SpeedOutcome.accepted and two_looks.n == 16
    # a clear first look is final: later rounds are not even read
    clear = gate_decision([[0.1]] * 16, [[0.09]] * 8 + [[0.2]] * 8, first=8)
    assert clear.outcome == SpeedOutcome.accepted and clear.n == 8
    # the mirror image: a loss of 3% that the first look cannot confirm is called slower after the second
    loss = gate_decision([[0.1]] * 16, [[0.103]] * 5 + [[0.099]] * 3 + [[0.103]] * 8, first=8, min_gain=0.01)
    assert loss.outcome == SpeedOutcome.slower and loss.n == 16
    # an A/A-looking first look (estimate within min_gain of 1) gets no second look
    flat = gate_decision([[0.1]] * 16, [[0.1 * r] for r in (1.01, 0.995, 1.0, 1.02, 0.99, 1.0, 1.005, 0.998)] + [[0.05]] * 8, first=8)
    assert flat.n == 8 and flat.outcome == SpeedOutcome.not_significant


def test_clear_win_is_accepted_and_clear_loss_is_slower():
    base, cand = synthetic_rounds(random.Random(2), 10, 0.8)
    win = decide_speed(base, cand, min_gain=0.05)
    assert win.outcome == SpeedOutcome.accepted
    assert win.ci_low <= win.ratio <= win.ci_high < 1.0 and abs(win.ratio - 0.8) < 0.04
    assert win.gain == pytest.approx(1 - win.ratio) and win.n == 10 and len(win.round_ratios) == 10
    base, cand = synthetic_rounds(random.Random(3), 10, 1.25)
    loss = decide_speed(base, cand)
    assert loss.outcome == SpeedOutcome.slower and 1.0 < loss.ci_low and "slower" in loss.message


def test_gain_below_min_gain_and_too_few_rounds_are_not_significant():
    base, cand = synthetic_rounds(random.Random(4), 20, 0.97, noise=0.005, drift=0.002)
    small = decide_speed(base, cand, min_gain=0.05)
    assert small.outcome == SpeedOutcome.not_significant and small.ci_high < 1.0
    assert "below the required 5%" in small.message
    base, cand = synthetic_rounds(random.Random(4), 5, 0.5, noise=0.001, drift=0.001)
    few = decide_speed(base, cand)
    assert few.outcome == SpeedOutcome.not_significant and "need at least 6" in few.message


# --- numerics comparison on real gradients ------------------------------------------------------

def _tiny_parts(folder: str, seed: int = 3) -> dict:
    path = WORKLOADS / folder / "step.py"
    spec = importlib.util.spec_from_file_location(f"tb_test_{folder}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(device="cpu", seed=seed)


def _probe(folder: str, tmp_path: Path, seed: int = 3, indices=(7, 17, 30)) -> ProbeReport:
    request = {"numerics": {"seed": seed, "batch_indices": list(indices), "grads_path": str(tmp_path / f"{folder}.pt")}}
    torch.manual_seed(seed)
    return ProbeReport.model_validate(run_numerics(_tiny_parts(folder, seed), Backend("cpu"), request))


def test_probe_reports_gradients_losses_and_integrity_facts(tmp_path):
    report = _probe("tiny", tmp_path)
    grads = torch.load(report.grads_path, weights_only=True)
    assert sorted(grads) == sorted(report.param_names) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(list(grads[n].shape) == report.param_shapes[n] for n in grads) and all(g.abs().sum() > 0 for g in grads.values())
    assert len(report.losses) == 3 and report.losses[0] == pytest.approx(report.grad_loss)
    assert len(set(report.batch_hashes)) == 3 and report.batch_repeatable
    assert report.unchanged_params == [[], [], []] and report.same_loss_object == [False] * 3
    again = _probe("tiny", tmp_path / "again")
    assert again.losses == report.losses and again.batch_hashes == report.batch_hashes


def test_content_hash_sees_values_dtypes_and_structure():
    x = torch.arange(6.0).reshape(2, 3)
    assert content_hash((x, {"y": 1})) == content_hash((x.clone(), {"y": 1}))
    assert content_hash(x) != content_hash(x.double())
    assert content_hash(x) != content_hash(x.reshape(3, 2))
    y = x.clone()
    y[1, 2] += 1e-6
    assert content_hash(x) != content_hash(y)
    assert content_hash([x]) != content_hash((x,))
    assert content_hash(object()) is None


def test_identical_programs_pass_numerics(tmp_path):
    result = compare_numerics(_probe("tiny", tmp_path / "a"), _probe("tiny", tmp_path / "b"))
    assert result.passed, result.message
    assert result.grad_cosine_min == pytest.approx(1.0) and result.grad_max_abs_diff == 0.0
    assert result.loss_max_rel_diff == 0.0 and result.message.startswith("numerics match")


def test_equivalent_rewrite_passes_but_is_not_bitwise_identical(tmp_path):
    result = compare_numerics(_probe("tiny", tmp_path), _probe("tiny_rewrite_ok", tmp_path))
    assert result.passed, result.message
    assert 0.0 < result.grad_max_abs_diff < 1e-5 and result.grad_cosine_min > 0.99999


def test_wrong_math_is_a_mismatch_with_figures(tmp_path):
    result = compare_numerics(_probe("tiny", tmp_path), _probe("tiny_wrong_math", tmp_path))
    assert not result.passed
    assert result.grad_cosine_min < 0.9999 and result.loss_max_rel_diff > 1e-3
    assert "cosine" in result.message and "numerics mismatch" in result.message
    assert f"{result.grad_cosine_min:.6f}" in result.message


def _rewrite_grads(report: ProbeReport, path: Path, change) -> ProbeReport:
    grads = torch.load(report.grads_path, weights_only=True)
    change(grads)
    torch.save(grads, path)
    return report.model_copy(update={"grads_path": path})


def test_scaled_gradient_fails_on_max_abs_even_with_perfect_cosine(tmp_path):
    base = _probe("tiny", tmp_path)
    cand = _rewrite_grads(base, tmp_path / "scaled.pt", lambda g: g["2.weight"].mul_(1.01))
    result = compare_numerics(base, cand)
    assert not result.passed
    worst = next(p for p in result.params if p.name == "2.weight")
    assert worst.cosine == pytest.approx(1.0) and not worst.passed
    assert "gradient of '2.weight'" in result.message
    assert compare_numerics(base, cand, NumericsTolerance(grad_rtol=0.02)).passed


def test_missing_gradient_and_parameter_name_mismatch(tmp_path):
    base = _probe("tiny", tmp_path)
    lost = _rewrite_grads(base, tmp_path / "lost.pt", lambda g: g.pop("0.weight"))
    result = compare_numerics(base, lost)
    assert not result.passed and "no gradient reached '0.weight'" in result.message
    renamed = base.model_copy(update={
        "param_names": ["0.weight", "0.bias", "head.weight", "head.bias"],
        "param_shapes": {**{k: v for k, v in base.param_shapes.items() if k.startswith("0.")},
                         "head.weight": [1, 32], "head.bias": [1]},
    })
    result = compare_numerics(base, renamed)
    assert not result.passed
    assert result.missing_params == ["2.weight", "2.bias"] and result.extra_params == ["head.weight", "head.bias"]
    assert "'head.weight'" in result.message and "named_parameters" in result.message


def test_loss_trajectory_mismatch_names_the_step(tmp_path):
    base = _probe("tiny", tmp_path)
    drifted = base.model_copy(update={"losses": [base.losses[0], base.losses[1], base.losses[2] * 1.001]})
    result = compare_numerics(base, drifted)
    assert not result.passed and "train_step loss at step 2" in result.message
    assert compare_numerics(base, drifted, NumericsTolerance(loss_rtol=2e-3)).passed
    nan = base.model_copy(update={"losses": [base.losses[0], float("nan"), base.losses[2]]})
    assert "step 1 is nan" in compare_numerics(base, nan).message


def test_different_inputs_refuse_to_compare(tmp_path):
    with pytest.raises(ValueError, match="different inputs"):
        compare_numerics(_probe("tiny", tmp_path / "a"), _probe("tiny", tmp_path / "b", seed=4))


def test_widen_tolerance_follows_the_reference_drift(tmp_path):
    base = _probe("tiny", tmp_path)
    noisy = _rewrite_grads(base, tmp_path / "noisy.pt", lambda g: g["0.weight"].add_(torch.randn_like(g["0.weight"]) * 3e-3))
    noisy = noisy.model_copy(update={"losses": [v * (1 + 2e-4) for v in base.losses]})
    drift = compare_numerics(base, noisy)
    wider = widen_tolerance(NumericsTolerance(), [drift], margin=10.0)
    assert wider.grad_cosine_min == pytest.approx(1 - 10 * (1 - drift.grad_cosine_min))
    assert wider.loss_rtol == pytest.approx(10 * drift.loss_max_rel_diff) and wider.grad_rtol > 1e-3
    assert compare_numerics(base, noisy, wider).passed
    quiet = widen_tolerance(NumericsTolerance(), [compare_numerics(base, base)], margin=10.0)
    assert quiet == NumericsTolerance()  # never tighter than the base


# --- integrity -----------------------------------------------------------------------------------

def test_probe_integrity_flags_skipping_caching_and_tampering(tmp_path):
    base = _probe("tiny", tmp_path)
    assert check_probes(base, _probe("tiny_rewrite_ok", tmp_path)) == []
    kinds = {f.kind for f in check_probes(base, _probe("tiny_skips_work", tmp_path))}
    assert kinds == {FindingKind.skipped_work}
    messages = " ".join(f.message for f in check_probes(base, _probe("tiny_skips_work", tmp_path)))
    assert "same loss object" in messages and "unchanged" in messages
    tampered = check_probes(base, _probe("tiny_tampers_batch", tmp_path))
    assert tampered and tampered[0].kind == FindingKind.tampered_inputs and "[7, 17]" in tampered[0].message


def test_integrity_only_flags_what_the_baseline_does_not_do(tmp_path):
    base = _probe("tiny", tmp_path)
    frozen_step = base.model_copy(update={"unchanged_params": [["0.weight"], [], []]})  # e.g. a zero LR warm-up step
    assert check_probes(frozen_step, frozen_step) == []
    finding = check_probes(base, frozen_step)
    assert len(finding) == 1 and "train_step 0 left 1 parameter(s) unchanged" in finding[0].message


def test_config_and_timed_loss_checks():
    workload = load_workload(WORKLOADS / "tiny")
    assert check_config(workload.config, workload.config) == []
    changed = check_config(workload.config, workload.with_overrides(seed=9, steps=1).config)
    assert changed[0].kind == FindingKind.tampered_inputs and "seed: 0 -> 9" in changed[0].message
    assert check_timed_losses(0, [1.0, 0.9], [1.0, 0.9 + 1e-9], 1e-3, 1e-6) == []
    gamed = check_timed_losses(2, [1.0, 0.9], [1.0, 0.95], 1e-3, 1e-6)
    assert gamed[0].kind == FindingKind.skipped_work and "timed round 2 at step 1" in gamed[0].message


def test_verdict_record_is_strict():
    with pytest.raises(ValueError, match="contradicts"):
        Verdict(accepted=True, reason=VerdictReason.slower, message="x", backend="cpu", phase="done")
    with pytest.raises(ValueError):
        Verdict(accepted=False, reason=VerdictReason.slower, message="x", backend="cpu", phase="done", typo=1)


# --- the gate on real workloads in sandbox children -----------------------------------------------

def gate(candidate: str, baseline: str = "tiny", **kwargs) -> Verdict:
    kwargs.setdefault("rng", random.Random(7))
    return run_gate(load_workload(WORKLOADS / baseline), load_workload(WORKLOADS / candidate), **kwargs)


def test_gate_rejects_wrong_math_with_numerics_mismatch():
    phases = []
    verdict = gate("tiny_wrong_math", rounds=2, on_progress=lambda *event: phases.append(event))
    assert not verdict.accepted and verdict.reason == VerdictReason.numerics_mismatch and verdict.phase == "numerics"
    assert verdict.numerics.grad_cosine_min < 0.9999 and "cosine" in verdict.message
    assert verdict.baseline_rounds == [] and verdict.speed is None  # no timing after a mismatch
    assert phases == [("numerics", 0, 2), ("numerics", 2, 2)]  # a paired round finishes both sides at once
    assert verdict.candidate_versions["torch"] == torch.__version__


def test_gate_rejects_a_candidate_that_skips_work():
    verdict = gate("tiny_skips_work", rounds=2)
    assert verdict.reason == VerdictReason.skipped_work and not verdict.accepted
    assert any("cached" in f.message for f in verdict.findings)


def test_gate_rejects_a_changed_data_pipeline():
    verdict = gate("tiny_tampers_batch", rounds=2)
    assert verdict.reason == VerdictReason.tampered_inputs and "data pipeline" in verdict.message


def test_gate_rejects_a_changed_config_without_running_anything():
    base = load_workload(WORKLOADS / "tiny")
    verdict = run_gate(base, base.with_overrides(seed=42))
    assert verdict.reason == VerdictReason.tampered_inputs and verdict.phase == "config"


def test_gate_refuses_command_mode_workloads():
    command = load_workload(WORKLOADS / "command_mode")
    with pytest.raises(GateError, match="entry"):
        run_gate(command, command)


def test_gate_types_a_crashing_candidate():
    verdict = gate("tiny_crashes", rounds=2)
    assert verdict.reason == VerdictReason.crashed and verdict.failure.exception_type == "RuntimeError"
    assert "shapes cannot be multiplied" in verdict.message


def test_gate_raises_when_the_baseline_itself_fails():
    with pytest.raises(GateError, match="baseline failed in the numerics check"):
        gate("tiny", baseline="tiny_crashes", rounds=2)


def test_gate_in_npu_emulation_verifies_numerics_and_leaves_speed_unmeasured():
    verdict = gate("tiny_npu_fused", baseline="tiny_npu", backend="npu", emulated_speed=True)  # the runner picks the emulation
    assert verdict.reason == VerdictReason.speed_unmeasured_numerics_ok and not verdict.accepted, verdict.message
    assert verdict.numerics.passed and verdict.baseline_rounds == []
    assert verdict.candidate_versions["torch_npu"].endswith("(emulated)")
    # NPU kernels per step, counted on the emulated device: the fused norm is one kernel forward and one
    # backward where the eager norm (pow, mean, add, rsqrt, mul, mul) launched several each way
    kernels = verdict.device_kernels
    assert kernels is not None and 0 < kernels.candidate < kernels.baseline, verdict.message
    assert kernels.describe() in verdict.message and "Speed unmeasured" in verdict.message


@pytest.mark.slow
def test_gate_times_an_equivalent_rewrite_in_alternating_rounds():
    events = []
    ratios = []

    def record(phase, done, total, ratio=None):  # takes the running ratio (issue 27)
        events.append((phase, done, total))
        ratios.append(ratio)

    verdict = gate("tiny_rewrite_ok", rounds=2, steps_per_round=2, on_progress=record)
    assert verdict.numerics.passed and verdict.phase == "done"
    # a round the machine was busy in is measured again (at most 1 of 2 here): the order keeps alternating
    measured = 2 + len(verdict.busy_rounds)
    assert len(verdict.busy_rounds) <= 1 and verdict.round_order == ["AB", "BA", "AB"][:measured]
    assert [len(r) for r in verdict.baseline_rounds] == [2] * measured == [len(r) for r in verdict.candidate_rounds]
    # two rounds can never be significant: a property of the test, not of this machine's speed
    assert verdict.reason == VerdictReason.not_significant and "need at least 6" in verdict.message
    assert verdict.ratio_ci[0] <= verdict.ratio <= verdict.ratio_ci[1]
    assert events[-1] == ("timing", measured, measured)
    assert ratios[-1] == pytest.approx(verdict.ratio)  # the last running ratio is the decision's own estimate
    assert [r is None for r in ratios[:3]] == [True] * 3  # numerics start/end and "timing starts" carry none


def test_the_gates_progress_carries_the_running_ratio_to_a_callback_that_takes_it():
    """Issue 27 asks for "gate round k of n with the running ratio": after each timed round the gate passes `ratio`,
    the speed decision's own estimate over the rounds so far, to a callback that takes it; a (phase, done, total)
    callback is called with those three, as before. No gate run: the rounds are given."""
    from trainbridge.agents.profiler.gate import progress_caller, running_ratio
    from trainbridge.agents.profiler.sequential import SequentialGate

    seq = SequentialGate((6, 8))
    assert running_ratio(seq) is None
    base = [[1.0, 1.1, 0.9], [2.0, 2.0, 2.2], [1.0, 1.0, 1.0]]
    cand = [[0.9, 1.0, 0.8], [2.2, 2.0, 2.2], [1.1, 1.1, 1.1]]
    seen = []
    for b, c in zip(base, cand):
        seq.add_round(b, c, None)
        seen.append(running_ratio(seq))
    # round medians 0.9/1.0, 2.2/2.0, 1.1/1.0: per-round ratios 0.9, 1.1, 1.1; of two, the geometric mean of the middle
    assert seen == pytest.approx([0.9, math.sqrt(0.9 * 1.1), 1.1])
    assert seen[-1] == pytest.approx(decide_speed(base, cand).ratio)
    plain, star, keyword, anything = [], [], [], []
    for callback in (lambda phase, done, total: plain.append((phase, done, total)), lambda *event: star.append(event),
                     lambda phase, done, total, ratio=None: keyword.append(ratio), lambda *a, **k: anything.append(k)):
        progress_caller(callback)("timing", 3, 6, ratio=0.9)
    progress_caller(None)("timing", 3, 6, ratio=0.9)  # no callback: nothing to call
    assert plain == star == [("timing", 3, 6)] and keyword == [0.9] and anything == [{"ratio": 0.9}]


@pytest.mark.slow
def test_gate_catches_work_skipped_only_when_timed():
    verdict = gate("tiny_skips_when_timed", rounds=3, steps_per_round=3)
    assert verdict.numerics.passed  # honest when checked ...
    # ... not when timed: every round's timed steps are checked like the probe, the first round's included
    assert verdict.reason == VerdictReason.skipped_work and verdict.phase == "numerics"
    assert "timed" in verdict.findings[0].message
    assert verdict.baseline_rounds == [] and "timed run computes something else" in verdict.message  # no round counted


def test_calibration_measures_the_baseline_drift_across_thread_counts():
    calibration = calibrate_tolerance(load_workload(WORKLOADS / "tiny"), rng=random.Random(3))
    (label, drift), = calibration.drifts.items()
    assert label == "threads=1 vs 2" and drift.passed
    base = calibration.base
    assert calibration.tolerance.grad_cosine_min <= base.grad_cosine_min and calibration.tolerance.loss_rtol >= base.loss_rtol
