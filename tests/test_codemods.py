"""The codemod engine: metavariable patterns and recipes applied to real source."""

from __future__ import annotations

import difflib
from pathlib import Path

import libcst as cst
import pytest

from trainbridge.knowledge.schema import parse_recipe
from trainbridge.records import SourceSpan
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.pattern import match, parse_expression_pattern

ROOT = Path(__file__).resolve().parents[1]


def bound(pattern: str, code: str):
    found = match(parse_expression_pattern(pattern), cst.parse_expression(code))
    return None if found is None else {k: cst.Module([]).code_for_node(v) for k, v in found.items()}


def test_patterns_ignore_formatting_and_compare_literals_by_value():
    assert bound("$x * torch.rsqrt($x.pow(2).mean(-1, keepdim=True) + $eps)",
                 "h*torch.rsqrt( h.pow(2.0).mean( -1 , keepdim = True ) + (self.eps) )") == {"x": "h", "eps": "(self.eps)"}
    assert bound("f($a, k=1, j=2)", "f(z, j=2, k=1.0)") == {"a": "z"}  # keyword order, 1 == 1.0
    assert bound("$x * $x", "a.b * a.b") == {"x": "a.b"}
    assert bound("$x * $x", "a * b") is None  # a metavariable binds one piece of code
    assert bound("f($a)", "f(a, b)") is None
    assert bound("x.mean(-1)", "x.mean(1)") is None


def recipe(**overrides):
    data = {
        "id": "test-recipe", "title": "t", "category": "gelu", "targets": ["cpu"],
        "match": {"kind": "expression", "params": {"pattern": "$x * torch.sigmoid($x)"}},
        "replacement": "F.silu($x)", "imports": ["import torch.nn.functional as F"],
        "numerics": {"class": "tolerance", "rtol": 1e-5, "atol": 1e-6},
        "provenance": {"kind": "seed"},
    }
    data.update(overrides)
    return parse_recipe(data)


SOURCE = '''"""A module."""
import torch


def act(h):
    # keep this comment
    y = h * torch.sigmoid(h)   # and this one
    return y


def other(h):
    return h * torch.sigmoid(h)
'''


def changed_lines(before: str, after: str) -> list[int]:
    lines = []
    for group in difflib.SequenceMatcher(None, before.splitlines(), after.splitlines()).get_opcodes():
        tag, i1, i2, _, _ = group
        if tag != "equal":
            lines.extend(range(i1 + 1, max(i2, i1 + 1) + 1))
    return lines


def test_expression_recipe_rewrites_only_inside_the_span_and_adds_the_import_once():
    edit = apply_recipe(SOURCE, recipe(), SourceSpan(file="m.py", line_start=5, line_end=8))
    assert "y = F.silu(h)   # and this one" in edit.source
    assert "# keep this comment" in edit.source
    assert "return h * torch.sigmoid(h)" in edit.source  # outside the span: untouched
    assert edit.source.count("import torch.nn.functional as F") == 1
    again = apply_recipe(edit.source, recipe(), SourceSpan(file="m.py", line_start=12, line_end=13))
    assert again.source.count("import torch.nn.functional as F") == 1
    assert edit.sites == [SourceSpan(file="m.py", line_start=7, line_end=7)]


def test_refusals_say_why_and_what_came_close():
    with pytest.raises(CodemodRefused) as refused:
        apply_recipe(SOURCE, recipe(match={"kind": "expression", "params": {"pattern": "$x * torch.tanh($x)"}}),
                     SourceSpan(file="m.py", line_start=5, line_end=8))
    assert "no expression in m.py:5-8" in str(refused.value) and "h * torch.sigmoid(h)" in str(refused.value)
    with pytest.raises(CodemodRefused, match="matches 2 expressions"):
        apply_recipe(SOURCE, recipe(), SourceSpan(file="m.py", line_start=1, line_end=13))
    with pytest.raises(CodemodRefused, match="does not parse"):
        apply_recipe("def broken(:\n", recipe(), SourceSpan(file="m.py", line_start=1, line_end=1))


def read(example: str, file: str) -> str:
    return (ROOT / "examples" / example / file).read_text()


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_call_recipe_resolves_imports_and_keyword_constraints():
    source = "from torch.optim import AdamW as A\n\nopt = A(params, lr=1e-3, foreach=False)\nother = A(params, lr=1e-3)\n"
    fused = recipe(category="optimizer_step", match={"kind": "call", "params": {"func": "torch.optim.AdamW", "kwargs": {"foreach": False}, "drop_kwargs": ["foreach"]}},
                   replacement="$func($args, fused=True)", imports=[])
    edit = apply_recipe(source, fused, SourceSpan(file="t.py", line_start=3, line_end=3))
    assert "opt = A(params, lr=1e-3, fused=True)" in edit.source
    with pytest.raises(CodemodRefused, match="needs foreach=False"):
        apply_recipe(source, fused, SourceSpan(file="t.py", line_start=4, line_end=4))


def test_semantic_recipe_rewrites_a_module_forward_and_refuses_other_math():
    rms = recipe(category="rmsnorm", match={"kind": "semantic", "params": {
        "scope": "module_forward", "signature": ["x"], "attributes": ["weight", "eps"],
        "alternatives": ["$x * torch.rsqrt($x.pow(2).mean(-1, keepdim=True) + $eps)"]}},
        replacement="F.rms_norm($x, ($x.shape[-1],), $self_weight, $self_eps)")
    source = read("llama_pretrain", "model.py")
    start = line_of(source, "class RMSNorm")
    edit = apply_recipe(source, rms, SourceSpan(file="model.py", line_start=start, line_end=start + 8))
    assert "return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)" in edit.source
    assert all(start <= line <= start + 8 or line < 20 for line in changed_lines(source, edit.source))
    gemma = "import torch\n\nclass GemmaNorm(torch.nn.Module):\n    def __init__(self):\n        self.weight = 1\n        self.eps = 1\n\n" \
            "    def forward(self, x):\n        return x.abs().mean() * (1 + self.weight)\n"
    with pytest.raises(CodemodRefused, match="none of recipe .* known forms"):
        apply_recipe(gemma, rms, SourceSpan(file="g.py", line_start=3, line_end=9))
