"""Semantic matching of a function-shaped region: the probe program that runs the region and a candidate.

For a region that is a whole function (a module-level or nested function, a static helper) the
syntactic patterns are only the fast path: however the function is written, a replacement is right
when it computes the same outputs and the same input gradients. This module builds, as text, a
self-contained program that checks exactly that on given input shapes:

- the file's top-level imports and its top-level functions (the helpers the region may call), without
  decorators (a ``@torch.compile`` changes nothing of the semantics), then the recipe's imports and
  ``define``;
- the original function as ``_tb_original`` and each candidate (the same signature, its body
  ``return <replacement>``) as ``_tb_candidate_<i>``;
- a driver that, for each input-shape set in turn, draws seeded inputs (float inputs require grad),
  runs the original (a shape set it rejects is skipped: it is not the shapes the region takes), runs
  each candidate on clones, back-propagates the same random cotangent through both and prints one JSON
  line per candidate with the largest output and gradient differences and the smallest cosine.

A module's ``forward`` that reads its own tables (a recipe of scope ``module_forward``: ``self.cos``, ``self.sin``
buffers of a rotary module) is probed on a stand-in module holding only the recipe's ``attributes``, drawn like the
inputs (``self_<name>`` in the shape sets; ``grad: false`` for buffers): the forward may read nothing else of its
object, and the recipe's ``buffers`` must not be parameters of the class.

Nothing here runs the program: the user's code runs only in a sandboxed child
(agents/coder/semantic_match.py). Input shapes are the recipe's ``params.probe`` (``{arg: {shape:
[...], dtype: float32, low: -1, high: 1}}`` or a list of such sets) unless the caller passes shapes
captured from the real step.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from trainbridge.knowledge.schema import Recipe
from trainbridge.records import SourceSpan
from trainbridge.tools.codemods import scopes
from trainbridge.tools.codemods.template import render_statements

ORIGINAL, CANDIDATE = "_tb_original", "_tb_candidate"
ArgSpec = dict  # {"shape": [..], "dtype": "float32", "low": -1.0, "high": 1.0}; int dtypes: integer draws in [low, high);
# complex dtypes: unit phasors of random angles (rotary frequencies)


class ProbeError(ValueError):
    """The region or the recipe cannot be probed (no function holds the span, no shapes, ...)."""


@dataclass(frozen=True)
class RegionProbe:
    program: str
    function: str  # the region's qualified name
    site: SourceSpan  # the whole function's lines
    shape_sets: list[dict[str, ArgSpec]]
    replacements: list[str]  # the candidates, in the order the program tries them


def shape_sets(recipe: Recipe, captured: dict[str, ArgSpec] | None = None) -> list[dict[str, ArgSpec]]:
    """The input-shape sets to try: the captured ones when given, else the recipe's ``params.probe``."""
    if captured:
        return [captured]
    probe = recipe.match.params.get("probe")
    if not probe:
        raise ProbeError(f"recipe {recipe.id} names no probe shapes (params.probe) and none were captured")
    return [dict(s) for s in (probe if isinstance(probe, list) else [probe])]


