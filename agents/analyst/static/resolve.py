"""From raw matches to intents: drop nested matches, fold helpers into their users, merge, build.

- A match whose root operation another match consumed is nested in it (the division of an
  RMSNorm inside a LayerNorm, the softmax inside an attention) and is dropped; at the same root
  the earlier pattern of the registry wins. A fallback match (the generic pointwise chain) comes
  after all others and is dropped when it shares any operation with a kept match.
- A match that looked into a helper function (the SwiGLU calling ``def silu(x): return x *
  torch.sigmoid(x)``, the rotary calling ``rotate_half``) lists the helper's lines as a further
  span. The helper's own pattern, if any, stays an intent of its own: it is a separate rewrite site.
- Expression matches of one category next to each other in one function (rotary for q on one
  line, for k on the next) become one intent; program-rule findings (two optimizers) stay apart.
- A match of a detector that marks ``whole_function`` spans the whole function when the function
  exists only to implement the op (helpers.is_whole_function); the patterns written before the
  real-code detectors keep their statement spans, which the recipes are written against.
"""

from __future__ import annotations

from collections import defaultdict

from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, SourceSpan

from .helpers import is_whole_function
from .match import Match


def drop_nested(matches: list[Match]) -> list[Match]:
    kept: list[Match] = []
    consumed: set[int] = set()
    for m in sorted(matches, key=lambda m: (m.fallback, -len(m.core), m.priority, m.start)):
        if id(m.root.node) in consumed or (m.fallback and m.core & consumed):
            continue
        kept.append(m)
        consumed |= m.core
    return kept


def _merge_adjacent(matches: list[Match]) -> list[list[Match]]:
    groups: dict[tuple, list[Match]] = defaultdict(list)
    for m in matches:
        groups[(m.category, m.file.relpath, id(m.scope) if m.mergeable else id(m))].append(m)
    merged: list[list[Match]] = []
    for members in groups.values():
        members.sort(key=lambda m: (m.start, m.end))
        current = [members[0]]
        for m in members[1:]:
            if m.start <= max(x.end for x in current) + 1:
                current.append(m)
            else:
                merged.append(current)
                current = [m]
        merged.append(current)
    return merged


def _spans(group: list[Match]) -> list[SourceSpan]:
    head = group[0]
    start, end = min(m.start for m in group), max(m.end for m in group)
    if all(m.whole_function for m in group) and is_whole_function(group):
        start, end = min(start, head.scope.start), max(end, head.scope.end)
    spans = [SourceSpan(file=head.file.relpath, line_start=start, line_end=end, function=head.scope.qualname)]
    for m in group:
        for file, site in m.sites:
            spans.append(SourceSpan(file=file.relpath, line_start=site.start, line_end=site.end, function=site.stmt.scope.qualname))
        for h in m.helpers:
            spans.append(SourceSpan(file=h.file.relpath, line_start=h.scope.start, line_end=h.scope.end, function=h.scope.qualname))
    unique: dict[tuple, SourceSpan] = {}
    for s in spans:
        unique.setdefault((s.file, s.line_start, s.line_end), s)
    return list(unique.values())


def build_intents(matches: list[Match]) -> list[Intent]:
    kept = drop_nested(matches)
    intents: dict[str, Intent] = {}
    for group in _merge_adjacent(kept):
        category = IntentCategory(group[0].category)
        spans = _spans(group)
        notes = list(dict.fromkeys(m.found.note for m in group))
        intent = Intent(
            id=Intent.make_id(category, spans),
            category=category,
            spans=spans,
            evidence=Evidence(detectors=["static"], notes=notes),
            confidence=max(m.found.confidence for m in group),
            source=IntentSource.static,
        )
        intents.setdefault(intent.id, intent)
    return sorted(intents.values(), key=lambda i: (i.spans[0].file, i.spans[0].line_start, i.category.value))
