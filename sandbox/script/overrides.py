"""Script mode's `[overrides]`: shrink a run without editing a file (runs INSIDE the sandbox child).

Key syntax (also in sandbox/workload.py's docstring and the README):

- ``batch_size``: a module-level constant of the script; an assignment of the override's value is
  compiled in right after each of the script's own top-level assignments of that name, and again
  after a top-level ``exec(...)`` / ``globals().update(...)`` (a configurator that runs config files
  and ``--key=value`` arguments into the module's globals);
- ``--max_iters``: a command-line argument, ``--max_iters=<value>`` replacing the launch line's
  (``--max_iters=..`` or ``--max_iters ..``) or appended; ``true`` adds the bare flag, ``false``
  removes it;
- ``GPTConfig.n_layer``: the value of a class attribute (a dataclass field's default) in the
  script or any module imported from the repository;
- ``GPTConfig(n_layer)``: a keyword argument forced on every call of ``GPTConfig`` (or
  ``something.GPTConfig``) in the repository's code, whatever the call passes (``**kwargs``
  included); a bare decorator is a call too (``@torch.compile`` above a function is
  ``torch.compile(function)``: ``compile(disable)`` reaches it).

The source files are never written: the script and the repository's modules are parsed, changed
and compiled in memory (an import hook for the modules), under their own file names and line
numbers. `OverridePlan.unmatched()` names every override that matched nothing, with the nearest
names (difflib), so a typo stops the run instead of silently running the full-size program.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALL_HELPER = "__trainbridge_forced_call__"
DECORATOR_HELPER = "__trainbridge_forced_decorator__"
_KEY = re.compile(r"^(?:(?P<arg>--?[A-Za-z0-9][\w.-]*)|(?P<constant>[A-Za-z_]\w*)|(?P<cls>[A-Za-z_]\w*)\.(?P<attr>[A-Za-z_]\w*)"
                  r"|(?P<call>[A-Za-z_]\w*)\((?P<keyword>[A-Za-z_]\w*)\))$")


class OverrideError(ValueError):
    """An override that matched nothing (the message names the nearest names) or a malformed one."""


def forced_call(function, forced: dict[str, Any], *args, **kwargs):
    """`function(*args, **kwargs)` with the keyword arguments in `forced` replaced (the call overrides)."""
    kwargs.update(forced)
    return function(*args, **kwargs)


def forced_decorator(function, forced: dict[str, Any]):
    """A bare decorator `@function` with the keyword arguments in `forced`: `function(target, **forced)`."""
    return lambda target: forced_call(function, forced, target)


def apply_argv(args: list[str], overrides: dict[str, Any]) -> list[str]:
    """The script's arguments with the `--key` overrides applied (replaced where present, else appended)."""
    out = list(args)
    for key, value in overrides.items():
        if not key.startswith("-"):
            continue
        kept: list[str] = []
        skip_next = False
        for index, arg in enumerate(out):
            if skip_next:
                skip_next = False
                continue
            if arg == key:
                nxt = out[index + 1] if index + 1 < len(out) else None
                skip_next = nxt is not None and not nxt.startswith("-")  # `--key value`
                continue
            if arg.startswith(key + "="):
                continue
            kept.append(arg)
        out = kept
        if value is True:
            out.append(key)
        elif value is not False:
            out.append(f"{key}={_argv_text(value)}")
    return out


def _argv_text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(_argv_text(v) for v in value)
    return str(value)


