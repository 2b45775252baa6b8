"""Source model of the static scan: libcst code lowered into a small, normalised expression tree.

Spelling differences disappear here, so the pattern matchers stay short:

- method and function calls share one form: ``x.mean(-1)`` and ``torch.mean(x, -1)`` are both
  ``call mean(x, -1)`` (the receiver becomes the first argument, ``method`` says which it was);
- operators are calls too: ``a * b`` -> ``mul(a, b)``, ``a ** 2`` -> ``pow(a, 2)``, ``a @ b`` ->
  ``matmul(a, b)``, ``-a`` -> ``neg(a)``, ``x += y`` -> ``add(x, y)``;
- a call of a submodule attribute, ``self.act(h)``, is ``call self.act(h)``;
- every name carries its reaching definition inside its function (the last assignment before the
  statement, in source order; branches are not merged), so a pattern spread over several
  statements can be followed; ``a, b = t.chunk(2)`` binds ``a`` to ``item 0 of chunk(t, 2)``.
"""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .model import Binding, Expr, FileModel, Scope, StaticScanError, Stmt

_CODE = cst.Module([])

# Names that refer to modules when no import says otherwise (for code snippets without imports).
DEFAULT_MODULE_ALIASES = frozenset({"torch", "math", "F", "nn", "np", "numpy", "torch_npu"})
# `from torch import nn` binds a module, `from torch import rsqrt` a function.
_SUBMODULE_NAMES = frozenset(
    {"nn", "functional", "optim", "linalg", "fft", "special", "distributed", "cuda", "autograd", "init", "jit", "npu"}
)
_BINARY_OPS = {
    cst.Add: "add",
    cst.Subtract: "sub",
    cst.Multiply: "mul",
    cst.Divide: "div",
    cst.FloorDivide: "floordiv",
    cst.Power: "pow",
    cst.MatrixMultiply: "matmul",
    cst.Modulo: "mod",
}
_AUG_OPS = {
    cst.AddAssign: "add",
    cst.SubtractAssign: "sub",
    cst.MultiplyAssign: "mul",
    cst.DivideAssign: "div",
    cst.PowerAssign: "pow",
    cst.MatrixMultiplyAssign: "matmul",
}


def dotted(node: cst.CSTNode) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def _child_exprs(node: cst.CSTNode) -> list[cst.BaseExpression]:
    """Sub-expressions of an expression the lowering has no special form for."""
    # Direct attribute access for the common kinds: libcst's generic `children` is slow.
    if isinstance(node, cst.Comparison):
        return [node.left, *(c.comparator for c in node.comparisons)]
    if isinstance(node, cst.BooleanOperation):
        return [node.left, node.right]
    if isinstance(node, cst.IfExp):
        return [node.test, node.body, node.orelse]
    if isinstance(node, cst.FormattedString):
        return [p.expression for p in node.parts if isinstance(p, cst.FormattedStringExpression)]
    if isinstance(node, cst.Dict):
        return [x for e in node.elements for x in ((e.key, e.value) if isinstance(e, cst.DictElement) else (e.value,))]
    out: list[cst.BaseExpression] = []
    for child in node.children:
        if isinstance(child, cst.BaseExpression):
            out.append(child)
        else:
            out.extend(_child_exprs(child))
    return out


