"""Static patterns: activations written out (SiLU, GELU, QuickGELU), gated forms, rotary embeddings."""

from __future__ import annotations

from .forms import (
    CONFIGURED_NOTE,
    activation_of,
    const_product,
    const_product_is,
    consume,
    mentions,
    rotate_half_inline,
    sigmoid_of,
    tensor_factors,
)
from .match import (
    Ctx,
    Expr,
    Found,
    Helper,
    call,
    const_value,
    peek,
    factors,
    follow,
    is_const,
    pattern,
    same,
    terms,
    uncast,
)


@pattern
def _swish_argument(ctx: Ctx, inner: Expr, x: Expr) -> bool:
    """``inner`` is ``beta * x`` with ``beta`` a name or an attribute (Swish, SiLU at beta = 1).

    A constant beta is left out: ``x * sigmoid(1.702 * x)`` is QuickGELU, another function.
    """
    fs = factors(ctx, inner)
    if len(fs) != 2 or any(p != 1 for _, p in fs):
        return False
    for (b, _), (y, _) in (fs, fs[::-1]):
        if same(y, x) and peek(b).kind in ("name", "attr") and const_value(b) is None and not same(b, x):
            return True
    return False


@pattern
def silu_form(ctx: Ctx, e: Expr) -> Expr | None:
    """x * sigmoid(x), x * sigmoid(beta * x) (Swish) or x / (1 + exp(-x)) -> x."""
    fs = factors(ctx, e)
    tensors = tensor_factors(fs)
    if len(tensors) == 2 and len(fs) == 2 and all(p == 1 for _, p in fs):
        for (a, _), (b, _) in (tensors, tensors[::-1]):
            inner = sigmoid_of(ctx, b)
            if inner is not None and (same(inner, a) or _swish_argument(ctx, inner, a)):
                return a
    if len(fs) == 2 and fs[0][1] == 1 and fs[1][1] == -1:
        parts = terms(ctx, fs[1][0])
        if len(parts) == 2 and is_const(parts[0][0], 1.0):
            exp = call(ctx, parts[1][0], "exp")
            neg = call(ctx, exp.args[0], "neg") if exp is not None else None
            if neg is not None and same(neg.args[0], fs[0][0]):
                return fs[0][0]
    return None


@pattern
def _quick_gelu(ctx: Ctx, x: Expr, bracket: Expr) -> Expr | None:
    inner = sigmoid_of(ctx, bracket)
    if inner is None:
        return None
    scaled = factors(ctx, inner)
    rest = tensor_factors(scaled)
    if len(rest) == 1 and same(rest[0][0], x) and const_product_is(scaled, rest, 1.702):
        return x
    return None


@pattern
def _one(ctx: Ctx, e: Expr, x: Expr) -> bool:
    """The constant 1, or ``torch.ones_like(x)`` (with casts around it)."""
    if is_const(e, 1.0):
        return True
    ones = call(ctx, uncast(ctx, e), "ones_like")
    return ones is not None and same(ones.args[0], x)


@pattern
def _gelu_bracket(ctx: Ctx, x: Expr, bracket: Expr) -> str | None:
    """(1 + tanh(...x...0.044715...)) or (1 + erf(x / sqrt(2)))."""
    parts = terms(ctx, bracket)
    if len(parts) != 2 or not all(sign == 1 for _, sign in parts):
        return None
    for (one, _), (fn, _) in (parts, parts[::-1]):
        f = call(ctx, uncast(ctx, fn), "tanh", "erf") if _one(ctx, one, x) else None
        if f is None or not f.args:
            continue
        z = f.args[0]
        if f.op == "tanh" and mentions(z, lambda n: is_const(n, 0.044715)) and mentions(z, lambda n: same(n, x)):
            consume(ctx, z)
            return "GELU written out, tanh approximation (F.gelu(x, approximate='tanh'))"
        if f.op == "erf":
            zf = factors(ctx, z)
            rest = tensor_factors(zf)
            if len(rest) == 1 and same(rest[0][0], x) and const_product_is(zf, rest, 2**-0.5):
                return "GELU written out, erf form (F.gelu(x))"
    return None


@pattern
def gelu_shape(ctx: Ctx, e: Expr) -> tuple[Expr, str] | None:
    """0.5 * x * (1 + tanh(...)), 0.5 * x * (1 + erf(x / sqrt(2))), x * sigmoid(1.702 x) -> (x, what)."""
    fs = factors(ctx, e)
    tensors = tensor_factors(fs)
    if len(tensors) != 2 or any(p != 1 for _, p in tensors):
        return None
    consts = [f for f in fs if f not in tensors]
    half = const_product(consts)
    for (x, _), (bracket, _) in (tensors, tensors[::-1]):
        if not consts and _quick_gelu(ctx, x, bracket) is not None:
            return x, "QuickGELU x * sigmoid(1.702 x) (npu_fast_gelu computes exactly this; F.gelu does not)"
        if half is not None and abs(half - 0.5) < 1e-6:
            how = _gelu_bracket(ctx, x, bracket)
            if how:
                return x, how
    return None


