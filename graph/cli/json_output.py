"""The record `run`, `resume` and `report` write with `--json` (the option itself is knowledge/cli_json.py's, one
contract for every command): where the run stands when the command returns, its accepted commits with their gate
figures, every verdict, the closing comparison and the report's paths.
"""

from __future__ import annotations

from typing import Any

from trainbridge.knowledge.cli_json import json_option, to_stdout, write_json

__all__ = ["json_option", "outcome_condition", "run_record", "to_stdout", "write_json"]


VERDICT_KEYS = ("candidate", "intent_id", "category", "recipe_id", "accepted", "reason", "ratio", "ratio_ci", "sha", "message")


def run_record(run_id: str, state: dict[str, Any], *, condition: str, error: str | None = None) -> dict[str, Any]:
    """A run as `run --json` / `resume --json` / `report --json` give it (one JSON object)."""
    from trainbridge.graph.runs import intents_left

    accepted = state.get("accepted") or []
    product = 1.0
    for record in accepted:
        product *= record.get("ratio") or 1.0
    return {
        "run_id": run_id, "condition": condition, "error": error, "stop_reason": state.get("stop_reason"),
        "run_branch": state.get("run_branch"), "base_sha": state.get("base_sha"), "baseline_step_s": state.get("baseline_step_s"),
        "candidates_tried": state.get("candidates_tried") or 0, "intents_left": intents_left(state) if state else None,
        "accepted": [{**{k: a.get(k) for k in VERDICT_KEYS if k != "message"}, "gate": a.get("gate")} for a in accepted],
        "accepted_ratio_product": product,
        "verdicts": [{k: v.get(k) for k in VERDICT_KEYS} for v in state.get("verdicts") or []],
        "final_comparison": state.get("final_comparison"),
        "eager_ops": {"before": state.get("eager_ops_before"), "last_analysis": state.get("eager_ops_now"),
                      "last_analysis_head": state.get("eager_ops_sha")},
        "report_paths": state.get("report_paths") or [],
    }


def outcome_condition(outcome) -> str:
    """finished, waiting for review, or stopped (where), of a RunOutcome."""
    if outcome.waiting_for_review is not None:
        return "waiting for review"
    if outcome.finished:
        return "finished"
    return f"stopped at {outcome.state.get('node')}"
