"""The ``call`` match kind: one call of a named function, its keyword arguments checked and rewritten.

Parameters (``match.params``):
- ``func``: the qualified name of the callee (``torch.optim.AdamW``; import aliases resolve);
- ``kwargs``: keywords the call must pass with these literal values (``{foreach: false}``);
- ``drop_kwargs``: keywords removed from ``$args`` before rendering (the replacement does not take them);
- ``absent_kwargs``: keywords the call must not pass ...
- ``overridable``: ... except these, when their value is not a literal: the replacement sets them
  itself (``fused=use_fused`` becomes the replacement's ``fused=True``);
- ``all_in_span``: rewrite every fitting call of the span (``q, k = F.rms_norm(q, s), F.rms_norm(k, s)``),
  not only a single one.

A ``**name`` argument is read through kwargs.star_keys: when every key it can hold is dropped or
overridable the argument is removed (``**extra_args`` that only ever holds ``fused``); when none is,
it stays; otherwise, and when its keys are unknown, the call is refused with the form that was seen.
"""

from __future__ import annotations

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from trainbridge.knowledge.schema import Recipe
from trainbridge.records import SourceSpan
from trainbridge.tools.codemods.kwargs import star_keys
from trainbridge.tools.codemods.pattern import Bindings
from trainbridge.tools.codemods.template import render_expression


class CallRefused(Exception):
    def __init__(self, reason: str, close: list[str]):
        super().__init__(reason)
        self.reason, self.close = reason, close


class _CallFinder(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, func: str, span: SourceSpan):
        self.func, self.span = func, span
        self.found: list[tuple[cst.Call, SourceSpan]] = []

    def visit_Call(self, node: cst.Call) -> None:
        position = self.get_metadata(PositionProvider, node)
        if not (self.span.line_start <= position.start.line <= self.span.line_end):
            return
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if self.func in names:
            self.found.append((node, SourceSpan(file=self.span.file, line_start=position.start.line, line_end=position.end.line)))


