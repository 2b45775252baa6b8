"""Inductor's FX graph files (node -> ATen op and `# File: path:line`), Python stack traces, and the
post-fusion scheduler IR (`ir_post_fusion.txt`)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FxNode:
    name: str
    target: str | None  # "aten.pow"
    file: str | None
    line: int | None
    function: str | None


_FILE_COMMENT = re.compile(r"^\s*# File: (.+?):(\d+) in ([^,]+), code:")
_NODE_LINE = re.compile(r"^\s+(\w+)(?::\s*\"[^\"]*\")? = (.*)$")
_TORCH_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.")


def parse_fx_graph(text: str) -> dict[str, FxNode]:
    """Node name -> ATen target and the user source line from the `# File:` comment above it."""
    nodes: dict[str, FxNode] = {}
    loc: tuple[str, int, str] | None = None
    for line in text.splitlines():
        if not line.strip():
            loc = None
            continue
        if fm := _FILE_COMMENT.match(line):
            loc = (fm.group(1), int(fm.group(2)), fm.group(3).strip())
            continue
        if line.strip().startswith("#"):
            if "No stacktrace found" in line:
                loc = None
            continue
        nm = _NODE_LINE.match(line)
        if nm is None or nm.group(1) in ("def", "return", "class"):
            continue
        tm = _TORCH_OP.search(nm.group(2))
        target = f"{tm.group(1)}.{tm.group(2)}" if tm else None
        nodes[nm.group(1)] = FxNode(nm.group(1), target, *(loc if loc else (None, None, None)))
    return nodes


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def parse_stack_trace(text: str) -> list[Frame]:
    """Frames of a Python traceback-style stack, outermost first."""
    return [Frame(m.group(1), int(m.group(2)), m.group(3))
            for m in (_FRAME.match(line) for line in text.splitlines()) if m]


_POST_NODE = re.compile(r"^(\w+): (\w*SchedulerNode)\(")


def parse_post_fusion(text: str) -> list[tuple[str, str]]:
    """Top-level scheduler nodes of ir_post_fusion.txt: (name, kind), nested snodes skipped."""
    nodes: list[tuple[str, str]] = []
    nested = False
    for line in text.splitlines():
        if re.match(r"^\w+\.snodes\[\d+\] =\s*$", line):
            nested = True
            continue
        if m := _POST_NODE.match(line):
            if not nested:
                nodes.append((m.group(1), m.group(2)))
            nested = False
    return nodes
