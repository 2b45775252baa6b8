"""Import lines of a recipe, as the pieces libcst's import adder needs."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ImportSpec:
    module: str
    obj: str | None = None
    asname: str | None = None


def parse_import_line(line: str) -> ImportSpec:
    """`import a.b [as c]` or `from a.b import x [as y]` (one name); anything else is refused."""
    text = line.strip()
    plain = re.fullmatch(r"import ([\w.]+)(?: as (\w+))?", text)
    if plain:
        return ImportSpec(plain.group(1), None, plain.group(2))
    from_import = re.fullmatch(r"from ([\w.]+) import (\w+)(?: as (\w+))?", text)
    if from_import:
        return ImportSpec(from_import.group(1), from_import.group(2), from_import.group(3))
    raise ValueError(f"unsupported import line {line!r}: use 'import a.b [as c]' or 'from a.b import x [as y]'")
