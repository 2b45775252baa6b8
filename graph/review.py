"""Human review at patch time: the interrupt's payload and the resume value, one versioned schema.

The run pauses in its `review` node with `interrupt(payload)`. A LangGraph client sees the payload as
the thread's `__interrupt__` value (`trainbridge review`, in process or `--server URL`, shows the same):

- ``schema`` (1), ``kind`` ("trainbridge.review"), ``run_id``;
- the patch: ``candidate`` (its name), ``recipe_id`` (None for an LLM patch), ``diff`` (unified, against
  the run head), ``files``;
- the intent it serves: ``intent`` = {id, category, spans, evidence, estimated_saving_us, estimate_basis};
- the figures measured so far: ``measured`` = {baseline_step_s, reference_step_s, eager_ops_before,
  eager_ops_now, candidates_tried, verdicts: [{candidate, recipe_id, category, accepted, reason,
  message, ratio, ratio_ci}], accepted: [{candidate, recipe_id, ratio, sha}], accepted_ratio_product}
  (ratio = candidate step / run-head step from the gate; below 1 is faster). ``baseline_step_s`` and
  ``accepted_so_far`` also stay at the top level, as in the first payloads of this version;
- ``respond_with``: the three resume values below.

The CLI and any LangGraph client (``command={"resume": value}``) send the same resume value:
``{"schema": 1, "action": "approve"}``, ``{"schema": 1, "action": "reject", "reason": "..."}`` or
``{"schema": 1, "action": "edit", "patch": "<unified diff against the run head>"}``.

Versioning: REVIEW_SCHEMA_VERSION changes when a field is removed or changes meaning, or when the
resume value needs something new; then a resume value of another version is refused with a message
(never misread). New payload fields are added within a version: readers ignore keys they do not know.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REVIEW_SCHEMA_VERSION = 1


class ReviewDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_: int = Field(default=REVIEW_SCHEMA_VERSION, alias="schema")
    action: Literal["approve", "reject", "edit"]
    reason: str | None = Field(default=None, description="why it was rejected; reaches the coder and the knowledge base")
    patch: str | None = Field(default=None, description="for edit: the whole candidate as a unified diff against the run head")

    @model_validator(mode="after")
    def _fields_for_action(self) -> "ReviewDecision":
        if self.schema_ != REVIEW_SCHEMA_VERSION:
            raise ValueError(f"review schema {self.schema_} is not supported (this TrainBridge speaks {REVIEW_SCHEMA_VERSION})")
        if self.action == "reject" and not (self.reason or "").strip():
            raise ValueError("a rejection needs a reason (the coder and the knowledge base learn from it)")
        if self.action == "edit" and not (self.patch or "").strip():
            raise ValueError("an edit needs the patch")
        return self


def review_payload(state: dict[str, Any]) -> dict[str, Any]:
    """What a reviewer sees: the diff, the intent's evidence, the recipe, and the run so far."""
    candidate = state.get("candidate") or {}
    intent = state.get("current_intent") or {}
    return {
        "schema": REVIEW_SCHEMA_VERSION,
        "kind": "trainbridge.review",
        "run_id": state.get("run_id"),
        "candidate": candidate.get("name"),
        "recipe_id": candidate.get("recipe_id"),
        "diff": candidate.get("diff", ""),
        "files": candidate.get("files", []),
        "intent": {"id": intent.get("id"), "category": intent.get("category"), "spans": intent.get("spans"),
                   "evidence": intent.get("evidence"), "estimated_saving_us": intent.get("estimated_saving_us"),
                   "estimate_basis": intent.get("estimate_basis")},
        "baseline_step_s": state.get("baseline_step_s"),
        "accepted_so_far": len(state.get("accepted") or []),
        "measured": measured_so_far(state),
        "respond_with": {"approve": {"schema": 1, "action": "approve"},
                         "reject": {"schema": 1, "action": "reject", "reason": "..."},
                         "edit": {"schema": 1, "action": "edit", "patch": "unified diff against the run head"}},
    }


def measured_so_far(state: dict[str, Any]) -> dict[str, Any]:
    """The run's measurements up to this patch: baseline, every verdict with its gate ratio, the accepted commits."""
    accepted = state.get("accepted") or []
    product = 1.0
    for record in accepted:
        product *= record.get("ratio") or 1.0
    return {
        "baseline_step_s": state.get("baseline_step_s"),
        "reference_step_s": state.get("reference_step_s"),
        "eager_ops_before": state.get("eager_ops_before"),
        "eager_ops_now": state.get("eager_ops_now"),
        "candidates_tried": state.get("candidates_tried") or 0,
        "verdicts": [{key: v.get(key) for key in ("candidate", "recipe_id", "category", "accepted", "reason", "message", "ratio", "ratio_ci")}
                     for v in state.get("verdicts") or []],
        "accepted": [{key: a.get(key) for key in ("candidate", "recipe_id", "ratio", "sha")} for a in accepted],
        "accepted_ratio_product": product,
    }


def apply_edit(workspace, candidate, patch: str):
    """Replace the candidate's change by the reviewer's patch (against the run head) and re-commit."""
    from trainbridge.agents.coder.candidate import Candidate
    from trainbridge.tools.git.ops import run_git_status

    cand = workspace.start_candidate(candidate.name)  # reset to the run head
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as handle:
        handle.write(patch if patch.endswith("\n") else patch + "\n")
    try:
        status, _, err = run_git_status(Path(cand.path), "apply", "--whitespace=nowarn", handle.name)
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if status != 0:
        raise ValueError(f"the edited patch does not apply to the run head: {err.strip()}")
    result = workspace.commit_candidate(candidate.name, f"trainbridge: {candidate.recipe_id or 'patch'} (edited in review)\n\n"
                                        f"Intent {candidate.intent_id} ({candidate.category}); the reviewer edited the patch.")
    if result.sha is None:
        raise ValueError("the edited patch changes nothing")
    return Candidate.model_validate({**candidate.model_dump(mode="json"), "sha": result.sha, "files": result.files,
                                     "diff": workspace.candidate_diff(candidate.name)})
