"""The ``statements`` match kind: a sequence of statement patterns over consecutive statements.

A pattern is a list of *slots*, matched one to one against consecutive statements of one block
(a function body, an ``if`` body, the module): each slot is one statement pattern (simple or
compound, e.g. an ``if $cond:`` with its body) or a list of alternative spellings of it. A
metavariable bound in one slot must bind equal code in every later slot, so the sequence is tied
together by its names (``$s = ...``, then ``$s.masked_fill(...)``).

The slot ``$_[E]`` (statement level only) is a hole: any simple statement containing exactly one
sub-expression that matches E. In the replacement, ``$_[T]`` renders that same statement with the
sub-expression replaced by T. It lets a recipe end at the statement that *uses* a result without
caring what that statement is (``return probs @ v``, ``y = (attn @ v).transpose(1, 2)``).

Safety checks before anything is rewritten:
- span: the matched statements overlap the intent's span, and at most ``slack`` (default 1) of
  them lie outside it;
- liveness: a name assigned by a replaced statement and read after the sequence (later in the
  function, or anywhere in an enclosing loop) must be assigned unconditionally (at the top level)
  by the replacement, or the rewrite is refused;
- control flow: when the sequence ends in a top-level ``return``, so must the replacement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import ExpressionContext, ExpressionContextProvider, MetadataWrapper

from trainbridge.records import SourceSpan
from trainbridge.tools.codemods.pattern import (
    CONTEXT_NAME,
    Bindings,
    PatternError,
    context_expression,
    find_matches,
    match,
    parse_statements_pattern,
)
from trainbridge.tools.codemods.template import TemplateError, render_expression, render_statements


class StatementsRefused(Exception):
    def __init__(self, reason: str, close: list[str] | None = None):
        super().__init__(reason)
        self.reason, self.close = reason, close or []


@dataclass
class Slot:
    options: list[cst.BaseStatement]
    contexts: list[cst.BaseExpression] = field(default_factory=list)  # `$_[E]` (alternative Es)


@dataclass
class Found:
    block: cst.CSTNode
    start: int
    statements: list[cst.BaseStatement]
    bindings: Bindings
    context: tuple[cst.BaseStatement, cst.BaseExpression] | None = None
    site: SourceSpan | None = None
    notes: list[str] = field(default_factory=list)


# --- parsing the pattern ------------------------------------------------------------------------


def _slots_of(spec) -> list[Slot]:
    if isinstance(spec, str):
        return [_slot([s]) for s in parse_statements_pattern(spec)]
    if isinstance(spec, list):
        slots = []
        for item in spec:
            if isinstance(item, str):
                slots.extend(_slots_of(item))
            elif isinstance(item, list) and item and all(isinstance(x, str) for x in item):
                options = []
                for text in item:
                    parsed = parse_statements_pattern(text)
                    if len(parsed) != 1:
                        raise PatternError(f"an alternative of one slot must be one statement: {text!r}")
                    options.append(parsed[0])
                slots.append(_slot(options))
            else:
                raise PatternError("a statements pattern is a string, or a list of strings / lists of alternative strings")
        return slots
    raise PatternError("params.pattern of a statements recipe must be a string or a list")


def _slot(options: list[cst.BaseStatement]) -> Slot:
    contexts = [context_expression(o) for o in options]
    if any(c is not None for c in contexts):
        if any(c is None for c in contexts):
            raise PatternError("a slot is either holes $_[...] or statements, not a mix")
        return Slot(options=[], contexts=contexts)
    return Slot(options=options)


def sequences(params: dict) -> list[list[Slot]]:
    specs = [params["pattern"]] + list(params.get("alternatives", []) or [])
    out = [_slots_of(spec) for spec in specs]
    for slots in out:
        if not slots:
            raise PatternError("an empty statements pattern")
        if any(s.contexts for s in slots[:-1]):
            raise PatternError("the hole $_[...] may only be the last slot of a statements pattern")
    return out


# --- finding matches ----------------------------------------------------------------------------


def statement_blocks(module: cst.Module) -> list[cst.CSTNode]:
    blocks: list[cst.CSTNode] = [module]

    class Visitor(cst.CSTVisitor):
        def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
            blocks.append(node)

    module.visit(Visitor())
    return blocks


def _match_from(slots: list[Slot], body, start: int, bindings: Bindings):
    """DFS over the slots' alternatives; yields (bindings, context) for each complete match."""
    if not slots:
        yield bindings, None
        return
    if start >= len(body):
        return
    slot, statement = slots[0], body[start]
    if slot.contexts:
        if not isinstance(statement, cst.SimpleStatementLine):
            return
        for context in slot.contexts:
            hits = find_matches(context, statement, bindings)
            if len(hits) == 1:
                node, got = hits[0]
                yield got, (statement, node)
                return
        return
    for option in slot.options:
        got = match(option, statement, bindings)
        if got is not None:
            yield from _match_from(slots[1:], body, start + 1, got)


