"""Static patterns: attention, softmax and cross-entropy written out."""

from __future__ import annotations

from .forms import (
    reduce_of,
    tensor_factors,
)
from .match import (
    Ctx,
    Expr,
    Found,
    call,
    factors,
    follow,
    pattern,
    peek,
    same,
    scalar_like,
    str_arg,
    terms,
    uncast,
)


def _einsum_operands(e: Expr) -> tuple[Expr, Expr] | None:
    spec = str_arg(e, 0)
    if spec is None or "->" not in spec or len(e.args) != 3:
        return None
    inputs, output = spec.replace(" ", "").split("->")
    first, _, second = inputs.partition(",")
    contracted = (set(first) & set(second)) - set(output) - {"."}
    return (e.args[1], e.args[2]) if len(contracted) == 1 else None


@pattern
def _scores(ctx: Ctx, e: Expr, seen: dict, depth: int = 0) -> bool:
    """Peel mask, scale and casts off attention scores down to q @ k^T."""
    if depth > 8:
        return False
    x = uncast(ctx, e)
    if x.kind != "call":
        return False
    if x.op in ("matmul", "bmm") and len(x.args) == 2:
        ctx.core.append(x)
        k = follow(ctx, x.args[1])
        transposed = k.kind == "call" and k.op in ("transpose", "permute", "t", "swapaxes")
        transposed = transposed or (k.kind == "attr" and k.op in ("mT", "T"))
        if transposed:
            ctx.core.append(k)
        seen["transposed"] = transposed
        return True
    if x.op == "einsum" and _einsum_operands(x) is not None:
        ctx.core.append(x)
        seen["transposed"] = True
        return True
    if not x.method and "mask" in x.op.lower() and x.args and _scores(ctx, x.args[0], seen, depth + 1):
        ctx.core.append(x)  # a helper that adds the mask, e.g. maybe_add_mask(scores, bias)
        seen["masked"] = True
        return True
    steps = {"masked_fill": (0,), "masked_fill_": (0,), "where": (1, 2), "add": (0, 1), "sub": (0,), "mul": (0, 1), "div": (0,)}
    if x.op in steps:
        for index in steps[x.op]:
            if index < len(x.args) and _scores(ctx, x.args[index], seen, depth + 1):
                ctx.core.append(x)
                if x.op != "sub":  # x - max(x) inside a manual softmax is neither a scale nor a mask
                    seen["scaled" if x.op in ("mul", "div") else "masked"] = True
                return True
    return False


@pattern
def _probabilities(ctx: Ctx, e: Expr) -> tuple[Expr, str] | None:
    x = uncast(ctx, e)
    for _ in range(4):
        dropped = call(ctx, x, "dropout")
        if dropped is None and x.kind == "call" and x.op.startswith("self.") and "drop" in x.op.lower():
            dropped = x
            ctx.core.append(x)
        if dropped is None or not dropped.args:
            break
        x = uncast(ctx, dropped.args[0])
    soft = call(ctx, x, "softmax", "_softmax") or _softmax_module(ctx, x)
    if soft is not None and soft.args:
        return soft.args[0], "softmax"
    inner = softmax_form(ctx, x)
    return (inner, "manual softmax") if inner is not None else None


@pattern
def _softmax_module(ctx: Ctx, e: Expr) -> Expr | None:
    """``self.attend(x)`` where ``__init__`` set ``self.attend = nn.Softmax(dim=-1)``."""
    x = follow(ctx, e)
    if x.kind != "call" or x.method or not x.op.startswith("self.") or not x.args:
        return None
    cls = x.stmt.scope.class_name
    value = ctx.file.module_attrs.get((cls, x.op[5:])) if cls else None
    built = peek(value) if value is not None else None
    if built is None or built.kind != "call" or built.method or built.op != "Softmax":
        return None
    ctx.core.append(x)
    return x


@pattern
def attention(ctx: Ctx, e: Expr) -> Found | None:
    """softmax(q @ k^T [* scale] [+ mask | masked_fill]) @ v, over one or several statements."""
    out = call(ctx, e, "matmul", "bmm", "einsum")
    if out is None:
        return None
    operands = _einsum_operands(out) if out.op == "einsum" else (tuple(out.args) if len(out.args) == 2 else None)
    probs = _probabilities(ctx, operands[0]) if operands else None
    seen: dict = {}
    if probs is None or not _scores(ctx, probs[0], seen):
        return None
    parts = ["q @ k^T" if seen.get("transposed") else "q @ k"]
    parts += [p for p in ("scaled", "masked") if seen.get(p)]
    note = f"attention written out: {probs[1]}({', '.join(parts)}) @ v" + (" (einsum)" if out.op == "einsum" else "")
    return Found(0.6 if seen.get("transposed") else 0.5, note)


