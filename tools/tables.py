"""Rich tables for results shown on the terminal."""

from __future__ import annotations

from rich.table import Table

from trainbridge.records import Intent


def intents_table(intents: list[Intent], title: str) -> Table:
    table = Table(title=title, show_lines=False)
    for column, justify in (("#", "right"), ("category", "left"), ("where", "left"), ("K vs N", "right"),
                            ("time share", "right"), ("est. saving", "right"), ("confidence", "right"), ("found by", "left")):
        table.add_column(column, justify=justify)
    for rank, intent in enumerate(intents, start=1):
        evidence = intent.evidence
        k = "?" if evidence.reference_kernels is None else str(evidence.reference_kernels)
        n = "?" if evidence.target_ops is None else str(evidence.target_ops)
        share = "-" if evidence.target_time_share is None else f"{evidence.target_time_share:.1%}"
        saving = "-" if intent.estimated_saving_us is None else f"~{intent.estimated_saving_us / 1000:.1f} ms"
        table.add_row(str(rank), str(intent.category), ", ".join(str(s) for s in intent.spans), f"{k} vs {n}",
                      share, saving, f"{intent.confidence:.2f}", ", ".join(evidence.detectors))
    return table
