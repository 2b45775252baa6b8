"""Matching machinery of the static scan: a context that records what a pattern consumed.

A pattern is a function ``(ctx, expr) -> Found | None``. While it runs, the primitives below record
into ``ctx`` the operation nodes it matched (``core``), the definitions it followed through names
(``defs``: they widen the reported line range) and the helper functions it looked into
(``helpers``). ``@pattern`` makes every function transactional: when it fails (returns None or
False) whatever it recorded is rolled back, so alternatives can be tried freely.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from .model import Expr, FileModel, Scope, Stmt

CAST_OPS = frozenset({"float", "double", "half", "bfloat16", "to", "type_as", "type"})
_CONST_FUNCS = {"sqrt": math.sqrt, "exp": math.exp, "log": math.log, "tanh": math.tanh, "float": float}
_CONST_NAMES = {"pi": math.pi, "e": math.e, "inf": math.inf}


@dataclass
class Found:
    """A pattern's verdict: how specific the match is, and what it saw."""

    confidence: float
    note: str


@dataclass(eq=False)
class Helper:
    """A function defined in the scanned code whose body a pattern looked into."""

    file: FileModel
    scope: Scope


@dataclass(eq=False)
class Ctx:
    index: "RepoIndex"
    file: FileModel
    scope: Scope
    core: list[Expr] = field(default_factory=list)
    defs: list[Stmt] = field(default_factory=list)
    helpers: list[Helper] = field(default_factory=list)
    # a library file's scan (agents/analyst/library_scan.py): an activation chosen by configuration (transformers'
    # `ACT2FN[config.hidden_act]`) is accepted for any kind and recorded here; which one ran in the step decides there
    configured_activations: bool = False
    configured: list[Expr] = field(default_factory=list)

    def mark(self) -> tuple[int, int, int, int]:
        return len(self.core), len(self.defs), len(self.helpers), len(self.configured)

    def rollback(self, mark: tuple[int, int, int, int]) -> None:
        del self.core[mark[0] :], self.defs[mark[1] :], self.helpers[mark[2] :], self.configured[mark[3] :]


def pattern(fn: Callable) -> Callable:
    """Roll back the context's records when ``fn`` fails (returns None or False)."""

    @functools.wraps(fn)
    def run(ctx: Ctx, *args, **kwargs):
        mark = ctx.mark()
        result = fn(ctx, *args, **kwargs)
        if result is None or result is False:
            ctx.rollback(mark)
        return result

    return run


# --- following names ---------------------------------------------------------------------------
def _follow(e: Expr, record: list[Stmt] | None) -> Expr:
    for _ in range(64):
        if e.kind == "name" and e.binding is not None:
            if record is not None:
                record.append(e.binding.stmt)
            e = e.binding.value
        elif e.kind == "item":
            container = _follow(e.args[0], record)
            if container.kind == "tuple" and isinstance(e.value, int) and e.value < len(container.args):
                e = container.args[e.value]
            else:
                return e
        else:
            return e
    return e


def follow(ctx: Ctx, e: Expr) -> Expr:
    """The expression a name stands for (through assignments), recording the definitions."""
    return _follow(e, ctx.defs)


def peek(e: Expr) -> Expr:
    """Like follow, without recording: for comparisons and looking ahead."""
    return _follow(e, None)


def is_cast(e: Expr) -> bool:
    return e.kind == "call" and e.method and (e.op in CAST_OPS or e.op == "contiguous")


def peel(e: Expr) -> Expr:
    """Names, casts and .contiguous() looked through, without recording (for comparisons)."""
    e = peek(e)
    while is_cast(e):
        e = peek(e.args[0])
    return e


# --- primitives --------------------------------------------------------------------------------
_BINARY = frozenset({"add", "sub", "mul", "div", "matmul", "bmm", "pow"})


@pattern
def call(ctx: Ctx, e: Expr, *ops: str) -> Expr | None:
    """``e`` (through names) is a call of one of ``ops`` with its operand(s): record and return it.

    Binary operations have two positional operands, all others at least one, so patterns can
    index ``args`` freely.
    """
    x = follow(ctx, e)
    if x.kind == "call" and x.op in ops and len(x.args) >= (2 if x.op in _BINARY else 1):
        ctx.core.append(x)
        return x
    return None


@pattern
def uncast(ctx: Ctx, e: Expr) -> Expr:
    """``e`` with casts and .contiguous() around it consumed (always succeeds)."""
    x = follow(ctx, e)
    while is_cast(x):
        ctx.core.append(x)
        x = follow(ctx, x.args[0])
    return x


