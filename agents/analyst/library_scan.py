"""The static source scan over the library code a profiled step ran (transformers' modeling_llama.py, ...).

The scan's patterns find a library's hand-written regions exactly as they find the user's (the RMSNorm written out in
`LlamaRMSNorm.forward`, the rotary in `apply_rotary_pos_emb`), with their exact lines. Only files where forward ops
ran innermost are read (a library is large; the step runs a few of its files), and only findings some op of the
step ran under are kept: each becomes an intent located in the library (`Intent.library`), whose spans are the
user's call sites of those ops. Library files never change here: this reads them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainbridge.agents.analyst.static.forms import CONFIGURED_NOTE
from trainbridge.agents.analyst.static.model import StaticScanError
from trainbridge.agents.analyst.static.scan import scan_source
from trainbridge.records import Intent, LibrarySpan, Phase, SourceSpan
from trainbridge.tools.eager_profile import UNATTRIBUTED_FILE, EagerOpTable, LibraryFrame
from trainbridge.tools.library_code import library_span

MAX_LINES = 4000  # a larger library file (modeling_utils.py) holds framework code, not a model's regions
log = logging.getLogger(__name__)


def scan_library_regions(table: EagerOpTable, *, target: str | None = None, step: int = 0) -> tuple[list[Intent], list[str]]:
    """Static intents of the library files the step's forward ran, located in the library; and notes on files that
    were not read (too large, unreadable, not parsed)."""
    frames_by_file: dict[str, list[LibraryFrame]] = {}
    for frame in table.library_frames:
        frames_by_file.setdefault(frame.function.file, []).append(frame)
    innermost = {table.library_frames[op.library_stack[0]].function.file for op in table.ops
                 if op.step == step and op.phase == Phase.forward and op.library_stack}
    intents: list[Intent] = []
    notes: list[str] = []
    for rel in sorted(innermost):
        source = _read(rel, frames_by_file[rel], notes)
        if source is None:
            continue
        try:
            found = scan_source(source, rel, target=target, library=True)
        except StaticScanError as exc:
            notes.append(f"library file {rel} not scanned: {exc}")
            continue
        for static in found:
            intent = _located(static, rel, table, step)
            if intent is not None:
                intents.append(intent)
    return intents, notes


def _read(rel: str, frames: list[LibraryFrame], notes: list[str]) -> str | None:
    path = _path_of(rel)
    if path is None:
        notes.append(f"library file {rel} not scanned: not found on this interpreter's path")
        return None
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        notes.append(f"library file {rel} not scanned: {exc}")
        return None
    if source.count("\n") > MAX_LINES:
        notes.append(f"library file {rel} not scanned: over {MAX_LINES} lines (the advisor's rules still read its ops)")
        return None
    return source


def _path_of(rel: str) -> Path | None:
    import sys

    for entry in sys.path:
        candidate = Path(entry or ".") / rel
        if candidate.is_file():
            return candidate
    return None


_GATED_OPS = {"swiglu": {"aten::silu", "aten::silu_"}, "geglu": {"aten::gelu", "aten::gelu_"}}


def _configured_kind_ran(static: Intent, ops) -> bool:
    """A gated activation whose activation is chosen by configuration (`ACT2FN[config.hidden_act]`, LlamaMLP's
    `act_fn`) is found as both kinds; the kind whose op ran under the region is the one kept."""
    if not any(CONFIGURED_NOTE in note for note in static.evidence.notes) or str(static.category) not in _GATED_OPS:
        return True
    return any(op.name in _GATED_OPS[str(static.category)] for op in ops)


def _located(static: Intent, rel: str, table: EagerOpTable, step: int) -> Intent | None:
    """The static finding as a library intent, if some op of the step ran under its first span."""
    region = static.spans[0]
    ops = [op for op in table.ops if op.step == step and any(
        frame.function.file == rel and region.line_start <= frame.line <= region.line_end for frame in table.library_of(op))]
    calls = sorted({(op.span.file, op.span.line_start, op.span.function) for op in ops if op.span.file != UNATTRIBUTED_FILE})
    if not calls or not _configured_kind_ran(static, ops):
        return None
    spans = [SourceSpan(file=file, line_start=line, line_end=line, function=function) for file, line, function in calls]
    library: LibrarySpan = library_span(rel, region.line_start, region.line_end, region.function)
    more = [f"also {s.function or rel}:{s.line_start}-{s.line_end}" for s in static.spans[1:]]
    evidence = static.evidence.model_copy(update={"notes": static.evidence.notes + more})
    return static.model_copy(update={"id": Intent.make_id(static.category, spans, library), "spans": spans,
                                     "library": library, "evidence": evidence})
