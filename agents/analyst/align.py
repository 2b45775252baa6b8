"""Align reference kernels, profiled eager ops and source patterns into ranked intents.

Inputs, each optional but the source scan:
- source-pattern intents (static scan: exact spans, category) and advisor-rule intents (op
  sequences at the lines of the matched ops);
- the target table: every eager op of a profiled step with its source line, phase and time;
- the reference: the compiled step's kernels (`FusionGroup`) with their source lines.

The join key is the source line. For each region an intent covers, N = eager ops launched there per
step (forward and backward), K = reference kernels whose source lines fall in the region. The saving
is an *estimate* — target time in the region x (1 - K/N), the share of launches fusion removed — and
says so in `estimate_basis`; only the profiler gate measures.

An intent located in a library (`Intent.library`: the region is `LlamaRMSNorm.forward` in
transformers, reached from the user's `model(x)` line) counts only the ops that ran under that
library region from its call sites, and the reference kernels whose stacks pass through it: regions
of one library called from one user line keep their own N and K.

The run compiles its reference once, on the original program. A later analysis of the run's head (after an accepted
rewrite) compiles nothing: `earlier` gives, for a region whose code is unchanged since, the K the first analysis
counted there (agents/analyst/earlier_reference.py matches regions by their code, not their moved lines).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from trainbridge.records import FusionGroup, Intent, IntentCategory, IntentSource, LibrarySpan, Phase, SourceSpan
from trainbridge.tools.eager_profile import UNATTRIBUTED_FILE, EagerOp, EagerOpTable

STATIC_ONLY_BASIS = "no runtime evidence: not estimated"
RUNTIME_BASIS = "estimate: eager time in region x (1 - K reference kernels / N eager ops)"
NO_REFERENCE_BASIS = "estimate: eager time in region x 0.5 (no compiled reference to count kernels)"
NO_KERNEL_NOTE = "no compiled kernel maps to"  # how a region outside the compiled graphs is noted (K unknown there)
EARLIER_NOTE = ("K from the run's compile reference of the original program (this region's code is unchanged since; "
                "this analysis compiled nothing)")
_HOST_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item"}
# Program-level categories: one intent per program, whatever lines the runtime detectors pointed at
# (the optimizer is rewritten where it is constructed, the advisor points at where it steps). Two
# source findings at different places (an optimizer built with foreach=False and a Muon-style
# per-parameter loop) are two rewrite sites and stay apart.
_PROGRAM_LEVEL = {IntentCategory.optimizer_step, IntentCategory.conv_layout}


@dataclass(frozen=True)
class EarlierReference:
    """What an earlier analysis's compile reference counted for a region: K and the kernels' names, or `kernels` None
    when no compiled kernel mapped to the region (it was outside the compiled graphs)."""

    kernels: int | None
    names: tuple[str, ...] = ()


EarlierLookup = Callable[[Intent], EarlierReference | None]


@dataclass
class RegionEvidence:
    ops: list[EagerOp] = field(default_factory=list)
    kernels: list[FusionGroup] = field(default_factory=list)


def align(
    pattern_intents: list[Intent],
    table: EagerOpTable | None = None,
    reference: list[FusionGroup] | None = None,
    *,
    step: int = 0,
    earlier: EarlierLookup | None = None,
) -> list[Intent]:
    """Merge pattern intents that describe the same region, attach runtime evidence, rank. Without a `reference`,
    `earlier` (when given) supplies K of regions an earlier analysis's reference counted."""
    merged = merge(pattern_intents)
    if table is None:
        return rank(merged)
    ops = [op for op in table.ops if op.step == step]
    step_time = sum(op.time_us for op in ops) or None
    by_line = _ops_by_line(ops)
    kernels_by_line = _kernels_by_line(reference or [])
    regions = _Regions(table, by_line, kernels_by_line, reference or [])
    if reference is not None:
        earlier = None
    return rank([_with_runtime(intent, regions, step_time, ops, reference is not None, earlier) for intent in merged])


@dataclass
class _Regions:
    """What a region's ops and kernels are looked up in: the op table (for library frames), ops and kernels by line."""

    table: EagerOpTable
    by_line: dict[tuple[str, int], list[EagerOp]]
    kernels_by_line: dict[tuple[str, int], list[FusionGroup]]
    kernels: list[FusionGroup]


