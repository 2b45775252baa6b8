"""The next intent to work on and the recipes to try for it, best first.

Intents come in the analyst's order (largest estimated saving first). An intent whose only option
is the last resort (a regional compile of the region) waits until no intent with a recipe of its
own is left.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainbridge.agents.retrieval.rank import rank_recipes
from trainbridge.sandbox.backends import host_capabilities
from trainbridge.tools.codemods.library_patch import fits as library_patch_fits
from trainbridge.records import Intent

if TYPE_CHECKING:
    from trainbridge.knowledge.store import KnowledgeBase

# The implementation ladder's last rung (reference README): compile just the region. Not on the NPU:
# there `backend="npu"` may silently run eager, and without an NPU its speed cannot be judged here.
LAST_RESORT_CATEGORY = "elementwise_chain"
LAST_RESORT_TARGETS = ("cpu", "cuda")
RANKED = 50  # recipes ranked per intent (every one of its category in practice)


@dataclass(frozen=True)
class Choice:
    """The intent to work on (as the state holds it) and its recipe ids, best first."""

    data: dict[str, Any]
    intent: Intent
    queue: list[str]
    last_resort: bool


def choose_intent(intents: Iterable[dict[str, Any]], *, done: Collection[str], kb: KnowledgeBase, target: str,
                  allowed: Collection[str] | None) -> Choice | None:
    """The first intent not done with a recipe of its own (restricted to ``allowed`` ids when given),
    else the first one the last resort applies to; None when nothing is left to try."""
    deferred: Choice | None = None
    for data in intents:
        intent = Intent.model_validate(data)
        if intent.id in done:
            continue
        queue = own_recipes(kb, intent, target, allowed)
        if queue:
            return Choice(data, intent, queue, last_resort=False)
        if target in LAST_RESORT_TARGETS and deferred is None:
            last = _allowed(allowed, [r.id for r in kb.list_recipes(category=LAST_RESORT_CATEGORY, target=target)])
            if last:
                deferred = Choice(data, intent, last, last_resort=True)
    return deferred


def own_recipes(kb: KnowledgeBase, intent: Intent, target: str, allowed: Collection[str] | None) -> list[str]:
    """The ids of the recipes of the intent's own category for `target`, best first (`allowed` only), leaving out
    those that need what this host does not have (`Recipe.requires`: every gate of theirs would crash)."""
    ranked = rank_recipes(kb, intent, target, n=RANKED)
    has = host_capabilities(target) if any(r.recipe.requires for r in ranked) else frozenset()
    own = [r.recipe for r in ranked if str(r.recipe.category) == str(intent.category) and set(r.recipe.requires) <= has]
    # a library patch only for the library function it replaces, and first for it (a library region's in-repo recipes
    # stay queued behind it, each refused with its reason: they rewrite the user's files)
    patches = [r.id for r in own if library_patch_fits(r, intent.library)]
    return _allowed(allowed, patches + [r.id for r in own if r.match.kind != "library_patch"])


def _allowed(allowed: Collection[str] | None, recipe_ids: list[str]) -> list[str]:
    return [r for r in recipe_ids if allowed is None or r in allowed]


@dataclass(frozen=True)
class IntentCoverage:
    """How far a run got through its intents: `reached` were worked (each of its recipes tried, or
    one accepted); `left_with_recipe` are intents of the latest analysis not reached although a
    recipe of their own fits them (a budget or candidate limit stopped the run first);
    `left_without` are the rest, with no recipe of their own (the last resort aside)."""

    reached: int
    left_with_recipe: list[str]
    left_without: int

    @property
    def every_intent_with_a_recipe(self) -> bool:
        return not self.left_with_recipe

    def line(self) -> str:
        if self.every_intent_with_a_recipe:
            return (f"intents: reached every intent with a recipe ({self.reached} worked"
                    f"{f'; {self.left_without} found without one' if self.left_without else ''})")
        return (f"intents: {self.reached} worked, {len(self.left_with_recipe)} with a recipe not reached "
                f"({', '.join(self.left_with_recipe[:6])}{', ...' if len(self.left_with_recipe) > 6 else ''})")

    def as_record(self) -> dict[str, Any]:
        return {"reached": self.reached, "left_with_recipe": list(self.left_with_recipe), "left_without": self.left_without,
                "every_intent_with_a_recipe": self.every_intent_with_a_recipe, "line": self.line()}


def intent_coverage(intents: Iterable[dict[str, Any]], *, done: Collection[str], kb: KnowledgeBase, target: str,
                    allowed: Collection[str] | None) -> IntentCoverage:
    """Which of the latest analysis's intents the run reached, and which it left that have a recipe
    of their own (`choose_intent`'s test, the last resort not counted)."""
    left, without = [], 0
    for data in intents:
        intent = Intent.model_validate(data)
        if intent.id in done:
            continue
        if own_recipes(kb, intent, target, allowed):
            left.append(f"{intent.category} at {intent.spans[0] if intent.spans else '?'}")
        else:
            without += 1
    return IntentCoverage(reached=len(set(done)), left_with_recipe=left, left_without=without)
