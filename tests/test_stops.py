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
