"""The precision reference of a candidate: the run head (with the pending NPU rewrites, as the candidate has them)
and the candidate's region computed in higher precision, for the gate to compare the candidate with.

A fused kernel that computes in fp32 and rounds once (npu_cross_entropy_loss on bf16 logits) does not reproduce a
bf16 program's own rounding: over a few optimizer steps the two trajectories part, and the gate cannot tell that
apart from a rewrite that computes something else. Its recipe's `numerics.precision_reference` is the original
region written to compute in fp32 (`F.cross_entropy(x.float(), ...).to(x.dtype)`): applied with the recipe's own
match at the same span, it gives a third program, never committed to the run, that the candidate must match
where it does not match the original (agents/profiler/gate.py, `check_against_reference`).

The reference comes from the recipe file (seed or the user's), never from the candidate: a recipe an LLM wrote
gets fixed numerics without one (agents/coder/learned.py).
"""

from __future__ import annotations

from trainbridge.agents.coder.candidate import Candidate, make_candidate
from trainbridge.knowledge.schema import Recipe
from trainbridge.records import Intent

REFERENCE_SUFFIX = "-precision-reference"


def reference_recipe(recipe: Recipe) -> Recipe | None:
    """`recipe` with its replacement (and helper, imports) swapped for its precision reference's; None without one.
    Companion edits are dropped: they adapt other code to the new API, which the reference does not call."""
    ref = recipe.numerics.precision_reference
    if ref is None:
        return None
    params = {key: value for key, value in recipe.match.params.items() if key != "define"}
    if ref.define:
        params["define"] = ref.define
    return recipe.model_copy(update={
        "id": f"{recipe.id}{REFERENCE_SUFFIX}", "title": f"{recipe.id}: the original region in higher precision (gate only)",
        "replacement": ref.replacement, "imports": list(ref.imports), "also": [],
        "match": recipe.match.model_copy(update={"params": params}),
    })


def make_reference(workspace, intent: Intent, recipe: Recipe, *, overlay: str | None) -> Candidate | None:
    """The precision reference's worktree for a candidate of `recipe` on `intent` (same span, same overlay), or None
    when the recipe has none or it does not apply. The caller drops it after the gate (`workspace.reject_candidate`)."""
    reference = reference_recipe(recipe)
    if reference is None or recipe.match.kind == "library_patch" or intent.library is not None:
        return None
    made = make_candidate(workspace, intent, reference, overlay=overlay)
    return made if isinstance(made, Candidate) else None