def _flattens(x: Expr, ops: tuple[str, ...]) -> bool:
    if x.kind != "call" or x.kwargs:
        return False
    if x.op in ops:
        return len(x.args) == (1 if x.op == "neg" else 2)
    return is_cast(x) and bool(x.args) and _flattens(peek(x.args[0]), ops)


def factors(ctx: Ctx, e: Expr) -> list[tuple[Expr, int]]:
    """Flatten a product: ``w * (x - m) / s`` -> [(w, 1), (x - m, 1), (s, -1)].

    Looks through names, casts and negation (a factor -1). Records the products it flattened.
    """
    out: list[tuple[Expr, int]] = []

    def visit(x: Expr, power: int) -> None:
        if not _flattens(peek(x), ("mul", "div", "neg")):
            out.append((x, power))
            return
        x = uncast(ctx, x)
        ctx.core.append(x)
        if x.op == "neg":
            out.append((_MINUS_ONE(x), power))
            visit(x.args[0], power)
        else:
            visit(x.args[0], power)
            visit(x.args[1], power if x.op == "mul" else -power)

    visit(e, 1)
    return out


def terms(ctx: Ctx, e: Expr) -> list[tuple[Expr, int]]:
    """Flatten a sum: ``a - b + c`` -> [(a, 1), (b, -1), (c, 1)] (through names and casts)."""
    out: list[tuple[Expr, int]] = []

    def visit(x: Expr, sign: int) -> None:
        if not _flattens(peek(x), ("add", "sub")):
            out.append((x, sign))
            return
        x = uncast(ctx, x)
        ctx.core.append(x)
        visit(x.args[0], sign)
        visit(x.args[1], sign if x.op == "add" else -sign)

    visit(e, 1)
    return out


def _MINUS_ONE(at: Expr) -> Expr:
    return Expr("const", "", at.node, at.stmt, at.start, at.end, value=-1)


def const_value(e: Expr) -> float | None:
    """The number a constant expression evaluates to (math.sqrt(2 / math.pi), 1.0 / 2, ...)."""
    x = peek(e)
    if x.kind == "const":
        return float(x.value) if isinstance(x.value, (int, float)) and not isinstance(x.value, bool) else None
    if x.kind == "attr":
        base = peek(x.args[0])
        if base.kind == "name" and base.binding is None and x.op in _CONST_NAMES:
            return _CONST_NAMES[x.op]
        return None
    if x.kind != "call":
        return None
    values = [const_value(a) for a in x.args]
    if not values or any(v is None for v in values) or x.kwargs:
        return None
    try:
        if x.op == "neg":
            return -values[0]
        if x.op in ("add", "sub", "mul", "div", "pow") and len(values) == 2:
            a, b = values
            return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b if b else None, "pow": a**b}[x.op]
        if x.op in _CONST_FUNCS and len(values) == 1:
            return _CONST_FUNCS[x.op](values[0])
    except (OverflowError, ValueError, ZeroDivisionError, TypeError):
        return None
    return None


def is_const(e: Expr, value: float | None = None, tol: float = 1e-3) -> bool:
    v = const_value(e)
    if v is None:
        return False
    return value is None or math.isclose(v, value, rel_tol=tol, abs_tol=tol * 1e-3)


def is_false(e: Expr | None) -> bool:
    """``e`` is the literal False (or 0)."""
    if e is None:
        return False
    x = peek(e)
    return x.kind == "const" and (x.value is False or (not isinstance(x.value, bool) and x.value == 0))


def scalar_like(e: Expr) -> bool:
    """A constant, a plain name or an attribute (``eps``, ``self.eps``, ``1e-6``): not a tensor op."""
    x = peek(e)
    return const_value(x) is not None or x.kind in ("name", "attr", "const")


def same(a: Expr, b: Expr) -> bool:
    """Structural equality, looking through names, casts and .contiguous()."""
    a, b = peel(a), peel(b)
    if a is b or a.node is b.node and a.kind == b.kind and a.value == b.value:
        return True
    if a.kind != b.kind or a.op != b.op:
        return False
    if a.kind == "name":
        return a.binding is b.binding
    if a.kind in ("const", "str"):
        return a.value == b.value
    if a.kind == "item" and a.value != b.value:
        return False
    if a.kind == "subscript" and [s[0] for s in a.value] != [s[0] for s in b.value]:
        return False
    if a.kind == "subscript":
        for sa, sb in zip(a.value, b.value):
            for pa, pb in zip(sa[1:], sb[1:]):
                if (pa is None) != (pb is None) or (pa is not None and not same(pa, pb)):
                    return False
        return same(a.args[0], b.args[0])
    if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
        return False
    return all(same(x, y) for x, y in zip(a.args, b.args)) and all(same(a.kwargs[k], b.kwargs[k]) for k in a.kwargs)


