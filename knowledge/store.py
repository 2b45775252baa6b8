"""The knowledge base: recipes and outcomes in Chroma, embedded on disk or on a team server.

    kb = KnowledgeBase()                              # $TRAINBRIDGE_KB_DIR, $TRAINBRIDGE_HOME/kb, else XDG data dir
    kb = KnowledgeBase("/data/kb")                    # a given directory
    kb = KnowledgeBase.connect("http://kb-host:8000") # a Chroma server shared by a team

Seed recipes (``knowledge/recipes/*.yaml``) are loaded on first use, by id: a seed already in the
knowledge base keeps its statistics, and is updated when a newer package ships a changed version of
it. Recording an outcome also updates its recipe's stats (read, modify, write): two runs recording
outcomes of the same recipe at the same instant on a shared server can lose one count; the
outcomes themselves are never lost, and the counts can be recomputed from them. An embedded
directory is for one process at a time; teams and parallel runs should use a server.

Beside this module: where a knowledge base lives (knowledge/location.py), the collections and
their rows (knowledge/chroma_tables.py), the retrieval agent's query (knowledge/ranking_query.py),
the typed results (knowledge/store_records.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainbridge.knowledge import embeddings
from trainbridge.knowledge.chroma_tables import ChromaTables, recipe_fits, where
from trainbridge.knowledge.jsonl import read_jsonl, write_jsonl
from trainbridge.knowledge.location import connect_server, default_kb_dir, open_directory
from trainbridge.knowledge.ranking_query import ranking_inputs
from trainbridge.knowledge.schema import Outcome, OutcomeHit, Recipe, Target, load_recipe_dir
from trainbridge.knowledge.store_records import ImportReport, KBStats, KnowledgeBaseError, SearchHit
from trainbridge.records import Intent

__all__ = ["SEED_DIR", "ImportReport", "KBStats", "KnowledgeBase", "KnowledgeBaseError", "SearchHit", "default_kb_dir"]

SEED_DIR = Path(__file__).resolve().parent / "recipes"


def with_outcome(recipe: Recipe, outcome: Outcome) -> Recipe:
    """`recipe` with its stats counting one more tried candidate, judged as `outcome` says."""
    stats = recipe.stats.model_copy()
    stats.tried += 1
    if outcome.accepted:
        stats.accepted += 1
        if outcome.ratio is not None and (stats.best_ratio is None or outcome.ratio < stats.best_ratio):
            stats.best_ratio = outcome.ratio
    elif not outcome.pending:  # a pending NPU candidate is tried, not judged: its verdict comes from `trainbridge verify`
        stats.rejected += 1
    return recipe.model_copy(update={"stats": stats})


class KnowledgeBase:
    """Recipes and outcomes in Chroma (see the module docstring). `batch_size` caps every read and
    write below the client's own maximum (tests use a small one to exercise the batching)."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        seed_dir: str | Path | None = SEED_DIR,
        embedding: embeddings.HashedCodeEmbedding | None = None,
        batch_size: int | None = None,
        _client: Any = None,
        _location: str | None = None,
    ) -> None:
        embeddings.register()
        if _client is None:
            _client, _location = open_directory(path)
        self.location = _location or "<chroma client>"
        self._tables = ChromaTables(_client, embedding or embeddings.HashedCodeEmbedding(), batch_size=batch_size)
        self._seed_dir = Path(seed_dir) if seed_dir is not None else None
        self._seeded = False

    @classmethod
    def connect(
        cls, url: str, *, headers: dict[str, str] | None = None, seed_dir: str | Path | None = SEED_DIR
    ) -> "KnowledgeBase":
        """A knowledge base on a Chroma server, e.g. ``http://kb-host:8000`` (``chroma run``)."""
        client, location = connect_server(url, headers)
        return cls(seed_dir=seed_dir, _client=client, _location=location)

    def close(self) -> None:
        self._tables.close()

    def __enter__(self) -> "KnowledgeBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- seeds -------------------------------------------------------------------------------

    def _ready(self) -> None:
        if self._seeded:
            return
        if self._seed_dir is not None and self._seed_dir.is_dir():
            self.load_seeds(self._seed_dir)
        self._seeded = True

    def load_seeds(self, directory: str | Path) -> int:
        """Add the folder's recipes that are missing (or changed seeds, keeping their stats)."""
        seeds = load_recipe_dir(directory)
        existing = self._tables.get_recipes([s.id for s in seeds])
        writes = []
        for seed in seeds:
            current = existing.get(seed.id)
            if current is None:
                writes.append(seed)
            elif current.provenance.kind == "seed" and current.content_key() != seed.content_key():
                writes.append(seed.model_copy(update={"stats": current.stats}))
        self._tables.write_recipes(writes)
        return len(writes)

    # -- recipes -----------------------------------------------------------------------------

    def add_recipe(self, recipe: Recipe) -> None:
        """Add a new recipe; an existing id is an error (use `upsert_recipe` to change one)."""
        self._ready()
        if self._tables.get_recipes([recipe.id]):
            raise KnowledgeBaseError(f"recipe {recipe.id!r} already exists; use upsert to replace it")
        self._tables.write_recipes([recipe])

    def upsert_recipe(self, recipe: Recipe, *, keep_stats: bool = True) -> bool:
        """Add or replace a recipe; an existing one keeps its measured stats. True if it was new."""
        self._ready()
        current = self._tables.get_recipes([recipe.id]).get(recipe.id)
        if current is not None and keep_stats:
            recipe = recipe.model_copy(update={"stats": current.stats})
        self._tables.write_recipes([recipe])
        return current is None

    def get_recipe(self, recipe_id: str) -> Recipe | None:
        self._ready()
        return self._tables.get_recipes([recipe_id]).get(recipe_id)

    def list_recipes(self, category: str | None = None, target: str | None = None) -> list[Recipe]:
        """Recipes, sorted by id, optionally of one category and/or for one target backend."""
        self._ready()
        wanted = Target(target) if target else None
        got = self._tables.get_all(self._tables.recipes, None, ["metadatas"])
        recipes = [
            Recipe.model_validate_json(m["record"])
            for m in got["metadatas"]
            if recipe_fits(m, str(category) if category else None, wanted)
        ]
        return sorted(recipes, key=lambda r: r.id)

    def search(self, text: str, n: int = 5, target: str | None = None) -> list[SearchHit]:
        """Recipes whose pattern text is most similar to ``text`` (code, op or kernel names)."""
        self._ready()
        wanted = Target(target) if target else None
        metas, matrix = self._tables.recipe_table()
        if not metas or n <= 0:
            return []
        sims = matrix @ np.asarray(self._tables.embedding.embed_query([text])[0], dtype=np.float32)
        order = sorted(
            (i for i, m in enumerate(metas) if recipe_fits(m, None, wanted)),
            key=lambda i: (-float(sims[i]), metas[i]["record"]),
        )[:n]
        return [SearchHit(recipe=Recipe.model_validate_json(metas[i]["record"]), similarity=float(sims[i])) for i in order]

    # -- outcomes ----------------------------------------------------------------------------

    def record_outcome(self, outcome: Outcome) -> bool:
        """Store a tried candidate and update its recipe's stats. False if it was already stored."""
        return self.record_outcomes([outcome]) == 1

    def record_outcomes(self, outcomes: Sequence[Outcome]) -> int:
        """Store many outcomes (batched), updating recipe stats once per new outcome."""
        self._ready()
        unique = list({o.id: o for o in outcomes}.values())
        existing = self._tables.existing_ids(self._tables.outcomes, [o.id for o in unique])
        new = [o for o in unique if o.id not in existing]
        self._tables.write_outcomes(new)
        self._count_in_stats(new)
        return len(new)

    def _count_in_stats(self, outcomes: Sequence[Outcome]) -> None:
        recipe_ids = sorted({o.recipe_id for o in outcomes if o.recipe_id})
        recipes = self._tables.get_recipes(recipe_ids)
        for outcome in outcomes:
            if outcome.recipe_id in recipes:
                recipes[outcome.recipe_id] = with_outcome(recipes[outcome.recipe_id], outcome)
        self._tables.write_recipes(list(recipes.values()))

    def outcomes_for(
        self,
        recipe_id: str | None = None,
        category: str | None = None,
        backend: str | None = None,
        limit: int | None = None,
    ) -> list[Outcome]:
        """Recorded outcomes of a recipe and/or an intent category (and backend), oldest first."""
        self._ready()
        filters = where(
            {"recipe_id": recipe_id} if recipe_id else None,
            {"category": str(category)} if category else None,
            {"backend": str(Target(backend))} if backend else None,
        )
        got = self._tables.get_all(self._tables.outcomes, filters, ["metadatas"])
        outcomes = sorted(
            (Outcome.model_validate_json(m["record"]) for m in got["metadatas"]),
            key=lambda o: (o.timestamp, o.id),
        )
        return outcomes[-limit:] if limit else outcomes

    def ranking_inputs(
        self, intent: Intent, target: str, *, categories: set[str], strict_target: bool = True
    ) -> tuple[list[tuple[Recipe, float]], list[OutcomeHit]]:
        """What the retrieval agent ranks for ``intent`` on ``target`` (knowledge/ranking_query.py)."""
        self._ready()
        return ranking_inputs(self._tables, intent, target, categories=categories, strict_target=strict_target)

    # -- exchange and statistics -------------------------------------------------------------

    def all_outcomes(self) -> list[Outcome]:
        return self.outcomes_for()

    def export_jsonl(self, path: str | Path) -> tuple[int, int]:
        """Write every recipe and outcome to ``path``; returns (recipes, outcomes) written."""
        return write_jsonl(path, self.list_recipes(), self.all_outcomes())

    def import_jsonl(self, path: str | Path) -> ImportReport:
        """Import an export. Idempotent: records already present (by id) are skipped.

        A recipe new to this knowledge base comes with the stats it had; outcomes new to it
        update the stats of recipes that were already here.
        """
        self._ready()
        recipes, outcomes = read_jsonl(path)
        report = ImportReport()
        present = self._tables.existing_ids(self._tables.recipes, [r.id for r in recipes])
        added = [r for r in recipes if r.id not in present]
        self._tables.write_recipes(added)
        report.recipes_added, report.recipes_skipped = len(added), len(recipes) - len(added)
        new_ids = {r.id for r in added}

        existing = self._tables.existing_ids(self._tables.outcomes, [o.id for o in outcomes])
        fresh = list({o.id: o for o in outcomes if o.id not in existing}.values())
        self._tables.write_outcomes(fresh)
        self._count_in_stats([o for o in fresh if o.recipe_id not in new_ids])
        report.outcomes_added, report.outcomes_skipped = len(fresh), len(outcomes) - len(fresh)
        return report

    def stats(self) -> KBStats:
        self._ready()
        recipes = self.list_recipes()
        by_category = Counter(str(r.category) for r in recipes)
        by_target = Counter(str(t) for r in recipes for t in r.targets)
        accepted = len(self._tables.get_all(self._tables.outcomes, {"accepted": True}, [])["ids"])
        pending = len(self._tables.get_all(self._tables.outcomes, {"pending": True}, [])["ids"])
        total = self._tables.outcomes.count()
        return KBStats(
            location=self.location,
            recipes=len(recipes),
            outcomes=total,
            accepted=accepted,
            pending=pending,
            rejected=total - accepted - pending,
            recipes_by_category=dict(sorted(by_category.items())),
            recipes_by_target=dict(sorted(by_target.items())),
        )
