"""Rich tables for results shown on the terminal, and the intents table's cells (the run report prints the same table)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from trainbridge.records import Intent, LibrarySpan

INTENT_COLUMNS = (("#", "right"), ("category", "left"), ("where", "left"), ("K vs N", "right"), ("time share", "right"),
                  ("est. saving", "right"), ("confidence", "right"), ("found by", "left"))


def intent_cells(rank: int, intent: dict[str, Any]) -> list[str]:
    """One intent's row of `INTENT_COLUMNS`, from an Intent's JSON dump (or the run's `intent_evidence` entry of it:
    spans as text, confidence and estimate when the analysis recorded them)."""
    evidence = intent.get("evidence") or {}
    k = "?" if evidence.get("reference_kernels") is None else str(evidence["reference_kernels"])
    n = "?" if evidence.get("target_ops") is None else str(evidence["target_ops"])
    share = "-" if evidence.get("target_time_share") is None else f"{evidence['target_time_share']:.1%}"
    saving = "-" if intent.get("estimated_saving_us") is None else f"~{intent['estimated_saving_us'] / 1000:.1f} ms"
    confidence = "-" if intent.get("confidence") is None else f"{intent['confidence']:.2f}"
    spans = ", ".join(s if isinstance(s, str) else _span(s) for s in intent.get("spans") or [])
    library = intent.get("library")
    if library:  # a region in a library: where it is, then the user's call sites that reach it
        spans = f"{library if isinstance(library, str) else LibrarySpan.model_validate(library)} via {spans or '?'}"
    return [str(rank), str(intent.get("category")), spans, f"{k} vs {n}", share, saving, confidence,
            ", ".join(evidence.get("detectors") or [])]


def _span(span: dict[str, Any]) -> str:
    lines = f"{span['line_start']}" if span["line_start"] == span["line_end"] else f"{span['line_start']}-{span['line_end']}"
    return f"{span['file']}:{lines}"


def intents_table(intents: list[Intent], title: str) -> Table:
    table = Table(title=title, show_lines=False)
    for column, justify in INTENT_COLUMNS:
        table.add_column(column, justify=justify)
    for rank, intent in enumerate(intents, start=1):
        table.add_row(*intent_cells(rank, intent.model_dump(mode="json")))
    return table
