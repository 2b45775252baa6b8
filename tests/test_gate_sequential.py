"""The gate's sequential stopping rule (agents/profiler/sequential.py): its level keeps the false-accept
rate over all looks, it stops early when the data decide either way and goes on when they are close,
and `run_gate` decides exactly as benchmarks/gate_calibration.py's replay of the same samples."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest

from trainbridge.agents.profiler import gate as gate_module
from trainbridge.agents.profiler.sequential import (
    FIRST_LOOK,
    SequentialGate,
    look_levels,
    looks,
    nominal_level,
    replay,
    unanimous_level,
)
from trainbridge.agents.profiler.stats import SpeedOutcome, wilcoxon_signed_rank
from trainbridge.sandbox.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "2026-12-01-gate-calibration-llama-paired.json"
TINY = Path(__file__).parent / "fixtures" / "workloads" / "tiny"


def _rounds(ratios, base=0.1):
    return [[base] * 3 for _ in ratios], [[base * r] * 3 for r in ratios]


def test_looks_start_at_the_first_decidable_round_and_end_at_the_last():
    assert looks(10, 20) == (6, 8, 10, 12, 14, 16, 18, 20)
    assert looks(10, 10) == (6, 8, 10)
    assert looks(10, 11) == (6, 8, 10, 11)
    assert looks(2, 2) == (2,) and looks(3, 6) == (3, 5, 6)
    with pytest.raises(ValueError):
        looks(5, 4)


def test_the_level_per_look_keeps_the_false_accept_rate_over_the_whole_schedule():
    schedule = looks(10, 20)
    alpha = 0.025
    level = nominal_level(schedule, alpha)
    assert nominal_level((10,), alpha) == alpha  # one look: the plain test
    assert 0.004 < level < alpha  # several looks: stricter at each
    # an independent check on another null distribution (heavy-tailed, another seed) with the real test function:
    # the chance that any look calls a no-change candidate faster stays at alpha, and naive repeated testing would not
    rng = random.Random(99)
    crossed = naive = 0
    trials = 1500
    for _ in range(trials):
        d = [rng.choice((-1, 1)) * rng.expovariate(1.0) for _ in range(schedule[-1])]
        ps = [wilcoxon_signed_rank(d[:n])[0] for n in schedule]
        crossed += min(ps) < level
        naive += min(ps) < alpha
    assert crossed / trials < alpha + 0.012  # Monte Carlo slack (sd ~0.004)
    assert naive / trials > 2 * alpha  # what the schedule's level protects against


def test_the_levels_with_a_unanimous_first_look_keep_the_false_accept_rate():
    """The first look decides only when all its rounds agree (spending 2**-6 of alpha); the later
    looks share the rest: checked on an independent heavy-tailed null with the real test function."""
    schedule, alpha = looks(10, 20), 0.025
    levels = look_levels(schedule, alpha)
    assert levels[0] == unanimous_level(6) == 2 ** -5 and len(set(levels[1:])) == 1
    assert 0.002 < levels[1] < nominal_level(schedule, alpha)  # stricter than Pocock after the first look
    assert look_levels((4, 6, 8), alpha) == (nominal_level((4, 6, 8), alpha),) * 3  # a unanimous 4 would spend too much
    rng = random.Random(7)
    crossed, trials = 0, 2000
    for _ in range(trials):
        d = [rng.choice((-1, 1)) * rng.paretovariate(1.5) for _ in range(schedule[-1])]
        crossed += any(wilcoxon_signed_rank(d[:n])[0] < level for n, level in zip(schedule, levels))
    assert crossed / trials < alpha + 0.01  # Monte Carlo slack (sd ~0.0035)


def test_a_clear_win_stops_at_the_first_look_when_every_round_agrees():
    gate = SequentialGate(looks(10, 20))
    base, cand = _rounds([0.9] * 20)
    for i in range(20):
        if gate.add_round(base[i], cand[i], 2.0) is not None:
            break
    assert gate.decision.outcome == SpeedOutcome.accepted and gate.stopped == "decided"
    assert len(gate.baseline_rounds) == 6
    assert gate.decision.look_rounds == [6] and "sequential: look 1 of 8" in gate.decision.message


def test_one_round_against_the_trend_moves_the_decision_to_a_later_look():
    ratios = [0.9, 0.9, 1.001, 0.9, 0.9, 0.9] + [0.9] * 14  # the smallest-magnitude round the other way
    gate = replay(*_rounds(ratios), None, rounds=10, max_rounds=20)
    assert gate.decision.outcome == SpeedOutcome.accepted and len(gate.baseline_rounds) > 6


def test_a_clear_loss_is_called_slower_early_and_a_flat_result_stops_for_futility():
    base, cand = _rounds([1.1] * 20)
    slow = replay(base, cand, None, rounds=10, max_rounds=20)
    assert slow.decision.outcome == SpeedOutcome.slower and len(slow.baseline_rounds) == 6
    flat_ratios = [1.02, 1 / 1.02, 1.01, 1 / 1.01, 1.03, 1 / 1.03] * 4
    flat = replay(*_rounds(flat_ratios), None, rounds=10, max_rounds=20)
    assert flat.decision.outcome == SpeedOutcome.not_significant and flat.stopped == "futility"
    assert len(flat.baseline_rounds) == FIRST_LOOK


def test_a_close_call_goes_on_to_later_looks():
    # a gain of ~2% under noise: no look before the last decides or gives up at once
    rng = random.Random(3)
    ratios = [math.exp(-0.02 + rng.gauss(0, 0.02)) for _ in range(20)]
    gate = replay(*_rounds(ratios), None, rounds=10, max_rounds=20)
    assert len(gate.looks_taken) >= 2 and len(gate.baseline_rounds) > FIRST_LOOK


def test_busy_rounds_do_not_count_towards_a_look():
    gate = SequentialGate(looks(10, 20))
    base, cand = _rounds([0.9] * 20)
    cores = [2.0, 2.0, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    for i, c in enumerate(cores):
        if gate.add_round(base[i], cand[i], c) is not None:
            break
    assert gate.busy == [2]
    assert len(gate.baseline_rounds) == 7 and gate.decision.n == 6  # one more round measured in place of the busy one


def _recorded(condition: str, count: int):
    record = json.loads(RECORDED.read_text(encoding="utf-8"))
    rounds = []
    for entry in record["rounds"][:count]:
        pair = entry["pairs"][condition]
        rounds.append({"baseline": pair["base"], "candidate": pair[condition],
                       "cores": {"baseline": pair["cores"]["base"], "candidate": pair["cores"][condition]}})
    return rounds


@pytest.mark.parametrize("condition", ["slow_0.05", "base_again"])
def test_run_gate_decides_exactly_as_the_calibration_replay_of_the_same_samples(monkeypatch, condition):
    """The real gate on a tiny workload, whose rounds after the real first one (numerics, conduct and
    drift are really run) replay recorded llama samples; the gate's verdict must be what
    `sequential.replay` (benchmarks/gate_calibration.py's decision) says on those samples."""
    recorded = _recorded(condition, 20)
    real_pair = gate_module.run_pair
    calls = []

    def replaying_pair(workloads, inputs, **kwargs):
        index = len(calls)
        if index == 0:
            calls.append(real_pair(workloads, inputs, **kwargs))
        else:
            calls.append(tuple(copy.deepcopy(side) for side in calls[0]))
        sides = calls[-1]
        for position, side in enumerate(sides):
            role = "candidate" if position == kwargs["orphans_to"] else "baseline"
            side.run.step_times_s = list(recorded[index][role])
            side.run.watch.cores_used = recorded[index]["cores"][role]
        return sides

    baseline, candidate = load_workload(TINY), load_workload(TINY)
    monkeypatch.setattr(gate_module, "run_pair", replaying_pair)
    verdict = gate_module.run_gate(baseline, candidate, rounds=10, max_rounds=20, steps_per_round=3, pairing="paired")
    expected = replay([r["baseline"] for r in recorded], [r["candidate"] for r in recorded],
                      [r["cores"]["baseline"] for r in recorded], rounds=10, max_rounds=20)
    assert verdict.phase == "done", verdict.message
    assert verdict.speed.outcome == expected.decision.outcome and verdict.ratio == expected.decision.ratio
    assert len(verdict.baseline_rounds) == len(expected.baseline_rounds) == len(calls)
    assert verdict.speed.look_rounds == expected.looks_taken and verdict.busy_rounds == expected.busy
    assert verdict.spawn == "fork-server"
    if condition == "slow_0.05":
        assert verdict.reason.value == "slower"