def _calls_seen(module: cst.Module, positions, span: SourceSpan, limit: int = 6) -> list[str]:
    """The callees of the span, in order, each once (what the code does instead of the recipe's call)."""
    seen: list[str] = []

    class Visitor(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            line = positions[node].start.line
            name = module.code_for_node(node.func).strip()
            if span.line_start <= line <= span.line_end and len(name) <= 60 and name not in seen:
                seen.append(name)

    module.visit(Visitor())
    return seen[:limit] + ([f"... {len(seen) - limit} more"] if len(seen) > limit else [])


def literal_equals(node: cst.BaseExpression, value) -> bool:
    if isinstance(value, bool) or value is None:
        return isinstance(node, cst.Name) and node.value == repr(value)
    if isinstance(value, (int, float)):
        return isinstance(node, (cst.Integer, cst.Float)) and float(node.evaluated_value) == float(value)
    if isinstance(value, str):
        return isinstance(node, cst.SimpleString) and node.evaluated_value == value
    return False


def _is_literal(node: cst.BaseExpression) -> bool:
    return (isinstance(node, cst.Name) and node.value in ("True", "False", "None")) or \
        isinstance(node, (cst.Integer, cst.Float, cst.SimpleString))


class _Plan:
    """What to do with one call: the arguments to drop, notes; or why it does not fit."""

    def __init__(self):
        self.drop: set[int] = set()  # indexes into call.args
        self.notes: list[str] = []
        self.why: str | None = None


def _plan(module: cst.Module, positions, call: cst.Call, params: dict, func_name: str) -> _Plan:
    plan = _Plan()
    required = dict(params.get("kwargs", {}) or {})
    dropped = set(params.get("drop_kwargs", []) or [])
    absent = list(params.get("absent_kwargs", []) or [])
    overridable = set(params.get("overridable", []) or [])
    given = {arg.keyword.value: (i, arg.value) for i, arg in enumerate(call.args) if arg.keyword is not None}
    stars = [(i, arg) for i, arg in enumerate(call.args) if arg.keyword is None and arg.star == "**"]
    short = func_name.rsplit(".", 1)[-1]
    star_info = [(i, arg, star_keys(module, positions, call, arg)) for i, arg in stars]

    wrong = [k for k, v in required.items() if k not in given or not literal_equals(given[k][1], v)]
    if wrong:
        needs = ", ".join(f"{k}={required[k]!r}" for k in wrong)
        via = [f"**{info.source}" for _, _, info in star_info if info.keys is None or set(wrong) & info.keys]
        plan.why = f"needs {needs}" + (f"; it may come through {', '.join(via)}, which the recipe cannot check" if via else "")
        return plan
    for k in absent:
        if k not in given:
            continue
        index, value = given[k]
        if k in overridable and not _is_literal(value):
            plan.drop.add(index)
            plan.notes.append(f"{k}={module.code_for_node(value).strip()} (line {positions[call].start.line}) replaced: "
                              f"the rewrite passes {k} itself")
            continue
        plan.why = f"already passes {k}={module.code_for_node(value).strip()}"
        return plan
    removable = dropped | overridable
    for index, arg, info in star_info:
        where = f" (line {', '.join(map(str, info.lines))})" if info.lines else ""
        seen = f"saw {short}(..., **{info.source})"
        if info.keys is None:
            at_stake = ", ".join(absent or sorted(dropped)) or "any keyword"
            plan.why = f"{seen}: {info.why_unknown}; it may hold {at_stake}"
            return plan
        blocked = sorted(info.keys & (set(absent) - overridable))
        if blocked:
            plan.why = f"{seen} whose {', '.join(map(repr, blocked))} comes from {info.source}{where}, which the recipe must not override"
            return plan
        own = info.keys & removable
        if own and own == info.keys:
            plan.drop.add(index)
            plan.notes.append(f"dropped **{info.source}: it only ever holds {', '.join(sorted(own))}{where}, "
                              "which the rewrite sets or does not take")
        elif own:
            plan.why = (f"{seen} whose {', '.join(map(repr, sorted(own)))} comes from {info.source}{where} together with "
                        f"{', '.join(sorted(info.keys - own))}: split them before rewriting")
            return plan
    return plan


def apply_call(wrapper: MetadataWrapper, recipe: Recipe, span: SourceSpan):
    """(new module, sites, notes) for the one call of ``params.func`` in the span that fits."""
    params = recipe.match.params
    func_name = str(params["func"])
    finder = _CallFinder(func_name, span)
    wrapper.visit(finder)
    module = wrapper.module
    positions = wrapper.resolve(PositionProvider)
    dropped = set(params.get("drop_kwargs", []) or [])
    candidates, misses, whys = [], [], []
    for call, site in finder.found:
        plan = _plan(module, positions, call, params, func_name)
        if plan.why is not None:
            misses.append(f"{site}: {module.code_for_node(call).strip()[:160]} ({plan.why})")
            whys.append(plan.why)
            continue
        candidates.append((call, site, plan))
    if not candidates:
        reason = f"no call of {func_name} in {span} fits recipe {recipe.id}"
        if len(whys) == 1:
            reason += ": " + whys[0]
        elif not finder.found:
            seen = _calls_seen(module, positions, span)
            reason += f": the span calls {', '.join(seen)}" if seen else ": the span holds no call"
        raise CallRefused(reason, misses)
    if len(candidates) > 1 and not params.get("all_in_span", False):
        raise CallRefused(f"recipe {recipe.id} matches {len(candidates)} calls in {span}; narrow the span "
                          "or mark the recipe all_in_span", [str(site) for _, site, _ in candidates])
    plans = {call: plan for call, _, plan in candidates}

    class Rewriter(cst.CSTTransformer):
        """Every fitting call, innermost first, so a fitting call nested in another's arguments is rewritten too."""

        def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
            plan = plans.get(original)
            return updated if plan is None else _render(module, recipe, updated, plan, dropped)

    notes = [note for _, _, plan in candidates for note in plan.notes]
    return module.visit(Rewriter()), [site for _, site, _ in candidates], notes


def _render(module: cst.Module, recipe: Recipe, call: cst.Call, plan: _Plan, dropped: set[str]) -> cst.BaseExpression:
    kept = [arg for i, arg in enumerate(call.args)
            if i not in plan.drop and (arg.keyword is None or arg.keyword.value not in dropped)]
    args_code = ", ".join(module.code_for_node(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip() for arg in kept)
    bindings: Bindings = {"func": call.func}
    text = recipe.replacement.replace("$args", "\0ARGS\0").replace("${args}", "\0ARGS\0")
    return render_expression(text, bindings, module, raw={"\0ARGS\0": args_code})
