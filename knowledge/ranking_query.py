"""The retrieval agent's one query of the knowledge base: the candidate recipes for an intent on a
target backend, each with its similarity to the intent's evidence, and the nearest judged outcomes
of those recipes (agents/retrieval/rank.py turns them into a ranking)."""

from __future__ import annotations

import numpy as np

from trainbridge.knowledge.chroma_tables import ChromaTables, recipe_fits
from trainbridge.knowledge.schema import OutcomeHit, Recipe, Target, evidence_text
from trainbridge.records import Intent

RANK_CANDIDATES = 50  # recipes taken by similarity, besides every recipe of the intent's category
RANK_OUTCOMES = 200  # nearest past outcomes considered when ranking


def ranking_inputs(
    tables: ChromaTables, intent: Intent, target: str, *, categories: set[str], strict_target: bool = True
) -> tuple[list[tuple[Recipe, float]], list[OutcomeHit]]:
    """Candidates, each with its cosine similarity to the intent's evidence: every recipe of one of
    ``categories`` plus the ``RANK_CANDIDATES`` most similar; with ``strict_target`` only recipes
    written for ``target``. Hits: the nearest ``RANK_OUTCOMES`` judged outcomes on this backend for
    this intent category, of those candidates."""
    backend = Target(target)
    query = np.asarray(
        tables.embedding.embed_query([evidence_text(str(intent.category), intent.evidence)])[0], dtype=np.float32
    )
    metas, matrix = tables.recipe_table()
    sims = matrix @ query
    usable = [i for i, m in enumerate(metas) if not strict_target or recipe_fits(m, None, backend)]
    by_similarity = sorted(usable, key=lambda i: -float(sims[i]))[:RANK_CANDIDATES]
    same_category = [i for i in usable if metas[i]["category"] in categories]
    candidates: dict[str, tuple[Recipe, float]] = {}
    for i in same_category + by_similarity:
        recipe = Recipe.model_validate_json(metas[i]["record"])
        candidates.setdefault(recipe.id, (recipe, float(sims[i])))
    if not candidates:
        return [], []
    hits = [
        OutcomeHit(
            recipe_id=meta["recipe_id"],
            accepted=bool(meta["accepted"]),
            similarity=1.0 - float(dist),
            ratio=meta.get("ratio"),
        )
        for meta, dist in tables.nearest_outcomes(query, RANK_OUTCOMES, str(backend), str(intent.category))
        if meta["recipe_id"] in candidates and not meta.get("pending")  # not judged yet: no evidence either way
    ]
    return list(candidates.values()), hits
