"""Static pattern: rotary embedding written as a 2x2 rotation of the two halves.

    x1, x2 = x.chunk(2, dim=-1)            # or x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos            # or x2 * cos - x1 * sin, terms in any order
    return torch.cat([y1, y2], -1)         # or torch.stack(...)

``y = [[a, b], [c, d]] @ [x1, x2]`` is a rotation when ``d`` is ``a`` and ``c`` is ``-b``, with the
two output halves in either order (the same permutation of q and k leaves q.k unchanged): the
rotate-half convention of ``npu_rotary_mul(x, cos, sin, 'half')`` up to the sign of the angle.
Interleaved halves (``x[..., ::2]``, ``x[..., 1::2]``) joined by ``torch.stack`` are the pairwise
convention ('interleave'), as are the two entries of a trailing pair axis (``xs = x.reshape(...,
-1, 2)``; ``xs[..., 0]``, ``xs[..., 1]``), whatever the coefficients are indexed the same way.
"""

from __future__ import annotations

from .forms import const_product, halves_of, tensor_factors
from .match import Ctx, Expr, Found, call, factors, follow, is_const, pattern, same, terms


@pattern
def _pair_of(ctx: Ctx, first: Expr, second: Expr) -> Expr | None:
    """The two halves of one tensor: contiguous (x[..., :d], x[..., d:], chunk) or interleaved (x[..., ::2], x[..., 1::2])."""
    whole = halves_of(ctx, first, second)
    if whole is not None:
        return whole
    a, b = follow(ctx, first), follow(ctx, second)
    if a.kind != "subscript" or b.kind != "subscript" or not a.value or not b.value or not same(a.args[0], b.args[0]):
        return None
    if a.value[-1][0] == b.value[-1][0] == "index":  # x[..., 0], x[..., 1]: the pairs of a (..., d/2, 2) view
        if len(a.value) == len(b.value) and is_const(a.value[-1][1], 0.0) and is_const(b.value[-1][1], 1.0):
            ctx.core += [a, b]
            return a.args[0]
        return None
    if a.value[-1][0] != "slice" or b.value[-1][0] != "slice":
        return None
    (_, lo_a, hi_a, st_a), (_, lo_b, hi_b, st_b) = a.value[-1], b.value[-1]
    if hi_a is not None or hi_b is not None:
        return None
    if st_a is None or st_b is None or not (is_const(st_a, 2.0) and is_const(st_b, 2.0)):
        return None
    if (lo_a is None or is_const(lo_a, 0.0)) and lo_b is not None and is_const(lo_b, 1.0):
        ctx.core += [a, b]
        return a.args[0]
    return None


@pattern
def _linear_in_halves(ctx: Ctx, e: Expr) -> list[tuple[Expr, Expr, int]] | None:
    """``e`` = h1 * c1 + h2 * c2 (signs allowed): [(factor, factor, sign)] per term, or None."""
    parts = terms(ctx, e)
    if len(parts) != 2:
        return None
    out = []
    for term, sign in parts:
        fs = factors(ctx, term)
        tensors = tensor_factors(fs)
        if len(tensors) != 2 or any(p != 1 for _, p in tensors):
            return None
        scale = const_product([f for f in fs if f not in tensors])
        if scale is None or abs(abs(scale) - 1.0) > 1e-9:
            return None
        out.append((tensors[0][0], tensors[1][0], sign * (1 if scale > 0 else -1)))
    return out


def _split(ctx: Ctx, rows: list[list[tuple[Expr, Expr, int]]]) -> bool:
    """Some choice of the half factor in each term makes both rows use the same two halves."""
    (a0, a1, _), (b0, b1, _) = rows[0]
    for h1, c1 in ((a0, a1), (a1, a0)):
        for h2, c2 in ((b0, b1), (b1, b0)):
            for first, second in ((h1, h2), (h2, h1)):
                mark = ctx.mark()
                if _pair_of(ctx, first, second) is None:
                    ctx.rollback(mark)
                    continue
                table = {}
                ok = True
                for row in rows:
                    entry = {}
                    for f0, f1, sign in row:
                        if same(f0, first) or same(f0, second):
                            half, coeff = f0, f1
                        elif same(f1, first) or same(f1, second):
                            half, coeff = f1, f0
                        else:
                            ok = False
                            break
                        entry["first" if same(half, first) else "second"] = (coeff, sign)
                    if not ok or len(entry) != 2:
                        ok = False
                        break
                    table[len(table)] = entry
                if ok and (_rotation(table[0], table[1]) or _rotation(table[1], table[0])):
                    return True
                ctx.rollback(mark)
    return False


def _rotation(r1: dict, r2: dict) -> bool:
    (a, sa), (b, sb) = r1["first"], r1["second"]
    (c, sc), (d, sd) = r2["first"], r2["second"]
    return same(a, d) and sa == sd and same(b, c) and sb == -sc


@pattern
def rope_rotation(ctx: Ctx, e: Expr) -> Found | None:
    joined = call(ctx, e, "cat", "concat", "concatenate", "stack")
    if joined is None or not joined.args:
        return None
    parts = follow(ctx, joined.args[0])
    if parts.kind != "tuple" or len(parts.args) != 2:
        return None
    rows = [_linear_in_halves(ctx, p) for p in parts.args]
    if any(r is None for r in rows) or not _split(ctx, rows):
        return None
    how = "interleaved (stack)" if joined.op == "stack" else "rotate-half (cat)"
    return Found(0.55, f"rotary embedding written out as a rotation of the two halves, {how}: "
                       "cat(x1*cos + x2*sin, x2*cos - x1*sin)")
