"""An LLM reply as edits: aider-style search/replace blocks parsed, located (exactly once, inside the
intent's span) and applied; `PatchRejected` says at which stage a reply was refused and why."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from trainbridge.records import Record, SourceSpan

Stage = Literal["request", "format", "confinement", "rules", "compile", "structure", "import", "sandbox"]


class AttemptFailure(Record):
    attempt: int = Field(ge=1)
    stage: Stage
    message: str
    close: list[str] = Field(default_factory=list, description="what came close, for the model and the user")


class PatchRejected(Exception):
    def __init__(self, stage: Stage, message: str, close: list[str] | None = None):
        super().__init__(message)
        self.stage, self.message, self.close = stage, message, close or []


# --- parsing the reply ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EditBlock:
    file: str | None
    search: list[str]
    replace: list[str]


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    blocks: list[EditBlock]
    imports: list[str]


_OPEN = re.compile(r"^\s*<{5,9} ?(SEARCH|IMPORTS)\s*$")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_CLOSE = re.compile(r"^\s*>{5,9} ?(REPLACE|IMPORTS)\s*$")


def parse_reply(text: str) -> ParsedReply:
    """Search/replace blocks (and at most one IMPORTS block) of a reply; prose around them is ignored."""
    lines = text.splitlines()
    blocks: list[EditBlock] = []
    imports: list[str] = []
    last_file: str | None = None
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        kind, start = opened.group(1), i + 1
        parts: list[list[str]] = [[]]
        i += 1
        while i < len(lines) and not _CLOSE.match(lines[i]):
            if _OPEN.match(lines[i]):
                raise PatchRejected("format", f"the {kind} block opened on reply line {start} is not closed before "
                                    f"another block opens on line {i + 1}")
            if kind == "SEARCH" and _DIVIDER.match(lines[i]):
                parts.append([])
            else:
                parts[-1].append(lines[i])
            i += 1
        if i == len(lines):
            closer = ">>>>>>> REPLACE" if kind == "SEARCH" else ">>>>>>> IMPORTS"
            raise PatchRejected("format", f"the {kind} block opened on reply line {start} never ends with {closer}")
        if _CLOSE.match(lines[i]).group(1) != ("REPLACE" if kind == "SEARCH" else "IMPORTS"):
            raise PatchRejected("format", f"the {kind} block opened on reply line {start} ends with the wrong marker "
                                f"{lines[i].strip()!r}")
        if kind == "IMPORTS":
            imports += [line.strip() for line in parts[0] if line.strip()]
        elif len(parts) != 2:
            raise PatchRejected("format", f"the SEARCH block opened on reply line {start} needs exactly one ======= "
                                f"divider between SEARCH and REPLACE text (found {len(parts) - 1})")
        else:
            last_file = _path_before(lines, start - 1) or last_file
            blocks.append(EditBlock(last_file, parts[0], parts[1]))
        i += 1
    if not blocks:
        raise PatchRejected("format", "the reply contains no SEARCH/REPLACE block; answer with blocks of the form "
                            "<path>, <<<<<<< SEARCH, old lines, =======, new lines, >>>>>>> REPLACE")
    return ParsedReply(blocks, imports)


def _path_before(lines: list[str], index: int) -> str | None:
    for line in reversed(lines[:index]):
        text = line.strip()
        if not text or text.startswith("```"):
            continue
        if _CLOSE.match(line):
            return None
        text = text.strip("`*#: ")
        return text if re.fullmatch(r"[\w./-]+\.py", text) else None
    return None


# --- locating and applying the blocks ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocatedEdit:
    """One search/replace block located in its file: lines [start, end) become `replace`."""

    file: str
    start: int  # 0-based first line
    end: int  # exclusive
    replace: list[str]


def locate(blocks: Sequence[EditBlock], sources: dict[str, str], spans: Sequence[SourceSpan]) -> list[LocatedEdit]:
    """Where each block applies; refuses blocks that are ambiguous, missing or outside the spans."""
    found: list[LocatedEdit] = []
    for number, block in enumerate(blocks, 1):
        file = _resolve_file(block.file, sources, number)
        if not any(line.strip() for line in block.search):
            raise PatchRejected("format", f"block {number}: the SEARCH text is empty; copy the lines to replace")
        lines = sources[file].splitlines()
        n = len(block.search)
        if len(block.replace) > 4 * n + 20:
            raise PatchRejected("format", f"block {number}: REPLACE has {len(block.replace)} lines for {n} SEARCH "
                                "line(s); a fused rewrite of the region should not grow it this much")
        hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block.search]
        if not hits:
            raise PatchRejected("confinement", f"block {number}: the SEARCH text does not occur in {file}",
                                _near_misses(block.search, lines, file))
        if len(hits) > 1:
            where = ", ".join(f"line {h + 1}" for h in hits)
            raise PatchRejected("confinement", f"block {number}: the SEARCH text occurs {len(hits)} times in {file} "
                                f"({where}); include more lines of the region to make it unique")
        start = hits[0]
        allowed = [s for s in spans if s.file == file]
        if not any(s.line_start <= start + 1 and start + n <= s.line_end for s in allowed):
            raise PatchRejected("confinement", f"block {number}: the SEARCH text is {file} lines {start + 1}-{start + n}, "
                                f"outside the editable region ({', '.join(str(s) for s in allowed)}); only those "
                                "lines may change")
        for other in found:
            if other.file == file and other.start < start + n and start < other.end:
                raise PatchRejected("confinement", f"block {number} overlaps an earlier block ({file} lines "
                                    f"{other.start + 1}-{other.end})")
        found.append(LocatedEdit(file, start, start + n, block.replace))
    return found


def _resolve_file(name: str | None, sources: dict[str, str], number: int) -> str:
    if name is None:
        if len(sources) == 1:
            return next(iter(sources))
        raise PatchRejected("format", f"block {number}: put the file path ({', '.join(sources)}) on the line before "
                            "<<<<<<< SEARCH")
    clean = name.removeprefix("./")
    matches = [f for f in sources if f == clean or f.endswith("/" + clean)]
    if len(matches) != 1:
        raise PatchRejected("confinement", f"block {number}: {name} is not a file this intent may edit "
                            f"({', '.join(sources)})")
    return matches[0]


def _near_misses(search: list[str], lines: list[str], file: str) -> list[str]:
    if all(re.match(r"\s*>?\s*\d+ \| ", line) for line in search if line.strip()):
        return ["the SEARCH lines start with line numbers ('  12 | '); copy the code without them"]
    stripped = [line.strip() for line in search]
    n = len(search)
    for i in range(len(lines) - n + 1):
        if [line.strip() for line in lines[i:i + n]] == stripped:
            return [f"{file} lines {i + 1}-{i + n} match except for indentation; copy the whitespace exactly"]
    first = next(line for line in search if line.strip())
    close = difflib.get_close_matches(first.strip(), [line.strip() for line in lines], n=3, cutoff=0.6)
    return [f"{file} line {i + 1}: {lines[i].strip()}" for i, line in enumerate(lines) if line.strip() in close][:3]


def apply_blocks(source: str, located: Sequence[LocatedEdit]) -> str:
    newline = "\r\n" if "\r\n" in source else "\n"
    lines = source.splitlines()
    for edit in sorted(located, key=lambda e: -e.start):
        lines[edit.start:edit.end] = edit.replace
    return newline.join(lines) + (newline if source.endswith(("\n", "\r")) else "")