def _has_modulo(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
        return True
    return any(_has_modulo(c) for c in node.children)


_OPTIMIZER_STEP = re.compile(r"\b\w*(opt|scaler)\w*\s*\.\s*step\s*\(", re.IGNORECASE)


def _periodic_test(node: cst.If) -> bool:
    """``if step % N == 0:`` (logging every N steps), but not the ``if`` of gradient accumulation.

    A ``%`` test whose own body steps the optimizer (``if (i + 1) % accum == 0: opt.step()``) runs
    once per optimizer step: what it holds is the training step, not periodic extras.
    """
    if not _has_modulo(node.test):
        return False
    own = [s for s in node.body.body if not isinstance(s, cst.If)]
    return not any(_OPTIMIZER_STEP.search(_CODE.code_for_node(s)) for s in own)


def _import_module_name(node: cst.ImportFrom) -> str:
    dots = "." * len(node.relative)
    return dots + (cst.Module([]).code_for_node(node.module) if node.module is not None else "")


class _Builder:
    def __init__(self, relpath: str, code: str):
        try:
            module = cst.parse_module(code)
        except cst.ParserSyntaxError as exc:
            raise StaticScanError(relpath, exc.raw_line, exc.message) from None
        self.relpath = relpath
        self.wrapper = MetadataWrapper(module, unsafe_skip_copy=True)  # read-only: no copy needed
        self.module = self.wrapper.module
        self.pos = self.wrapper.resolve(PositionProvider)
        self.scopes: list[Scope] = []
        self.functions: dict[str, Scope] = {}
        self.methods: dict[tuple[str, str], Scope] = {}
        self.module_attrs: dict[tuple[str, str], Expr] = {}
        self.imports: dict[str, tuple[str, str]] = {}
        self.declared_aliases: set[str] = set()
        for node in _top_level_statements(self.module.body):
            self.import_statement(node)
        self.aliases = frozenset(self.declared_aliases | (DEFAULT_MODULE_ALIASES - set(self.imports)))

    def import_statement(self, node: cst.CSTNode) -> None:
        """Record what an import binds: module aliases (torch, F, nn) or names from modules."""
        if isinstance(node, cst.Import):
            for alias in node.names:
                name = cst.Module([]).code_for_node(alias.name)
                self.declared_aliases.add(alias.asname.name.value if alias.asname else name.split(".")[0])
        elif isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
            source = _import_module_name(node)
            for alias in node.names:
                name = cst.Module([]).code_for_node(alias.name)
                local = alias.asname.name.value if alias.asname else name
                if name in _SUBMODULE_NAMES and source.split(".")[0] in ("torch", "torch_npu"):
                    self.declared_aliases.add(local)
                else:
                    self.imports[local] = (source, name)

    # --- lines -------------------------------------------------------------------------------
    def lines(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.pos[node]
        return r.start.line, r.end.line

    # --- statements --------------------------------------------------------------------------
    def build(self) -> FileModel:
        start, end = 1, max(1, self.module.code.count("\n"))
        top = Scope(None, self.module, None, [], start, end)
        self.scopes.append(top)
        self.block(self.module.body, {}, top, (), False)
        text = self.module.code
        return FileModel(
            relpath=self.relpath,
            module=self.module,
            scopes=self.scopes,
            functions=self.functions,
            methods=self.methods,
            imports=self.imports,
            module_aliases=self.aliases,
            module_attrs=self.module_attrs,
            mentions_channels_last="channels_last" in text,
        )

    def block(self, body, env: dict, scope: Scope, loops: tuple, periodic: bool) -> None:
        for stmt in body:
            if isinstance(stmt, cst.BaseSmallStatement):  # a one-line body: `def f(x): return g(x)`
                self.small(stmt, env, self._stmt(stmt, scope, loops, periodic))
            else:
                self.statement(stmt, env, scope, loops, periodic)

    def _stmt(self, node, scope, loops, periodic) -> Stmt:
        start, end = self.lines(node)
        return Stmt(node, start, end, scope, loops, periodic)

    def statement(self, node, env: dict, scope: Scope, loops: tuple, periodic: bool) -> None:
        if isinstance(node, cst.SimpleStatementLine):
            for small in node.body:
                self.small(small, env, self._stmt(small, scope, loops, periodic))
        elif isinstance(node, cst.FunctionDef):
            self.function(node, scope)
            env.pop(node.name.value, None)
        elif isinstance(node, cst.ClassDef):
            self.klass(node, scope)
            env.pop(node.name.value, None)
        elif isinstance(node, cst.If):
            self.root(node.test, env, self._stmt(node.test, scope, loops, periodic))
            inner = periodic or _periodic_test(node)
            self.block(node.body.body, env, scope, loops, inner)
            if isinstance(node.orelse, cst.If):
                self.statement(node.orelse, env, scope, loops, inner)
            elif isinstance(node.orelse, cst.Else):
                self.block(node.orelse.body.body, env, scope, loops, inner)
        elif isinstance(node, (cst.For, cst.While)):
            header = node.iter if isinstance(node, cst.For) else node.test
            self.root(header, env, self._stmt(header, scope, loops, periodic))
            if isinstance(node, cst.For):
                self.unbind(node.target, env)
            scope.loop_ops.setdefault(id(node), set())
            scope.loop_lines[id(node)] = self.lines(node)
            self.block(node.body.body, env, scope, loops + (node,), periodic)
            if node.orelse is not None:
                self.block(node.orelse.body.body, env, scope, loops, periodic)
        elif isinstance(node, cst.With):
            for item in node.items:
                self.root(item.item, env, self._stmt(item.item, scope, loops, periodic))
                if item.asname is not None:
                    self.unbind(item.asname.name, env)
            self.block(node.body.body, env, scope, loops, periodic)
        elif isinstance(node, cst.Try):
            self.block(node.body.body, env, scope, loops, periodic)
            for handler in node.handlers:
                self.block(handler.body.body, env, scope, loops, periodic)
            for extra in (node.orelse, node.finalbody):
                if extra is not None:
                    self.block(extra.body.body, env, scope, loops, periodic)
        elif isinstance(node, cst.Match):
            for case in node.cases:
                self.block(case.body.body, env, scope, loops, periodic)

    def small(self, node, env: dict, stmt: Stmt) -> None:
        if isinstance(node, cst.Assign):
            value = self.root(node.value, env, stmt)
            for target in node.targets:
                self.bind(target.target, value, env, stmt)
        elif isinstance(node, cst.AnnAssign):
            if node.value is not None:
                self.bind(node.target, self.root(node.value, env, stmt), env, stmt)
        elif isinstance(node, cst.AugAssign):
            rhs = self.lower(node.value, env, stmt)
            op = _AUG_OPS.get(type(node.operator), "other")
            old = self.lower(node.target, env, stmt)
            value = self.make_call(op, node, stmt, (old, rhs), {}, callee=None)
            stmt.scope.roots.append(value)
            self.bind(node.target, value, env, stmt)
        elif isinstance(node, cst.Expr):
            self.root(node.value, env, stmt)
        elif isinstance(node, cst.Return) and node.value is not None:
            stmt.scope.returns.append(self.root(node.value, env, stmt))
        elif isinstance(node, cst.Del):
            self.unbind(node.target, env)
        elif isinstance(node, (cst.Import, cst.ImportFrom)) and stmt.scope.qualname is not None:
            self.import_statement(node)  # an import inside a function: effective from here on
            self.aliases = frozenset(self.aliases | self.declared_aliases)

    def root(self, node, env: dict, stmt: Stmt) -> Expr:
        expr = self.lower(node, env, stmt)
        stmt.scope.roots.append(expr)
        return expr

    def bind(self, target, value: Expr, env: dict, stmt: Stmt) -> None:
        if isinstance(target, cst.Name):
            env[target.value] = Binding(value, stmt)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for i, element in enumerate(target.elements):
                if isinstance(element, cst.StarredElement):
                    self.unbind(element.value, env)
                    continue
                item = Expr("item", "", value.node, stmt, value.start, value.end, args=(value,), value=i)
                self.bind(element.value, item, env, stmt)
        elif isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name):
            if target.value.value == "self" and stmt.scope.class_name:
                self.module_attrs[(stmt.scope.class_name, target.attr.value)] = value

    def unbind(self, target, env: dict) -> None:
        if isinstance(target, cst.Name):
            env.pop(target.value, None)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self.unbind(element.value, env)

    def function(self, node: cst.FunctionDef, outer: Scope) -> None:
        name = node.name.value
        in_class = outer.node is not self.module and isinstance(outer.node, cst.ClassDef)
        if outer.qualname is None:
            qualname = name
        else:
            qualname = f"{outer.qualname}.{name}"
        p = node.params
        params = [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]
        start, end = self.lines(node)
        scope = Scope(qualname, node, outer.class_name if in_class else None, params, start, end)
        self.scopes.append(scope)
        if in_class and outer.class_name:
            self.methods[(outer.class_name, name)] = scope
        elif outer.qualname is None:
            self.functions[name] = scope
        self.block(node.body.body, {}, scope, (), False)

    def klass(self, node: cst.ClassDef, outer: Scope) -> None:
        name = node.name.value
        qualname = name if outer.qualname is None else f"{outer.qualname}.{name}"
        start, end = self.lines(node)
        scope = Scope(qualname, node, name, [], start, end)
        self.scopes.append(scope)
        self.block(node.body.body, {}, scope, (), False)

    # --- expressions -------------------------------------------------------------------------
    def make_call(self, op, node, stmt, args, kwargs, callee, method=False) -> Expr:
        start, end = self.lines(node)
        expr = Expr("call", op, node, stmt, start, end, tuple(args), kwargs, method=method, callee=callee)
        scope = stmt.scope
        keys = {op} | ({callee} if callee else set())
        scope.calls.append(expr)
        scope.ops |= keys
        for loop in stmt.loops:
            scope.loop_ops.setdefault(id(loop), set()).update(keys)
        return expr

    def lower(self, node: cst.BaseExpression, env: dict, stmt: Stmt) -> Expr:
        start, end = self.lines(node)

        def make(kind, op="", args=(), **kw) -> Expr:
            return Expr(kind, op, node, stmt, start, end, tuple(args), **kw)

        if isinstance(node, cst.Name):
            if node.value in ("True", "False", "None"):
                return make("const", value={"True": True, "False": False, "None": None}[node.value])
            return make("name", node.value, binding=env.get(node.value))
        if isinstance(node, (cst.Integer, cst.Float)):
            return make("const", value=node.evaluated_value)
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            try:
                text = node.evaluated_value
            except Exception:  # noqa: BLE001 - bytes or odd prefixes: not a string constant we use
                text = None
            return make("str", value=text if isinstance(text, str) else None)
        if isinstance(node, cst.Attribute):
            return make("attr", node.attr.value, (self.lower(node.value, env, stmt),))
        if isinstance(node, cst.BinaryOperation):
            op = _BINARY_OPS.get(type(node.operator), "binop")
            args = (self.lower(node.left, env, stmt), self.lower(node.right, env, stmt))
            return self.make_call(op, node, stmt, args, {}, callee=None)
        if isinstance(node, cst.UnaryOperation):
            operand = self.lower(node.expression, env, stmt)
            if isinstance(node.operator, cst.Minus):
                if operand.kind == "const" and isinstance(operand.value, (int, float)):
                    return make("const", value=-operand.value)
                return self.make_call("neg", node, stmt, (operand,), {}, callee=None)
            if isinstance(node.operator, cst.Plus):
                return operand
            return make("other", "not", (operand,))
        if isinstance(node, cst.Call):
            return self.lower_call(node, env, stmt)
        if isinstance(node, cst.Subscript):
            base = self.lower(node.value, env, stmt)
            specs, subs = [], []
            for element in node.slice:
                s = element.slice
                if isinstance(s, cst.Slice):
                    parts = [None if b is None else self.lower(b, env, stmt) for b in (s.lower, s.upper, s.step)]
                    specs.append(("slice", *parts))
                    subs += [p for p in parts if p is not None]
                else:
                    index = self.lower(s.value, env, stmt)
                    specs.append(("index", index))
                    subs.append(index)
            return make("subscript", "", (base, *subs), value=specs)
        if isinstance(node, (cst.Tuple, cst.List)):
            elements = [self.lower(e.value, env, stmt) for e in node.elements]
            return make("tuple", "", elements)
        return make("other", type(node).__name__, [self.lower(c, env, stmt) for c in _child_exprs(node)])

    def lower_call(self, node: cst.Call, env: dict, stmt: Stmt) -> Expr:
        args, kwargs = [], {}
        for a in node.args:
            value = self.lower(a.value, env, stmt)
            if a.keyword is not None:
                kwargs[a.keyword.value] = value
            elif a.star:
                kwargs["*" + a.star] = value
            else:
                args.append(value)
        if not args and "input" in kwargs:  # torch.logsumexp(input=x, dim=-1): the operand first
            args.append(kwargs.pop("input"))
        func = node.func
        if isinstance(func, cst.Attribute):
            op = func.attr.value
            receiver = dotted(func.value)
            root = receiver.split(".")[0] if receiver else None
            if receiver and root in self.aliases and root not in env:
                return self.make_call(op, node, stmt, args, kwargs, callee=f"{receiver}.{op}")
            if receiver == "self":
                return self.make_call(f"self.{op}", node, stmt, args, kwargs, callee=f"self.{op}")
            recv = self.lower(func.value, env, stmt)
            callee = f"{receiver}.{op}" if receiver else None
            return self.make_call(op, node, stmt, [recv, *args], kwargs, callee=callee, method=True)
        if isinstance(func, cst.Name):
            return self.make_call(func.value, node, stmt, args, kwargs, callee=func.value)
        target = self.lower(func, env, stmt)
        return self.make_call("", node, stmt, [target, *args], kwargs, callee=None)


def _top_level_statements(body) -> Iterator[cst.CSTNode]:
    """Small statements at module level, also inside top-level if/try blocks (guarded imports)."""
    for stmt in body:
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif isinstance(stmt, cst.If):
            yield from _top_level_statements(stmt.body.body)
            if isinstance(stmt.orelse, cst.Else):
                yield from _top_level_statements(stmt.orelse.body.body)
        elif isinstance(stmt, cst.Try):
            yield from _top_level_statements(stmt.body.body)
            for handler in stmt.handlers:
                yield from _top_level_statements(handler.body.body)


def build_file_model(code: str, relpath: str) -> FileModel:
    """Parse and lower one file; raises StaticScanError when it does not parse."""
    return _Builder(relpath, code).build()
