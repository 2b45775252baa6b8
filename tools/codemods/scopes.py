"""Where a region lives: the function, method or module ``forward`` that encloses a source span.

Real training code writes the op inside class bodies, methods, static helpers, nested functions and
``forward``s of any module, at any depth (a class inside a function, a helper inside a method). The
engine's ``semantic`` and ``decorate`` kinds need the definition that holds an intent's span:

- ``function`` scope: the innermost ``def`` that overlaps the span (a method counts as a function);
  when the span covers several definitions of one body (a whole class), its ``forward`` is preferred.
- ``module_forward`` scope: the innermost class overlapping the span that defines ``forward``.

Each result carries the class that owns the definition directly (for ``self.`` attributes) and a
dotted qualified name for messages (``Attention.forward``, ``train.<locals>.step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from trainbridge.records import SourceSpan


@dataclass(frozen=True)
class Scope:
    function: cst.FunctionDef
    owner: cst.ClassDef | None  # the class whose body holds the function directly (a method), else None
    qualname: str  # Class.method, outer.<locals>.inner
    depth: int  # how many defs and classes enclose it
    nested: bool  # defined inside another function (re-created on every call of that one)

    @property
    def is_method(self) -> bool:
        return self.owner is not None


def definitions(module: cst.Module) -> list[Scope]:
    """Every function definition of the module, outermost first, with its owner and qualified name."""
    out: list[Scope] = []

    def walk(body, prefix: str, owner: cst.ClassDef | None, depth: int, in_function: bool) -> None:
        for statement in body:
            for node in _definitions_in(statement):
                if isinstance(node, cst.FunctionDef):
                    name = f"{prefix}{node.name.value}"
                    out.append(Scope(node, owner, name, depth, in_function))
                    walk(_body(node), f"{name}.<locals>.", None, depth + 1, True)
                else:
                    walk(_body(node), f"{prefix}{node.name.value}.", node, depth + 1, in_function)

    walk(module.body, "", None, 0, False)
    return out


def _body(node: cst.FunctionDef | cst.ClassDef) -> list[cst.CSTNode]:
    return list(node.body.body) if isinstance(node.body, cst.IndentedBlock) else []


def _definitions_in(statement: cst.CSTNode) -> list[cst.FunctionDef | cst.ClassDef]:
    """The defs and classes of one statement: itself, or those under its if/try/with/for blocks."""
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return [statement]
    found: list[cst.FunctionDef | cst.ClassDef] = []
    if isinstance(statement, (cst.If, cst.Try, cst.With, cst.For, cst.While, cst.Else, cst.ExceptHandler, cst.Finally)):
        for child in statement.children:
            if isinstance(child, cst.IndentedBlock):
                for inner in child.body:
                    found += _definitions_in(inner)
            elif isinstance(child, (cst.If, cst.Else, cst.ExceptHandler, cst.Finally)):
                found += _definitions_in(child)
            elif isinstance(child, (list, tuple)):
                for item in child:
                    found += _definitions_in(item)
    return found


def _lines(positions, node) -> tuple[int, int]:
    position = positions[node]
    return position.start.line, position.end.line


def _overlaps(lines: tuple[int, int], span: SourceSpan) -> bool:
    return lines[0] <= span.line_end and span.line_start <= lines[1]


def _contains(lines: tuple[int, int], span: SourceSpan) -> bool:
    return lines[0] <= span.line_start and span.line_end <= lines[1]


def innermost_function(module: cst.Module, positions, span: SourceSpan) -> Scope | None:
    """The deepest definition containing the span; but when the span covers a class's methods (a
    class defined inside that definition, or at module level), one of those methods: ``forward``
    first, then the first in the file."""
    scopes = definitions(module)
    containing = [s for s in scopes if _contains(_lines(positions, s.function), span)]
    holder = max(containing, key=lambda s: s.depth) if containing else None
    overlapping = [s for s in scopes if _overlaps(_lines(positions, s.function), span)]
    methods = [s for s in overlapping if s.owner is not None and (holder is None or s.depth > holder.depth)]
    if holder is not None and not methods:
        return holder
    pool = methods or overlapping
    if not pool:
        return None
    level = [s for s in pool if s.depth == min(p.depth for p in pool)] if methods else \
        [s for s in pool if s.depth == max(p.depth for p in pool)]
    forward = [s for s in level if s.function.name.value == "forward"]
    return (forward or level)[0]


def module_forward(module: cst.Module, positions, span: SourceSpan) -> Scope | None:
    """The ``forward`` of the innermost class that overlaps the span and defines one."""
    best: Scope | None = None
    best_depth = -1
    for scope in definitions(module):
        if scope.owner is None or scope.function.name.value != "forward":
            continue
        if _overlaps(_lines(positions, scope.owner), span) and scope.depth > best_depth:
            best, best_depth = scope, scope.depth
    return best


def describe_position(module: cst.Module, positions, span: SourceSpan) -> str:
    """What the span holds when no definition encloses it (for a refusal): its first statement."""
    for statement in module.body:
        if _overlaps(_lines(positions, statement), span):
            text = module.code_for_node(statement).strip().splitlines()[0][:120]
            return f"line {positions[statement].start.line} is module-level code ({text})"
    return "no code lies in the span"


def parameter_attributes(owner: cst.ClassDef) -> set[str]:
    """The attributes the class makes learnable: ``self.<name> = nn.Parameter(...)`` (any spelling ending in
    ``Parameter``) or ``self.register_parameter("<name>", ...)``, anywhere in its body."""
    found: set[str] = set()

    def _parameter_call(node: cst.BaseExpression | None) -> bool:
        if not isinstance(node, cst.Call):
            return False
        func = node.func
        return (isinstance(func, cst.Name) and func.value == "Parameter") or \
            (isinstance(func, cst.Attribute) and func.attr.value == "Parameter")

    def _self_target(node: cst.BaseExpression) -> str | None:
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
            return node.attr.value
        return None

    class Visitor(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if _parameter_call(node.value):
                found.update(n for t in node.targets if (n := _self_target(t.target)))

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            if _parameter_call(node.value) and (name := _self_target(node.target)):
                found.add(name)

        def visit_Call(self, node: cst.Call) -> None:
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value == "register_parameter" and node.args \
                    and isinstance(node.args[0].value, cst.SimpleString):
                found.add(node.args[0].value.evaluated_value)

    owner.visit(Visitor())
    return found


def learned_buffers(owner: cst.ClassDef | None, params: dict) -> list[str]:
    """The recipe's ``buffers`` (fixed tables it reads from the module) that the class makes parameters instead."""
    if owner is None:
        return []
    return sorted(set(str(b) for b in params.get("buffers", []) or []) & parameter_attributes(owner))


def attribute_reads(node: cst.CSTNode, name: str) -> set[str]:
    """The attributes read from the name ``name`` anywhere under ``node`` (``name.<attr>``, calls of methods included)."""
    found: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            if isinstance(node.value, cst.Name) and node.value.value == name:
                found.add(node.attr.value)

    node.visit(Visitor())
    return found


def self_reads(function: cst.FunctionDef) -> set[str]:
    """The attributes a method reads from its first parameter (``self.<name>``, calls of its methods included)."""
    params = function.params.params
    return attribute_reads(function.body, params[0].name.value) if params else set()
