"""How the retrieval agent ranks recipes for an intent: pure scoring functions, every part of a
score explained.

score = 3.0 x category       1 if the recipe's category is the intent's, 0.5 if related, else 0
      + 1.0 x target         0.5 + 0.5 / len(recipe.targets) when it supports the target backend
                             (a recipe written for this backend alone beats a generic one), else 0
      + 1.0 x similarity     cosine similarity of the intent's evidence and the recipe's text
      + 2.0 x accept rate    Laplace-smoothed (a + 1) / (n + 2) over past outcomes of this recipe on
                             this backend, each weighted by how similar its evidence is to this
                             intent's (untried: 0.5)
      + 1.0 x gain           1 - weighted mean step-time ratio of the accepted ones (0 when none)

The weights keep the category decisive (a wrong-category recipe cannot win on outcomes alone)
while past verdicts on similar evidence reorder the recipes of one category.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.knowledge.schema import OutcomeHit, Recipe, Target

W_CATEGORY = 3.0
W_TARGET = 1.0
W_SIMILARITY = 1.0
W_ACCEPT = 2.0
W_GAIN = 1.0
MIN_OUTCOME_SIMILARITY = 0.2  # outcomes on less similar evidence say nothing about this intent

# Categories whose recipes are worth trying for one another (symmetric).
_RELATED: dict[str, set[str]] = {
    "rmsnorm": {"add_norm"},
    "layernorm": {"add_norm"},
    "add_norm": {"rmsnorm", "layernorm"},
    "gelu": {"geglu", "elementwise_chain"},
    "geglu": {"gelu"},
    "silu": {"swiglu", "elementwise_chain"},
    "swiglu": {"silu"},
    "softmax": {"attention"},
    "attention": {"softmax"},
    "elementwise_chain": {"gelu", "silu"},
    "optimizer_step": {"zero_grad"},
    "zero_grad": {"optimizer_step"},
    "permute_reshape": {"conv_layout"},
    "conv_layout": {"permute_reshape"},
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScoreParts(_Model):
    category: float = Field(description="1 same category, 0.5 related, 0 other")
    target: float = Field(description="0.5 + 0.5/len(targets) if the backend is supported, else 0")
    similarity: float = Field(description="cosine similarity of evidence and recipe text")
    accept_rate: float = Field(description="Laplace-smoothed weighted accept rate of similar outcomes")
    similar_outcomes: float = Field(description="similarity-weighted count of those outcomes")
    gain: float = Field(description="1 - weighted mean ratio of accepted similar outcomes, 0 if none")

    def total(self) -> float:
        return (
            W_CATEGORY * self.category
            + W_TARGET * self.target
            + W_SIMILARITY * self.similarity
            + W_ACCEPT * self.accept_rate
            + W_GAIN * self.gain
        )


class RankedRecipe(_Model):
    recipe: Recipe
    score: float
    parts: ScoreParts
    explanation: str


def related_categories(intent_category: str) -> set[str]:
    """The intent's category and those whose recipes are worth trying for it."""
    return {intent_category} | _RELATED.get(intent_category, set())


def category_part(recipe_category: str, intent_category: str) -> float:
    if recipe_category == intent_category:
        return 1.0
    return 0.5 if recipe_category in _RELATED.get(intent_category, set()) else 0.0


def target_part(targets: list[Target], target: Target) -> float:
    return 0.5 + 0.5 / len(targets) if target in targets else 0.0


def outcome_parts(hits: Iterable[OutcomeHit]) -> tuple[float, float, float]:
    """(accept rate, weighted count, gain) of one recipe's outcomes near the evidence."""
    n = accepted = ratio_weight = ratio_sum = 0.0
    for hit in hits:
        if hit.similarity < MIN_OUTCOME_SIMILARITY:
            continue
        w = hit.similarity
        n += w
        if hit.accepted:
            accepted += w
            if hit.ratio is not None:
                ratio_weight += w
                ratio_sum += w * hit.ratio
    rate = (accepted + 1.0) / (n + 2.0)
    gain = max(0.0, min(1.0, 1.0 - ratio_sum / ratio_weight)) if ratio_weight > 0 else 0.0
    return rate, n, gain


def rank(
    candidates: Iterable[tuple[Recipe, float]],
    hits: Iterable[OutcomeHit],
    intent_category: str,
    target: Target,
) -> list[RankedRecipe]:
    """Score (recipe, similarity) candidates against the intent; best first, ties by recipe id."""
    by_recipe: dict[str, list[OutcomeHit]] = {}
    for hit in hits:
        by_recipe.setdefault(hit.recipe_id, []).append(hit)
    ranked = []
    for recipe, similarity in candidates:
        rate, n, gain = outcome_parts(by_recipe.get(recipe.id, []))
        parts = ScoreParts(
            category=category_part(str(recipe.category), intent_category),
            target=target_part(recipe.targets, target),
            similarity=round(max(0.0, similarity), 6),
            accept_rate=rate,
            similar_outcomes=n,
            gain=gain,
        )
        ranked.append(
            RankedRecipe(recipe=recipe, score=parts.total(), parts=parts, explanation=explain(recipe, parts, intent_category, target))
        )
    ranked.sort(key=lambda r: (-r.score, r.recipe.id))
    return ranked


def explain(recipe: Recipe, parts: ScoreParts, intent_category: str, target: Target) -> str:
    cat = {1.0: "= intent", 0.5: "related to intent"}.get(parts.category, f"!= intent {intent_category}")
    tgt = (
        f"supports {target} ({len(recipe.targets)} target{'s' if len(recipe.targets) > 1 else ''})"
        if parts.target
        else f"not written for {target}"
    )
    outcomes = (
        f"accept rate {parts.accept_rate:.2f} over {parts.similar_outcomes:.1f} similar outcomes"
        if parts.similar_outcomes
        else "no similar outcomes yet (prior 0.50)"
    )
    return (
        f"category {recipe.category} {cat} (+{W_CATEGORY * parts.category:.2f}); "
        f"{tgt} (+{W_TARGET * parts.target:.2f}); "
        f"similarity {parts.similarity:.2f} (+{W_SIMILARITY * parts.similarity:.2f}); "
        f"{outcomes} (+{W_ACCEPT * parts.accept_rate:.2f}); "
        f"gain {parts.gain:.0%} (+{W_GAIN * parts.gain:.2f})"
    )
