"""`--json` as every command that prints results takes it (`trainbridge kb ...` here, and graph/cli's commands,
which import it: the knowledge layer is the lowest one with commands).

`--json FILE` writes the command's record to FILE, and the usual output still shows; `--json -` writes the record
to stdout and nothing else goes there (tables and messages go to stderr).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

JSON_HELP = "Write the {what} as JSON to FILE; '-' writes it to stdout, and nothing else goes there."


def json_option(what: str):
    return typer.Option(None, "--json", metavar="FILE|-", help=JSON_HELP.format(what=what))


def to_stdout(target: Optional[Path]) -> bool:
    """Whether stdout carries the JSON (so every other output belongs on stderr)."""
    return target is not None and str(target) == "-"


def write_json(target: Optional[Path], record: Any) -> None:
    """The record to `target` (nothing when None); a file is announced on stderr."""
    if target is None:
        return
    text = json.dumps(record, indent=2, default=str)
    if to_stdout(target):
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    target.write_text(text + "\n", encoding="utf-8")
    Console(stderr=True).print(f"wrote {target}", soft_wrap=True, markup=False, highlight=False)
