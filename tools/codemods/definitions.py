"""Module-level helper definitions a recipe carries as data (``match.params.define``).

Some rewrites need a few lines of module-level code next to the call site: an ``autograd.Function``
around a fused op that has no registered backward, a cached constant mask, a step counter. The
recipe carries that code as text; the engine inserts it once into the rewritten file, right after
the leading import block, and never executes it. Re-applying the same recipe (or another recipe
with the same helper) finds the identical definitions already there and inserts nothing; a
different definition under the same name is refused.
"""

from __future__ import annotations

import libcst as cst

from trainbridge.tools.codemods.pattern import equal


class DefinitionError(ValueError):
    """The helper code is unusable, or clashes with a name the file already defines."""


def _defined_names(statement: cst.CSTNode) -> list[str]:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return [statement.name.value]
    if isinstance(statement, cst.SimpleStatementLine):
        names = []
        for small in statement.body:
            targets = []
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
            elif isinstance(small, cst.AnnAssign):
                targets = [small.target]
            for target in targets:
                if not isinstance(target, cst.Name):
                    return []
                names.append(target.value)
        return names
    return []


def parse_definitions(code: str) -> list[cst.BaseStatement]:
    """The helper statements: top-level functions, classes and simple name assignments only."""
    try:
        body = list(cst.parse_module(code.strip("\n") + "\n").body)
    except cst.ParserSyntaxError as exc:
        raise DefinitionError(f"params.define does not parse: {exc.message} (line {exc.raw_line})") from None
    for statement in body:
        if not _defined_names(statement):
            text = cst.Module([statement]).code.strip().splitlines()[0]
            raise DefinitionError(f"params.define may only hold def, class and NAME = value statements, not {text!r}")
    return body


def _import_block_end(module: cst.Module) -> int:
    """Index after the module docstring and the imports that precede the first other statement."""
    index = 0
    for i, statement in enumerate(module.body):
        if isinstance(statement, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
        ):
            index = i + 1
        elif i == 0 and isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Expr) \
                and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
            index = 1
        else:
            break
    return index


def insert_definitions(module: cst.Module, code: str) -> tuple[cst.Module, list[str]]:
    """`module` with the helper definitions of `code` inserted once; returns notes on what was done."""
    wanted = parse_definitions(code)
    existing: dict[str, cst.CSTNode] = {}
    for statement in module.body:
        for name in _defined_names(statement):
            existing[name] = statement
    missing = []
    for statement in wanted:
        names = _defined_names(statement)
        present = [existing[n] for n in names if n in existing]
        if not present:
            missing.append(statement)
            continue
        if not all(equal(statement.with_changes(leading_lines=[]), p.with_changes(leading_lines=[])) for p in present):
            raise DefinitionError(f"the file already defines {', '.join(names)} differently; rename it or drop the helper")
    if not missing:
        return module, []
    blank = [cst.EmptyLine(), cst.EmptyLine()]
    block = [missing[0].with_changes(leading_lines=blank)] + [
        s.with_changes(leading_lines=blank) if isinstance(s, (cst.FunctionDef, cst.ClassDef)) else s for s in missing[1:]
    ]
    at = _import_block_end(module)
    body = list(module.body)
    if at < len(body):
        follower = body[at]
        leading = list(follower.leading_lines)
        empties = next((i for i, line in enumerate(leading) if line.comment is not None), len(leading))
        if empties < 2:
            body[at] = follower.with_changes(leading_lines=[cst.EmptyLine()] * (2 - empties) + leading)
    names = [n for s in missing for n in _defined_names(s)]
    return module.with_changes(body=body[:at] + block + body[at:]), [f"inserted helper {', '.join(names)}"]