def find_function(source: str, span: SourceSpan) -> tuple[cst.Module, cst.FunctionDef, str, SourceSpan]:
    """The innermost function or method holding the span, as (module, node, qualname, its lines)."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    positions = wrapper.resolve(PositionProvider)
    found = scopes.innermost_function(wrapper.module, positions, span)
    if found is None:
        raise ProbeError(f"no function holds {span}: {scopes.describe_position(wrapper.module, positions, span)}")
    position = positions[found.function]
    site = SourceSpan(file=span.file, line_start=position.start.line, line_end=position.end.line, function=found.function.name.value)
    if found.is_method and not any(isinstance(d.decorator, cst.Name) and d.decorator.value == "staticmethod"
                                   for d in found.function.decorators):
        raise ProbeError(f"{found.qualname} is a method that reads its object; only functions and static helpers are probed here "
                         "(a module's forward by a recipe of scope module_forward)")
    return wrapper.module, found.function, found.qualname, site


def find_forward(source: str, span: SourceSpan, recipe: Recipe) -> tuple[cst.Module, cst.FunctionDef, str, SourceSpan]:
    """The ``forward`` of the module class overlapping the span (a recipe of scope ``module_forward``), as
    (module, node, qualname, its lines), when it reads nothing of its object but the recipe's ``attributes``
    and none of the recipe's ``buffers`` is a parameter of the class."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    positions = wrapper.resolve(PositionProvider)
    found = scopes.module_forward(wrapper.module, positions, span)
    if found is None:
        raise ProbeError(f"no class with a forward overlaps {span}: {scopes.describe_position(wrapper.module, positions, span)}")
    params = recipe.match.params
    attributes = [str(a) for a in params.get("attributes", []) or []]
    others = sorted(scopes.self_reads(found.function) - set(attributes))
    if others:
        raise ProbeError(f"{found.qualname} reads self.{', self.'.join(others)}, which recipe {recipe.id} does not bind "
                         f"(it binds {', '.join(attributes) or 'no attribute'})")
    learned = scopes.learned_buffers(found.owner, params)
    if learned:
        raise ProbeError(f"class {found.owner.name.value} makes self.{', self.'.join(learned)} an nn.Parameter; recipe "
                         f"{recipe.id} takes them as fixed tables (buffers)")
    position = positions[found.function]
    site = SourceSpan(file=span.file, line_start=position.start.line, line_end=position.end.line, function=found.function.name.value)
    return wrapper.module, found.function, found.qualname, site


def _plain(module: cst.Module, function: cst.FunctionDef, name: str) -> str:
    """The function's code, undecorated, dedented, under another name."""
    node = function.with_changes(decorators=[], name=cst.Name(name), leading_lines=[])
    return textwrap.dedent(module.code_for_node(node))


def _context(module: cst.Module) -> list[str]:
    """The file's top-level imports and functions (undecorated): what the region may call."""
    parts = []
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body):
            code = module.code_for_node(statement.with_changes(leading_lines=[])).strip()
            if "torch_npu" not in code:  # the probe imports torch_npu itself when the recipe needs it
                parts.append(code)
        elif isinstance(statement, cst.FunctionDef):
            parts.append(_plain(module, statement, statement.name.value))
    return parts


def candidate_function(module: cst.Module, function: cst.FunctionDef, replacement: str, signature: list[str],
                       name: str = CANDIDATE, attributes: list[str] | None = None) -> str:
    """A candidate (``_tb_candidate_<i>``): the region's signature, its body ``return <replacement>`` with the recipe's
    argument names bound to the region's (for a method, `attributes` given: after its first parameter, and
    ``$self_<a>`` bound to ``<first parameter>.<a>``)."""
    names = [p.name.value for p in function.params.params]
    me = names.pop(0) if attributes is not None and names else None
    if len(names) != len(signature):
        raise ProbeError(f"{function.name.value}({', '.join(names)}) takes {len(names)} argument(s); the recipe expects "
                         f"({', '.join(signature)})")
    bindings = {want: cst.Name(have) for want, have in zip(signature, names)}
    bindings.update({f"self_{a}": cst.Attribute(value=cst.Name(me), attr=cst.Name(a)) for a in attributes or [] if me})
    body = render_statements(f"return {replacement}", bindings, module)
    node = function.with_changes(decorators=[], name=cst.Name(name), leading_lines=[],
                                 body=cst.IndentedBlock(body=list(body)))
    return textwrap.dedent(module.code_for_node(node))


