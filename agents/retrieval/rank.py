"""Recipes for one intent on one backend, best first: the knowledge base's query, then the scoring."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainbridge.agents.retrieval.ranking import RankedRecipe, rank, related_categories
from trainbridge.knowledge.schema import Target
from trainbridge.records import Intent

if TYPE_CHECKING:
    from trainbridge.knowledge.store import KnowledgeBase


def rank_recipes(kb: KnowledgeBase, intent: Intent, target: str, n: int = 5, *,
                 strict_target: bool = True) -> list[RankedRecipe]:
    """The ``n`` best recipes for ``intent`` on ``target``, with the parts of each score explained.

    Candidates: every recipe of the intent's (or a related) category plus the recipes most similar
    to its evidence; with ``strict_target`` only recipes written for ``target``. Past outcomes: the
    nearest judged ones on this backend for this intent category (`KnowledgeBase.ranking_inputs`).
    Scoring: `agents.retrieval.ranking`.
    """
    category = str(intent.category)
    candidates, hits = kb.ranking_inputs(intent, target, categories=related_categories(category),
                                         strict_target=strict_target)
    return rank(candidates, hits, category, Target(target))[:n]
