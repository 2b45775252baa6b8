"""What a ``**name`` argument of a call can hold, read from the code that builds ``name``.

Real training code passes optimizer options through a variable: nanoGPT-style
``extra_args = dict(fused=True) if use_fused else dict()`` then ``AdamW(groups, lr=lr, **extra_args)``.
A ``call`` recipe may rewrite such a call only when it knows which keywords the ``**`` can carry.
This module finds the assignments of ``name`` in the function that makes the call (or the module),
and reads the keys of every dict they can produce: literals ``{"k": v}``, ``dict(k=v)``, the two
branches of ``a if c else b``, and later ``name["k"] = v`` / ``name.update(k=v)``. Anything else (a
parameter, a function's result, ``**`` inside the dict) makes the keys unknown, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst


@dataclass
class StarKeys:
    """The keys a ``**`` argument can hold (``keys`` None when they are not known) and where that came from."""

    source: str  # the code after ``**``
    keys: set[str] | None
    lines: list[int] = field(default_factory=list)  # where the dict is built
    why_unknown: str = ""


def _dict_keys(node: cst.BaseExpression) -> set[str] | None:
    if isinstance(node, cst.IfExp):
        body, orelse = _dict_keys(node.body), _dict_keys(node.orelse)
        return None if body is None or orelse is None else body | orelse
    if isinstance(node, cst.Dict):
        keys: set[str] = set()
        for element in node.elements:
            if not isinstance(element, cst.DictElement) or not isinstance(element.key, cst.SimpleString):
                return None
            keys.add(str(element.key.evaluated_value))
        return keys
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "dict":
        if any(arg.keyword is None for arg in node.args):
            return None
        return {arg.keyword.value for arg in node.args}
    return None


def _enclosing_function(module: cst.Module, positions, line: int) -> cst.FunctionDef | None:
    best = None

    class Visitor(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            nonlocal best
            position = positions[node]
            if position.start.line <= line <= position.end.line:
                best = node  # visited outermost first: the last hit is the innermost

    module.visit(Visitor())
    return best


def star_keys(module: cst.Module, positions, call: cst.Call, star: cst.Arg) -> StarKeys:
    """The keywords ``star`` (a ``**`` argument of ``call``) can pass."""
    source = module.code_for_node(star.value).strip()
    if not isinstance(star.value, cst.Name):
        direct = _dict_keys(star.value)
        if direct is not None:
            return StarKeys(source, direct, [positions[call].start.line])
        return StarKeys(source, None, why_unknown=f"{source} is not a variable or dict the call's function builds")
    name = star.value.value
    call_line = positions[call].start.line
    scope = _enclosing_function(module, positions, call_line)
    if scope is not None and name in {p.name.value for p in (*scope.params.params, *scope.params.kwonly_params)} \
            or scope is not None and isinstance(scope.params.star_kwarg, cst.Param) and scope.params.star_kwarg.name.value == name:
        return StarKeys(source, None, why_unknown=f"{name} is a parameter of {scope.name.value}(): its keys come from the caller")
    keys: set[str] = set()
    lines: list[int] = []
    unknown: list[str] = []

    class Visitor(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is scope  # assignments in other functions are other variables

        def visit_Assign(self, node: cst.Assign) -> None:
            line = positions[node].start.line
            for target in node.targets:
                if isinstance(target.target, cst.Name) and target.target.value == name and line < call_line:
                    found = _dict_keys(node.value)
                    lines.append(line)
                    if found is None:
                        unknown.append(f"{name} = {module.code_for_node(node.value).strip()[:80]} (line {line})")
                    else:
                        keys.update(found)
                elif isinstance(target.target, cst.Subscript) and _is_name(target.target.value, name) and line < call_line:
                    key = _subscript_key(target.target)
                    lines.append(line)
                    if key is None:
                        unknown.append(f"{module.code_for_node(target.target).strip()} (line {line})")
                    else:
                        keys.add(key)

        def visit_Call(self, node: cst.Call) -> None:
            line = positions[node].start.line
            if isinstance(node.func, cst.Attribute) and _is_name(node.func.value, name) and line < call_line \
                    and node.func.attr.value in ("update", "setdefault", "pop", "__setitem__"):
                lines.append(line)
                if node.func.attr.value == "update" and all(a.keyword is not None for a in node.args):
                    keys.update(a.keyword.value for a in node.args)
                elif node.func.attr.value != "pop":
                    unknown.append(f"{module.code_for_node(node).strip()[:80]} (line {line})")

    (scope if scope is not None else module).visit(Visitor())
    if not lines:
        return StarKeys(source, None, why_unknown=f"{name} is not built in the function that makes the call")
    if unknown:
        return StarKeys(source, None, sorted(lines), f"its keys are not known statically: {'; '.join(unknown)}")
    return StarKeys(source, keys, sorted(lines))


def _is_name(node: cst.BaseExpression, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name


def _subscript_key(node: cst.Subscript) -> str | None:
    if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
        return None
    value = node.slice[0].slice.value
    return str(value.evaluated_value) if isinstance(value, cst.SimpleString) else None