def match_sequence(slots: list[Slot], body: list[cst.BaseStatement]):
    """Bindings for each way ``slots`` match ``body`` from its first statement."""
    for bindings, _ in _match_from(slots, body, 0, {}):
        yield bindings


def find(module: cst.Module, positions, slots: list[Slot], span: SourceSpan, slack: int) -> tuple[list[Found], list[str]]:
    found: list[Found] = []
    near: list[str] = []
    for block in statement_blocks(module):
        body = list(block.body)
        for start in range(len(body)):
            for bindings, context in _match_from(slots, body, start, {}):
                statements = body[start:start + len(slots)]
                lines = [(positions[s].start.line, positions[s].end.line) for s in statements]
                inside = [span.line_start <= a and b <= span.line_end for a, b in lines]
                overlaps = any(a <= span.line_end and span.line_start <= b for a, b in lines)
                site = SourceSpan(file=span.file, line_start=lines[0][0], line_end=lines[-1][1])
                if not overlaps:
                    continue
                if inside.count(False) > slack:
                    near.append(f"{site}: matches, but {inside.count(False)} of its statements lie outside {span} (slack {slack})")
                    continue
                found.append(Found(block=block, start=start, statements=statements, bindings=bindings,
                                   context=context, site=site))
                break  # one match per start position
    return _non_overlapping(found), near


def _non_overlapping(found: list[Found]) -> list[Found]:
    """Drop matches whose lines overlap an earlier one (also one nested inside another's if-body)."""
    taken: list[Found] = []
    for f in sorted(found, key=lambda f: (f.site.line_start, -f.site.line_end)):
        if any(t.site.line_start <= f.site.line_end and f.site.line_start <= t.site.line_end for t in taken):
            continue
        taken.append(f)
    return taken


# --- safety: liveness and control flow ----------------------------------------------------------


def _assigned(nodes) -> set[str]:
    names: set[str] = set()

    def targets(t):
        if isinstance(t, cst.Name):
            names.add(t.value)
        elif isinstance(t, (cst.Tuple, cst.List)):
            for e in t.elements:
                targets(e.value)
        elif isinstance(t, cst.StarredElement):
            targets(t.value)

    class Visitor(cst.CSTVisitor):
        def visit_Assign(self, node):
            for t in node.targets:
                targets(t.target)

        def visit_AugAssign(self, node):
            targets(node.target)

        def visit_AnnAssign(self, node):
            targets(node.target)

        def visit_For(self, node):
            targets(node.target)

        def visit_NamedExpr(self, node):
            targets(node.target)

        def visit_WithItem(self, node):
            if node.asname is not None:
                targets(node.asname.name)

    for n in nodes:
        n.visit(Visitor())
    return names


def _names_read(nodes, skip: cst.CSTNode | None = None) -> set[str]:
    """Names the nodes mention as values (not attribute names, not keyword names), outside ``skip``."""
    names: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if node is skip:
                return False
            if isinstance(node, cst.Name):
                names.add(node.value)
            if isinstance(node, cst.Attribute):
                node.value.visit(self)
                return False
            if isinstance(node, cst.Arg):
                node.value.visit(self)
                return False
            return True

    for n in nodes:
        n.visit(Visitor())
    return names


def _top_level_assigned(statements: list[cst.BaseStatement]) -> set[str]:
    return _assigned([s for s in statements if isinstance(s, cst.SimpleStatementLine)])


def _enclosing(module: cst.Module, positions, site: SourceSpan):
    """The innermost function containing the site, and the loops inside it that contain the site."""
    function, loops = None, []

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node):
            if isinstance(node, (cst.FunctionDef, cst.For, cst.While)):
                p = positions[node]
                if p.start.line <= site.line_start and site.line_end <= p.end.line:
                    nonlocal function
                    if isinstance(node, cst.FunctionDef):
                        function, loops[:] = node, []
                    else:
                        loops.append(node)
            return True

    module.visit(Visitor())
    return function, loops


