"""Building blocks shared by the static patterns: the many spellings of a few tensor operations.

Each function takes the matching context and an expression and returns what the operation was
applied to (or None): ``square_of(x.pow(2))``, ``square_of(x ** 2)``, ``square_of(x * x)`` and
``square_of(x.square())`` all return ``x``.
"""

from __future__ import annotations

from typing import Callable

from .match import (
    Ctx,
    Expr,
    call,
    const_value,
    follow,
    is_const,
    pattern,
    peek,
    same,
    scalar_like,
    terms,
    uncast,
)

SILU_CALLS = frozenset({"silu", "swish"})
GELU_CALLS = frozenset({"gelu", "gelu_new", "gelu_pytorch_tanh"})  # not QuickGELU: another function
ACTIVATION_MODULES = {"silu": frozenset({"SiLU"}), "gelu": frozenset({"GELU"})}
ACTIVATION_CALLS = {"silu": SILU_CALLS, "gelu": GELU_CALLS}


@pattern
def square_of(ctx: Ctx, e: Expr) -> Expr | None:
    x = call(ctx, e, "pow", "square", "mul")
    if x is None:
        return None
    if x.op == "square" and len(x.args) == 1:
        return x.args[0]
    if x.op == "pow" and len(x.args) == 2 and is_const(x.args[1], 2.0):
        return x.args[0]
    if x.op == "mul" and len(x.args) == 2 and same(x.args[0], x.args[1]):
        return x.args[0]
    return None


@pattern
def sqrt_of(ctx: Ctx, e: Expr) -> Expr | None:
    if const_value(e) is not None:  # math.sqrt(2.0): a constant, not a tensor op
        return None
    x = call(ctx, e, "sqrt", "pow")
    if x is None or not x.args:
        return None
    if x.op == "sqrt" or (len(x.args) == 2 and is_const(x.args[1], 0.5)):
        return x.args[0]
    return None


@pattern
def rsqrt_of(ctx: Ctx, e: Expr) -> Expr | None:
    """rsqrt(a), a ** -0.5, 1 / sqrt(a), sqrt(a).reciprocal()."""
    x = call(ctx, e, "rsqrt", "pow", "div", "reciprocal")
    if x is None or not x.args:
        return None
    if x.op == "rsqrt":
        return x.args[0]
    if x.op == "pow" and len(x.args) == 2 and is_const(x.args[1], -0.5):
        return x.args[0]
    if x.op == "div" and len(x.args) == 2 and is_const(x.args[0], 1.0):
        return sqrt_of(ctx, x.args[1])
    if x.op == "reciprocal":
        return sqrt_of(ctx, x.args[0])
    return None


@pattern
def plus_eps(ctx: Ctx, e: Expr) -> tuple[Expr, bool] | None:
    """``a + eps`` (or clamp(a, min=eps)) -> (a, True); anything else -> (e, False)."""
    clamped = call(ctx, e, "clamp", "clamp_min")
    if clamped is not None and clamped.args:
        return clamped.args[0], True
    parts = terms(ctx, e)
    if len(parts) == 2 and all(sign == 1 for _, sign in parts):
        (a, _), (b, _) = parts
        if scalar_like(b) and not scalar_like(a):
            return a, True
        if scalar_like(a) and not scalar_like(b):
            return b, True
    if len(parts) == 1:
        return e, False
    return None


@pattern
def reduce_of(ctx: Ctx, e: Expr, *ops: str) -> Expr | None:
    """A reduction over explicit dimension(s): mean(x, -1, keepdim=True) -> the call."""
    x = call(ctx, e, *ops)
    if x is None or not x.args or x.arg(1, "dim") is None and x.arg(1, "axis") is None:
        return None
    return x


def mean_of(ctx: Ctx, e: Expr) -> Expr | None:
    x = reduce_of(ctx, e, "mean")
    return x.args[0] if x is not None else None


@pattern
def sigmoid_of(ctx: Ctx, e: Expr) -> Expr | None:
    x = call(ctx, e, "sigmoid")
    return x.args[0] if x is not None and x.args else None


@pattern
def centred_of(ctx: Ctx, e: Expr) -> Expr | None:
    """``x - x.mean(dim)`` -> x."""
    x = call(ctx, e, "sub")
    if x is None:
        return None
    m = mean_of(ctx, x.args[1])
    return x.args[0] if m is not None and same(m, x.args[0]) else None


