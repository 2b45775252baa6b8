"""Shared helpers of the static scan tests (tests/test_static_scan*.py): an intent as a comparable row,
a scan of a code snippet, a small repository written to a folder."""

from __future__ import annotations

import textwrap
from pathlib import Path

from trainbridge.agents.analyst.static.scan import scan_source
from trainbridge.records import Intent


Row = tuple[str, str, int, int]  # (category, file, first line, last line) of an intent's first span


def rows(intents: list[Intent]) -> list[Row]:
    return sorted((i.category.value, i.spans[0].file, i.spans[0].line_start, i.spans[0].line_end) for i in intents)


def spans_of(intents: list[Intent], category: str) -> list[list[str]]:
    return [[f"{s}@{s.function}" for s in i.spans] for i in intents if i.category.value == category]


def scan(code: str) -> list[Row]:
    return rows(scan_source(textwrap.dedent(code), "m.py"))


def write_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root