def check_safety(module: cst.Module, wrapper: MetadataWrapper, positions, f: Found, new_statements: list[cst.BaseStatement]) -> str | None:
    """Why replacing `f` by `new_statements` could change the program's behaviour, or None."""
    last = f.statements[-1]
    if isinstance(last, cst.SimpleStatementLine) and any(isinstance(s, cst.Return) for s in last.body):
        tail = new_statements[-1] if new_statements else None
        if not (isinstance(tail, cst.SimpleStatementLine) and any(isinstance(s, cst.Return) for s in tail.body)):
            return "the replaced statements end in a return but the replacement does not return unconditionally"
    removed = _assigned(f.statements)
    kept = _top_level_assigned(new_statements)
    at_risk = removed - kept
    if not at_risk:
        return None
    if f.context is not None:  # `$_[E]`: the rest of that statement keeps reading what the earlier slots assigned
        statement, node = f.context
        stale = sorted((at_risk & _assigned(f.statements[:-1]) & _names_read([statement], skip=node))
                       - _assigned(new_statements))
        if stale:
            return (f"{', '.join(stale)} is read again in the statement the rewrite ends at, but the replacement no "
                    "longer assigns it")
    contexts = wrapper.resolve(ExpressionContextProvider)
    function, loops = _enclosing(module, positions, f.site)
    scope = function if function is not None else module
    end = f.site.line_end
    loop_ranges = [(positions[l].start.line, positions[l].end.line) for l in loops]
    reads: list[str] = []

    class Visitor(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            if node.value not in at_risk or contexts.get(node) != ExpressionContext.LOAD:
                return
            line = positions[node].start.line
            if f.site.line_start <= line <= end:
                return
            if line > end or any(a <= line <= b for a, b in loop_ranges):
                reads.append(f"{node.value} (line {line})")

    scope.visit(Visitor())
    if reads:
        return (f"{', '.join(sorted(set(reads)))} is read after the rewritten statements, but the replacement no longer "
                "assigns it unconditionally")
    return None


# --- rendering ----------------------------------------------------------------------------------

_HOLE = re.compile(r"\$" + CONTEXT_NAME + r"\[")


def hole_spans(template: str) -> list[tuple[int, int]]:
    """(start, end) of each `$_[ ... ]` in the template, end exclusive, brackets balanced."""
    spans = []
    for m in _HOLE.finditer(template):
        depth, i, quote = 1, m.end(), None
        while i < len(template) and depth:
            ch = template[i]
            if quote:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = None
            elif ch in "\"'":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            i += 1
        if depth:
            raise TemplateError(f"unbalanced $_[ in replacement {template!r}")
        spans.append((m.start(), i))
    return spans


MATCHED = "matched"  # `$matched` alone on a replacement line: the matched statements as written
_MATCHED_LINE = re.compile(r"^([ \t]*)\$(?:matched|\{matched\})[ \t]*$", re.MULTILINE)


def _matched_code(f: Found, module: cst.Module, indent: str) -> str:
    parts = []
    for i, statement in enumerate(f.statements):
        node = statement.with_changes(leading_lines=()) if i == 0 else statement
        parts.append(module.code_for_node(node).rstrip("\n"))
    lines = "\n".join(parts).split("\n")
    return "\n".join([lines[0]] + [indent + line if line.strip() else line for line in lines[1:]])


def render(template: str, f: Found, module: cst.Module) -> list[cst.BaseStatement]:
    raw: dict[str, str] = {}
    if "matched" in template:
        def whole(m: re.Match) -> str:
            raw["\0MATCHED\0"] = _matched_code(f, module, m.group(1))
            return m.group(1) + "\0MATCHED\0"

        template = _MATCHED_LINE.sub(whole, template)
        if re.search(r"\$(matched\b|\{matched\})", template):
            raise TemplateError("$matched must stand alone on its line in the replacement (it renders whole statements)")
    pieces, last = [], 0
    for k, (a, b) in enumerate(hole_spans(template)):
        if f.context is None:
            raise TemplateError("the replacement uses $_[...] but the pattern has no $_[...] slot")
        line_start = template.rfind("\n", 0, a) + 1
        line_end = template.find("\n", b)
        line_end = len(template) if line_end < 0 else line_end
        if template[line_start:a].strip() or template[b:line_end].strip():
            raise TemplateError("$_[...] must stand alone on its line in the replacement (it renders a whole statement)")
        statement, node = f.context
        inner = render_expression(template[a + 3:b - 1], f.bindings, module)
        new = statement.deep_replace(node, inner).with_changes(leading_lines=())
        token = f"\0HOLE{k}\0"
        raw[token] = module.code_for_node(new).strip()
        pieces += [template[last:a], token]
        last = b
    pieces.append(template[last:])
    text = "".join(pieces)
    statements = render_statements(text, {k: v for k, v in f.bindings.items() if k != CONTEXT_NAME}, module, raw=raw)
    if statements:
        first_leading = f.statements[0].leading_lines
        statements[0] = statements[0].with_changes(leading_lines=first_leading)
    return statements


def replace_blocks(module: cst.Module, edits: list[tuple[Found, list[cst.BaseStatement]]]) -> cst.Module:
    """Splice each match's replacement into its block (inner blocks first, so nested edits compose)."""
    splices: dict[int, list[tuple[int, int, list[cst.BaseStatement]]]] = {}
    for f, new in edits:
        splices.setdefault(id(f.block), []).append((f.start, len(f.statements), new))

    class Splicer(cst.CSTTransformer):
        def on_leave(self, original_node, updated_node):
            todo = splices.get(id(original_node))
            if not todo:
                return updated_node
            body = list(updated_node.body)
            for start, length, new in sorted(todo, key=lambda item: -item[0]):
                body[start:start + length] = new
            return updated_node.with_changes(body=body)

    return module.visit(Splicer())
