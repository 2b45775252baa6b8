"""torch_npu calls in the seed recipes' replacements and helpers checked against the op-plugin
schemas and the wheel's class signatures (tests/fixtures/npu_reference), and the documented traps
of the fusion-attention and gated-activation replacements."""

from __future__ import annotations

import ast
import re

import pytest

from trainbridge.knowledge.schema import Recipe
from recipe_lab import NPU_REFERENCE, RECIPES
from trainbridge.tools.codemods.statements import hole_spans

# ------------------------------------------------------------------------------------------------
# torch_npu calls in replacements against the op-plugin schemas


def _schemas() -> dict[str, list[tuple[str, bool, bool]]]:
    """op name -> [(parameter name, has a default, keyword-only)] from fused_api_signatures.txt."""
    out = {}
    for line in (NPU_REFERENCE / "fused_api_signatures.txt").read_text().splitlines():
        m = re.match(r"^(\w+)\((.*)\) -> ", line)
        if not m:
            continue
        params, star = [], False
        for part in _split_args(m.group(2)):
            if part == "*":
                star = True
                continue
            declaration, _, default = part.partition("=")
            params.append((declaration.split()[-1], bool(default), star))
        out[m.group(1)] = params
    return out


def _split_args(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _class_signatures() -> dict[str, list[str]]:
    out = {}
    for line in (NPU_REFERENCE / "torch_npu_python_api_surface.txt").read_text().splitlines():
        m = re.search(r"class (\w+)\([^)]*\)\.__init__\(self, (.*)\)\s*$", line)
        if m:
            out[m.group(1)] = [p.split("=")[0].strip() for p in _split_args(m.group(2))]
    return out


def _torch_npu_calls(code: str) -> list[ast.Call]:
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.startswith("torch_npu."):
                calls.append(node)
    return calls


def _render_for_check(recipe: Recipe) -> str:
    """The replacement as plain Python (holes opened, placeholders as names) plus the helper code."""
    text = recipe.replacement
    for a, b in reversed(hole_spans(text)):
        text = text[:a] + text[a + 3:b - 1] + text[b:]
    text = re.sub(r"^(\s*)\$\{?matched\}?\s*$", r"\1pass", text, flags=re.MULTILINE)
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: f"ph_{m.group(1)}", text)
    return text + "\n" + str(recipe.match.params.get("define") or "")


NPU_RECIPES = [r for r in RECIPES.values() if "torch_npu." in r.replacement + str(r.match.params.get("define", ""))]


@pytest.mark.parametrize("recipe", NPU_RECIPES, ids=[r.id for r in NPU_RECIPES])
def test_torch_npu_calls_match_the_op_plugin_schemas(recipe):
    assert recipe.targets == ["npu"], f"{recipe.id} calls torch_npu but targets {recipe.targets}"
    assert "import torch_npu" in recipe.imports
    schemas, classes = _schemas(), _class_signatures()
    code = _render_for_check(recipe)
    calls = _torch_npu_calls(code)
    if recipe.match.kind == "decorate":  # regional compile: no fused op, only the backend check (tested elsewhere)
        assert not calls
        return
    assert calls, f"no torch_npu call found in {recipe.id}"
    for call in calls:
        name = ast.unparse(call.func).split(".")[-1]
        if name in classes:
            params = classes[name]
            assert len(call.args) <= len(params)
            continue
        assert name in schemas, f"{recipe.id}: torch_npu.{name} is not in fused_api_signatures.txt"
        params = schemas[name]
        positional = [p for p, _, kw_only in params if not kw_only]
        names = [p for p, _, _ in params]
        assert len(call.args) <= len(positional), f"{recipe.id}: too many positional arguments for {name}"
        given = set(positional[:len(call.args)])
        for kw in call.keywords:
            assert kw.arg in names, f"{recipe.id}: torch_npu.{name} has no parameter {kw.arg!r} (schema: {names})"
            assert kw.arg not in given, f"{recipe.id}: {kw.arg} given twice to {name}"
            given.add(kw.arg)
        missing = [p for p, has_default, _ in params if not has_default and p not in given]
        assert not missing, f"{recipe.id}: torch_npu.{name} misses required {missing}"


def test_npu_adamw_replacement_matches_the_wheel_class_signature():
    recipe = RECIPES["adamw-npu-fused"]
    classes = _class_signatures()
    assert "NpuFusedAdamW" in classes
    dropped = set(recipe.match.params["drop_kwargs"])
    # every torch.optim.AdamW keyword NpuFusedAdamW lacks must be dropped by the recipe
    torch_kwargs = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused"}
    assert torch_kwargs - set(classes["NpuFusedAdamW"]) <= dropped


def test_fusion_attention_replacements_follow_the_documented_traps():
    for rid in ("attention-npu-fusion-causal", "attention-npu-fusion-masked"):
        call = _torch_npu_calls(_render_for_check(RECIPES[rid]))[0]
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert "scale" in keywords, "scale defaults to 1.0: it must be passed"
        assert "atten_mask" in keywords, "without atten_mask sparse_mode is ignored (dense attention)"
        assert ast.unparse(call.args[4]) == "'BNSD'"
    causal = RECIPES["attention-npu-fusion-causal"]
    call = _torch_npu_calls(_render_for_check(causal))[0]
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert keywords["sparse_mode"] == "2" and keywords["next_tockens"] == "0"
    assert "2048, 2048" in causal.match.params["define"] and "diagonal=1" in causal.match.params["define"]
    assert RECIPES["attention-npu-fusion-causal"].replacement.rstrip().endswith("[0]]")


def test_geglu_and_swiglu_pass_the_non_default_halves_explicitly():
    geglu = _torch_npu_calls(_render_for_check(RECIPES["geglu-npu-geglu"]))[0]
    keywords = {k.arg: ast.unparse(k.value) for k in geglu.keywords}
    assert keywords["approximate"] == "0", "npu_geglu defaults to the tanh approximation; F.gelu is erf"
    assert keywords["activate_left"] == "False"
    swiglu = RECIPES["swiglu-npu-swiglu"]
    assert "torch.cat(($g, $u)" in swiglu.replacement, "npu_swiglu activates the first half: the gate goes first"
