"""The coder agent's turn: the next recipe of the queue that applies, else (once per intent) an LLM
patch; every recipe that does not apply is a refusal the run records as a verdict."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainbridge.agents.coder.candidate import Candidate, CoderRefusal, make_candidate
from trainbridge.records import Intent


@dataclass
class CoderTurn:
    """What one turn made: a candidate (or None), the recipes still queued, and the refusal records."""

    candidate: Candidate | None
    queue: list[str]
    refusals: list[dict[str, Any]] = field(default_factory=list)


def refusal_record(intent: Intent, refusal: CoderRefusal) -> dict[str, Any]:
    """A verdict record for a recipe that did not apply (the state's `verdicts` entry shape)."""
    return {"intent_id": intent.id, "category": str(intent.category), "recipe_id": refusal.recipe_id, "candidate": None,
            "accepted": False, "reason": "not_applicable", "message": refusal.reason, "ratio": None, "ratio_ci": None}


def coder_turn(workspace, intent: Intent, queue: Sequence[str], *, kb, llm, verdicts: Sequence[dict[str, Any]],
               feedback: str | None, target: str, overlay: str | None, say: Callable[[str], None]) -> CoderTurn:
    """Apply the first recipe of ``queue`` that fits ``intent``; when none does and an LLM is configured
    (and has not been asked for this intent yet), ask it for a patch confined to the intent's span."""
    queue = list(queue)
    refusals: list[dict[str, Any]] = []
    attempt = sum(1 for v in verdicts if v.get("intent_id") == intent.id)
    while queue:
        recipe = kb.get_recipe(queue.pop(0))
        if recipe is None:
            continue
        made = make_candidate(workspace, intent, recipe, attempt, overlay=overlay)
        if isinstance(made, Candidate):
            say(f"candidate {made.name}: {', '.join(made.files)}")
            return CoderTurn(made, queue, refusals)
        refusals.append(refusal_record(intent, made))
    if intent.library is not None:  # an LLM patch is confined to the intent's spans: the call site, not the region
        return CoderTurn(None, [], refusals)
    if llm is not None and not any(v.get("intent_id") == intent.id and v.get("recipe_id") is None for v in verdicts):
        from trainbridge.agents.coder.llm.patch import llm_candidate

        say(f"no recipe fits {intent.category}: asking the LLM for a patch confined to the span")
        made = llm_candidate(workspace, intent, llm, feedback=feedback, target=target, attempt=attempt)
        if isinstance(made, Candidate):
            return CoderTurn(made, [], refusals)
        refusals.append({**refusal_record(intent, made), "recipe_id": None})
    return CoderTurn(None, [], refusals)