@pattern
def gelu(ctx: Ctx, e: Expr) -> Found | None:
    shape = gelu_shape(ctx, e)
    if shape is None:
        return None
    return Found(0.4 if shape[1].startswith("QuickGELU") else 0.5, shape[1])


@pattern
def silu(ctx: Ctx, e: Expr) -> Found | None:
    return Found(0.5, "SiLU written out: x * sigmoid(x)") if silu_form(ctx, e) is not None else None


@pattern
def _gated(ctx: Ctx, e: Expr, kind: str) -> Found | None:
    """activation(a) * b, with the activation a call, a submodule or a helper; or a * sigmoid(a) * b."""
    fs = factors(ctx, e)
    tensors = tensor_factors(fs)
    if len(tensors) < 2 or any(p != 1 for _, p in fs):
        return None
    for i, (f, _) in enumerate(tensors):
        gate = activation_of(ctx, f, kind)
        if gate is not None:
            name = {"silu": "SiLU", "gelu": "GELU"}[kind]
            if ctx.configured:
                return Found(0.5, f"gated activation written out: act(gate) * up, act {CONFIGURED_NOTE}; {name} where "
                                  f"{kind} ran")
            return Found(0.55, f"gated {name} written out: {kind}(gate) * up")
    if kind == "silu" and len(tensors) >= 3:
        for i, (s, _) in enumerate(tensors):
            inner = sigmoid_of(ctx, s)
            if inner is not None and any(same(g, inner) for j, (g, _) in enumerate(tensors) if j != i):
                return Found(0.5, "gated SiLU written out: a * sigmoid(a) * b")
    return None


@pattern
def swiglu(ctx: Ctx, e: Expr) -> Found | None:
    return _gated(ctx, e, "silu")


@pattern
def geglu(ctx: Ctx, e: Expr) -> Found | None:
    return _gated(ctx, e, "gelu")


# --- rotary ------------------------------------------------------------------------------------
@pattern
def rotate_half_of(ctx: Ctx, e: Expr) -> Expr | None:
    """A call of rotate_half (by name, or a helper whose body is the cat((-x2, x1)) form), or the form inline."""
    x = follow(ctx, e)
    if x.kind == "call" and x.args:
        helper = ctx.index.resolve(ctx.file, x)
        if helper is not None and ctx.index.helper_kind(helper) in ("rotate_half", "rotate_every_two"):
            ctx.core.append(x)
            ctx.helpers.append(helper)
            return x.args[0]
        if helper is None and not x.method and x.op == "rotate_half":
            ctx.core.append(x)
            return x.args[0]
        static = _static_method(ctx, x)
        if static is not None and ctx.index.helper_kind(static) in ("rotate_half", "rotate_every_two"):
            ctx.core.append(x)
            ctx.helpers.append(static)
            return x.args[1]
    return rotate_half_inline(ctx, e)


def _static_method(ctx: Ctx, x: Expr) -> Helper | None:
    """``Class._rotate_half(t)``: a static method of a class defined in the same file."""
    if not x.method or len(x.args) != 2:
        return None
    receiver = peek(x.args[0])
    if receiver.kind != "name" or receiver.binding is not None:
        return None
    scope = ctx.file.methods.get((receiver.op, x.op))
    return Helper(ctx.file, scope) if scope is not None else None


@pattern
def _rope_terms(ctx: Ctx, rotated: Expr, plain: Expr) -> bool:
    rf = factors(ctx, rotated)
    for i, (r, p) in enumerate(rf):
        x = rotate_half_of(ctx, r) if p == 1 else None
        if x is None:
            continue
        pf = factors(ctx, plain)
        if len(tensor_factors(rf)) == 2 and len(tensor_factors(pf)) == 2:
            return any(p == 1 and same(g, x) for g, p in pf)
        return False
    return False


@pattern
def rope(ctx: Ctx, e: Expr) -> Found | None:
    """q * cos + rotate_half(q) * sin (any order), or view_as_real(view_as_complex(q) * freqs)."""
    parts = terms(ctx, e)
    if len(parts) == 2 and parts[0][1] == 1:
        for (a, _), (b, _) in (parts, parts[::-1]):
            if _rope_terms(ctx, b, a):
                if any(ctx.index.helper_kind(h) == "rotate_every_two" for h in ctx.helpers):
                    return Found(0.55, "rotary embedding written out, interleaved pairs: x * cos + rotate_every_two(x) * sin "
                                       "(npu_rotary_mul mode 'interleave')")
                return Found(0.55, "rotary embedding written out: x * cos + rotate_half(x) * sin")
    real = call(ctx, e, "view_as_real")
    if real is not None and real.args:
        for f, p in factors(ctx, real.args[0]):
            if p == 1 and call(ctx, f, "view_as_complex") is not None:
                return Found(0.5, "rotary embedding in complex form (interleaved pairs): view_as_real(view_as_complex(x) * freqs)")
    return None
