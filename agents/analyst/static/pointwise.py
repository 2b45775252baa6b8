"""Static pattern of last resort: a chain of pointwise ops that no named pattern covers.

Inductor fuses any chain of pointwise ops into one kernel; eager launches one kernel per op (and
keeps every intermediate for the backward). The named patterns (norms, activations, rotary,
soft-capping, blends) report the chains whose rewrite is known; this one reports the rest when the
chain is long enough to matter:

- three or more pointwise ops of which one is a transcendental or an activation (``exp``, ``tanh``,
  ``sigmoid``, ``softplus``, ...): mish ``x * tanh(softplus(x))``, a DyT-like ``w * tanh(a * x) + b``,
  a learned mask ``where(m, softplus(w) * bias, -inf)``;
- three or more pointwise ops reduced right away (``((a - b - c) ** 2).mean(dim)``): the reduction
  fuses with them.

It is a fallback (``Match.fallback``): a chain that shares an operation with any named match is
dropped, so a GELU or an RMSNorm written out stays that finding alone. Not reported: chains whose
tensors all come from factories (``exp(-log(p) * arange(h) / h)``: a positional table computed
once), arithmetic on Python numbers (``math.*``, sizes, ``self.dim``, loss values), and set-up code
(``__init__``, ``reset_parameters``, ``init_*``): it runs once.
"""

from __future__ import annotations

import re

from .chains import coefficient
from .match import Ctx, Expr, Found, const_value, follow, pattern, peek

_POINTWISE = frozenset({"add", "sub", "mul", "div", "pow", "neg", "where", "abs", "clamp", "clamp_min", "clamp_max",
                        "maximum", "minimum", "square", "reciprocal", "masked_fill"})
_TRANSCENDENTAL = frozenset({"exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "softplus", "erf", "sin",
                             "cos", "rsqrt", "sqrt", "relu", "gelu", "silu", "mish", "elu", "leaky_relu", "softsign",
                             "logsigmoid"})
_REDUCTIONS = frozenset({"mean", "sum"})
_SCALAR_MODULES = ("math.", "np.", "numpy.", "random.")
_TABLES = frozenset({"arange", "linspace", "logspace", "ones", "zeros", "full", "tensor", "as_tensor", "empty", "eye",
                     "ones_like", "zeros_like", "full_like", "empty_like", "outer", "polar"})


class _Chain:
    def __init__(self) -> None:
        self.ops = 0
        self.transcendental = False
        self.tensors = 0  # leaves that are tensors other than factory tables and parameters
        self.params = 0  # leaves that are function parameters (tensors, or sizes next to a table)
        self.tables = 0  # leaves made by factories (arange, ones, ...)


def _on_numbers(x: Expr) -> bool:
    """``math.log(p)``, ``np.sqrt(d)``, ``n // 2``: arithmetic on Python numbers, not on tensors."""
    return x.kind == "call" and ((x.callee or "").startswith(_SCALAR_MODULES) or x.op in ("floordiv", "mod"))


def _walk(ctx: Ctx, e: Expr, chain: _Chain, depth: int) -> None:
    x = follow(ctx, e)
    if _on_numbers(x):
        return
    if x.kind == "call" and (x.op in _POINTWISE or x.op in _TRANSCENDENTAL) and x.args and depth < 12:
        if const_value(x) is not None:  # math.sqrt(2 / math.pi): a number
            return
        ctx.core.append(x)
        chain.ops += 1
        chain.transcendental |= x.op in _TRANSCENDENTAL
        for a in (*x.args, *(v for k, v in x.kwargs.items() if not k.startswith("*"))):
            _walk(ctx, a, chain, depth + 1)
        return
    if x.kind == "call" and x.method and x.op in ("float", "to", "type_as", "contiguous", "detach", "bfloat16", "half"):
        _walk(ctx, x.args[0], chain, depth + 1)  # a cast in the middle is part of the chain
        return
    leaf = peek(x)
    if leaf.kind == "call" and leaf.op in _TABLES and not leaf.method:
        chain.tables += 1
    elif leaf.kind == "name" and _tensor_leaf(ctx, leaf):
        chain.params += 1
    elif _tensor_leaf(ctx, x):
        chain.tensors += 1


def _tensor_leaf(ctx: Ctx, x: Expr) -> bool:
    """A tensor the chain reads: a parameter, a slice, a module tensor (``self.w``), a result of a non-factory op."""
    x = peek(x)
    if x.kind == "name":
        return x.binding is None and x.op in x.stmt.scope.tensor_params
    if x.kind == "subscript":
        return any(spec[0] == "slice" for spec in x.value) or _tensor_leaf(ctx, x.args[0])
    if x.kind == "attr":  # self.w built as a Parameter or a tensor in __init__ (self.dim is a number)
        owner, cls = peek(x.args[0]), x.stmt.scope.class_name
        value = ctx.file.module_attrs.get((cls, x.op)) if owner.kind == "name" and owner.op == "self" and cls else None
        built = peek(value) if value is not None else None
        return built is not None and built.kind == "call" and (built.op == "Parameter" or built.op in _TABLES)
    if x.kind == "item":
        return _tensor_leaf(ctx, x.args[0])
    if x.kind != "call" or coefficient(x) or _on_numbers(x):
        return False
    return x.op not in _TABLES and not ("loss" in x.op.lower() or "criterion" in x.op.lower())


_SET_UP = re.compile(r"(^|_)(init|initiali[sz]e|reset_parameters|build|setup)(_|$)|^__init__$", re.IGNORECASE)


@pattern
def pointwise_chain(ctx: Ctx, e: Expr) -> Found | None:
    x = peek(e)
    name = (ctx.scope.qualname or "").rsplit(".", 1)[-1]
    if x.kind != "call" or _SET_UP.search(name):  # set-up code runs once
        return None
    reduced = x.op in _REDUCTIONS and bool(x.args)
    chain = _Chain()
    if reduced:
        ctx.core.append(x)
        _walk(ctx, x.args[0], chain, 0)
    elif x.op in _POINTWISE or x.op in _TRANSCENDENTAL:
        _walk(ctx, e, chain, 0)
    else:
        return None
    # parameters next to a factory table are sizes (exp(-log(p) * arange(half) / half)): a table, not a tensor chain
    reads_tensors = chain.tensors > 0 or (chain.params > 0 and chain.tables == 0)
    if chain.ops < 3 or not reads_tensors or not (chain.transcendental or reduced):
        return None
    what = f"{chain.ops} pointwise ops" + (" and the reduction after them" if reduced else "")
    return Found(0.35, f"elementwise chain ({what}): one eager kernel per op and a saved intermediate each; one fused "
                       "kernel under Inductor (regional torch.compile)")
