"""Records of the static scan's source model: statements, expressions, scopes, files.

``ir`` builds them from libcst trees; the patterns and rules read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import libcst as cst


class StaticScanError(ValueError):
    """A source file could not be scanned (it does not parse)."""

    def __init__(self, relpath: str, line: int | None, message: str):
        where = f"{relpath}:{line}" if line else relpath
        super().__init__(
            f"cannot scan {where}: {message}. Fix the syntax error (the file must parse with Python 3 syntax), "
            "or leave the file out of the scan."
        )
        self.relpath = relpath
        self.line = line


@dataclass(eq=False)
class Stmt:
    """One (simple) statement, or the header of a compound one, with its context in the scope."""

    node: cst.CSTNode
    start: int
    end: int
    scope: "Scope"
    loops: tuple[cst.CSTNode, ...] = ()  # enclosing for/while loops within the scope, outermost first
    periodic: bool = False  # under an `if` whose test uses `%` (e.g. logging every N steps)


@dataclass(eq=False)
class Binding:
    value: "Expr"
    stmt: Stmt


@dataclass(eq=False)
class Expr:
    kind: str  # call | name | attr | const | str | subscript | tuple | item | other
    op: str  # call: normalised op name; name: the identifier; attr: the attribute name
    node: cst.CSTNode
    stmt: Stmt
    start: int
    end: int
    args: tuple["Expr", ...] = ()
    kwargs: dict[str, "Expr"] = field(default_factory=dict)
    value: object = None  # const: the number; str: the text; item: the index; subscript: slice specs
    binding: Binding | None = None  # name: its reaching definition in the scope, if any
    method: bool = False  # call written as receiver.op(...)
    callee: str | None = None  # call: the callee as written when dotted ("torch.mean", "self.act", "silu")

    def arg(self, index: int, keyword: str | None = None) -> "Expr | None":
        """Argument by keyword, else by position (a method's receiver is position 0)."""
        if keyword is not None and keyword in self.kwargs:
            return self.kwargs[keyword]
        return self.args[index] if index < len(self.args) else None

    def walk(self) -> Iterator["Expr"]:
        """This expression and all its sub-expressions (not through name bindings)."""
        yield self
        for a in self.args:
            yield from a.walk()
        for v in self.kwargs.values():
            yield from v.walk()


@dataclass(eq=False)
class Scope:
    """A function (or the module / a class body): the unit of data flow."""

    qualname: str | None  # "Class.method", "function", "outer.inner"; None for module level
    node: cst.CSTNode
    class_name: str | None
    params: list[str]
    start: int
    end: int
    roots: list[Expr] = field(default_factory=list)  # top-level expression of every statement
    calls: list[Expr] = field(default_factory=list)  # every call lowered in the scope, in order
    returns: list[Expr] = field(default_factory=list)
    ops: set[str] = field(default_factory=set)  # op names and dotted callees called in the scope
    loop_ops: dict[int, set[str]] = field(default_factory=dict)  # id(loop node) -> ops called in it
    loop_lines: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(loop node) -> (first, last line)

    @property
    def tensor_params(self) -> list[str]:
        return [p for p in self.params if p not in ("self", "cls")]


@dataclass(eq=False)
class FileModel:
    relpath: str
    module: cst.Module
    scopes: list[Scope]
    functions: dict[str, Scope]  # module-level functions by name
    methods: dict[tuple[str, str], Scope]  # (class, method) -> scope
    imports: dict[str, tuple[str, str]]  # local name -> (module as written, with leading dots; name)
    module_aliases: frozenset[str]
    module_attrs: dict[tuple[str, str], Expr]  # (class, attribute) -> value assigned to self.<attribute>
    mentions_channels_last: bool
