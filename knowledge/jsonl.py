"""The JSONL exchange format of the knowledge base, to move knowledge between sites.

One JSON object per line: a header ``{"type": "header", "format": "trainbridge-kb", "version": 1}``,
then ``{"type": "recipe", "record": {...}}`` lines (sorted by id) and ``{"type": "outcome",
"record": {...}}`` lines (sorted by time, then id). Records are the full `Recipe` / `Outcome`
JSON, so an export imported elsewhere gives back the same records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from trainbridge.knowledge.schema import Outcome, Recipe

FORMAT = "trainbridge-kb"
VERSION = 1


class KBFileError(ValueError):
    """A JSONL file that cannot be imported; the message names the file and line."""


def write_jsonl(path: str | Path, recipes: Iterable[Recipe], outcomes: Iterable[Outcome]) -> tuple[int, int]:
    """Write records to ``path`` (atomically: a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    n_recipes = n_outcomes = 0
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", "format": FORMAT, "version": VERSION}) + "\n")
        for recipe in sorted(recipes, key=lambda r: r.id):
            fh.write('{"type":"recipe","record":' + recipe.model_dump_json() + "}\n")
            n_recipes += 1
        for outcome in sorted(outcomes, key=lambda o: (o.timestamp, o.id)):
            fh.write('{"type":"outcome","record":' + outcome.model_dump_json() + "}\n")
            n_outcomes += 1
    tmp.replace(path)
    return n_recipes, n_outcomes


def read_jsonl(path: str | Path) -> tuple[list[Recipe], list[Outcome]]:
    """Read and validate every line before anything is imported (a bad line imports nothing)."""
    path = Path(path)
    recipes: list[Recipe] = []
    outcomes: list[Outcome] = []
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise KBFileError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KBFileError(f"{where}: not JSON: {exc.msg}") from None
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "header":
                if obj.get("format") != FORMAT or obj.get("version") != VERSION:
                    raise KBFileError(
                        f"{where}: expected format {FORMAT!r} version {VERSION}, got "
                        f"{obj.get('format')!r} version {obj.get('version')!r}"
                    )
                continue
            model = {"recipe": Recipe, "outcome": Outcome}.get(kind)  # type: ignore[arg-type]
            if model is None:
                raise KBFileError(f"{where}: 'type' must be header, recipe or outcome, got {kind!r}")
            try:
                record = model.model_validate(obj.get("record"))
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                loc = ".".join(str(p) for p in first["loc"])
                raise KBFileError(f"{where}: {kind}.{loc}: {first['msg']}") from None
            (recipes if kind == "recipe" else outcomes).append(record)  # type: ignore[arg-type]
    return recipes, outcomes
