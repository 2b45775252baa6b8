"""Static patterns: layout copies (permute/transpose then reshape) and redundant casts.

Redundant casts (``redundant_cast``), each a copy of the whole tensor that changes nothing:
- a cast of a cast (``x.float().float()``, ``x.float().to(torch.bfloat16)``);
- a cast to the dtype the tensor was created in (``torch.zeros(n, dtype=torch.float32).float()``),
  or an fp32 cast of a factory that makes the default float dtype (``torch.randn(n).float()``);
- a round trip around ops that are exact in any precision: ``x.float().transpose(1, 2).type_as(x)``
  (views, permutes, negation, abs, relu, slicing). An upcast around arithmetic (``x.float()`` then
  products, then ``.type_as(x)``: rotary, norms) is deliberate precision and is not reported.
"""

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
    """x.transpose(...).contiguous().view(...) / .permute(...).reshape(...) / .flatten(...) / .view_as(y): a relayout copy."""
    shaped = call(ctx, e, "view", "reshape", "flatten", "view_as", "reshape_as")
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
# Ops whose result is bit-identical in any floating dtype: moving data, selecting, or flipping the sign.
_EXACT_OPS = frozenset({
    "view", "view_as", "reshape", "transpose", "permute", "flatten", "unflatten", "contiguous", "squeeze",
    "unsqueeze", "expand", "expand_as", "neg", "abs", "relu", "clone", "detach", "t", "narrow", "select",
    "roll", "flip", "repeat", "movedim", "swapaxes", "swapdims",
})  # fmt: skip
# Factories that make torch.get_default_dtype() (float32 unless the program changes it) without a dtype.
_DEFAULT_FLOAT_FACTORIES = frozenset({"zeros", "ones", "empty", "rand", "randn", "linspace", "logspace"})


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
    if target == "float32" and _default_float_factory(inner):
        ctx.core.append(outer)
        return Found(0.3, f"an fp32 cast of torch.{inner.op}(...), which already makes the default float dtype (float32)")
    if isinstance(target, tuple):
        base, path = _through_exact_ops(ctx, outer.args[0])
        up = _cast_target(base) if path else None
        if up in ("float32", "float64") and same(base.args[0], target[1]):
            ctx.core += [outer, base]
            ops = ", ".join(dict.fromkeys(x.op if x.kind == "call" else "[...]" for x in path))
            return Found(0.35, f"an upcast and the cast back around {ops}, which are exact in any precision: "
                               "two copies of the tensor that change nothing")
    return None


def _default_float_factory(x: Expr) -> bool:
    return (x.kind == "call" and not x.method and x.op in _DEFAULT_FLOAT_FACTORIES and "dtype" not in x.kwargs
            and (x.callee or "").startswith("torch."))


def _through_exact_ops(ctx: Ctx, e: Expr, limit: int = 8) -> tuple[Expr, list[Expr]]:
    """The expression under a chain of exact ops (views, permutes, neg, slicing), and the chain
    (the definitions it goes through are recorded: the finding spans them)."""
    x, path = follow(ctx, e), []
    for _ in range(limit):
        if (x.kind == "call" and x.op in _EXACT_OPS and x.args) or (x.kind == "subscript" and x.args):
            path.append(x)
            x = follow(ctx, x.args[0])
        else:
            break
    return x, path