@pattern
def softmax_form(ctx: Ctx, e: Expr) -> Expr | None:
    """exp(a) / exp(a).sum(dim, keepdim=True) -> a."""
    div = call(ctx, e, "div")
    if div is None:
        return None
    numerator = call(ctx, div.args[0], "exp")
    total = reduce_of(ctx, div.args[1], "sum") if numerator is not None else None
    if total is None:
        return None
    summed = total.args[0]
    if same(summed, div.args[0]):
        return numerator.args[0]
    again = call(ctx, summed, "exp")
    return numerator.args[0] if again is not None and same(again.args[0], numerator.args[0]) else None


@pattern
def softmax(ctx: Ctx, e: Expr) -> Found | None:
    return Found(0.45, "softmax written out: exp(x) / exp(x).sum(dim)") if softmax_form(ctx, e) is not None else None


@pattern
def log_probs_of(ctx: Ctx, e: Expr) -> Expr | None:
    """log_softmax(x), log(softmax(x)) or x - logsumexp(x) -> x."""
    ls = call(ctx, e, "log_softmax")
    if ls is not None and ls.args:
        return ls.args[0]
    log = call(ctx, e, "log")
    if log is not None and log.args:
        sm = call(ctx, log.args[0], "softmax")
        return sm.args[0] if sm is not None and sm.args else None
    parts = terms(ctx, e)
    if len(parts) == 2 and parts[0][1] == 1 and parts[1][1] == -1:
        lse = call(ctx, parts[1][0], "logsumexp")
        if lse is not None and same(lse.args[0], parts[0][0]):
            return parts[0][0]
    return None


@pattern
def _picked_log_prob(ctx: Ctx, e: Expr) -> str | None:
    """The log-probability of the target class, in any of the usual spellings."""
    x = uncast(ctx, e)
    for _ in range(3):
        squeezed = call(ctx, x, "squeeze")
        if squeezed is None:
            break
        x = uncast(ctx, squeezed.args[0])
    picked = call(ctx, x, "gather", "take_along_dim", "diagonal", "nll_loss")
    if picked is not None and picked.args and log_probs_of(ctx, picked.args[0]) is not None:
        return {"diagonal": "log_softmax(...).diagonal() (labels = arange)", "nll_loss": "nll_loss(log_softmax(...))"}.get(
            picked.op, "log_softmax(...).gather(target)"
        )
    if x.kind == "subscript" and log_probs_of(ctx, x.args[0]) is not None:
        ctx.core.append(x)
        return "log_softmax(...)[rows, target]"
    parts = terms(ctx, x)
    if len(parts) == 2 and parts[0][1] == 1 and parts[1][1] == -1:
        lse = call(ctx, parts[0][0], "logsumexp")
        gathered = uncast(ctx, parts[1][0])
        while lse is not None and gathered.kind == "call" and gathered.op == "squeeze":
            ctx.core.append(gathered)
            gathered = uncast(ctx, gathered.args[0])
        g = call(ctx, gathered, "gather") if lse is not None else None
        if g is not None and same(g.args[0], lse.args[0]):
            return "logsumexp(logits) - logits.gather(target)"
    fs = factors(ctx, x)
    tensors = tensor_factors(fs)
    if len(tensors) == 2 and all(p == 1 for _, p in fs):
        if any(log_probs_of(ctx, f) is not None for f, _ in tensors):
            return "(one_hot * log_softmax(...)).sum()"
    return None


@pattern
def cross_entropy(ctx: Ctx, e: Expr) -> Found | None:
    """Reductions and negation around the picked log-probability of the target class."""
    x = e
    for _ in range(6):
        step = call(ctx, x, "mean", "sum", "neg")
        if step is None:
            step = call(ctx, x, "div")
            if step is not None and not scalar_like(step.args[1]):
                return None
        if step is None or not step.args:
            break
        x = step.args[0]
    how = _picked_log_prob(ctx, x)
    return Found(0.5, f"cross-entropy written out: {how}") if how else None
