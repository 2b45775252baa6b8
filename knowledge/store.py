"""The knowledge base: recipes and outcomes in Chroma, embedded on disk or on a team server.

    kb = KnowledgeBase()                              # $TRAINBRIDGE_KB_DIR, $TRAINBRIDGE_HOME/kb, else XDG data dir
    kb = KnowledgeBase("/data/kb")                    # a given directory
    kb = KnowledgeBase.connect("http://kb-host:8000") # a Chroma server shared by a team

Two collections: ``trainbridge_recipes`` and ``trainbridge_outcomes``. Each entry keeps its full
record JSON in the metadata key ``record``, so records come back exactly as stored; the embedded
document is the recipe's pattern text or the outcome's evidence (op and kernel names). Seed recipes
(``knowledge/recipes/*.yaml``) are loaded on first use, by id: a seed already in the knowledge base
keeps its statistics, and is updated when a newer package ships a changed version of it.

Recording an outcome also updates its recipe's stats (read, modify, write): two runs recording
outcomes of the same recipe at the same instant on a shared server can lose one count; the
outcomes themselves are never lost, and the counts can be recomputed from them. An embedded
directory is for one process at a time; teams and parallel runs should use a server.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import chromadb
import numpy as np
from chromadb.config import Settings
from pydantic import BaseModel, ConfigDict

from trainbridge.knowledge import embeddings
from trainbridge.knowledge.jsonl import read_jsonl, write_jsonl
from trainbridge.knowledge.schema import Outcome, OutcomeHit, Recipe, Target, evidence_text, load_recipe_dir
from trainbridge.records import Intent

RECIPES = "trainbridge_recipes"
OUTCOMES = "trainbridge_outcomes"
SEED_DIR = Path(__file__).resolve().parent / "recipes"
RANK_CANDIDATES = 50  # recipes taken by similarity, besides every recipe of the intent's category
RANK_OUTCOMES = 200  # nearest past outcomes considered when ranking


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


def default_kb_dir() -> Path:
    """$TRAINBRIDGE_KB_DIR, else $TRAINBRIDGE_HOME/kb (beside its runs/), else $XDG_DATA_HOME/trainbridge/kb,
    else ~/.local/share/trainbridge/kb."""
    env = os.environ.get("TRAINBRIDGE_KB_DIR")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("TRAINBRIDGE_HOME")
    if home:
        return Path(home).expanduser() / "kb"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "trainbridge" / "kb"


def _settings() -> Settings:
    return Settings(anonymized_telemetry=False, allow_reset=False)


def _where(*clauses: dict[str, Any] | None) -> dict[str, Any] | None:
    parts = [c for c in clauses if c]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else {"$and": parts}


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _recipe_metadata(recipe: Recipe) -> dict[str, Any]:
    return {
        "category": str(recipe.category),
        "targets": ",".join(recipe.targets),
        "provenance": recipe.provenance.kind,
        "record": recipe.model_dump_json(),
    }


def _scope(backend: str, category: str) -> str:
    return f"{backend}:{category}"


def _outcome_metadata(outcome: Outcome) -> dict[str, Any]:
    # Few keys on purpose: Chroma's filter and fetch costs grow with the number of metadata keys.
    meta: dict[str, Any] = {
        "scope": _scope(str(outcome.backend), str(outcome.category)),  # one selective key for ranking
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


def _bump(recipe: Recipe, outcome: Outcome) -> Recipe:
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
    """Recipes and outcomes in Chroma (see the module docstring)."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        seed_dir: str | Path | None = SEED_DIR,
        embedding: embeddings.HashedCodeEmbedding | None = None,
        _client: Any = None,
        _location: str | None = None,
    ) -> None:
        embeddings.register()
        self._ef = embedding or embeddings.HashedCodeEmbedding()
        if _client is None:
            directory = (Path(path).expanduser() if path is not None else default_kb_dir()).resolve()
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise KnowledgeBaseError(
                    f"cannot create the knowledge base directory {directory}: {exc.strerror}; "
                    "pass another one (--kb-dir or TRAINBRIDGE_KB_DIR)"
                ) from None
            _client = chromadb.PersistentClient(path=str(directory), settings=_settings())
            _location = str(directory)
        self._client = _client
        self.location = _location or "<chroma client>"
        self._seed_dir = Path(seed_dir) if seed_dir is not None else None
        self._seeded = False
        self._batch = int(self._client.get_max_batch_size())
        self._recipes = self._collection(RECIPES, "TrainBridge rewrite recipes")
        self._outcomes = self._collection(OUTCOMES, "TrainBridge tried candidates and verdicts")

    @classmethod
    def connect(
        cls, url: str, *, headers: dict[str, str] | None = None, seed_dir: str | Path | None = SEED_DIR
    ) -> "KnowledgeBase":
        """A knowledge base on a Chroma server, e.g. ``http://kb-host:8000`` (``chroma run``)."""
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise KnowledgeBaseError(f"--kb-url must look like http://host:port, got {url!r}")
        if parsed.path not in ("", "/"):
            raise KnowledgeBaseError(f"--kb-url takes no path (got {parsed.path!r}): use http://host:port")
        ssl = parsed.scheme == "https"
        port = parsed.port or (443 if ssl else 8000)
        try:
            client = chromadb.HttpClient(
                host=parsed.hostname, port=port, ssl=ssl, headers=headers, settings=_settings()
            )
            client.heartbeat()
        except Exception as exc:  # noqa: BLE001 - any failure here means the server is not usable
            raise KnowledgeBaseError(
                f"cannot reach the Chroma server at {url}: {exc}. Start one with "
                "`chroma run --path DIR --host HOST --port PORT`, or leave out --kb-url to use the "
                "local knowledge base"
            ) from None
        return cls(seed_dir=seed_dir, _client=client, _location=f"{parsed.scheme}://{parsed.hostname}:{port}")

    def _collection(self, name: str, description: str) -> Any:
        return self._client.get_or_create_collection(
            name,
            embedding_function=self._ef,
            configuration={"hnsw": {"space": "cosine"}},
            metadata={"description": description},
        )

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            close()

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
        existing = self._get_recipes([s.id for s in seeds])
        writes = []
        for seed in seeds:
            current = existing.get(seed.id)
            if current is None:
                writes.append(seed)
            elif current.provenance.kind == "seed" and current.content_key() != seed.content_key():
                writes.append(seed.model_copy(update={"stats": current.stats}))
        self._write_recipes(writes)
        return len(writes)

    # -- recipes -----------------------------------------------------------------------------

    def _write_recipes(self, recipes: Sequence[Recipe]) -> None:
        for chunk in _chunks(list(recipes), self._batch):
            self._recipes.upsert(
                ids=[r.id for r in chunk],
                documents=[r.embedding_text() for r in chunk],
                metadatas=[_recipe_metadata(r) for r in chunk],
            )

    def _get_recipes(self, ids: Sequence[str]) -> dict[str, Recipe]:
        found: dict[str, Recipe] = {}
        for chunk in _chunks(list(ids), self._batch):
            got = self._recipes.get(ids=list(chunk), include=["metadatas"])
            for meta in got["metadatas"]:
                recipe = Recipe.model_validate_json(meta["record"])
                found[recipe.id] = recipe
        return found

    def add_recipe(self, recipe: Recipe) -> None:
        """Add a new recipe; an existing id is an error (use `upsert_recipe` to change one)."""
        self._ready()
        if self._get_recipes([recipe.id]):
            raise KnowledgeBaseError(f"recipe {recipe.id!r} already exists; use upsert to replace it")
        self._write_recipes([recipe])

    def upsert_recipe(self, recipe: Recipe, *, keep_stats: bool = True) -> bool:
        """Add or replace a recipe; an existing one keeps its measured stats. True if it was new."""
        self._ready()
        current = self._get_recipes([recipe.id]).get(recipe.id)
        if current is not None and keep_stats:
            recipe = recipe.model_copy(update={"stats": current.stats})
        self._write_recipes([recipe])
        return current is None

    def get_recipe(self, recipe_id: str) -> Recipe | None:
        self._ready()
        return self._get_recipes([recipe_id]).get(recipe_id)

    def _recipe_table(self) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Every recipe's metadata and stored embedding (rows of a matrix), in one unfiltered read.

        Recipes are few (hundreds), so they are filtered and compared here: a metadata filter in
        Chroma costs time in proportion to *all* metadata rows of the database, outcomes included
        (measured: a boolean filter over 105 recipes took 85-130 ms next to 100k outcomes, the
        unfiltered read 5 ms). Records are parsed only for the recipes that are returned.
        """
        got = self._get_all(self._recipes, None, ["metadatas", "embeddings"])
        metas = list(got["metadatas"])
        if not metas:
            return [], np.zeros((0, self._ef.dims), dtype=np.float32)
        return metas, np.asarray(got["embeddings"], dtype=np.float32)

    @staticmethod
    def _fits(meta: dict[str, Any], category: str | None, target: Target | None) -> bool:
        if target is not None and "targets" not in meta:  # written before the key existed
            meta["targets"] = ",".join(Recipe.model_validate_json(meta["record"]).targets)
        return (category is None or meta["category"] == category) and (
            target is None or str(target) in meta["targets"].split(",")
        )

    def list_recipes(self, category: str | None = None, target: str | None = None) -> list[Recipe]:
        """Recipes, sorted by id, optionally of one category and/or for one target backend."""
        self._ready()
        wanted = Target(target) if target else None
        got = self._get_all(self._recipes, None, ["metadatas"])
        recipes = [
            Recipe.model_validate_json(m["record"])
            for m in got["metadatas"]
            if self._fits(m, str(category) if category else None, wanted)
        ]
        return sorted(recipes, key=lambda r: r.id)

    def search(self, text: str, n: int = 5, target: str | None = None) -> list[SearchHit]:
        """Recipes whose pattern text is most similar to ``text`` (code, op or kernel names)."""
        self._ready()
        wanted = Target(target) if target else None
        metas, matrix = self._recipe_table()
        if not metas or n <= 0:
            return []
        sims = matrix @ np.asarray(self._ef.embed_query([text])[0], dtype=np.float32)
        order = sorted(
            (i for i, m in enumerate(metas) if self._fits(m, None, wanted)),
            key=lambda i: (-float(sims[i]), metas[i]["record"]),
        )[:n]
        return [SearchHit(recipe=Recipe.model_validate_json(metas[i]["record"]), similarity=float(sims[i])) for i in order]

    # -- outcomes ----------------------------------------------------------------------------

    def _get_all(self, collection: Any, where: dict[str, Any] | None, include: list[str]) -> dict[str, list]:
        """`get` in pages: one unbounded get of many records fails in Chroma (too many SQL variables)."""
        merged: dict[str, list] = {"ids": [], **{key: [] for key in include}}
        offset = 0
        while True:
            page = collection.get(where=where, include=include, limit=self._batch, offset=offset)
            for key in merged:
                merged[key].extend(page[key])
            if len(page["ids"]) < self._batch:
                return merged
            offset += self._batch

    def _existing_ids(self, collection: Any, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for chunk in _chunks(list(ids), self._batch):
            found.update(collection.get(ids=list(chunk), include=[])["ids"])
        return found

    def _write_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        for chunk in _chunks(list(outcomes), self._batch):
            self._outcomes.add(
                ids=[o.id for o in chunk],
                documents=[o.evidence_text() for o in chunk],
                metadatas=[_outcome_metadata(o) for o in chunk],
            )

    def record_outcome(self, outcome: Outcome) -> bool:
        """Store a tried candidate and update its recipe's stats. False if it was already stored."""
        return self.record_outcomes([outcome]) == 1

    def record_outcomes(self, outcomes: Sequence[Outcome]) -> int:
        """Store many outcomes (batched), updating recipe stats once per new outcome."""
        self._ready()
        unique = list({o.id: o for o in outcomes}.values())
        existing = self._existing_ids(self._outcomes, [o.id for o in unique])
        new = [o for o in unique if o.id not in existing]
        self._write_outcomes(new)
        self._bump_stats(new)
        return len(new)

    def _bump_stats(self, outcomes: Sequence[Outcome]) -> None:
        recipe_ids = sorted({o.recipe_id for o in outcomes if o.recipe_id})
        recipes = self._get_recipes(recipe_ids)
        for outcome in outcomes:
            if outcome.recipe_id in recipes:
                recipes[outcome.recipe_id] = _bump(recipes[outcome.recipe_id], outcome)
        self._write_recipes(list(recipes.values()))

    def outcomes_for(
        self,
        recipe_id: str | None = None,
        category: str | None = None,
        backend: str | None = None,
        limit: int | None = None,
    ) -> list[Outcome]:
        """Recorded outcomes of a recipe and/or an intent category (and backend), oldest first."""
        self._ready()
        where = _where(
            {"recipe_id": recipe_id} if recipe_id else None,
            {"category": str(category)} if category else None,
            {"backend": str(Target(backend))} if backend else None,
        )
        got = self._get_all(self._outcomes, where, ["metadatas"])
        outcomes = sorted(
            (Outcome.model_validate_json(m["record"]) for m in got["metadatas"]),
            key=lambda o: (o.timestamp, o.id),
        )
        return outcomes[-limit:] if limit else outcomes

    # -- the retrieval agent's query --------------------------------------------------------

    def ranking_inputs(
        self, intent: Intent, target: str, *, categories: set[str], strict_target: bool = True
    ) -> tuple[list[tuple[Recipe, float]], list[OutcomeHit]]:
        """What the retrieval agent ranks for ``intent`` on ``target`` (agents/retrieval/rank.py).

        Candidates, each with its cosine similarity to the intent's evidence: every recipe of one of
        ``categories`` plus the ``RANK_CANDIDATES`` most similar; with ``strict_target`` only recipes
        written for ``target``. Hits: the nearest ``RANK_OUTCOMES`` judged outcomes on this backend
        for this intent category, of those candidates.
        """
        self._ready()
        backend = Target(target)
        query = np.asarray(
            self._ef.embed_query([evidence_text(str(intent.category), intent.evidence)])[0], dtype=np.float32
        )
        metas, matrix = self._recipe_table()
        sims = matrix @ query
        usable = [i for i, m in enumerate(metas) if not strict_target or self._fits(m, None, backend)]
        by_similarity = sorted(usable, key=lambda i: -float(sims[i]))[:RANK_CANDIDATES]
        same_category = [i for i in usable if metas[i]["category"] in categories]
        candidates: dict[str, tuple[Recipe, float]] = {}
        for i in same_category + by_similarity:
            recipe = Recipe.model_validate_json(metas[i]["record"])
            candidates.setdefault(recipe.id, (recipe, float(sims[i])))
        if not candidates:
            return [], []

        # The nearest outcomes on this backend for this kind of intent: one equality filter (scope)
        # is far cheaper in Chroma than backend AND category AND recipe_id IN (...).
        past = self._outcomes.query(
            query_embeddings=[query],
            n_results=RANK_OUTCOMES,
            where={"scope": _scope(str(backend), str(intent.category))},
            include=["metadatas", "distances"],
        )
        hits = [
            OutcomeHit(
                recipe_id=meta["recipe_id"],
                accepted=bool(meta["accepted"]),
                similarity=1.0 - float(dist),
                ratio=meta.get("ratio"),
            )
            for meta, dist in zip(past["metadatas"][0], past["distances"][0])
            if meta["recipe_id"] in candidates and not meta.get("pending")  # not judged yet: no evidence either way
        ]
        return list(candidates.values()), hits

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
        present = self._existing_ids(self._recipes, [r.id for r in recipes])
        added = [r for r in recipes if r.id not in present]
        self._write_recipes(added)
        report.recipes_added, report.recipes_skipped = len(added), len(recipes) - len(added)
        new_ids = {r.id for r in added}

        existing = self._existing_ids(self._outcomes, [o.id for o in outcomes])
        fresh = list({o.id: o for o in outcomes if o.id not in existing}.values())
        self._write_outcomes(fresh)
        self._bump_stats([o for o in fresh if o.recipe_id not in new_ids])
        report.outcomes_added, report.outcomes_skipped = len(fresh), len(outcomes) - len(fresh)
        return report

    def stats(self) -> KBStats:
        self._ready()
        recipes = self.list_recipes()
        by_category = Counter(str(r.category) for r in recipes)
        by_target = Counter(str(t) for r in recipes for t in r.targets)
        accepted = len(self._get_all(self._outcomes, {"accepted": True}, [])["ids"])
        pending = len(self._get_all(self._outcomes, {"pending": True}, [])["ids"])
        total = self._outcomes.count()
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
