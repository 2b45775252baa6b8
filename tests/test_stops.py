"""The limits that end the loop, typed, in one place (graph/stops.py)."""

from __future__ import annotations

import time

from trainbridge.graph.state import RunConfig
from trainbridge.graph.stops import NO_INTENTS, StopReason, limit_reached, stop_reason


def _config(**overrides) -> RunConfig:
    return RunConfig(repo="/nonexistent", run_id="r", **overrides)


def test_each_limit_has_its_typed_reason():
    now = time.time()
    fresh = {"started_at": now}
    assert limit_reached(fresh, _config()) is None
    assert limit_reached({"started_at": now - 20}, _config(budget_s=10)).reason is StopReason.budget_spent
    gates = [{"node": "profiler", "wall_s": 90.0, "parts": {}}]
    short = {"started_at": now - 540, "phase_times": gates}
    assert limit_reached(short, _config(budget_s=600)).reason is StopReason.budget_short
    assert limit_reached({**fresh, "candidates_tried": 3}, _config(max_candidates=3)).reason is StopReason.candidate_limit
    assert limit_reached({**fresh, "low_gain_rounds": 2}, _config(low_gain_rounds_to_stop=2)).reason is StopReason.low_gain
    # the budget comes first: a run past its budget says so even at its candidate limit
    assert limit_reached({"started_at": now - 20, "candidates_tried": 3}, _config(budget_s=10, max_candidates=3)).reason \
        is StopReason.budget_spent


def test_the_report_states_the_limit_or_what_retrieval_said():
    config = _config(max_candidates=3)
    assert stop_reason({"started_at": time.time(), "candidates_tried": 3}, config) == "candidate limit (3) reached"
    assert stop_reason({"started_at": time.time()}, config) == NO_INTENTS.message == "no intents left"
    assert stop_reason({"stop_reason": "no intents left", "candidates_tried": 3}, config) == "no intents left"


def test_the_closing_comparison_is_reserved_from_the_runs_own_children_and_compile():
    """The demo's run of 2026-12-02: a 3.8 s baseline child and a 64.8 s compile reference; six rounds of three
    arms took 167 s after the loop, which the old estimate (a typical gate's children) put at 45 s."""
    from trainbridge.graph.stops import final_comparison_s

    config = _config(final_rounds=6, gate_rounds=8, compile_reference=True)
    times = [{"node": "prepare", "wall_s": 3.9, "parts": {"baseline": 3.8}},
             {"node": "analyst", "wall_s": 70.9, "parts": {"reference": 64.8}}]
    assert final_comparison_s({"phase_times": times}, config, typical_gate_s=40.0) == 3 * 6 * 3.8 + 64.8
    assert final_comparison_s({"phase_times": times}, _config(final_rounds=6, gate_rounds=8, compile_reference=False),
                              typical_gate_s=40.0) == 2 * 6 * 3.8
    assert final_comparison_s({"phase_times": []}, config, typical_gate_s=40.0) == 40.0 * 18 / 16  # nothing measured yet
    assert final_comparison_s({"phase_times": times}, _config(final_rounds=0, compile_reference=True), typical_gate_s=40.0) == 0.0
    # 620 s into a 780 s budget with 60 s gates: the old estimate (68 s) let one more gate start, the run's own figures do not
    state = {"started_at": time.time() - 620, "phase_times": [*times, {"node": "profiler", "wall_s": 60.0, "parts": {}}]}
    assert limit_reached(state, _config(budget_s=780, final_rounds=6, gate_rounds=8, compile_reference=True)).reason \
        is StopReason.budget_short


