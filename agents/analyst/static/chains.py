"""Static patterns: elementwise chains that Inductor fuses into one kernel and eager runs op by op.

Reported only for targets listing the ``elementwise_chain`` gain (targets.GAINS):

- ReLU²: ``F.relu(x).square()``, ``torch.relu(x) ** 2``, ``F.relu(x) * F.relu(x)``;
- soft-capping: ``c * tanh(x / c)``, ``tanh(x / t) * t``, ``c * sigmoid(x / s)``, with scalar
  (constant, name or attribute) caps;
- blends: ``a * x + b * y`` where each product has a coefficient (a constant, ``self.w``,
  ``self.lambdas[i]``, ``1 - self.lamb``) and a tensor (a call result, a function parameter);
  scalar arithmetic (``(1 - frac) * 0.85 + frac * 0.95`` with ``frac = min(...)``, a weighted sum of
  losses, a product of sizes) is not a chain;
- scale-and-shift: ``x * (1 + scale) + shift``;
- matrix blends: ``a * X + B @ X``, ``b * A + c * A @ A``, ``a * X + b * B + c * A @ B`` (a Newton-Schulz step of a
  Muon optimizer): scalings and adds around a matmul, which ``torch.addmm`` / ``baddbmm`` fold into the matmul.
"""

from __future__ import annotations

import re

from .forms import square_of
from .match import Ctx, Expr, Found, call, const_value, factors, pattern, peek, same, terms

_SCALAR_BUILTINS = frozenset({"min", "max", "len", "int", "float", "round", "abs", "sum"})  # called as functions
_SCALAR_METHODS = frozenset({"size", "numel", "item", "dim"})  # tensor methods that return Python numbers
_LOSS = re.compile(r"loss|criterion|cross_entropy", re.IGNORECASE)


def _is_param(e: Expr) -> bool:
    x = peek(e)
    return x.kind == "name" and x.binding is None and x.op in x.stmt.scope.tensor_params


def coefficient(e: Expr, depth: int = 0) -> bool:
    """A scalar-like factor: a constant, a non-parameter name, self.w, self.w[i], 1 - self.w, self.w.to(dtype)."""
    x = peek(e)
    if const_value(x) is not None or x.kind == "const":
        return True
    if x.kind == "name":
        return not _is_param(x)
    if x.kind == "attr":
        return peek(x.args[0]).kind == "name" and not _is_param(x.args[0])
    if x.kind == "subscript":
        simple = all(spec[0] == "index" for spec in x.value)
        return simple and peek(x.args[0]).kind == "attr" and coefficient(x.args[0], depth + 1)
    if x.kind == "call" and depth < 4:
        if (x.op in _SCALAR_BUILTINS and not x.method and x.callee == x.op) or (x.method and x.op in _SCALAR_METHODS):
            return True
        if _LOSS.search(x.op):  # criterion(out, y), F.mse_loss(...): a loss value, weighted into a total loss
            return True
        if x.op in ("add", "sub", "mul", "div", "neg"):
            return all(coefficient(a, depth + 1) for a in x.args)
        if x.method and x.op in ("to", "type_as", "float", "bfloat16", "half"):
            return coefficient(x.args[0], depth + 1)
    return False


def tensor_like(e: Expr) -> bool:
    """A tensor operand: a function parameter, or the result of a call that is not scalar arithmetic."""
    x = peek(e)
    if _is_param(x):
        return True
    if x.kind == "subscript":
        return tensor_like(x.args[0]) or any(spec[0] == "slice" for spec in x.value)
    if x.kind == "item":  # q, k, v = qkv.chunk(3): an item of a tensor op's result
        return tensor_like(x.args[0])
    return x.kind == "call" and not coefficient(x)


@pattern
def relu_squared(ctx: Ctx, e: Expr) -> Found | None:
    x = square_of(ctx, e)
    if x is None or call(ctx, x, "relu") is None:
        return None
    return Found(0.45, "ReLU² (relu(x).square()): two eager kernels and a saved intermediate; one fused kernel under "
                       "Inductor (regional torch.compile)")


