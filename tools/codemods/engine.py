"""Apply a recipe (data) to one source region of one file with libcst.

Formatting and comments outside the rewritten nodes are preserved, imports are added once, nothing
outside the intent's span changes except the import block, and the engine refuses — with the
reason and what came close — when the recipe does not match, matches ambiguously, or its
precondition on the source cannot hold. A recipe's companion edits (`Recipe.also`: the calls its new API needs
changed) are the exception by design: `apply_companion` rewrites them wherever a file makes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider

from trainbridge.knowledge.schema import CompanionEdit, Recipe
from trainbridge.records import SourceSpan
from trainbridge.tools.codemods import scopes
from trainbridge.tools.codemods.calls import CallRefused, apply_call
from trainbridge.tools.codemods import statements as stmts
from trainbridge.tools.codemods.definitions import DefinitionError, insert_definitions
from trainbridge.tools.codemods.imports import parse_import_line
from trainbridge.tools.codemods.module_kinds import modules_mismatch
from trainbridge.tools.codemods.pattern import Bindings, PatternError, equal, match, parse_expression_pattern
from trainbridge.tools.codemods.template import TemplateError, render_expression, render_statements


class CodemodRefused(Exception):
    """The recipe cannot be applied here; `reason` says why, `close` lists near misses."""

    def __init__(self, reason: str, close: list[str] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.close = close or []

    def __str__(self) -> str:
        if not self.close:
            return self.reason
        return self.reason + "\nclosest code in the span:\n" + "\n".join(f"  {c}" for c in self.close)


@dataclass
class Edit:
    """A successful rewrite of one file."""

    source: str
    sites: list[SourceSpan] = field(default_factory=list)  # original line ranges that were rewritten
    notes: list[str] = field(default_factory=list)


SITE_TOKEN = "{site}"  # in a recipe's replacement and define: the first line of the span, so each site gets names of its own


def per_site(recipe: Recipe, span: SourceSpan) -> Recipe:
    """The recipe with `SITE_TOKEN` replaced by this site's line (two rewritten sites of one file must not
    share helper state, e.g. the logging counter of host-sync-*: shared, each site would log less often)."""
    define = recipe.match.params.get("define")
    if SITE_TOKEN not in recipe.replacement and not (define and SITE_TOKEN in str(define)):
        return recipe
    site = str(span.line_start)
    params = {**recipe.match.params, **({"define": str(define).replace(SITE_TOKEN, site)} if define else {})}
    return recipe.model_copy(update={"replacement": recipe.replacement.replace(SITE_TOKEN, site),
                                     "match": recipe.match.model_copy(update={"params": params})})


def apply_recipe(source: str, recipe: Recipe, span: SourceSpan) -> Edit:
    """Rewrite the part of `source` (the file `span.file`) that `recipe` matches inside `span`."""
    recipe = per_site(recipe, span)
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise CodemodRefused(f"{span.file} does not parse: {exc.message} (line {exc.raw_line})") from None
    wrapper = MetadataWrapper(module)
    kind = recipe.match.kind
    notes: list[str] = []
    try:
        if kind == "expression":
            new_module, sites = _apply_expression(wrapper, recipe, span)
        elif kind == "call":
            try:
                new_module, sites, notes = apply_call(wrapper, recipe, span)
            except CallRefused as refused:
                raise CodemodRefused(refused.reason, refused.close) from None
        elif kind == "semantic":
            new_module, sites = _apply_semantic(wrapper, recipe, span)
        elif kind == "statements":
            new_module, sites = _apply_statements(wrapper, recipe, span)
        elif kind == "decorate":
            new_module, sites = _apply_decorate(wrapper, recipe, span)
        else:
            raise CodemodRefused(f"recipe {recipe.id}: match kind {kind!r} identifies regions but carries no source rewrite")
        new_module = _add_imports(new_module, recipe.imports)
        define = recipe.match.params.get("define")
        if define:
            new_module, defined = insert_definitions(new_module, str(define))
            notes = notes + defined
    except (PatternError, TemplateError, DefinitionError) as exc:
        raise CodemodRefused(f"recipe {recipe.id}: {exc}") from None
    return Edit(source=new_module.code, sites=sites, notes=notes)


# --- expression ---------------------------------------------------------------------------------


def _patterns(recipe: Recipe) -> list[cst.BaseExpression]:
    params = recipe.match.params
    texts = ([params["pattern"]] if "pattern" in params else []) + list(params.get("alternatives", []) or [])
    return [parse_expression_pattern(str(text)) for text in texts]


class _ExpressionFinder(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, patterns: list[cst.BaseExpression], span: SourceSpan):
        self.patterns, self.span = patterns, span
        self.found: list[tuple[cst.BaseExpression, Bindings, SourceSpan]] = []
        self.in_span: list[tuple[cst.BaseExpression, SourceSpan]] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if not isinstance(node, cst.BaseExpression):
            return True
        position = self.get_metadata(PositionProvider, node)
        if position.end.line < self.span.line_start or position.start.line > self.span.line_end:
            return True
        site = SourceSpan(file=self.span.file, line_start=position.start.line, line_end=position.end.line)
        if self.span.line_start <= position.start.line and position.end.line <= self.span.line_end:
            for pattern in self.patterns:
                bindings = match(pattern, node)
                if bindings is not None:
                    self.found.append((node, bindings, site))
                    return False  # outermost match wins; do not look inside it
            self.in_span.append((node, site))
        return True


def _apply_expression(wrapper: MetadataWrapper, recipe: Recipe, span: SourceSpan):
    finder = _ExpressionFinder(_patterns(recipe), span)
    wrapper.visit(finder)
    module = wrapper.module
    helper_misses: list[str] = []
    if recipe.match.params.get("helpers"):
        finder.found, helper_misses = _check_helpers(module, finder.found, dict(recipe.match.params["helpers"]))
    if not finder.found and helper_misses:
        raise CodemodRefused(f"recipe {recipe.id} matches in {span}, but a helper it calls is not the one it needs: "
                             f"{helper_misses[0]}", helper_misses)
    if not finder.found:
        raise CodemodRefused(f"no expression in {span} matches recipe {recipe.id}", _closest(module, finder.in_span))
    if len(finder.found) > 1 and not recipe.match.params.get("all_in_span", False):
        lines = ", ".join(str(site) for _, _, site in finder.found)
        raise CodemodRefused(f"recipe {recipe.id} matches {len(finder.found)} expressions in {span} ({lines}); "
                             "narrow the span or mark the recipe all_in_span")
    replacements = {node: render_expression(recipe.replacement, bindings, module) for node, bindings, _ in finder.found}
    return _replace_nodes(module, replacements), [site for _, _, site in finder.found]


def apply_companion(source: str, file: str, edit: CompanionEdit) -> Edit | None:
    """`source` (the file `file`) with every expression that the companion edit matches rewritten (outermost matches;
    `Recipe.also`), or None when nothing in it matches or it does not parse."""
    if not any(all(word in source for word in _words(text)) for text in (edit.pattern, *edit.alternatives)):
        return None  # a file that cannot match is not parsed (a repository may hold thousands)
    try:
        module = cst.parse_module(source)
        patterns = [parse_expression_pattern(text) for text in (edit.pattern, *edit.alternatives)]
    except (cst.ParserSyntaxError, PatternError):
        return None
    wrapper = MetadataWrapper(module)
    finder = _ExpressionFinder(patterns, SourceSpan(file=file, line_start=1, line_end=max(1, source.count("\n") + 1)))
    wrapper.visit(finder)
    if not finder.found:
        return None
    try:
        replacements = {node: render_expression(edit.replacement, bindings, wrapper.module)
                        for node, bindings, _ in finder.found}
    except TemplateError:
        return None
    return Edit(source=_replace_nodes(wrapper.module, replacements).code, sites=[site for _, _, site in finder.found],
                notes=[edit.why])


def _words(pattern: str) -> list[str]:
    """The names a pattern spells out (its `$placeholders` aside): text every match contains."""
    return re.findall(r"(?<![$\w])[A-Za-z_]\w*", pattern)


def _check_helpers(module: cst.Module, found, helpers: dict) -> tuple[list, list[str]]:
    """Keep the matches whose helper metavariables (``params.helpers``: name -> statement patterns of
    the helper's body) name a function or method of this file whose body is one of those forms
    (``TinyRotary._swap_halves(q)``, ``self.rotate(x)``, ``rotate_half(x)``)."""
    kept, misses = [], []
    for node, bindings, site in found:
        why = helpers_mismatch(module, bindings, helpers)
        if why is None:
            kept.append((node, bindings, site))
        else:
            misses.append(f"{site}: {why}")
    return kept, misses


def helpers_mismatch(module: cst.Module, bindings: Bindings, helpers: dict) -> str | None:
    """Why a helper bound in ``bindings`` is not one of the forms ``helpers`` names, or None."""
    defs = scopes.definitions(module)
    for name, forms in helpers.items():
        callee = bindings.get(name)
        if callee is None:
            continue  # matched by a form that names no helper
        ident = callee.value if isinstance(callee, cst.Name) else callee.attr.value if isinstance(callee, cst.Attribute) else None
        candidates = [d for d in defs if ident is not None and d.function.name.value == ident]
        if not candidates:
            return f"{module.code_for_node(callee).strip()} is not defined in this file"
        if not any(_body_is(d.function, forms) for d in candidates):
            return f"{ident}() computes something else than {str(list(forms)[0]).splitlines()[-1].strip()}"
    return None


def _body_is(function: cst.FunctionDef, forms) -> bool:
    docstring = _docstring(function)
    body = list(function.body.body)[len(docstring):]
    for form in ([forms] if isinstance(forms, str) else list(forms)):
        slots = stmts.sequences({"pattern": str(form)})[0]
        if len(slots) == len(body) and any(True for _ in stmts.match_sequence(slots, body)):
            return True
    return False


def _closest(module: cst.Module, candidates: list[tuple[cst.BaseExpression, SourceSpan]], limit: int = 3) -> list[str]:
    """The largest expressions in the span: what the author probably meant the pattern to match."""
    outer = sorted(candidates, key=lambda item: -len(module.code_for_node(item[0])))[:limit]
    return [f"{site}: {module.code_for_node(node).strip()[:160]}" for node, site in outer]


class _NodeReplacer(cst.CSTTransformer):
    def __init__(self, replacements: dict[cst.CSTNode, cst.CSTNode]):
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):
        return self.replacements.get(original_node, updated_node)


def _replace_nodes(module: cst.Module, replacements: dict) -> cst.Module:
    return module.visit(_NodeReplacer(replacements))


# --- call: see calls.py ------------------------------------------------------------------------


# --- semantic (module forward / function) -------------------------------------------------------


def _apply_semantic(wrapper: MetadataWrapper, recipe: Recipe, span: SourceSpan):
    params = recipe.match.params
    module = wrapper.module
    positions = wrapper.resolve(PositionProvider)
    scope, signature = params["scope"], [str(n) for n in params["signature"]]
    attributes = [str(a) for a in params.get("attributes", []) or []]
    function, owner = _find_scope(module, positions, span, scope)
    if function is None:
        raise _no_scope(module, positions, span, scope, recipe)
    arg_names = [p.name.value for p in function.params.params]
    if scope == "module_forward":
        arg_names = arg_names[1:]  # self
    if len(arg_names) != len(signature):
        raise CodemodRefused(f"{function.name.value}({', '.join(arg_names)}) takes {len(arg_names)} argument(s); "
                             f"recipe {recipe.id} expects ({', '.join(signature)})")
    bindings: Bindings = {name: cst.Name(actual) for name, actual in zip(signature, arg_names)}
    if attributes:
        assigned = scopes.attribute_reads(owner, "self")
        missing = [a for a in attributes if a not in assigned]
        if missing:
            raise CodemodRefused(f"class {owner.name.value} never assigns self.{', self.'.join(missing)}, which recipe {recipe.id} needs")
        bindings.update({f"self_{a}": cst.Attribute(value=cst.Name("self"), attr=cst.Name(a)) for a in attributes})
    learned = scopes.learned_buffers(owner, params)
    if learned:
        raise CodemodRefused(f"class {owner.name.value} makes self.{', self.'.join(learned)} an nn.Parameter; recipe {recipe.id} "
                             "takes them as fixed tables (buffers): a learned table has gradients and values of its own")
    anchors = [parse_expression_pattern(str(text)) for text in params.get("alternatives", []) or []]
    by_behaviour = bool(params.get("probe") or params.get("candidates"))
    if by_behaviour and not anchors:
        raise CodemodRefused(f"recipe {recipe.id} is matched by behaviour, not by spelling: {function.name.value} and its "
                             "candidates must run on the same inputs first (agents/coder/semantic_match.py)")
    if anchors and not _contains_match(function, anchors):
        raise CodemodRefused(f"{function.name.value} in {span} contains none of recipe {recipe.id}'s known forms; "
                             "it may compute something else (a semantic check on captured shapes would decide)",
                             [module.code_for_node(function.body).strip()[:200]])
    body = render_statements(f"return {recipe.replacement}", bindings, module)
    docstring = _docstring(function)
    new_function = function.with_changes(body=function.body.with_changes(body=[*docstring, *body]))
    position = positions[function]
    site = SourceSpan(file=span.file, line_start=position.start.line, line_end=position.end.line, function=function.name.value)
    return _replace_nodes(module, {function: new_function}), [site]


def _find_scope(module: cst.Module, positions, span: SourceSpan, scope: str):
    """(function, owning class) for the scope that holds the span, at any depth (methods, nested
    functions, classes inside functions); (None, None) when there is none."""
    found = scopes.module_forward(module, positions, span) if scope == "module_forward" \
        else scopes.innermost_function(module, positions, span)
    if found is None:
        return None, None
    return found.function, found.owner


def _no_scope(module: cst.Module, positions, span: SourceSpan, scope: str, recipe: Recipe) -> CodemodRefused:
    what = "class with a forward method" if scope == "module_forward" else "function or method"
    return CodemodRefused(f"no {what} overlaps {span} for recipe {recipe.id}: "
                          f"{scopes.describe_position(module, positions, span)}")


def _contains_match(function: cst.FunctionDef, patterns: list[cst.BaseExpression]) -> bool:
    hit = []

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, cst.BaseExpression) and any(match(p, node) is not None for p in patterns):
                hit.append(node)
                return False
            return not hit

    function.visit(Visitor())
    return bool(hit)


def _docstring(function: cst.FunctionDef) -> list[cst.BaseStatement]:
    first = function.body.body[0] if function.body.body else None
    if isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 and isinstance(first.body[0], cst.Expr) \
            and isinstance(first.body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        return [first]
    return []


# --- statements ---------------------------------------------------------------------------------


def _apply_statements(wrapper: MetadataWrapper, recipe: Recipe, span: SourceSpan):
    params = recipe.match.params
    module = wrapper.module
    positions = wrapper.resolve(PositionProvider)
    slack = int(params.get("slack", 1))
    near: list[str] = []
    for slots in stmts.sequences(params):
        found, close = stmts.find(module, positions, slots, span, slack)
        near += close
        edits, unsafe = [], []
        helpers = dict(params.get("helpers", {}) or {})
        kinds = dict(params.get("modules", {}) or {})
        for f in found:
            why = helpers_mismatch(module, f.bindings, helpers) if helpers else None
            why = why or (modules_mismatch(module, f.bindings, kinds) if kinds else None)
            if why is not None:
                unsafe.append(f"{f.site}: {why}")
                continue
            new = stmts.render(recipe.replacement, f, module)
            reason = stmts.check_safety(module, wrapper, positions, f, new)
            if reason:
                unsafe.append(f"{f.site}: {reason}")
                continue
            edits.append((f, new))
        near += unsafe
        if not edits:
            continue
        if len(edits) > 1 and not params.get("all_in_span", False):
            raise CodemodRefused(f"recipe {recipe.id} matches {len(edits)} statement sequences in {span} "
                                 f"({', '.join(str(f.site) for f, _ in edits)}); narrow the span or mark the recipe all_in_span")
        return stmts.replace_blocks(module, edits), [f.site for f, _ in edits]
    in_span = [f"{positions[s].start.line}: {module.code_for_node(s).strip().splitlines()[0][:150]}"
               for block in stmts.statement_blocks(module) for s in block.body
               if span.line_start <= positions[s].start.line <= span.line_end]
    raise CodemodRefused(f"no statement sequence in {span} matches recipe {recipe.id}", near + in_span[:6])


# --- decorate -----------------------------------------------------------------------------------


def _apply_decorate(wrapper: MetadataWrapper, recipe: Recipe, span: SourceSpan):
    params = recipe.match.params
    module = wrapper.module
    positions = wrapper.resolve(PositionProvider)
    scope = str(params["scope"])
    if scope not in ("function", "module_forward"):
        raise CodemodRefused(f"recipe {recipe.id}: params.scope must be 'function' or 'module_forward', not {scope!r}")
    function, _ = _find_scope(module, positions, span, scope)
    if function is None:
        raise _no_scope(module, positions, span, scope, recipe)
    decorator = render_expression(recipe.replacement, {}, module)
    if any(equal(d.decorator, decorator) for d in function.decorators):
        raise CodemodRefused(f"{function.name.value} in {span} is already decorated with {recipe.replacement}")
    only = [str(f) for f in params.get("functions", []) or []]
    if only and function.name.value not in only:
        raise CodemodRefused(f"{span} lies in {function.name.value}(), not in {' / '.join(only)}: recipe {recipe.id} "
                             f"compiles only {' / '.join(only)}")
    why_not = _why_not_compiled(module, function)
    if why_not:
        raise CodemodRefused(f"{function.name.value} (line {positions[function].start.line}) holds {span} but {why_not}; "
                             f"recipe {recipe.id} does not apply there")
    new_function = function.with_changes(decorators=[*function.decorators, cst.Decorator(decorator=decorator)])
    position = positions[function]
    site = SourceSpan(file=span.file, line_start=position.start.line, line_end=position.end.line, function=function.name.value)
    return _replace_nodes(module, {function: new_function}), [site]


_COMPILE_DECORATORS = ("torch.compile", "compile", "_tb_npu_compile", "torch.jit.script")


def _why_not_compiled(module: cst.Module, function: cst.FunctionDef) -> str | None:
    """Why decorating `function` with a compile would be wrong, or None."""
    name = function.name.value
    if name == "__init__" or (name.startswith("__") and name.endswith("__") and name != "__call__"):
        return f"it is the special method {name}, which builds state rather than computing the step"
    for d in function.decorators:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        if module.code_for_node(target).strip() in _COMPILE_DECORATORS:
            return f"it is already compiled (@{module.code_for_node(d.decorator).strip()})"
    if function.asynchronous is not None:
        return "it is a coroutine"
    generator: list[cst.Yield] = []
    loop_calls: list[str] = []

    class Visitor(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is function  # yields and calls of nested functions are theirs

        def visit_Yield(self, node: cst.Yield) -> None:
            generator.append(node)

        def visit_Call(self, node: cst.Call) -> None:
            if isinstance(node.func, cst.Attribute) and _drives_training(node.func):
                loop_calls.append(module.code_for_node(node).strip())

    function.visit(Visitor())
    if generator:
        return "it is a generator (yield)"
    if loop_calls:
        # a compiled loop draws its random batches and dropout masks from other random numbers than eager's, and
        # compiles the optimizer and the data pipeline with it: the last rung compiles a module's forward or one function
        return (f"it holds the training loop ({loop_calls[0][:60]}): compiling it would compile the loop, its data "
                "and its optimizer; compile the module's forward or the function the region is in")
    return None


_TRAINING_CALLS = ("backward", "zero_grad", "step", "fit")


def _drives_training(func: cst.Attribute) -> bool:
    """`loss.backward()`, `optimizer.zero_grad()`, `optimizer.step()`, `trainer.fit()`/`trainer.train()` (not
    `super().step()` inside an optimizer's own step, not `model.train()` on a module: only a trainer object's)."""
    name = func.attr.value
    receiver = func.value
    if isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Name) and receiver.func.value == "super":
        return False
    if name == "train":
        return isinstance(receiver, cst.Name) and "trainer" in receiver.value.lower()
    return name in _TRAINING_CALLS


# --- imports ------------------------------------------------------------------------------------


def _add_imports(module: cst.Module, lines: list[str]) -> cst.Module:
    if not lines:
        return module
    context = CodemodContext()
    for line in lines:
        spec = parse_import_line(line)
        AddImportsVisitor.add_needed_import(context, spec.module, spec.obj, spec.asname)
    return AddImportsVisitor(context).transform_module(module)