DRIVER = '''
def _tb_draw(spec, generator):
    dtype = getattr(torch, spec.get("dtype", "float32"))
    shape = tuple(spec["shape"])
    low, high = float(spec.get("low", -1.0)), float(spec.get("high", 1.0))
    if dtype.is_complex:  # unit phasors (rotary frequencies, torch.polar(ones, angles)): no gradient
        angles = torch.rand(shape, generator=generator, dtype=torch.float64) * 6.283185307179586
        return torch.polar(torch.ones_like(angles), angles).to(dtype).to(_TB_DEVICE)
    if dtype.is_floating_point:
        value = torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low
        return value.to(dtype).to(_TB_DEVICE).requires_grad_(bool(spec.get("grad", True)))
    return torch.randint(int(low), int(high), shape, generator=generator).to(dtype).to(_TB_DEVICE)


def _tb_tensors(out):
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _tb_compare(a, b):
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    if a.shape != b.shape:
        return None
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = a.abs().max().item() if a.numel() else 0.0
    na, nb = a.norm().item(), b.norm().item()
    cosine = 1.0 if na == 0.0 and nb == 0.0 else (float(a @ b) / (na * nb) if na and nb else 0.0)
    return {"max_abs": diff, "scale": scale, "cosine": cosine}


def _tb_probe(_tb_candidate, shape_sets, seed):
    skipped = []
    for index, specs in enumerate(shape_sets):
        generator = torch.Generator().manual_seed(seed + index)
        inputs = {name: _tb_draw(spec, generator) for name, spec in specs.items()}
        try:
            expected = _tb_original(**inputs)
        except Exception as exc:
            skipped.append(f"set {index}: the region rejects it ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        twins = {name: (t.detach().clone().requires_grad_(t.requires_grad)) for name, t in inputs.items()}
        try:
            got = _tb_candidate(**twins)
        except Exception as exc:
            return {"equivalent": False, "shape_set": index, "reason": f"the candidate raises {type(exc).__name__}: {str(exc)[:200]}"}
        want, have = _tb_tensors(expected), _tb_tensors(got)
        if len(want) != len(have) or any(w.shape != h.shape for w, h in zip(want, have)):
            return {"equivalent": False, "shape_set": index, "reason": "the candidate returns other shapes: "
                    f"{[tuple(w.shape) for w in want]} vs {[tuple(h.shape) for h in have]}"}
        outputs = [_tb_compare(w, h) for w, h in zip(want, have)]
        grads = {}
        differentiable = [(w, h) for w, h in zip(want, have) if w.requires_grad and h.requires_grad]
        if differentiable:
            cotangents = [torch.randn(w.shape, generator=generator, dtype=torch.float64).to(w.dtype).to(_TB_DEVICE) for w, _ in differentiable]
            leaves = [n for n, t in inputs.items() if t.requires_grad]
            g_want = torch.autograd.grad([w for w, _ in differentiable], [inputs[n] for n in leaves], cotangents, allow_unused=True)
            g_have = torch.autograd.grad([h for _, h in differentiable], [twins[n] for n in leaves], cotangents, allow_unused=True)
            for name, a, b in zip(leaves, g_want, g_have):
                if (a is None) != (b is None):
                    return {"equivalent": False, "shape_set": index, "reason": f"the gradient of {name} is missing on one side"}
                if a is not None:
                    grads[name] = _tb_compare(a, b)
        return {"equivalent": None, "shape_set": index, "outputs": outputs, "grads": grads, "skipped": skipped,
                "shapes": {n: list(t.shape) for n, t in inputs.items()}}
    return {"equivalent": False, "shape_set": None, "reason": "the region rejected every shape set: " + "; ".join(skipped)}


for _tb_index, _tb_function in enumerate(_TB_CANDIDATES):
    print("TB_PROBE " + json.dumps({"candidate": _tb_index, **_tb_probe(_tb_function, _TB_SHAPE_SETS, _TB_SEED)}), flush=True)
'''


