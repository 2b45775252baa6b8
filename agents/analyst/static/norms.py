"""Static patterns: normalisations written out (RMSNorm, LayerNorm, L2 normalisation)."""

from __future__ import annotations

from .forms import (
    Factors,
    centred_of,
    mean_of,
    others,
    plus_eps,
    reduce_of,
    rsqrt_of,
    sqrt_of,
    square_of,
    tensor_factors,
)
from .match import (
    Ctx,
    Expr,
    Found,
    call,
    factors,
    peek,
    is_const,
    is_false,
    pattern,
    same,
    terms,
)


@pattern
def _rms_at(ctx: Ctx, fs: Factors, i: int) -> Found | None:
    """Factor ``i`` is rsqrt(mean(x^2) + eps) (or divides by its sqrt) and another factor is x."""
    f, power = fs[i]
    inner = rsqrt_of(ctx, f) if power == 1 else sqrt_of(ctx, f)
    eps = plus_eps(ctx, inner) if inner is not None else None
    squared = mean_of(ctx, eps[0]) if eps is not None else None
    x = square_of(ctx, squared) if squared is not None else None
    if x is None:
        return None
    rest = others(fs, {i})
    hits = [j for j, (g, p) in enumerate(rest) if p == 1 and same(g, x)]
    if not hits:
        return None
    weighted = len(tensor_factors(others(rest, {hits[0]}))) > 0
    form = "x * rsqrt(mean(x^2) + eps)" if power == 1 else "x / sqrt(mean(x^2) + eps)"
    note = f"RMSNorm written out: {form}" + (" * weight" if weighted else "") + ("" if eps[1] else " (no eps)")
    return Found(0.6 if weighted else 0.55, note)


@pattern
def _normalize_scaled(ctx: Ctx, fs: Factors) -> Found | None:
    """F.normalize(x, dim=-1) * sqrt(d) [* g]: x / ||x|| * sqrt(d) is x / rms(x)."""
    for i, (f, p) in enumerate(fs):
        unit = call(ctx, f, "normalize") if p == 1 else None
        if unit is None or unit.method:
            continue
        order = unit.arg(1, "p")
        if order is not None and not is_const(order, 2.0):
            return None
        dim = unit.arg(2, "dim")
        if dim is not None and not is_const(dim, -1.0):
            return None
        rest = others(fs, {i})
        root_d = [j for j, (g, q) in enumerate(rest) if q == 1 and _square_root(ctx, g)]
        if not root_d:
            return None
        weighted = len(tensor_factors(others(rest, {root_d[0]}))) > 0
        return Found(0.5, "RMSNorm written as F.normalize(x, dim=-1) * sqrt(d)" + (" * weight" if weighted else ""))
    return None


@pattern
def _square_root(ctx: Ctx, e: Expr) -> bool:
    """sqrt(d), d ** 0.5, math.sqrt(d), or a name such as self.scale / sqrt_d (a precomputed sqrt(d)).

    A bare number is not enough: F.normalize(x) * 2.0 is a scaled L2 normalisation, not an RMSNorm.
    """
    return sqrt_of(ctx, e) is not None or _written_sqrt(e)


def _written_sqrt(e: Expr) -> bool:
    x = peek(e)
    if x.kind == "call" and x.op in ("sqrt", "pow"):
        return x.op == "sqrt" or (len(x.args) == 2 and is_const(x.args[1], 0.5))
    return x.kind in ("name", "attr") and any(w in x.op.lower() for w in ("sqrt", "scale"))


@pattern
def rmsnorm(ctx: Ctx, e: Expr) -> Found | None:
    fs = factors(ctx, e)
    if len(fs) < 2:
        return None
    for i in range(len(fs)):
        found = _rms_at(ctx, fs, i)
        if found:
            return found
    return _normalize_scaled(ctx, fs)


@pattern
def _variance_of(ctx: Ctx, v: Expr, x: Expr) -> str | None:
    """``v`` is the variance of ``x`` over a dimension: 'biased' or 'unbiased'."""
    var = reduce_of(ctx, v, "var")
    if var is not None:
        if not same(var.args[0], x):
            return None
        biased = is_false(var.kwargs.get("unbiased")) or is_false(var.kwargs.get("correction"))
        return "biased" if biased else "unbiased"
    squared = mean_of(ctx, v)
    centred = square_of(ctx, squared) if squared is not None else None
    return "biased" if centred is not None and same(centred_of(ctx, centred), x) else None


@pattern
def _std_of(ctx: Ctx, s: Expr, x: Expr) -> str | None:
    """``s`` is ``x.std(dim) + eps`` (or the std alone): a LayerNorm whose eps is added to the std."""
    eps = plus_eps(ctx, s)
    std = reduce_of(ctx, eps[0], "std") if eps is not None else None
    return "std" if std is not None and same(std.args[0], x) else None


@pattern
def _layernorm_product(ctx: Ctx, e: Expr, bias: bool = False) -> Found | None:
    fs = factors(ctx, e)
    for i, (c, p) in enumerate(fs):
        x = centred_of(ctx, c) if p == 1 else None
        if x is None:
            continue
        for j, (s, q) in enumerate(fs):
            if j == i:
                continue
            inner = sqrt_of(ctx, s) if q == -1 else rsqrt_of(ctx, s)
            eps = plus_eps(ctx, inner) if inner is not None else None
            kind = _variance_of(ctx, eps[0], x) if eps is not None else None
            if kind is None and q == -1:
                kind = _std_of(ctx, s, x)
            if kind is None:
                continue
            weighted = len(tensor_factors(others(fs, {i, j}))) > 0
            note = "LayerNorm written out: (x - mean) / sqrt(var + eps)" + (" * weight" if weighted else "")
            note += " + bias" if bias else ""
            if kind == "unbiased":
                return Found(0.4, note + "; uses the unbiased variance, which F.layer_norm does not")
            if kind == "std":
                return Found(0.4, note.replace("sqrt(var + eps)", "(std + eps)") + "; the (unbiased) std plus eps "
                              "is close to, not exactly, F.layer_norm's sqrt(var + eps)")
            return Found(0.6, note)
        return None
    return None


@pattern
def layernorm(ctx: Ctx, e: Expr) -> Found | None:
    parts = terms(ctx, e)
    if len(parts) == 1:
        return _layernorm_product(ctx, e)
    if len(parts) == 2 and all(sign == 1 for _, sign in parts):
        for (product, _), (bias, _) in (parts, parts[::-1]):
            found = _layernorm_product(ctx, product, bias=True)
            if found:
                return found
    return None


@pattern
def normalize(ctx: Ctx, e: Expr) -> Found | None:
    """``x / x.norm(dim=-1, keepdim=True)`` (optionally clamped or + eps); a whole-tensor norm
    (``X / X.norm()``, ``X.norm(dim=(-2, -1))``: Newton-Schulz's scaling) is not a row normalisation
    and is not reported."""
    div = call(ctx, e, "div")
    if div is None:
        return None
    denominator = plus_eps(ctx, div.args[1])
    if denominator is None:
        return None
    norm = call(ctx, denominator[0], "norm", "vector_norm")
    dim = norm.arg(2, "dim") if norm is not None else None
    if dim is not None and peek(dim).kind != "tuple" and same(norm.args[0], div.args[0]):
        order = norm.arg(1, "p") if norm.op == "norm" else norm.arg(1, "ord")
        if order is None or is_const(order, 2.0):
            return Found(0.45, "L2 normalisation written out: x / x.norm(dim, keepdim=True)")
    return None
