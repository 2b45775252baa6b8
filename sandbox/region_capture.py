"""Finding and capturing the region the region lab times (sandbox/region_bench.py runs these in its child).

A site (file, line range, function name) is resolved to a qualified name in the baseline's source
(`qualname_for`), then to the imported function of each side (`module_of`, `resolve`); one training
step under a profile hook records the first call's real arguments (`capture_call`: tensors cloned,
`requires_grad` as they were). The baseline's objects among them (its model's submodules, its
optimizer) are swapped for the candidate's twins at the same place (`twin_args`).
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from typing import Any


class Unisolated(Exception):
    """The region cannot be timed alone; the message says why."""


def qualname_for(path: Path, function: str | None, line: int) -> str:
    """The qualified name (`f`, `Class.method`) of the def named `function` in `path` (the innermost def
    enclosing `line` when `function` is None, or when several defs share the name)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        raise Unisolated(f"{path.name}: cannot be parsed ({exc})") from exc
    found: list[tuple[str, ast.AST, bool]] = []

    def walk(node: ast.AST, prefix: str, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((name, child, nested))
                inner = nested or not isinstance(child, ast.ClassDef)
                walk(child, f"{name}.<locals>." if not isinstance(child, ast.ClassDef) else f"{name}.", inner)

    walk(tree, "", False)
    named = [(q, n, nested) for q, n, nested in found if function is None or q.rsplit(".", 1)[-1] == function]
    enclosing = [(q, n, nested) for q, n, nested in named if n.lineno <= line <= (n.end_lineno or n.lineno)]
    pick = enclosing[-1:] or (named if len(named) == 1 else [])
    if not pick:
        what = f"no def named {function!r}" if function else f"no function encloses line {line}"
        raise Unisolated(f"{path.name}: {what}" + (f" ({len(named)} defs share that name)" if len(named) > 1 else ""))
    qualname, _, nested = pick[0]
    if nested or "<locals>" in qualname:
        raise Unisolated(f"{qualname} is defined inside another function: it has no name to import it by")
    return qualname


def module_of(root: Path, file: str):
    """The imported module whose file is `root/file`."""
    target = (root / file).resolve()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve() == target:
            return module
    raise Unisolated(f"{file} was not imported by the workload")


def resolve(module, qualname: str):
    """The function object (for a method: the class's function) at `qualname` in `module`."""
    owner, value = None, module
    for part in qualname.split("."):
        owner, value = value, getattr(value, part, None)
        if value is None:
            raise Unisolated(f"{module.__name__} has no {qualname}")
    value = inspect.unwrap(value)
    if not inspect.isfunction(value):
        raise Unisolated(f"{qualname} is a {type(value).__name__}, not a Python function")
    return value, (owner if inspect.isclass(owner) else None)


def capture_call(code, run_step) -> dict[str, Any]:
    """Run one step; the locals of the first frame of `code` at its entry (its arguments)."""
    seen: dict[str, Any] = {}

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code is code and not seen:
            seen.update(frame.f_locals)
            seen["__frame_args__"] = clone_args(dict(frame.f_locals), code)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        run_step()
    finally:
        sys.setprofile(previous)
    if not seen:
        raise Unisolated(f"{code.co_qualname} was not called during the training step")
    return seen


def arg_names(code) -> tuple[list[str], list[str], str | None, str | None]:
    positional = list(code.co_varnames[: code.co_argcount])
    keyword = list(code.co_varnames[code.co_argcount: code.co_argcount + code.co_kwonlyargcount])
    index = code.co_argcount + code.co_kwonlyargcount
    star = code.co_varnames[index] if code.co_flags & inspect.CO_VARARGS else None
    index += 1 if star else 0
    starstar = code.co_varnames[index] if code.co_flags & inspect.CO_VARKEYWORDS else None
    return positional, keyword, star, starstar


def clone_args(local: dict[str, Any], code) -> dict[str, Any]:
    positional, keyword, star, starstar = arg_names(code)
    names = positional + keyword + [n for n in (star, starstar) if n]
    return {name: clone(local[name]) for name in names if name in local}


def clone(value):
    import torch

    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad) if copy.is_floating_point() or copy.is_complex() else copy
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value) if not hasattr(value, "_fields") else type(value)(*(clone(v) for v in value))
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


def shapes_of(args: dict[str, Any]) -> dict[str, str]:
    import torch

    def describe(value) -> str | None:
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" + (" grad" if value.requires_grad else "")
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return "[" + ", ".join(describe(v) or type(v).__name__ for v in value) + "]"
        return None

    return {name: text for name, value in args.items() if (text := describe(value)) is not None}


def twin_args(args: dict[str, Any], base_parts: dict[str, Any], cand_parts: dict[str, Any]) -> dict[str, Any]:
    """The captured arguments with the baseline's objects (its model's submodules, its optimizer) replaced by
    the candidate's twins at the same place, so a region that takes the model runs the candidate's."""
    paths = {id(module): name for name, module in base_parts["model"].named_modules()}
    twins = {id(base_parts["optimizer"]): cand_parts["optimizer"]}

    def swap(value):
        if id(value) in twins:
            return twins[id(value)]
        if id(value) in paths:
            try:
                return cand_parts["model"].get_submodule(paths[id(value)])
            except AttributeError as exc:
                raise Unisolated(f"the candidate's model has no submodule {paths[id(value)]!r}") from exc
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    return {name: swap(value) for name, value in args.items()}


def forget_modules(root: Path) -> dict[str, Any]:
    """Move the modules imported from `root` out of `sys.modules` (their objects stay alive)."""
    root = root.resolve()
    moved = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(root):
            moved[name] = sys.modules.pop(name)
    while str(root) in sys.path:
        sys.path.remove(str(root))
    return moved
