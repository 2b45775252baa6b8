"""`trainbridge kb ...`: look into and manage the rewrite knowledge base.

A typer sub-app; the main CLI mounts it with ``app.add_typer(kb_app, name="kb")``.
Every command takes ``--kb-dir`` (a local knowledge base directory) or ``--kb-url`` (a Chroma
server shared by a team); without either, $TRAINBRIDGE_KB_URL if set, else the local default
directory ($TRAINBRIDGE_KB_DIR, else $TRAINBRIDGE_HOME/kb, else $XDG_DATA_HOME/trainbridge/kb, else
~/.local/share/trainbridge/kb).
Exit codes: 0 done, 1 the knowledge base failed, 2 bad input (a malformed recipe or file).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from trainbridge.knowledge.cli_json import json_option, to_stdout, write_json
from trainbridge.knowledge.jsonl import KBFileError
from trainbridge.knowledge.schema import Recipe, RecipeFileError, Target, load_recipe_file
from trainbridge.knowledge.store import KnowledgeBase, KnowledgeBaseError
from trainbridge.settings import settings

kb_app = typer.Typer(
    name="kb",
    help=(
        "The rewrite knowledge base: recipes (declarative rewrites, with their numerics class, "
        "preconditions and pitfalls) and the outcomes of every tried candidate. Local by default; "
        "--kb-url points at a Chroma server shared by a team."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)
out = Console()
err = Console(stderr=True)

KbDir = Annotated[
    Optional[Path],
    typer.Option(
        "--kb-dir",
        help="Local knowledge base directory (default: $TRAINBRIDGE_KB_DIR, else $TRAINBRIDGE_HOME/kb, else $XDG_DATA_HOME/trainbridge/kb).",
        file_okay=False,
    ),
]
KbUrl = Annotated[
    Optional[str],
    typer.Option(
        "--kb-url",
        help=(
            "Chroma server URL, e.g. http://kb-host:8000 (start one with `chroma run --path DIR`). "
            "Default: $TRAINBRIDGE_KB_URL when --kb-dir is not given."
        ),
    ),
]


@contextmanager
def _open(kb_dir: Optional[Path], kb_url: Optional[str]) -> Iterator[KnowledgeBase]:
    if kb_dir is not None and kb_url:
        err.print("[red]error:[/red] give --kb-dir or --kb-url, not both")
        raise typer.Exit(2)
    if kb_dir is None and not kb_url:
        kb_url = settings().KB_URL
    try:
        kb = KnowledgeBase.connect(kb_url) if kb_url else KnowledgeBase(kb_dir)
    except KnowledgeBaseError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    try:
        yield kb
    except (RecipeFileError, KBFileError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    except KnowledgeBaseError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        kb.close()


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _recipe_table(recipes: list[Recipe], title: str) -> Table:
    table = Table(title=title)
    table.add_column("id", style="bold", no_wrap=True)
    table.add_column("category")
    table.add_column("targets")
    table.add_column("rtol")
    table.add_column("tried/ok/no", justify="right", no_wrap=True)
    table.add_column("best", justify="right")
    for r in recipes:
        table.add_row(
            r.id,
            str(r.category),
            ",".join(map(str, r.targets)),
            "exact" if r.numerics.class_ == "exact" else f"{r.numerics.rtol:g}",
            f"{r.stats.tried}/{r.stats.accepted}/{r.stats.rejected}",
            _ratio(r.stats.best_ratio),
        )
    return table


def _target(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in set(Target):
        raise typer.BadParameter(f"{value!r} is not a backend; use one of {', '.join(Target)}", param_hint="--target")
    return value


@kb_app.command("list")
def list_cmd(
    category: Annotated[Optional[str], typer.Option(help="Only this intent category, e.g. rmsnorm.")] = None,
    target: Annotated[Optional[str], typer.Option(help="Only recipes for this backend: cpu, cuda or npu.", callback=_target)] = None,
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
    json_out: Optional[Path] = json_option("recipes listed (every field of each, as `kb show --json` gives one)"),
) -> None:
    """List recipes with their targets, numerics class and outcome counts."""
    with _open(kb_dir, kb_url) as kb:
        recipes = kb.list_recipes(category=category, target=target)
        if not to_stdout(json_out):
            out.print(_recipe_table(recipes, f"{len(recipes)} recipe(s) in {kb.location}"))
        write_json(json_out, [r.model_dump(mode="json") for r in recipes])


@kb_app.command()
def show(
    recipe_id: Annotated[str, typer.Argument(help="Recipe id, as `trainbridge kb list` shows it.")],
    json_out: Optional[Path] = json_option("recipe's full record"),
    outcomes: Annotated[int, typer.Option(help="How many recent outcomes to show.")] = 10,
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Show one recipe: pattern, replacement, preconditions, pitfalls, stats and recent outcomes."""
    with _open(kb_dir, kb_url) as kb:
        recipe = kb.get_recipe(recipe_id)
        if recipe is None:
            err.print(f"[red]error:[/red] no recipe {recipe_id!r} in {kb.location}; `trainbridge kb list` shows the ids")
            raise typer.Exit(1)
        write_json(json_out, recipe.model_dump(mode="json"))
        if to_stdout(json_out):
            return
        n = recipe.numerics
        tol = "" if n.class_ == "exact" else f" rtol={n.rtol} atol={n.atol} loss_rtol={n.loss_rtol}"
        out.print(Panel.fit(
            f"[bold]{recipe.title}[/bold]\ncategory {recipe.category}   targets {', '.join(recipe.targets)}   "
            f"numerics {n.class_}{tol}\nprovenance {recipe.provenance.kind}: {recipe.provenance.notes}",
            title=recipe.id,
        ))
        out.print(f"match: [bold]{recipe.match.kind}[/bold]")
        out.print_json(json.dumps(recipe.match.params))
        out.print("replacement:")
        out.print(Syntax(recipe.replacement, "python", word_wrap=True))
        if recipe.imports:
            out.print("imports: " + "; ".join(recipe.imports))
        for p in recipe.preconditions:
            out.print(f"precondition: {p.kind} {p.subject} {p.op} {json.dumps(p.value)}" + (f"  ({p.note})" if p.note else ""))
        for pitfall in recipe.pitfalls:
            out.print(f"pitfall: {pitfall}")
        s = recipe.stats
        out.print(f"stats: tried {s.tried}, accepted {s.accepted}, rejected {s.rejected}, best ratio {_ratio(s.best_ratio)}")
        recent = kb.outcomes_for(recipe_id=recipe.id, limit=outcomes) if outcomes > 0 else []
        if recent:
            table = Table(title="recent outcomes")
            for col in ("time", "run", "intent", "backend", "verdict", "ratio"):
                table.add_column(col)
            for o in reversed(recent):
                table.add_row(o.timestamp.strftime("%Y-%m-%d %H:%M"), o.run_id, o.intent_id, str(o.backend), o.verdict, _ratio(o.ratio))
            out.print(table)


