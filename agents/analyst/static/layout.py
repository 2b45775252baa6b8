"""Static patterns: layout copies (permute/transpose then reshape) and redundant casts."""

from __future__ import annotations

from .match import (
    Ctx,
    Expr,
    Found,
    call,
    follow,
    pattern,
    peek,
    same,
)


@pattern
def permute_reshape(ctx: Ctx, e: Expr) -> Found | None:
    """x.transpose(...).contiguous().view(...) / .permute(...).reshape(...) / .flatten(...): a relayout copy."""
    shaped = call(ctx, e, "view", "reshape", "flatten")
    if shaped is None:
        return None
    x = shaped.args[0]
    contiguous = call(ctx, x, "contiguous")
    moved = call(ctx, contiguous.args[0] if contiguous else x, "transpose", "permute", "swapaxes", "swapdims", "movedim")
    if moved is None:
        return None
    how = f"{moved.op}" + (".contiguous()" if contiguous else "") + f".{shaped.op}"
    return Found(0.3, f"layout copy: {how}")


_DTYPES = {
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
}  # fmt: skip
_CAST_TARGET = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16"}


def _dtype_name(e: Expr | None) -> str | None:
    if e is None:
        return None
    x = peek(e)
    if x.kind == "attr" and x.op in _DTYPES and peek(x.args[0]).kind == "name":
        return _DTYPES[x.op]
    return None


def _cast_target(x: Expr) -> object | None:
    """What a cast converts to: a dtype name, ('like', expr) for type_as / .to(t.dtype), else None."""
    if x.kind != "call" or not x.method:
        return None
    if x.op in _CAST_TARGET and len(x.args) == 1:
        return _CAST_TARGET[x.op]
    if x.op in ("to", "type"):
        arg = x.arg(1, "dtype")
        if _dtype_name(arg):
            return _dtype_name(arg)
        if arg is not None and peek(arg).kind == "attr" and peek(arg).op == "dtype":
            return ("like", peek(arg).args[0])
    if x.op == "type_as" and len(x.args) == 2:
        return ("like", x.args[1])
    return None


def _same_target(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return same(a[1], b[1])
    return a == b


@pattern
def redundant_cast(ctx: Ctx, e: Expr) -> Found | None:
    """A cast whose input was just cast (x.float().float(), x.float().to(dtype)) or made in that dtype."""
    outer = follow(ctx, e)
    target = _cast_target(outer)
    if target is None:
        return None
    inner = follow(ctx, outer.args[0])
    first = _cast_target(inner)
    if first is not None:
        ctx.core += [outer, inner]
        if _same_target(first, target):
            return Found(0.4, "the same cast twice in a row")
        if first in ("float32", "float64"):
            return Found(0.35, "an up-cast immediately cast again: the first cast does nothing (floating input assumed)")
        return None
    made = _dtype_name(inner.kwargs.get("dtype")) if inner.kind == "call" else None
    if made is not None and made == target:
        ctx.core.append(outer)
        return Found(0.35, f"a cast to {made} of a tensor created as {made}")
    return None