def merge(intents: list[Intent]) -> list[Intent]:
    """One intent per (category, region): static spans win (they are exact), detectors are united."""
    ordered = sorted(intents, key=lambda i: (i.source != IntentSource.static, -i.confidence))
    kept: list[Intent] = []
    for intent in ordered:
        twin = next((k for k in kept if k.category == intent.category and _same_library(k.library, intent.library)
                     and (_overlap(k.spans, intent.spans) or (intent.category in _PROGRAM_LEVEL and not both_static(k, intent)))),
                    None)
        if twin is None:
            kept.append(intent.model_copy(deep=True))
            continue
        if twin.library is not None and intent.library is not None and twin.source == intent.source:
            _widen(twin, intent)  # one library function, matched on several of its lines (rope on q's and k's)
            continue
        twin.evidence.detectors = sorted(set(twin.evidence.detectors) | set(intent.evidence.detectors))
        twin.evidence.notes = twin.evidence.notes + [n for n in intent.evidence.notes if n not in twin.evidence.notes]
        if not twin.evidence.target_op_names and intent.evidence.target_op_names:
            twin.evidence.target_op_names = intent.evidence.target_op_names
        twin.confidence = min(1.0, max(twin.confidence, intent.confidence) + 0.1)
    return kept


def _same_library(a: LibrarySpan | None, b: LibrarySpan | None) -> bool:
    """Both in the user's code, or in the same library function: regions of one user line in different library
    functions stay apart; findings in one function are one region (a patch replaces the function)."""
    if a is None or b is None:
        return a is None and b is None
    return a.file == b.file and a.function == b.function


def _widen(twin: Intent, other: Intent) -> None:
    """`twin`'s library region grows over `other`'s lines and call sites (same detector, same function)."""
    library = twin.library
    if library is None or other.library is None:
        return
    twin.library = library.model_copy(update={"line_start": min(library.line_start, other.library.line_start),
                                              "line_end": max(library.line_end, other.library.line_end)})
    twin.spans = twin.spans + [s for s in other.spans if not any(s.overlaps(t) for t in twin.spans)]
    twin.evidence.notes = twin.evidence.notes + [n for n in other.evidence.notes if n not in twin.evidence.notes]
    twin.evidence.detectors = sorted(set(twin.evidence.detectors) | set(other.evidence.detectors))
    twin.id = Intent.make_id(twin.category, twin.spans, twin.library)


def both_static(a: Intent, b: Intent) -> bool:
    return a.source == IntentSource.static and b.source == IntentSource.static


def rank(intents: list[Intent]) -> list[Intent]:
    """Highest estimated saving first; unestimated ones after, by confidence."""
    return sorted(intents, key=lambda i: (i.estimated_saving_us is None, -(i.estimated_saving_us or 0.0), -i.confidence, i.id))


def _with_runtime(intent: Intent, regions: _Regions, step_time, all_ops: list[EagerOp], has_reference: bool,
                  earlier: EarlierLookup | None = None) -> Intent:
    region = _region_ops(intent, regions, all_ops)
    updated = intent.model_copy(deep=True)
    evidence = updated.evidence
    if not region:
        evidence.notes.append("no eager op of the profiled step ran on these lines")
        updated.confidence = min(updated.confidence, 0.3)
        return updated
    time_us = sum(op.time_us for op in region)
    n_ops = len(region)
    evidence.target_ops = n_ops
    evidence.target_time_us = round(time_us, 3)
    evidence.target_time_share = round(min(1.0, time_us / step_time), 6) if step_time else None
    if not evidence.target_op_names:
        evidence.target_op_names = [op.name for op in region if op.phase == Phase.forward][:64]
    evidence.detectors = sorted(set(evidence.detectors) | {"eager_profile"})
    counted: EarlierReference | None = None
    if has_reference:
        kernels = _region_kernels(intent, regions)
        counted = EarlierReference(len(kernels) or None, tuple(sorted({k.kernel for k in kernels})[:64]))
    elif earlier is not None:
        counted = earlier(intent)
        if counted is not None:
            evidence.notes.append(EARLIER_NOTE)
    if counted is not None and counted.kernels is None:
        where = "this library region" if intent.library is not None else "these lines"
        evidence.notes.append(f"{NO_KERNEL_NOTE} {where}: the region was outside the compiled graphs")
    if counted is not None and counted.kernels is not None:
        evidence.reference_kernels = counted.kernels
        evidence.kernels = list(counted.names)
        evidence.detectors = sorted(set(evidence.detectors) | {"inductor"})
        fused_away = 1.0 - min(counted.kernels, n_ops) / n_ops
        updated.estimated_saving_us = round(time_us * fused_away, 3)
        updated.estimate_basis = RUNTIME_BASIS
        if counted.kernels < n_ops:
            updated.confidence = min(1.0, max(updated.confidence, 0.7) + 0.2)
    else:
        updated.estimated_saving_us = round(time_us * 0.5, 3)
        updated.estimate_basis = NO_REFERENCE_BASIS
        updated.confidence = min(1.0, max(updated.confidence, 0.6) + 0.1)
    return updated


