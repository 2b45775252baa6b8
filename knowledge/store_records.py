"""What the knowledge base's store answers with: typed results and its one error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from trainbridge.knowledge.schema import Recipe


class KnowledgeBaseError(RuntimeError):
    """The knowledge base cannot do what was asked; the message says what to do."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchHit(_Model):
    recipe: Recipe
    similarity: float


class ImportReport(_Model):
    recipes_added: int = 0
    outcomes_added: int = 0
    recipes_skipped: int = 0
    outcomes_skipped: int = 0


class KBStats(_Model):
    location: str
    recipes: int
    outcomes: int
    accepted: int
    rejected: int
    pending: int = 0  # NPU candidates verified on the emulation, waiting for a measurement on hardware
    recipes_by_category: dict[str, int]
    recipes_by_target: dict[str, int]