def build_probe(source: str, span: SourceSpan, recipe: Recipe, replacements: list[str] | None = None, *,
                captured: dict[str, ArgSpec] | None = None, device: str = "cpu", seed: int = 0) -> RegionProbe:
    """The probe program for the region holding ``span`` against each of ``replacements`` (default: the
    recipe's ``params.candidates``, else its replacement); it prints one ``TB_PROBE`` line per candidate."""
    params = recipe.match.params
    method = params.get("scope") == "module_forward"
    module, function, qualname, site = find_forward(source, span, recipe) if method else find_function(source, span)
    attributes = [str(a) for a in params.get("attributes", []) or []] if method else None
    names = [p.name.value for p in function.params.params][1 if method else 0:]
    signature = [str(n) for n in params.get("signature", [])] or names
    replacements = replacements or [str(c) for c in params.get("candidates", []) or []] or [recipe.replacement]
    if len(names) != len(signature):
        raise ProbeError(f"{qualname}({', '.join(names)}) takes {len(names)} argument(s); recipe {recipe.id} expects "
                         f"({', '.join(signature)})")
    sets = shape_sets(recipe, captured)
    renamed = [{names[signature.index(k)] if k in signature else k: v for k, v in s.items()} for s in sets]
    parts = ["import json", "import torch", *recipe.imports, *_context(module)]
    if params.get("define"):
        parts.append(textwrap.dedent(str(params["define"])))
    if method:
        parts.append(_STAND_IN)
        parts.append(_plain(module, function, ORIGINAL + "_method") + _on_stand_in(ORIGINAL, names, attributes))
        parts += [candidate_function(module, function, text, signature, f"{CANDIDATE}_{i}_method", attributes)
                  + _on_stand_in(f"{CANDIDATE}_{i}", names, attributes) for i, text in enumerate(replacements)]
    else:
        parts.append(_plain(module, function, ORIGINAL))
        parts += [candidate_function(module, function, text, signature, f"{CANDIDATE}_{i}") for i, text in enumerate(replacements)]
    header = (f"_TB_DEVICE = {device!r}\n_TB_SEED = {int(seed)}\n_TB_SHAPE_SETS = json.loads({json.dumps(json.dumps(renamed))})\n"
              f"_TB_CANDIDATES = [{', '.join(f'{CANDIDATE}_{i}' for i in range(len(replacements)))}]\n")
    program = "\n\n".join(parts) + "\n\n" + header + DRIVER
    return RegionProbe(program=program, function=qualname, site=site, shape_sets=renamed, replacements=replacements)


_STAND_IN = '''class _TbModule:
    """The module as a method of it sees it in the probe: the recipe's attributes, drawn like the inputs."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)
'''


def _on_stand_in(name: str, names: list[str], attributes: list[str]) -> str:
    """``name(<args>, self_<a>...)``: calls ``<name>_method`` on a stand-in module holding the attributes."""
    clash = sorted(set(names) & {f"self_{a}" for a in attributes})
    if clash:
        raise ProbeError(f"the region's argument(s) {', '.join(clash)} clash with the probe's names for the module's attributes")
    args = ", ".join([*names, *(f"self_{a}" for a in attributes)])
    held = ", ".join(f"{a}=self_{a}" for a in attributes)
    return f"\n\ndef {name}({args}):\n    return {name}_method(_TbModule({held}), {', '.join(names)})\n"


def verdict(report: dict, rtol: float, atol: float, cosine_min: float = 0.9999) -> tuple[bool, str]:
    """(equivalent, why) from the probe's JSON line, within the recipe's tolerance."""
    if report.get("equivalent") is False:
        return False, str(report.get("reason"))
    worst = []
    for what, figures in [*((f"output {i}", f) for i, f in enumerate(report.get("outputs", []))),
                          *((f"gradient of {n}", f) for n, f in report.get("grads", {}).items())]:
        if figures is None:
            return False, f"{what}: shapes differ"
        bound = atol + rtol * figures["scale"]
        if figures["max_abs"] > bound or figures["cosine"] < cosine_min:
            worst.append(f"{what}: max abs diff {figures['max_abs']:.3g} (allowed {bound:.3g}), cosine {figures['cosine']:.6f}")
    if worst:
        return False, "; ".join(worst)
    figures = [*report.get("outputs", []), *report.get("grads", {}).values()]
    largest = max((f["max_abs"] for f in figures), default=0.0)
    return True, f"equivalent on shapes {report.get('shapes')}: outputs and input gradients within rtol {rtol:g} (largest diff {largest:.3g})"
