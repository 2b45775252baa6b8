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
    str_arg,
    terms,
    uncast,
)

SILU_CALLS = frozenset({"silu", "swish"})
GELU_CALLS = frozenset({"gelu", "gelu_new", "gelu_pytorch_tanh"})  # not QuickGELU: another function
ACTIVATION_MODULES = {"silu": frozenset({"SiLU"}), "gelu": frozenset({"GELU"})}
ACTIVATION_CALLS = {"silu": SILU_CALLS, "gelu": GELU_CALLS}
CONFIGURED_ACTIVATIONS = frozenset({"ACT2FN"})  # transformers' table of activations by name (config.hidden_act)
CONFIGURED_NOTE = "chosen by configuration (ACT2FN[...])"  # a finding's note: which activation ran decides its kind


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
        if ctx.configured_activations and built is not None and _configured(built):
            ctx.core.append(x)
            ctx.configured.append(x)
            return x.args[0]
        return None
    if not x.method and x.op in ACTIVATION_CALLS[kind]:
        ctx.core.append(x)
        return x.args[0]
    return None


def _configured(built: Expr) -> bool:
    """`ACT2FN[config.hidden_act]`: an activation looked up by name in a library's table."""
    return built.kind == "subscript" and bool(built.args) and built.args[0].kind == "name" \
        and built.args[0].op in CONFIGURED_ACTIVATIONS


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
            if container.op == "unbind" and container.args:
                ctx.core.append(container)
                return _split_in_two(ctx, container.args[0], container.arg(1, "dim")) or container.args[0]
            if container.op in ("chunk", "split", "tensor_split"):
                ctx.core.append(container)
                return container.args[0] if container.args else None
    return None


@pattern
def _split_in_two(ctx: Ctx, e: Expr, dim: Expr | None) -> Expr | None:
    """The tensor whose last dimension ``e`` splits into (2, d), unbound along that 2: the two halves.

    ``rearrange(x, '... (j d) -> ... j d', j=2)`` then ``.unbind(dim=-2)``, or
    ``x.unflatten(-1, (2, -1)).unbind(-2)``.
    """
    if dim is None or not is_const(dim, -2.0):
        return None
    x = follow(ctx, e)
    if x.kind != "call" or not x.args:
        return None
    if x.op == "rearrange":
        spec = str_arg(x, 1)
        if spec is None or "->" not in spec:
            return None
        left, right = (side.split() for side in spec.replace("(", " ( ").replace(")", " ) ").split("->"))
        if len(left) < 4 or left[-4:-2] != ["(", left[-3]] or left[-1] != ")" or right[-2:] != left[-3:-1]:
            return None
        two = x.kwargs.get(left[-3])
        if two is None or not is_const(two, 2.0):
            return None
        ctx.core.append(x)
        return x.args[0]
    if x.op == "unflatten" and len(x.args) >= 3 and is_const(x.args[1], -1.0):
        shape = peek(x.args[2])
        if shape.kind == "tuple" and len(shape.args) == 2 and is_const(shape.args[0], 2.0):
            ctx.core.append(x)
            return x.args[0]
    return None


@pattern
def _pairs_of(ctx: Ctx, first: Expr, second: Expr) -> Expr | None:
    """``first``/``second`` are the even and odd entries of one tensor's last dimension: x[..., ::2], x[..., 1::2]."""
    a, b = follow(ctx, first), follow(ctx, second)
    if a.kind != "subscript" or b.kind != "subscript" or not a.value or not b.value or not same(a.args[0], b.args[0]):
        return None
    if a.value[-1][0] != "slice" or b.value[-1][0] != "slice":
        return None
    (_, lo_a, hi_a, st_a), (_, lo_b, hi_b, st_b) = a.value[-1], b.value[-1]
    if hi_a is not None or hi_b is not None or st_a is None or st_b is None:
        return None
    if not (is_const(st_a, 2.0) and is_const(st_b, 2.0) and (lo_a is None or is_const(lo_a, 0.0))):
        return None
    if lo_b is None or not is_const(lo_b, 1.0):
        return None
    ctx.core += [a, b]
    return a.args[0]


@pattern
def rotate_every_two(ctx: Ctx, e: Expr) -> Expr | None:
    """``torch.stack((-x2, x1), dim=-1).flatten(-2)`` with x1, x2 the even and odd entries of x -> x (GPT-J style)."""
    flat = call(ctx, e, "flatten", "reshape", "view")
    if flat is None or not flat.args:
        return None
    stacked = call(ctx, flat.args[0], "stack")
    dim = stacked.arg(1, "dim") if stacked is not None and stacked.args else None
    if dim is None or not is_const(dim, -1.0):
        return None
    parts = follow(ctx, stacked.args[0])
    if parts.kind != "tuple" or len(parts.args) != 2:
        return None
    neg = call(ctx, parts.args[0], "neg")
    return _pairs_of(ctx, parts.args[1], neg.args[0]) if neg is not None else None


@pattern
def rotate_half_inline(ctx: Ctx, e: Expr) -> Expr | None:
    """``torch.cat((-x2, x1), dim=-1)`` where x1, x2 are the halves of x -> x; or its interleaved form
    ``torch.stack((-x2, x1), dim=-1).flatten(-2)`` over the even and odd entries."""
    every_two = rotate_every_two(ctx, e)
    if every_two is not None:
        return every_two
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