def test_an_npu_target_on_the_emulation_holds_nothing_back_for_a_closing_comparison(monkeypatch):
    """Issue 25: its candidates wait, speed unmeasured, on the pending branch; the report compares nothing, so a
    30-minute run that stopped at 16 minutes to keep 13 for that comparison now spends them on candidates."""
    from trainbridge.graph import stops
    from trainbridge.sandbox import backends

    times = [{"node": "prepare", "wall_s": 3.9, "parts": {"baseline": 3.8}},
             {"node": "analyst", "wall_s": 70.9, "parts": {"reference": 64.8}}]
    npu = _config(target="npu", final_rounds=6, gate_rounds=8, compile_reference=True)
    monkeypatch.setattr(backends, "npu_emulated", lambda: True)
    assert stops.final_comparison_s({"phase_times": times}, npu, typical_gate_s=40.0) == 0.0
    state = {"started_at": time.time() - 620, "phase_times": [*times, {"node": "profiler", "wall_s": 60.0, "parts": {}}]}
    assert stops.limit_reached(state, _config(target="npu", budget_s=780, final_rounds=6, gate_rounds=8)) is None
    # its first gate is estimated as what an emulated gate runs (probe, first round, drift child), not a look's rounds:
    # Modded-NanoGPT's late records (20 s a step) stopped at a 2400 s budget before their first candidate
    assert stops.typical_gate_s({"phase_times": times}, npu) == 4 * 3.8
    monkeypatch.setattr(backends, "npu_emulated", lambda: False)  # a real NPU: the comparison runs and is reserved
    assert stops.final_comparison_s({"phase_times": times}, npu, typical_gate_s=40.0) == 3 * 6 * 3.8 + 64.8
    assert stops.typical_gate_s({"phase_times": times}, npu) == (6 + 2) * 3.8  # and its gates time rounds


def test_a_resumed_run_does_not_count_the_time_it_was_down(monkeypatch, tmp_path):
    """An 8-hour run killed at hour 2 and resumed the next day has 6 hours left, not none (issue 27)."""
    from trainbridge.graph import runs

    now = time.time()
    day_old = {"started_at": now - 26 * 3600}  # started yesterday, checkpointed two hours in
    config = _config(budget_s=8 * 3600)
    assert limit_reached(day_old, config).reason is StopReason.budget_spent  # the clock from started_at alone
    used = runs.resume_used_s(day_old, checkpoint_at=now - 24 * 3600)
    assert abs(used - 2 * 3600) < 1
    assert limit_reached(day_old, config.model_copy(update={"budget_origin": now - used})) is None
    assert runs.resume_used_s({}, checkpoint_at=now) == 0.0 and runs.resume_used_s(day_old, None) == 0.0

    seen = []
    paths = runs.RunPaths("r", tmp_path)
    paths.dir.mkdir()
    monkeypatch.setattr(runs, "load_config", lambda run_id, root, checkpoint: (config, paths))
    monkeypatch.setattr(runs, "run_status", lambda run_id, root, checkpoint: {
        "waiting_for_review": None, "finished": False, "state": day_old, "checkpoint_at": now - 24 * 3600})
    monkeypatch.setattr(runs, "_invoke", lambda config, paths, payload, say: seen.append(config))
    said = []
    runs.resume_run("r", say=said.append)
    assert abs(seen[0].budget_origin - (time.time() - 2 * 3600)) < 5 and seen[0].budget_s == 8 * 3600
    assert "120.0 of 480.0 min used before the stop" in said[0]
    runs.resume_run("r", say=said.append, budget_s=1800)  # `resume --budget 30m`: 30 minutes from now
    assert seen[1].budget_s == 1800 and abs(seen[1].budget_origin - time.time()) < 5 and "30.0 min from now" in said[1]
    assert limit_reached(day_old, seen[1]) is None


def _gate(timing_s: float, rounds: int) -> dict:
    return {"accepted": False, "gate": {"wall_s": timing_s + 20.0, "rounds": rounds, "timing_s": timing_s}}


def test_a_slow_first_child_stops_counting_once_the_runs_gates_time_rounds():
    """Issue 27: on a fresh clone at a load of ~2 the demo's first baseline child took 47 s instead of 4 s, and the
    13-minute demo stopped after one candidate, 12 intents left. The estimate now follows the run's latest gates."""
    from trainbridge.graph.stops import baseline_child_s, budget_allows_another

    config = _config(budget_s=780, final_rounds=6, gate_rounds=8, compile_reference=False)
    prepare = [{"node": "prepare", "wall_s": 48.0, "parts": {"baseline": 47.0}}]
    now = time.time()
    cold = {"started_at": now - 100, "phase_times": prepare}
    assert baseline_child_s(cold) == 47.0
    # before any gate: room for the first candidate and one closing round (8 x 47 + 2 x 47 = 470 s of 680 left)
    assert budget_allows_another(cold, config)
    gated = {"started_at": now - 200, "phase_times": [*prepare, {"node": "profiler", "wall_s": 60.0, "parts": {}}],
             "verdicts": [_gate(timing_s=36.0, rounds=10)]}  # nine timed rounds of 4 s each
    assert baseline_child_s(gated) == 4.0
    assert budget_allows_another(gated, config)  # 200 + 60 + 2 x 6 x 4 = 308 s <= 780 s; the first child's 47 s: 884 s
    later = {**gated, "verdicts": [_gate(36.0, 10), _gate(90.0, 10), _gate(45.0, 10), {"accepted": False, "gate": {}}]}
    assert baseline_child_s(later) == 5.0  # the median of the last three that timed rounds: 4, 10, 5 s