def _region_ops(intent: Intent, regions: _Regions, all_ops: list[EagerOp]) -> list[EagerOp]:
    if intent.category == IntentCategory.optimizer_step:
        return [op for op in all_ops if op.phase == Phase.optimizer]
    by_line = regions.by_line
    ops = [op for span in intent.spans for line in range(span.line_start, span.line_end + 1) for op in by_line.get((span.file, line), [])]
    if intent.library is not None:
        ops = [op for op in ops if in_library_region(intent.library, regions.table, op)]
    if intent.category == IntentCategory.host_sync:
        return [op for op in ops if op.name in _HOST_SYNC_OPS] or ops
    return ops


def in_library_region(library: LibrarySpan, table: EagerOpTable, op: EagerOp) -> bool:
    """Whether `op` ran under `library` (one of its library frames is on a line of that region)."""
    return any(library.contains(frame.function.file, frame.line) for frame in table.library_of(op))


def _region_kernels(intent: Intent, regions: _Regions) -> list[FusionGroup]:
    if intent.library is not None:
        return library_kernels(intent, regions.kernels)
    found: dict[int, FusionGroup] = {}
    for span in intent.spans:
        for line in range(span.line_start, span.line_end + 1):
            for kernel in regions.kernels_by_line.get((span.file, line), []):
                found[id(kernel)] = kernel
    return list(found.values())


def library_kernels(intent: Intent, kernels: list[FusionGroup]) -> list[FusionGroup]:
    """Reference kernels whose stacks pass through the intent's library region, matched by the library's lines (files
    the run never edits). A kernel that also names user lines (a model of the user's own that calls the library) must
    come from one of the intent's call sites; one that names none (a library model compiled from its own forward, as
    script mode does) is the region's wherever called.

    The reference is compiled once, on the original; the user's lines of a later head move under the run's own edits
    (a library patch's import line moves the entry script down a line). A call site is therefore matched by its line
    when some kernel's line is that call's, else by its enclosing function (file and function name: moved lines keep
    it), so two calls of one library function from one user function keep their own kernels while lines hold."""
    library = intent.library
    if library is None:
        return []
    region = [k for k in kernels if any(library.contains(line.file, line.line_start) for line in k.library_lines)]
    by_line = [k for k in region if not k.spans or _overlap(k.spans, intent.spans)]
    if any(k.spans for k in by_line):
        return by_line
    return [k for k in region if not k.spans or _same_function(k.spans, intent.spans)]


def _same_function(left: list[SourceSpan], right: list[SourceSpan]) -> bool:
    """Some span of each side in one file and one enclosing function (the eager profile names it by its qualified
    name, a compiled stack by its bare name: the last dotted part is compared)."""
    def key(span: SourceSpan) -> tuple[str, str] | None:
        return (span.file, span.function.rsplit(".", 1)[-1]) if span.function else None

    found = {key(s) for s in left} - {None}
    return any(key(s) in found for s in right)


def _ops_by_line(ops: list[EagerOp]) -> dict[tuple[str, int], list[EagerOp]]:
    table: dict[tuple[str, int], list[EagerOp]] = defaultdict(list)
    for op in ops:
        if op.span.file != UNATTRIBUTED_FILE:
            table[(op.span.file, op.span.line_start)].append(op)
    return table


def _kernels_by_line(groups: list[FusionGroup]) -> dict[tuple[str, int], list[FusionGroup]]:
    table: dict[tuple[str, int], list[FusionGroup]] = defaultdict(list)
    for group in groups:
        for span in group.spans:
            for line in range(span.line_start, span.line_end + 1):
                table[(span.file, line)].append(group)
    return table


def _overlap(left: list[SourceSpan], right: list[SourceSpan]) -> bool:
    return any(a.overlaps(b) for a in left for b in right)
