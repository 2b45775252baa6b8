"""Loop rules of the static scan: per-parameter update loops (Muon-style optimizers, gradient scaling).

A ``for`` loop whose iterable names parameters (``model.parameters()``, ``group['params']``,
``zip(params_world, buffers)``, ``range(len(params))``) and whose body updates tensors in place
(``buf.mul_(m).add_(g)``, ``p.data.add_(g, alpha=-lr)``, ``buf.lerp_(g, 1 - m)``, ``p.grad /= n``)
launches a few small kernels per parameter every step; ``torch._foreach_*`` ops (or a fused
multi-tensor optimizer) update all parameters in a few launches. Reported for every target.

Also here: a blocking collective once per parameter (``per_parameter_collectives``, category
communication).

Each in-place update is attributed to the innermost such loop around it, so an outer
``for group in self.param_groups:`` is not reported when its inner loop is. Not reported:
loops that only copy (``copy_``: checkpoint loading), zero (``zero_``: the zero_grad rule), or
initialise (``nn.init.*``), and loops that only communicate (``dist.all_reduce(p.grad)``).
"""

from __future__ import annotations

import re
from typing import Callable

import libcst as cst

from trainbridge.records import IntentCategory

from .match import Found, Match, peek
from .model import Expr, FileModel, Scope, Stmt

INPLACE_UPDATES = frozenset({"add_", "sub_", "mul_", "div_", "lerp_", "addcmul_", "addcdiv_", "pow_", "sqrt_", "neg_",
                             "clamp_", "sign_", "maximum_"})
_PARAMS = re.compile(r"param", re.IGNORECASE)
_CODE = cst.Module([])


def _augmented_tensor(c: Expr, loop: cst.For) -> bool:
    """``p.grad /= n``, ``p.data *= s`` or ``p -= ...`` on the loop variable."""
    if not isinstance(c.node, cst.AugAssign):
        return False
    target = c.node.target
    if isinstance(target, cst.Attribute) and target.attr.value in ("grad", "data"):
        return True
    names = {n.value for n in _loop_names(loop.target)}
    return isinstance(target, cst.Name) and target.value in names


def _loop_names(target: cst.BaseExpression) -> list[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _loop_names(e.value)]
    return []


def _parameter_loop(loop: cst.CSTNode) -> bool:
    return isinstance(loop, cst.For) and bool(_PARAMS.search(_CODE.code_for_node(loop.iter)))


def _loop_match(file: FileModel, scope: Scope, loop: cst.For, updates: list[str]) -> Match:
    start, end = scope.loop_lines[id(loop)]
    site = Expr("other", "for", loop, Stmt(loop, start, end, scope), start, end)
    ops = ", ".join(dict.fromkeys(updates))
    note = (f"per-parameter update loop ({ops} on each parameter): a few small kernels per parameter every step; "
            "torch._foreach_* ops or a fused multi-tensor optimizer update all parameters in a few launches")
    return Match(IntentCategory.optimizer_step, file, scope, site, start, end, frozenset({id(loop)}), Found(0.45, note), 100)


def parameter_update_loops(files: list[FileModel]) -> list[Match]:
    out = []
    for file in files:
        for scope in file.scopes:
            found: dict[int, tuple[cst.For, list[str]]] = {}
            for c in scope.calls:
                loops = [loop for loop in c.stmt.loops if _parameter_loop(loop)]
                if not loops:
                    continue
                inner = loops[-1]
                if c.method and c.op in INPLACE_UPDATES:
                    what = c.op
                elif _augmented_tensor(c, inner):
                    what = f"{c.op} in place"
                else:
                    continue
                found.setdefault(id(inner), (inner, []))[1].append(what)
            out += [_loop_match(file, scope, loop, updates) for loop, updates in found.values()]
    return out


COLLECTIVES = frozenset({"all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                         "broadcast", "reduce"})


def _over_groups(loop: cst.For) -> bool:
    """``for group in self.param_groups``: one iteration per group, whose tensors may already be flat."""
    return "param_groups" in _CODE.code_for_node(loop.iter)


def _on_gradient(c: Expr) -> bool:
    """The collective moves a gradient (``p.grad``): the per-step kind (a broadcast of weights at start is not)."""
    return any(peek(a).kind == "attr" and peek(a).op == "grad" for a in c.args)


def _distributed(file: FileModel, c: Expr) -> bool:
    """``dist.all_reduce(...)``, ``torch.distributed.all_reduce(...)`` or an all_reduce imported from torch.distributed."""
    if (c.callee or "").startswith(("dist.", "torch.distributed.")):
        return True
    return c.callee == c.op and file.imports.get(c.op, ("", ""))[0].startswith("torch.distributed")


def per_parameter_collectives(files: list[FileModel]) -> list[Match]:
    """A blocking collective per parameter gradient (``for p in model.parameters(): dist.all_reduce(p.grad)``).

    Each launch pays the collective's latency; one bucketed collective over the flattened
    gradients (``torch._utils._flatten_dense_tensors``, DDP's buckets) pays it once. A collective
    with ``async_op=True`` is overlapped with other work and is not reported: fewer, larger
    messages gain nothing end to end when communication is already hidden.
    """
    out = []
    for file in files:
        for scope in file.scopes:
            for c in scope.calls:
                loops = [loop for loop in c.stmt.loops if _parameter_loop(loop) and not _over_groups(loop)]
                if not loops or c.op not in COLLECTIVES or not _distributed(file, c) or not _on_gradient(c):
                    continue
                async_op = c.kwargs.get("async_op")
                if async_op is not None and not (peek(async_op).kind == "const" and peek(async_op).value is False):
                    continue
                start, end = scope.loop_lines[id(loops[-1])]
                note = (f"{c.callee} once per parameter, blocking: one bucketed collective over the flattened tensors "
                        "(or DDP's gradient buckets) pays the launch and latency once")
                site = Expr("other", "for", loops[-1], Stmt(loops[-1], start, end, scope), start, end)
                out.append(Match(IntentCategory.communication, file, scope, site, start, end,
                                 frozenset({id(c.node)}), Found(0.4, note), 100))
    return out


LOOP_RULES: tuple[Callable[[list[FileModel]], list[Match]], ...] = (parameter_update_loops, per_parameter_collectives)
