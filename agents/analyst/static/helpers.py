"""Whether a finding is the whole of the function around it: then the function is the rewrite site.

A function exists only to implement the operation a match found when the match computes what the
function returns (``return torch.cat((y1, y2), 3).type_as(x)``, ``return F.rms_norm(x, ...)``) and
every other call in it is bookkeeping: shapes and sizes, views, splits, casts, checks and the
errors they raise. Then the finding's span is the whole function (``def`` line to its end), so
a rewrite replaces the helper once instead of editing its lines; otherwise it stays on the
statements.
"""

from __future__ import annotations

import libcst as cst

from .match import Match, peel
from .model import Expr

BOOKKEEPING = frozenset({
    "size", "dim", "numel", "view", "reshape", "view_as", "reshape_as", "unsqueeze", "squeeze", "expand", "expand_as",
    "contiguous", "chunk", "split", "unbind", "flatten", "unflatten", "transpose", "permute", "float", "half", "bfloat16", "to", "type_as", "type",
    "floordiv", "len", "int", "isinstance", "getattr", "tuple", "list", "range",
    "ValueError", "RuntimeError", "TypeError", "AssertionError", "NotImplementedError",
})  # fmt: skip


def _shape_arithmetic(e: Expr) -> bool:
    """``x.shape[-1] // 2``, ``cos.shape[0:1] + (1,) * n``: arithmetic on sizes, not on tensors."""
    if e.kind != "call" or e.op not in ("add", "sub", "mul", "floordiv", "div", "mod"):
        return False
    for a in e.args:
        x = a
        while x.kind == "subscript":
            x = x.args[0]
        if x.kind == "attr" and x.op in ("shape", "ndim"):
            continue
        if x.kind in ("const", "tuple", "name") or (x.kind == "call" and (x.op in BOOKKEEPING or _shape_arithmetic(x))):
            continue
        return False
    return True


def is_whole_function(matches: list[Match]) -> bool:
    """The matches' function returns what they compute and does nothing else but bookkeeping."""
    scope = matches[0].scope
    if not isinstance(scope.node, cst.FunctionDef) or not scope.returns:
        return False
    core = {node for m in matches for node in (*m.core, id(m.root.node))}
    returned = peel(scope.returns[-1])
    while returned.kind == "call" and returned.op in BOOKKEEPING and id(returned.node) not in core and returned.args:
        returned = peel(returned.args[0])  # sdpa(...).transpose(1, 2): the value is still the op's
    if id(returned.node) not in core:
        return False
    return all(id(c.node) in core or c.op in BOOKKEEPING or _shape_arithmetic(c) for c in scope.calls)