def int_arg(e: Expr, index: int, keyword: str | None = None) -> int | None:
    a = e.arg(index, keyword)
    v = const_value(a) if a is not None else None
    return int(v) if v is not None and float(v).is_integer() else None


def str_arg(e: Expr, index: int, keyword: str | None = None) -> str | None:
    a = e.arg(index, keyword)
    if a is None:
        return None
    x = peek(a)
    return x.value if x.kind == "str" and isinstance(x.value, str) else None


def is_param(ctx: Ctx, e: Expr, scope: Scope, position: int = 0) -> bool:
    """``e`` is the ``position``-th tensor parameter of ``scope`` (unassigned in the body)."""
    x = peel(e)
    params = scope.tensor_params
    return x.kind == "name" and x.binding is None and position < len(params) and x.op == params[position]


# --- the repository: helper functions across files ---------------------------------------------
class RepoIndex:
    """The scanned files, to resolve calls of helper functions (same file, imports, methods)."""

    def __init__(self, files: dict[str, FileModel], classify: Callable[["RepoIndex", Helper], str | None]):
        self.files = files
        self._classify = classify
        self._kinds: dict[int, str | None] = {}

    def _module_file(self, importer: FileModel, source: str) -> FileModel | None:
        here = importer.relpath.split("/")[:-1]
        level = len(source) - len(source.lstrip("."))
        parts = [p for p in source.lstrip(".").split(".") if p]
        bases: list[list[str]] = []
        if level:
            base = here[: len(here) - (level - 1)] if level - 1 <= len(here) else None
            if base is not None:
                bases.append(base + parts)
        else:
            for k in range(len(parts)):
                bases += [parts[k:], here + parts[k:]]
        for base in bases:
            for candidate in ("/".join(base) + ".py", "/".join(base + ["__init__"]) + ".py"):
                if candidate in self.files:
                    return self.files[candidate]
        return None

    def resolve(self, file: FileModel, e: Expr) -> Helper | None:
        """The function a call expression calls, when it is defined in the scanned code."""
        if e.kind != "call" or e.method:
            return None
        if e.op.startswith("self."):
            cls = e.stmt.scope.class_name
            scope = file.methods.get((cls, e.op[5:])) if cls else None
            return Helper(file, scope) if scope else None
        if e.callee != e.op:
            return None
        if e.op in file.functions:
            return Helper(file, file.functions[e.op])
        if e.op in file.imports:
            source, name = file.imports[e.op]
            target = self._module_file(file, source)
            if target is not None and name in target.functions:
                return Helper(target, target.functions[name])
        return None

    def helper_kind(self, helper: Helper) -> str | None:
        """What a helper computes from its first argument ('silu', 'gelu', 'rotate_half', ...)."""
        key = id(helper.scope)
        if key not in self._kinds:
            self._kinds[key] = None  # guards against recursion
            self._kinds[key] = self._classify(self, helper)
        return self._kinds[key]


@dataclass(eq=False)
class Match:
    """One finding before it becomes an Intent: where, what it consumed, and the verdict."""

    category: str
    file: FileModel
    scope: Scope
    root: Expr
    start: int
    end: int
    core: frozenset[int]  # id() of the CST nodes of the operations the match consumed
    found: Found
    priority: int = 0
    helpers: list[Helper] = field(default_factory=list)
    sites: list[tuple[FileModel, Expr]] = field(default_factory=list)  # all places reported (conv layers)
    mergeable: bool = False  # one rewrite may cover neighbours of the same kind (rotary for q, then k)
    whole_function: bool = False  # span the function when it exists only for this op (helpers.is_whole_function)
    fallback: bool = False  # a pattern of last resort: dropped when it shares any operation with another match

    @classmethod
    def from_ctx(cls, category: str, ctx: Ctx, root: Expr, found: Found, priority: int) -> "Match":
        starts = [root.start] + [d.start for d in ctx.defs]
        ends = [root.end] + [d.end for d in ctx.defs]
        core = frozenset(id(x.node) for x in (root, *ctx.core))
        helpers = list({id(h.scope): h for h in ctx.helpers}.values())
        return cls(category, ctx.file, ctx.scope, root, min(starts), max(ends), core, found, priority, helpers, mergeable=True)

    @classmethod
    def at_call(cls, category: str, file: FileModel, site: Expr, found: Found, priority: int = 100) -> "Match":
        return cls(category, file, site.stmt.scope, site, site.start, site.end, frozenset({id(site.node)}), found, priority)