@pattern
def soft_cap(ctx: Ctx, e: Expr) -> Found | None:
    fs = factors(ctx, e)
    for i, (f, p) in enumerate(fs):
        squash = call(ctx, f, "tanh", "sigmoid") if p == 1 else None
        if squash is None:
            continue
        outer = [g for j, (g, _) in enumerate(fs) if j != i]
        inner = factors(ctx, squash.args[0])
        # tanh(x / t) * t: t may be a parameter, but it divides inside (x * sigmoid(b * x) is a swish, not a cap)
        capped = [(g, q) for g, q in inner if q == -1 and any(same(g, o) for o in outer)]
        values = [g for g, q in inner if q == 1 and (g, q) not in capped and not coefficient(g)]
        scales = [g for g, q in inner if (g, q) in capped or coefficient(g)]
        if len(values) != 1 or not scales or len(values) + len(scales) != len(inner):
            return None
        if not outer or not all(coefficient(g) or any(same(g, s) for s in scales) for g in outer):
            return None
        consts = all(const_value(g) is not None for g in outer + scales)
        if not consts and not any(same(g, s) for g in outer for s in scales):
            return None
        fn = squash.op
        return Found(0.45, f"soft-capping c * {fn}(x / c): three eager kernels over the whole tensor (often the "
                           "full-vocabulary logits); one fused kernel under Inductor")
    return None


@pattern
def _weighted(ctx: Ctx, term: Expr) -> bool:
    fs = factors(ctx, term)
    if len(fs) < 2 or any(p != 1 for _, p in fs):
        return False
    weights = [f for f, _ in fs if coefficient(f) and const_value(f) not in (1.0, -1.0)]  # -a is not a scaling
    # one tensor per product: 2 * layers * batch * seq * hidden is a count of sizes, not a scaled tensor
    return bool(weights) and sum(tensor_like(f) for f, _ in fs) == 1


@pattern
def blend(ctx: Ctx, e: Expr) -> Found | None:
    parts = terms(ctx, e)
    if len(parts) != 2 or not all(_weighted(ctx, t) for t, _ in parts):
        return None
    return Found(0.4, "blend a * x + b * y: three eager kernels (two scalings and an add); one fused kernel under "
                      "Inductor (torch.lerp / torch.add(alpha=) when the weights are Python numbers)")


@pattern
def scale_and_shift(ctx: Ctx, e: Expr) -> Found | None:
    parts = terms(ctx, e)
    if len(parts) != 2:
        return None
    for (product, _), (shift, _) in (parts, parts[::-1]):
        fs = factors(ctx, product)
        if len(fs) != 2 or any(p != 1 for _, p in fs) or not tensor_like(shift):
            continue
        for (x, _), (scale, _) in (fs, fs[::-1]):
            inner = terms(ctx, scale) if tensor_like(x) else []
            if len(inner) == 2 and any(const_value(t) == 1.0 for t, _ in inner):
                return Found(0.4, "scale-and-shift x * (1 + scale) + shift: three eager kernels; one fused kernel "
                                  "under Inductor (torch.addcmul)")
    return None


@pattern
def _scaled(ctx: Ctx, term: Expr) -> bool:
    """``a * X`` with a number (``a, b, c = (3.4445, -4.7750, 2.0315)``) and an operand that is not one: X may be a
    name the loop rebinds (``X = a * X + B @ X``), which `tensor_like` cannot see through."""
    x = peek(term)
    if x.kind != "call" or x.op != "mul" or len(x.args) != 2:
        return False
    return sum(const_value(a) is not None for a in x.args) == 1


@pattern
def matmul_blend(ctx: Ctx, e: Expr) -> Found | None:
    parts = terms(ctx, e)
    if len(parts) < 2 or any(sign != 1 for _, sign in parts):
        return None
    products = [t for t, _ in parts if call(ctx, t, "matmul") is not None]
    if not products or not all(any(t is p for p in products) or _weighted(ctx, t) or _scaled(ctx, t) for t, _ in parts):
        return None
    if len(products) == len(parts):
        return None  # A @ B + C @ D: no scaling to fold
    return Found(0.4, "matrix blend a * X + b * (A @ B): scalings, a matmul and adds launched one by one; torch.addmm "
                      "(baddbmm for batches) folds the scalings and the add into the matmul")
