"""The registry of the static scan's expression patterns, and what helper functions compute.

Each pattern is a small matcher (in norms, activations, attention,
layout) tried on every operation of every statement; it returns ``Found`` (how specific
the match is, what it saw) or None. Confidence stays in 0.3-0.6: a source match says what the
code computes, not what it costs. To add a category: write a matcher with the primitives of
match / forms and add an ``ExprPattern`` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainbridge.records import IntentCategory

from .activations import gelu, gelu_shape, geglu, rope, silu, silu_form, swiglu
from .attention import attention, cross_entropy, softmax
from .chains import blend, matmul_blend, relu_squared, scale_and_shift, soft_cap
from .forms import activation_of, rotate_every_two, rotate_half_inline
from .layout import permute_reshape, redundant_cast
from .match import Ctx, Expr, Found, Helper, RepoIndex, is_param
from .norms import layernorm, normalize, rmsnorm
from .pointwise import pointwise_chain
from .rotary import rope_rotation


def classify_helper(index: RepoIndex, helper: Helper) -> str | None:
    """What a function of the scanned code computes from its first tensor argument, if recognised.

    'silu' / 'gelu' for the activation written out or a wrapper of the library one
    (``return F.silu(x)``), 'quick_gelu' for x * sigmoid(1.702 x), 'rotate_half' for the
    cat((-x2, x1)) form, 'rotate_every_two' for its interleaved stack((-x2, x1), -1).flatten(-2).
    """
    if not helper.scope.returns:
        return None
    result = helper.scope.returns[-1]
    checks = (
        ("silu", silu_form),
        ("silu", lambda c, e: activation_of(c, e, "silu")),
        ("gelu", gelu_shape),
        ("quick_gelu", gelu_shape),
        ("gelu", lambda c, e: activation_of(c, e, "gelu")),
        ("rotate_every_two", rotate_every_two),
        ("rotate_half", rotate_half_inline),
    )
    for kind, check in checks:
        ctx = Ctx(index, helper.file, helper.scope)
        x = check(ctx, result)
        if isinstance(x, tuple):
            quick = x[1].startswith("QuickGELU")
            x = x[0] if quick == (kind == "quick_gelu") else None
        if x is not None and is_param(ctx, x, helper.scope):
            return kind
    return None


@dataclass(frozen=True)
class ExprPattern:
    category: IntentCategory
    match: Callable[[Ctx, Expr], Found | None]
    gain: str | None = None  # reported only for targets listing this gain (targets.GAINS); None: always
    whole_function: bool = False  # span a helper that exists only for this op as a whole (helpers.py)
    fallback: bool = False  # of last resort: dropped where any other match shares an operation (resolve.py)


# Order matters only when two patterns match at the same expression: the earlier one wins.
EXPRESSION_PATTERNS: tuple[ExprPattern, ...] = (
    ExprPattern(IntentCategory.attention, attention),
    ExprPattern(IntentCategory.cross_entropy, cross_entropy),
    ExprPattern(IntentCategory.layernorm, layernorm),
    ExprPattern(IntentCategory.rmsnorm, rmsnorm),
    ExprPattern(IntentCategory.rope, rope),
    ExprPattern(IntentCategory.rope, rope_rotation, whole_function=True),
    ExprPattern(IntentCategory.swiglu, swiglu),
    ExprPattern(IntentCategory.geglu, geglu),
    ExprPattern(IntentCategory.gelu, gelu),
    ExprPattern(IntentCategory.silu, silu),
    ExprPattern(IntentCategory.softmax, softmax),
    ExprPattern(IntentCategory.normalize, normalize),
    ExprPattern(IntentCategory.permute_reshape, permute_reshape),
    ExprPattern(IntentCategory.redundant_cast, redundant_cast),
    ExprPattern(IntentCategory.elementwise_chain, relu_squared, gain="elementwise_chain", whole_function=True),
    ExprPattern(IntentCategory.elementwise_chain, soft_cap, gain="elementwise_chain", whole_function=True),
    ExprPattern(IntentCategory.elementwise_chain, scale_and_shift, gain="elementwise_chain", whole_function=True),
    ExprPattern(IntentCategory.elementwise_chain, blend, gain="elementwise_chain", whole_function=True),
    ExprPattern(IntentCategory.elementwise_chain, matmul_blend, gain="elementwise_chain"),
    ExprPattern(IntentCategory.elementwise_chain, pointwise_chain, gain="elementwise_chain", fallback=True),
)