@dataclass
class OverridePlan:
    """The code overrides (constants, class attributes, call keywords) and what each matched so far."""

    constants: dict[str, Any] = field(default_factory=dict)
    attributes: dict[tuple[str, str], Any] = field(default_factory=dict)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    matched: set[str] = field(default_factory=set)
    seen_names: set[str] = field(default_factory=set)  # what could have matched, for the error's suggestions

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> "OverridePlan":
        plan = cls()
        for key, value in overrides.items():
            match = _KEY.match(key)
            if match is None:
                raise OverrideError(f"override key {key!r} not understood")
            if match["arg"]:
                continue
            if match["constant"]:
                plan.constants[key] = value
            elif match["cls"]:
                plan.attributes[(match["cls"], match["attr"])] = value
            else:
                plan.calls.setdefault(match["call"], {})[match["keyword"]] = value
        return plan

    @property
    def changes_code(self) -> bool:
        return bool(self.constants or self.attributes or self.calls)

    def keys(self) -> list[str]:
        return [*self.constants, *(f"{c}.{a}" for c, a in self.attributes),
                *(f"{call}({kw})" for call, kws in self.calls.items() for kw in kws)]

    def unmatched(self) -> list[str]:
        """One message per override that matched nothing, with the nearest names."""
        messages = []
        for key in self.keys():
            if key in self.matched:
                continue
            near = difflib.get_close_matches(key, sorted(self.seen_names), n=3, cutoff=0.5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            messages.append(f"override {key!r} matched nothing in the script or the modules it imported from the repository{hint}")
        return messages

    def transform(self, tree: ast.Module, *, is_script: bool) -> ast.Module:
        """Apply the overrides to a parsed module (constants only in the script itself)."""
        if is_script:
            tree.body = self._constants(tree.body)
        _Rewriter(self).visit(tree)
        ast.fix_missing_locations(tree)
        return tree

    def _constants(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for statement in body:
            if isinstance(statement, ast.If):
                statement.body, statement.orelse = self._constants(statement.body), self._constants(statement.orelse)
            out.append(statement)
            for name in _assigned_names(statement):
                self.seen_names.add(name)
                if name in self.constants:
                    self.matched.add(name)
                    out.append(self._assignment(name, statement))
            if _rebinds_globals(statement):  # nanoGPT's `exec(open('configurator.py').read())` runs a config file
                out += [self._assignment(name, statement) for name in self.constants if name in self.matched]
        return out

    def _assignment(self, name: str, where: ast.stmt) -> ast.stmt:
        return ast.copy_location(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                            value=_literal(self.constants[name])), where)


def _rebinds_globals(statement: ast.stmt) -> bool:
    """A top-level `exec(...)` or `globals().update(...)`: it may assign any module-level name (a config
    file's values), so the constant overrides are applied again after it."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return False
    func = statement.value.func
    if isinstance(func, ast.Name):
        return func.id == "exec"
    return (isinstance(func, ast.Attribute) and func.attr == "update" and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name) and func.value.func.id == "globals")


def _assigned_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, (ast.AnnAssign, ast.AugAssign)) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def _literal(value: Any, like: ast.expr | None = None) -> ast.expr:
    """`value` as code; a TOML array replacing a tuple stays a tuple (a dataclass refuses a list default)."""
    if isinstance(value, list) and isinstance(like, ast.Tuple):
        value = tuple(value)
    return ast.parse(repr(value), mode="eval").body


class _Rewriter(ast.NodeTransformer):
    def __init__(self, plan: OverridePlan):
        self.plan = plan

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        for statement in node.body:
            for name in _assigned_names(statement):
                self.plan.seen_names.add(f"{node.name}.{name}")
                key = (node.name, name)
                if key in self.plan.attributes and getattr(statement, "value", None) is not None:
                    statement.value = ast.copy_location(_literal(self.plan.attributes[key], statement.value),
                                                        statement.value)
                    self.plan.matched.add(f"{node.name}.{name}")
                elif key in self.plan.attributes and isinstance(statement, ast.AnnAssign):  # `n_layer: int` without a default
                    statement.value = ast.copy_location(_literal(self.plan.attributes[key]), statement)
                    statement.simple = 1
                    self.plan.matched.add(f"{node.name}.{name}")
        self.generic_visit(node)
        return node

    def _decorators(self, node):
        """A bare decorator of a forced callee (`@torch.compile`) gets the forced keywords as its call would."""
        self.generic_visit(node)
        for index, decorator in enumerate(node.decorator_list):
            name = decorator.id if isinstance(decorator, ast.Name) else decorator.attr if isinstance(decorator, ast.Attribute) else None
            forced = self.plan.calls.get(name) if name else None
            if forced:
                self.plan.matched.update(f"{name}({kw})" for kw in forced)
                helper = ast.Name(id=DECORATOR_HELPER, ctx=ast.Load())
                node.decorator_list[index] = ast.copy_location(
                    ast.Call(func=helper, args=[decorator, _literal(forced)], keywords=[]), decorator)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _decorators

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name is None:
            return node
        for keyword in node.keywords:
            if keyword.arg:
                self.plan.seen_names.add(f"{name}({keyword.arg})")
        if name == "add_argument":  # argparse options: an override of one is written "--flag"
            self.plan.seen_names.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-"))
        forced = self.plan.calls.get(name)
        if not forced:
            return node
        self.plan.matched.update(f"{name}({kw})" for kw in forced)
        helper = ast.Name(id=CALL_HELPER, ctx=ast.Load())
        call = ast.Call(func=helper, args=[node.func, _literal(forced), *node.args], keywords=node.keywords)
        return ast.copy_location(call, node)


def compile_source(source: str, filename: str, plan: OverridePlan | None, *, is_script: bool):
    """Code object of a source file, with the overrides applied when there are any."""
    if plan is None or not plan.changes_code:
        return compile(source, filename, "exec", dont_inherit=True)
    tree = plan.transform(ast.parse(source, filename), is_script=is_script)
    return compile(tree, filename, "exec", dont_inherit=True)


class _OverridingLoader(importlib.machinery.SourceFileLoader):
    plan: OverridePlan

    def get_code(self, fullname: str):  # never the cached bytecode: it would hold the unchanged code
        path = self.get_filename(fullname)
        source = importlib.util.decode_source(self.get_data(path))
        return compile_source(source, path, self.plan, is_script=False)


class _RepoFinder(importlib.abc.MetaPathFinder):
    """Finds modules as the normal path finder does; those whose file lies under the repository get the overriding loader."""

    def __init__(self, root: Path, plan: OverridePlan):
        self.root, self.plan = root.resolve(), plan

    def find_spec(self, fullname, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return spec
        try:
            inside = Path(spec.origin).resolve().relative_to(self.root)
        except ValueError:
            return spec
        if "site-packages" in inside.parts or "dist-packages" in inside.parts:  # a virtualenv inside the repository
            return spec
        loader = _OverridingLoader(spec.name, spec.origin)
        loader.plan = self.plan
        spec.loader = loader
        return spec


def install(root: Path, plan: OverridePlan) -> None:
    """Make the repository's modules load with the overrides applied (call before the script runs)."""
    setattr(builtins, CALL_HELPER, forced_call)
    setattr(builtins, DECORATOR_HELPER, forced_decorator)
    if plan.changes_code:
        sys.meta_path.insert(0, _RepoFinder(root, plan))
