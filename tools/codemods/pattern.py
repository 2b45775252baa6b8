"""Syntactic patterns with metavariables, matched against libcst trees.

A pattern is Python source in which ``$name`` stands for any expression (or, in an assignment
target, any name). Matching ignores formatting (whitespace, parentheses, trailing commas), compares
numbers by value (``2`` matches ``2.0``), strings by value, and keyword arguments regardless of
their order. A metavariable used twice must bind equal code both times (``$x * $x``).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from typing import Sequence

import libcst as cst

METAVAR_PREFIX = "__tb_mv_"
_METAVAR = re.compile(r"\$(?:\{([_a-zA-Z]\w*)\}|([_a-zA-Z]\w*))")

# Fields that carry only formatting.
_FORMAT_FIELDS = {
    "lpar", "rpar", "comma", "dot", "equal", "semicolon", "lbracket", "rbracket", "lbrace", "rbrace",
    "colon", "whitespace_after_star", "whitespace_after_arg", "whitespace_after_func",
    "whitespace_before_args", "whitespace_before_equal", "whitespace_after_equal", "whitespace_after_value",
    "whitespace_before", "whitespace_after", "whitespace_before_colon", "whitespace_after_colon",
    "leading_lines", "trailing_whitespace", "header", "footer", "first_line", "empty_lines", "indent",
    "lines_after_decorators",
}
_OPERATORS = (cst.BaseBinaryOp, cst.BaseUnaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseAugOp)
_NUMBERS = (cst.Integer, cst.Float, cst.Imaginary)


class PatternError(ValueError):
    """A pattern that does not parse as Python (after replacing metavariables)."""


Bindings = dict[str, cst.CSTNode]


def to_python(text: str) -> str:
    """Replace ``$name`` metavariables with plain identifiers so the text parses."""
    return _METAVAR.sub(lambda m: METAVAR_PREFIX + (m.group(1) or m.group(2)), text.replace("$$", "$"))


def parse_expression_pattern(text: str) -> cst.BaseExpression:
    try:
        return cst.parse_expression(to_python(text))
    except cst.ParserSyntaxError as exc:
        raise PatternError(f"pattern {text!r} is not a Python expression: {exc.message}") from None


def parse_statement_pattern(text: str) -> cst.BaseSmallStatement:
    try:
        statement = cst.parse_statement(to_python(text))
    except cst.ParserSyntaxError as exc:
        raise PatternError(f"pattern {text!r} is not a Python statement: {exc.message}") from None
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        raise PatternError(f"pattern {text!r} must be one simple statement (an assignment, a return, an expression)")
    return statement.body[0]


def metavar_name(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name) and node.value.startswith(METAVAR_PREFIX):
        return node.value[len(METAVAR_PREFIX):]
    return None


def match(pattern: cst.CSTNode, node: cst.CSTNode, bindings: Bindings | None = None) -> Bindings | None:
    """Bindings when `node` matches `pattern`, else None. `bindings` seeds already-bound names."""
    found: Bindings = dict(bindings or {})
    return found if _match(pattern, node, found) else None


def equal(left: cst.CSTNode, right: cst.CSTNode) -> bool:
    """Structural equality ignoring formatting (no metavariables involved)."""
    return _match(left, right, {}, metavars=False)


def _match(pattern, node, bindings: Bindings, metavars: bool = True) -> bool:
    name = metavar_name(pattern) if metavars else None
    if name is not None:
        if not isinstance(node, cst.BaseExpression):
            return False
        if name in bindings:
            return equal(bindings[name], node)
        bindings[name] = node
        return True
    if isinstance(pattern, _NUMBERS) and isinstance(node, _NUMBERS):
        return _literal(pattern.value) == _literal(node.value)
    if isinstance(pattern, cst.SimpleString) and isinstance(node, cst.SimpleString):
        return _literal(pattern.value) == _literal(node.value)
    if type(pattern) is not type(node):
        return False
    if isinstance(pattern, _OPERATORS):
        return True
    if isinstance(pattern, cst.Call):
        return _match(pattern.func, node.func, bindings, metavars) and _match_args(pattern.args, node.args, bindings, metavars)
    for field in dataclasses.fields(pattern):
        if field.name in _FORMAT_FIELDS or field.name.startswith("whitespace"):
            continue
        left, right = getattr(pattern, field.name), getattr(node, field.name)
        if not _match_value(left, right, bindings, metavars):
            return False
    return True


def _match_value(left, right, bindings: Bindings, metavars: bool) -> bool:
    if isinstance(left, cst.CSTNode) and isinstance(right, cst.CSTNode):
        return _match(left, right, bindings, metavars)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return len(left) == len(right) and all(_match_value(a, b, bindings, metavars) for a, b in zip(left, right))
    if isinstance(left, cst.CSTNode) or isinstance(right, cst.CSTNode):
        return False
    if isinstance(left, cst.MaybeSentinel) or isinstance(right, cst.MaybeSentinel):
        return type(left) is type(right)
    return left == right


def _match_args(left: Sequence[cst.Arg], right: Sequence[cst.Arg], bindings: Bindings, metavars: bool) -> bool:
    """Positional arguments in order, keyword arguments in any order."""
    left_pos = [a for a in left if a.keyword is None]
    right_pos = [a for a in right if a.keyword is None]
    if len(left_pos) != len(right_pos) or len(left) != len(right):
        return False
    for a, b in zip(left_pos, right_pos):
        if a.star != b.star or not _match(a.value, b.value, bindings, metavars):
            return False
    right_kw = {a.keyword.value: a for a in right if a.keyword is not None}
    for a in left:
        if a.keyword is None:
            continue
        b = right_kw.get(a.keyword.value)
        if b is None or not _match(a.value, b.value, bindings, metavars):
            return False
    return True


def _literal(text: str):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


# --- statement patterns -------------------------------------------------------------------------

CONTEXT_NAME = "_"  # `$_[E]`: a statement-level hole, "the statement that contains E" (see statements.py)


def parse_statements_pattern(text: str) -> list[cst.BaseStatement]:
    """One or more statements (simple or compound) with metavariables, as libcst statement nodes."""
    source = to_python(text).strip("\n")
    try:
        module = cst.parse_module(textwrap.dedent(source) + "\n")
    except cst.ParserSyntaxError as exc:
        raise PatternError(f"statement pattern {text!r} does not parse: {exc.message}") from None
    if not module.body:
        raise PatternError(f"statement pattern {text!r} is empty")
    return list(module.body)


def context_expression(statement: cst.CSTNode) -> cst.BaseExpression | None:
    """E when `statement` is the statement-level hole ``$_[E]``, else None."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return None
    expr = statement.body[0]
    if not (isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Subscript)):
        return None
    sub = expr.value
    if metavar_name(sub.value) != CONTEXT_NAME or len(sub.slice) != 1 or not isinstance(sub.slice[0].slice, cst.Index):
        return None
    return sub.slice[0].slice.value


def find_matches(pattern: cst.BaseExpression, root: cst.CSTNode, bindings: Bindings) -> list[tuple[cst.BaseExpression, Bindings]]:
    """Every outermost sub-expression of `root` that matches `pattern` (given `bindings`)."""
    found: list[tuple[cst.BaseExpression, Bindings]] = []

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, cst.BaseExpression):
                got = match(pattern, node, bindings)
                if got is not None:
                    found.append((node, got))
                    return False
            return True

    root.visit(Visitor())
    return found