@pattern
def activation_of(ctx: Ctx, e: Expr, kind: str) -> Expr | None:
    """``e`` applies the activation ``kind`` ('silu' or 'gelu') to something: return it.

    Recognises library calls (F.silu, torch.nn.functional.gelu), submodules assigned in __init__
    (self.act = nn.SiLU()), and helper functions of the scanned code whose body computes it.
    """
    x = follow(ctx, e)
    if x.kind != "call" or not x.args:
        return None
    helper = ctx.index.resolve(ctx.file, x)
    if helper is not None:
        if ctx.index.helper_kind(helper) != kind:
            return None
        ctx.core.append(x)
        ctx.helpers.append(helper)
        return x.args[0]
    if x.op.startswith("self."):
        cls = x.stmt.scope.class_name
        value = ctx.file.module_attrs.get((cls, x.op[5:])) if cls else None
        built = peek(value) if value is not None else None
        if built is not None and built.kind == "call" and built.op in ACTIVATION_MODULES[kind]:
            ctx.core.append(x)
            return x.args[0]
        return None
    if not x.method and x.op in ACTIVATION_CALLS[kind]:
        ctx.core.append(x)
        return x.args[0]
    return None


@pattern
def halves_of(ctx: Ctx, first: Expr, second: Expr) -> Expr | None:
    """``first``/``second`` are the two halves of one tensor along its last dimension.

    x[..., :h] and x[..., h:], or items 0 and 1 of x.chunk(2, dim=-1) / x.split(h, -1).
    """
    a, b = follow(ctx, first), follow(ctx, second)
    if a.kind == "subscript" and b.kind == "subscript" and a.value and b.value:
        sa, sb = a.value[-1], b.value[-1]
        if sa[0] == sb[0] == "slice" and same(a.args[0], b.args[0]):
            (_, lo_a, hi_a, st_a), (_, lo_b, hi_b, st_b) = sa, sb
            if st_a is None and st_b is None and lo_a is None and hi_b is None and hi_a and lo_b and same(hi_a, lo_b):
                ctx.core += [a, b]
                return a.args[0]
        return None
    if a.kind == "item" and b.kind == "item" and (a.value, b.value) == (0, 1):
        container = uncast(ctx, a.args[0])
        if container is uncast(ctx, b.args[0]) and container.kind == "call":
            if container.op in ("chunk", "split", "tensor_split", "unbind"):
                ctx.core.append(container)
                return container.args[0] if container.args else None
    return None


@pattern
def rotate_half_inline(ctx: Ctx, e: Expr) -> Expr | None:
    """``torch.cat((-x2, x1), dim=-1)`` where x1, x2 are the halves of x -> x."""
    cat = call(ctx, e, "cat", "concat", "concatenate")
    if cat is None or not cat.args:
        return None
    parts = follow(ctx, cat.args[0])
    if parts.kind != "tuple" or len(parts.args) != 2:
        return None
    neg = call(ctx, parts.args[0], "neg")
    if neg is None:
        return None
    return halves_of(ctx, parts.args[1], neg.args[0])



# --- products ------------------------------------------------------------------------------------
Factors = list[tuple[Expr, int]]


def others(fs: Factors, skip: set[int]) -> Factors:
    """The factors but those at the ``skip`` positions."""
    return [f for i, f in enumerate(fs) if i not in skip]


def const_product(fs: Factors) -> float | None:
    """The product of constant factors, or None when one is not a (non-zero) constant."""
    value = 1.0
    for f, p in fs:
        v = const_value(f)
        if v is None or v == 0:
            return None
        value *= v**p
    return value


def tensor_factors(fs: Factors) -> Factors:
    """The factors that are not constants."""
    return [(f, p) for f, p in fs if const_value(f) is None]


def consume(ctx: Ctx, e: Expr) -> None:
    """Record every operation written inside ``e`` (the rest of a matched formula)."""
    ctx.core += [x for x in e.walk() if x.kind == "call"]


def mentions(e: Expr, test: Callable[[Expr], bool], depth: int = 12) -> bool:
    """Some sub-expression of ``e`` (through names) passes ``test``."""
    x = peek(e)
    if test(x):
        return True
    return depth > 0 and any(mentions(a, test, depth - 1) for a in (*x.args, *x.kwargs.values()))


def const_product_is(fs: Factors, tensors: Factors, value: float) -> bool:
    """The constant factors of ``fs`` (all but ``tensors``) multiply to ``value``."""
    product = const_product([f for f in fs if f not in tensors])
    return product is not None and abs(product - value) < 1e-3 * abs(value)
