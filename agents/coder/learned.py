"""A learned recipe: an accepted LLM patch generalised into a knowledge-base recipe (provenance
"learned"), so the next run needs no LLM for the same code.

It lives with the coder, not in knowledge/: generalising a patch needs the codemod engine
(tools/codemods), and the knowledge base sits below tools in the layering; the recipe it makes is
plain knowledge-base data (knowledge/schema.py).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import libcst as cst

from trainbridge.agents.coder.candidate import Candidate
from trainbridge.knowledge.schema import MatchSpec, Numerics, Provenance, Recipe, Target
from trainbridge.records import Intent, SourceSpan
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.pattern import METAVAR_PREFIX, equal


class LearnedRecipeError(ValueError):
    """The accepted patch has a shape no recipe kind can express; the message says which."""


_SIGNIFICANT = (cst.BaseExpression, cst.BaseStatement, cst.BaseSmallStatement, cst.BaseSuite, cst.Arg, cst.Param,
                cst.Parameters, cst.AssignTarget, cst.BaseElement, cst.SubscriptElement, cst.BaseSlice,
                cst.ComparisonTarget, cst.Decorator)


def _change_path(old: cst.CSTNode, new: cst.CSTNode) -> list[tuple[cst.CSTNode, cst.CSTNode]]:
    """The chain of node pairs from (old, new) down to the smallest one that holds the whole change."""
    path = [(old, new)]
    while type(old) is type(new):
        pairs, same_shape = [], True
        for field in dataclasses.fields(old):
            a, b = getattr(old, field.name), getattr(new, field.name)
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                a, b = [x for x in a if isinstance(x, _SIGNIFICANT)], [x for x in b if isinstance(x, _SIGNIFICANT)]
                same_shape &= len(a) == len(b)
                pairs += [(x, y) for x, y in zip(a, b) if not equal(x, y)]
            elif isinstance(a, _SIGNIFICANT) and isinstance(b, _SIGNIFICANT) and not equal(a, b):
                pairs.append((a, b))
        if not same_shape or len(pairs) != 1:
            break
        old, new = pairs[0]
        path.append((old, new))
    return path


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body)


def _dollar(code: str) -> str:
    return code.replace("$", "$$")


def _generalise(module: cst.Module, expr: cst.BaseExpression, params: list[str]) -> tuple[str, list[str]]:
    """`expr` as template text: parameters become $name, self.<attr> becomes $self_<attr>."""
    attributes: list[str] = []

    class Rename(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if isinstance(original.value, cst.Name) and original.value.value == "self":
                attributes.append(original.attr.value)
                return cst.Name(METAVAR_PREFIX + "self_" + original.attr.value)
            return updated

        def leave_Name(self, original, updated):
            return cst.Name(METAVAR_PREFIX + original.value) if original.value in params else updated

    code = module.code_for_node(expr.visit(Rename()))
    return re.sub(re.escape(METAVAR_PREFIX) + r"(\w+)", r"$\1", _dollar(code)), sorted(set(attributes))


def learned_recipe(candidate: Candidate, intent: Intent, *, repo_root: str | Path, target: str | Target,
                   model: str | None = None, numerics: Numerics | None = None) -> Recipe:
    """A recipe (provenance "learned") that redoes an accepted LLM patch wherever the same code appears.

    Generality: a patch that changes one expression becomes an ``expression`` recipe whose pattern is
    the old expression with every name kept literal (it matches that exact code, in any formatting);
    a patch that replaces a whole function body (top-level function or a class's ``forward``) by one
    ``return`` becomes a ``semantic`` recipe with the parameters and ``self`` attributes as
    placeholders, anchored on the old body's largest expression. Anything else is refused. The
    recipe is checked to reproduce the accepted patch on the original file.
    """
    from trainbridge.tools.git.ops import run_git

    if len(candidate.files) != 1 or not candidate.files[0].endswith(".py"):
        raise LearnedRecipeError(f"candidate {candidate.name} changes {candidate.files}; a recipe covers one Python file")
    file = candidate.files[0]
    old_text, new_text = (run_git(Path(repo_root), "cat-file", "blob", f"{sha}:{file}", strip=False)
                          for sha in (candidate.base_sha, candidate.sha))
    old_mod, new_mod = cst.parse_module(old_text), cst.parse_module(new_text)
    added = sorted({new_mod.code_for_node(s).strip() for s in new_mod.body if _is_import(s)}
                   - {old_mod.code_for_node(s).strip() for s in old_mod.body if _is_import(s)})
    path = _change_path(old_mod.with_changes(body=[s for s in old_mod.body if not _is_import(s)]),
                        new_mod.with_changes(body=[s for s in new_mod.body if not _is_import(s)]))
    exprs = [(a, b) for a, b in path if isinstance(a, cst.BaseExpression) and isinstance(b, cst.BaseExpression)]
    common = {"category": intent.category, "targets": [Target(str(target))], "imports": added,
              "numerics": numerics or Numerics(class_="tolerance", rtol=1e-3, atol=1e-5, loss_rtol=1e-4),
              "keywords": list(dict.fromkeys([*intent.evidence.target_op_names, *intent.evidence.kernels]))[:20],
              "pitfalls": [f"Learned from one accepted LLM patch at {', '.join(map(str, candidate.sites))}; "
                           "verified only there."],
              "provenance": Provenance(kind="learned", sources=[f"commit {candidate.sha}"],
                                       notes=f"LLM candidate {candidate.name}" + (f" by {model}" if model else ""))}
    rid = f"learned-{intent.category}-{candidate.sha[:10]}".lower().replace("_", "-")
    if exprs and not isinstance(exprs[-1][0], (cst.Name, cst.Attribute)):
        old, new = exprs[-1]
        pattern, replacement = old_mod.code_for_node(old).strip(), new_mod.code_for_node(new).strip()
        recipe = Recipe(id=rid, title=f"Learned: {_short(pattern)} -> {_short(replacement)}",
                        match=MatchSpec(kind="expression", params={"pattern": _dollar(pattern)}),
                        replacement=_dollar(replacement), **common)
    else:
        recipe = _semantic_recipe(old_mod, new_mod, path, rid, common)
    _check_reproduces(recipe, old_text, new_text, [s for s in intent.spans if s.file == file] or candidate.sites)
    return recipe


def _semantic_recipe(old_mod: cst.Module, new_mod: cst.Module, path: list, rid: str, common: dict) -> Recipe:
    functions = [(a, b) for a, b in path if isinstance(a, cst.FunctionDef)]
    classes = [a for a, _ in path if isinstance(a, cst.ClassDef)]
    refuse = LearnedRecipeError("the patch is neither one changed expression nor a function body replaced by one "
                                "return; no recipe kind expresses it")
    if len(functions) != 1 or len(classes) > 1:
        raise refuse
    old_fn, new_fn = functions[0]
    body = [s for s in new_fn.body.body if not (isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Expr)
                                                 and isinstance(s.body[0].value, cst.SimpleString))]
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or not isinstance(body[0].body[0], cst.Return) \
            or body[0].body[0].value is None:
        raise refuse
    scope = "module_forward" if classes else "function"
    if scope == "module_forward" and old_fn.name.value != "forward":
        raise LearnedRecipeError(f"the patch rewrites {classes[0].name.value}.{old_fn.name.value}; only forward methods "
                                 "and top-level functions can be semantic recipes")
    params = [p.name.value for p in old_fn.params.params][1 if classes else 0:]
    replacement, attributes = _generalise(new_mod, body[0].body[0].value, params)
    old_values = [s.value for line in old_fn.body.body if isinstance(line, cst.SimpleStatementLine)
                  for s in line.body if isinstance(s, (cst.Assign, cst.Return, cst.AugAssign)) and s.value is not None]
    anchors = [_generalise(old_mod, v, params)[0] for v in
               sorted(old_values, key=lambda v: -len(old_mod.code_for_node(v)))[:1]]
    params_spec = {"scope": scope, "signature": params, "attributes": attributes, "alternatives": anchors}
    return Recipe(id=rid, title=f"Learned: {old_fn.name.value} body -> {_short(replacement)}",
                  match=MatchSpec(kind="semantic", params=params_spec), replacement=replacement, **common)


def _short(code: str) -> str:
    flat = " ".join(code.split())
    return flat if len(flat) <= 60 else flat[:57] + "..."


def _check_reproduces(recipe: Recipe, old_text: str, new_text: str, spans: Sequence[SourceSpan]) -> None:
    reasons = []
    for span in spans:
        try:
            redone = apply_recipe(old_text, recipe, span).source
        except CodemodRefused as refused:
            reasons.append(str(refused))
            continue
        if ast.dump(ast.parse(redone)) == ast.dump(ast.parse(new_text)):
            return
        reasons.append(f"applied at {span} it gives different code")
    raise LearnedRecipeError(f"the learned recipe {recipe.id} does not reproduce the accepted patch: {'; '.join(reasons)}")