def test_the_closing_comparison_runs_the_rounds_that_fit_in_what_the_budget_left():
    from trainbridge.graph.stops import closing_rounds_that_fit

    config = _config(budget_s=780, final_rounds=6, gate_rounds=8, compile_reference=False)
    times = [{"node": "prepare", "wall_s": 4.0, "parts": {"baseline": 4.0}}, {"node": "profiler", "wall_s": 30.0, "parts": {}}]
    verdicts = [_gate(timing_s=40.0, rounds=11)]  # 4 s a round
    now = time.time()
    assert closing_rounds_that_fit({"started_at": now - 100, "phase_times": times, "verdicts": verdicts}, config) == 6
    # 740 s used: 40 s left, a round of two arms is 8 s (and never less than a typical gate's share, 30 x 2 / 16)
    assert closing_rounds_that_fit({"started_at": now - 740, "phase_times": times, "verdicts": verdicts}, config) == 4
    assert closing_rounds_that_fit({"started_at": now - 800, "phase_times": times, "verdicts": verdicts}, config) == 0
    assert closing_rounds_that_fit({"started_at": now, "phase_times": times, "verdicts": verdicts}, _config(final_rounds=0)) == 0


def test_the_reanalysis_after_an_accepted_commit_is_counted_before_it_runs():
    """After a commit lands the loop re-analyses the new head before choosing again (58 s for gpt2_pretrain on the busy
    host): that was in no estimate, so a run could stop an analysis past its budget. A re-analysis does not compile the
    reference again: the first analysis's reference time is not counted."""
    from trainbridge.graph.stops import budget_allows_another, reanalysis_s

    config = _config(budget_s=1000, final_rounds=0, gate_rounds=8, compile_reference=False)
    times = [{"node": "prepare", "wall_s": 5.0, "parts": {"baseline": 4.0}},
             {"node": "analyst", "wall_s": 450.0, "parts": {"reference": 200.0}},  # a re-analysis: 250 s of it
             {"node": "profiler", "wall_s": 100.0, "parts": {}}]
    landed = {"started_at": time.time() - 700, "phase_times": times, "eager_ops_sha": "a" * 40,
              "verdicts": [{"accepted": True, "sha": "b" * 40, "gate": {}}]}
    assert reanalysis_s(landed) == 250.0
    assert not budget_allows_another(landed, config)  # 700 + 250 + 100 > 1000
    analysed = {**landed, "eager_ops_sha": "b" * 40}  # the new head analysed: only a gate to fit
    assert reanalysis_s(analysed) == 0.0 and budget_allows_another(analysed, config)  # 700 + 100 <= 1000


def test_each_candidate_starts_with_where_the_run_stands_against_its_budget():
    """Issue 27: no ETA from the run's own figures. Said as each candidate starts: time used, the next gate's and the
    closing comparison's estimates, and how many more candidates like the typical one fit."""
    from trainbridge.graph.stops import budget_line

    config = _config(budget_s=1802, final_rounds=0, gate_rounds=8, compile_reference=False)
    state = {"started_at": time.time() - 600, "phase_times": [{"node": "prepare", "wall_s": 5.0, "parts": {"baseline": 4.0}},
                                                              {"node": "profiler", "wall_s": 120.0, "parts": {}}]}
    assert budget_line(state, config) == ("  budget: 10.0 of 30.0 min used; a gate about 2.0 min, the closing comparison "
                                          "about 0.0 min; room for about 10 more candidate(s) like that")