@kb_app.command()
def search(
    text: Annotated[str, typer.Argument(help="Code, op names or kernel names, e.g. 'cpp_fused_add_mean_mul_pow_rsqrt'.")],
    n: Annotated[int, typer.Option("-n", help="How many recipes.")] = 5,
    target: Annotated[Optional[str], typer.Option(help="Only recipes for this backend.", callback=_target)] = None,
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Find recipes similar to a piece of code or an op/kernel sequence (offline embeddings)."""
    with _open(kb_dir, kb_url) as kb:
        hits = kb.search(text, n=n, target=target)
        table = Table(title=f"recipes nearest to {text[:40]!r}")
        table.add_column("#", justify="right")
        table.add_column("id", style="bold", no_wrap=True)
        table.add_column("similarity", justify="right")
        table.add_column("title")
        for i, hit in enumerate(hits, 1):
            table.add_row(str(i), hit.recipe.id, f"{hit.similarity:.3f}", hit.recipe.title)
        out.print(table)


@kb_app.command()
def add(
    files: Annotated[list[Path], typer.Argument(help="Recipe YAML files.", exists=True, dir_okay=False)],
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Validate recipe YAML files and add them (an existing id is updated; its stats are kept).

    Nothing is written unless every file is valid.
    """
    try:
        recipes = [load_recipe_file(f) for f in files]
    except RecipeFileError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    with _open(kb_dir, kb_url) as kb:
        for recipe in recipes:
            new = kb.upsert_recipe(recipe)
            out.print(f"{'added' if new else 'updated'} {recipe.id}")


@kb_app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(help="A JSONL file written by `trainbridge kb export`.", exists=True, dir_okay=False)],
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Import recipes and outcomes from JSONL. Idempotent: records already present are skipped."""
    with _open(kb_dir, kb_url) as kb:
        report = kb.import_jsonl(file)
        out.print(
            f"imported {report.recipes_added} recipe(s) and {report.outcomes_added} outcome(s) "
            f"(skipped {report.recipes_skipped} and {report.outcomes_skipped} already present)"
        )


@kb_app.command()
def export(
    file: Annotated[Path, typer.Argument(help="Output JSONL file.", dir_okay=False)],
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Export every recipe and outcome as JSONL, to move knowledge to another site."""
    with _open(kb_dir, kb_url) as kb:
        n_recipes, n_outcomes = kb.export_jsonl(file)
        out.print(f"exported {n_recipes} recipe(s) and {n_outcomes} outcome(s) to {file}")


@kb_app.command()
def stats(
    json_out: Optional[Path] = json_option("counts"),
    kb_dir: KbDir = None,
    kb_url: KbUrl = None,
) -> None:
    """Counts: recipes per category and backend, outcomes accepted and rejected."""
    with _open(kb_dir, kb_url) as kb:
        s = kb.stats()
        write_json(json_out, s.model_dump(mode="json"))
        if to_stdout(json_out):
            return
        table = Table(title=f"knowledge base {s.location}")
        table.add_column("what")
        table.add_column("count", justify="right")
        table.add_row("recipes", str(s.recipes))
        for cat, n in s.recipes_by_category.items():
            table.add_row(f"  category {cat}", str(n))
        for tgt, n in s.recipes_by_target.items():
            table.add_row(f"  for {tgt}", str(n))
        table.add_row("outcomes", str(s.outcomes))
        table.add_row("  accepted", str(s.accepted))
        table.add_row("  rejected", str(s.rejected))
        out.print(table)
