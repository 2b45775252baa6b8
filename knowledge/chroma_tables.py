"""The knowledge base's two Chroma collections, ``trainbridge_recipes`` and ``trainbridge_outcomes``,
and how records map onto their rows.

Each row keeps its full record JSON in the metadata key ``record``, so records come back exactly as
stored; the embedded document is the recipe's pattern text or the outcome's evidence (op and kernel
names). Besides the record, a row holds only the few keys that filters need: Chroma's filter and
fetch costs grow with the number of metadata keys. Every read and write goes in batches of at most
the client's maximum batch size (one unbounded get of many records fails in Chroma: too many SQL
variables).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from trainbridge.knowledge import embeddings
from trainbridge.knowledge.schema import Outcome, Recipe, Target

RECIPES = "trainbridge_recipes"
OUTCOMES = "trainbridge_outcomes"


def where(*clauses: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Chroma `where` filter from the clauses given (None ones left out)."""
    parts = [c for c in clauses if c]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else {"$and": parts}


def chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def scope(backend: str, category: str) -> str:
    """The one selective key an outcome is ranked by: its backend and intent category."""
    return f"{backend}:{category}"


def recipe_metadata(recipe: Recipe) -> dict[str, Any]:
    return {
        "category": str(recipe.category),
        "targets": ",".join(recipe.targets),
        "provenance": recipe.provenance.kind,
        "record": recipe.model_dump_json(),
    }


def outcome_metadata(outcome: Outcome) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "scope": scope(str(outcome.backend), str(outcome.category)),  # one selective key for ranking
        "category": str(outcome.category),
        "backend": str(outcome.backend),
        "recipe_id": outcome.recipe_id or "",
        "run_id": outcome.run_id,
        "accepted": outcome.accepted,
        "pending": outcome.pending,
        "record": outcome.model_dump_json(),
    }
    if outcome.ratio is not None:
        meta["ratio"] = outcome.ratio
    return meta


def recipe_fits(meta: dict[str, Any], category: str | None, target: Target | None) -> bool:
    """Whether a recipe row is of `category` (None: any) and written for `target` (None: any)."""
    if target is not None and "targets" not in meta:  # written before the key existed
        meta["targets"] = ",".join(Recipe.model_validate_json(meta["record"]).targets)
    return (category is None or meta["category"] == category) and (
        target is None or str(target) in meta["targets"].split(",")
    )


class ChromaTables:
    """The recipe and outcome collections of one Chroma client, read and written in batches."""

    def __init__(self, client: Any, embedding: embeddings.HashedCodeEmbedding, *, batch_size: int | None = None) -> None:
        self.client = client
        self.embedding = embedding
        most = int(client.get_max_batch_size())
        self.batch = min(batch_size, most) if batch_size else most
        self.recipes = self._collection(RECIPES, "TrainBridge rewrite recipes")
        self.outcomes = self._collection(OUTCOMES, "TrainBridge tried candidates and verdicts")

    def _collection(self, name: str, description: str) -> Any:
        return self.client.get_or_create_collection(
            name,
            embedding_function=self.embedding,
            configuration={"hnsw": {"space": "cosine"}},
            metadata={"description": description},
        )

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

    def get_all(self, collection: Any, filters: dict[str, Any] | None, include: list[str]) -> dict[str, list]:
        """`get` in pages of the batch size."""
        merged: dict[str, list] = {"ids": [], **{key: [] for key in include}}
        offset = 0
        while True:
            page = collection.get(where=filters, include=include, limit=self.batch, offset=offset)
            for key in merged:
                merged[key].extend(page[key])
            if len(page["ids"]) < self.batch:
                return merged
            offset += self.batch

    def existing_ids(self, collection: Any, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for chunk in chunks(list(ids), self.batch):
            found.update(collection.get(ids=list(chunk), include=[])["ids"])
        return found

    # -- recipes -----------------------------------------------------------------------------

    def write_recipes(self, recipes: Sequence[Recipe]) -> None:
        for chunk in chunks(list(recipes), self.batch):
            self.recipes.upsert(
                ids=[r.id for r in chunk],
                documents=[r.embedding_text() for r in chunk],
                metadatas=[recipe_metadata(r) for r in chunk],
            )

    def get_recipes(self, ids: Sequence[str]) -> dict[str, Recipe]:
        found: dict[str, Recipe] = {}
        for chunk in chunks(list(ids), self.batch):
            got = self.recipes.get(ids=list(chunk), include=["metadatas"])
            for meta in got["metadatas"]:
                recipe = Recipe.model_validate_json(meta["record"])
                found[recipe.id] = recipe
        return found

    def recipe_table(self) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Every recipe's metadata and stored embedding (rows of a matrix), in one unfiltered read.

        Recipes are few (hundreds), so they are filtered and compared here: a metadata filter in
        Chroma costs time in proportion to *all* metadata rows of the database, outcomes included
        (measured: a boolean filter over 105 recipes took 85-130 ms next to 100k outcomes, the
        unfiltered read 5 ms). Records are parsed only for the recipes that are returned.
        """
        got = self.get_all(self.recipes, None, ["metadatas", "embeddings"])
        metas = list(got["metadatas"])
        if not metas:
            return [], np.zeros((0, self.embedding.dims), dtype=np.float32)
        return metas, np.asarray(got["embeddings"], dtype=np.float32)

    # -- outcomes ----------------------------------------------------------------------------

    def write_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        for chunk in chunks(list(outcomes), self.batch):
            self.outcomes.add(
                ids=[o.id for o in chunk],
                documents=[o.evidence_text() for o in chunk],
                metadatas=[outcome_metadata(o) for o in chunk],
            )

    def nearest_outcomes(self, query: np.ndarray, n: int, backend: str, category: str) -> list[tuple[dict[str, Any], float]]:
        """The `n` outcome rows nearest to `query` on `backend` for intents of `category`, with their
        cosine distances. One equality filter (scope) is far cheaper in Chroma than backend AND
        category AND recipe_id IN (...)."""
        past = self.outcomes.query(
            query_embeddings=[query],
            n_results=n,
            where={"scope": scope(backend, category)},
            include=["metadatas", "distances"],
        )
        return list(zip(past["metadatas"][0], past["distances"][0]))
