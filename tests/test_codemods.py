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


# --- statements, define, decorate (engine extensions) -------------------------------------------


ATTENTION = {
    "kind": "statements",
    "params": {"pattern": [
        ["$s = ($q @ $k.transpose(-2, -1)) * $scale", "$s = torch.matmul($q, $k.transpose(-1, -2)) * $scale"],
        "$s = $s.masked_fill($m, float('-inf'))",
        ["$p = torch.softmax($s, dim=-1)", "$p = $s.softmax(dim=-1)"],
        ["$_[$p @ $v]", "$_[torch.matmul($p, $v)]"],
    ]},
}
SDPA = "$_[F.scaled_dot_product_attention($q, $k, $v, attn_mask=~$m, scale=$scale)]"

ATTENTION_SOURCE = '''import torch


def attend(q, k, v, mask):
    scale = q.size(-1) ** -0.5
    # scores
    w = torch.matmul( q, k.transpose(-1,-2) )*scale
    w = w.masked_fill(mask, float("-inf"))   # hide
    w = w.softmax(dim = -1)
    out = torch.matmul(w, v).transpose(1, 2)
    return out
'''


def test_statements_recipe_matches_a_sequence_across_spellings_and_rewrites_the_using_statement():
    r = recipe(category="attention", match=ATTENTION, replacement=SDPA)
    edit = apply_recipe(ATTENTION_SOURCE, r, SourceSpan(file="a.py", line_start=7, line_end=9))
    assert "    # scores\n    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=scale).transpose(1, 2)\n" in edit.source
    assert "masked_fill" not in edit.source and "scale = q.size(-1) ** -0.5" in edit.source
    assert edit.sites == [SourceSpan(file="a.py", line_start=7, line_end=10)]  # the using statement: slack 1
    strict = recipe(category="attention", match={**ATTENTION, "params": {**ATTENTION["params"], "slack": 0}}, replacement=SDPA)
    with pytest.raises(CodemodRefused, match="lie outside"):
        apply_recipe(ATTENTION_SOURCE, strict, SourceSpan(file="a.py", line_start=7, line_end=9))


def test_statements_recipe_refuses_when_a_removed_name_is_still_read():
    source = ATTENTION_SOURCE.replace("    return out\n", "    return out, w\n")
    r = recipe(category="attention", match=ATTENTION, replacement=SDPA)
    with pytest.raises(CodemodRefused, match=r"w \(line 11\) is read after"):
        apply_recipe(source, r, SourceSpan(file="a.py", line_start=7, line_end=10))


def test_statements_recipe_keeps_returns_unconditional_and_renders_matched_statements():
    guard = recipe(category="host_sync", match={"kind": "statements", "params": {"pattern": "$_[$t.item()]"}},
                   replacement="if every():\n    $_[$t.item()]", imports=[])
    source = "def step(loss):\n    print(loss.item())\n    return loss.item()\n"
    edit = apply_recipe(source, guard, SourceSpan(file="s.py", line_start=2, line_end=2))
    assert "    if every():\n        print(loss.item())\n    return loss.item()\n" in edit.source
    with pytest.raises(CodemodRefused, match="end in a return"):
        apply_recipe(source, guard, SourceSpan(file="s.py", line_start=3, line_end=3))
    after = recipe(category="conv_layout", match={"kind": "statements", "params": {"pattern": "$m = $build.to($d)"}},
                   replacement="$matched\n$m.extra()", imports=[])
    source = "def build(d):\n    if d:\n        net = Net(\n            3,\n        ).to(d)\n    return net\n"
    edit = apply_recipe(source, after, SourceSpan(file="b.py", line_start=3, line_end=5))
    assert "        net = Net(\n            3,\n        ).to(d)\n        net.extra()\n    return net\n" in edit.source


def test_define_inserts_helpers_once_after_the_imports_and_refuses_a_clash():
    helper = "def _tb_twice(x):\n    return x + x\n"
    r = recipe(match={"kind": "expression", "params": {"pattern": "$x * 2", "define": helper}},
               replacement="_tb_twice($x)", imports=[])
    source = '"""Doc."""\nimport torch\n\nA = 1\n\n\ndef f(a):\n    return a * 2\n\n\ndef g(b):\n    return b * 2\n'
    once = apply_recipe(source, r, SourceSpan(file="d.py", line_start=8, line_end=8))
    assert once.source.startswith('"""Doc."""\nimport torch\n\n\ndef _tb_twice(x):\n    return x + x\n\n\nA = 1\n')
    assert once.notes == ["inserted helper _tb_twice"]
    at = line_of(once.source, "return b * 2")
    twice = apply_recipe(once.source, r, SourceSpan(file="d.py", line_start=at, line_end=at))
    assert twice.source.count("def _tb_twice") == 1 and "return _tb_twice(b)" in twice.source and twice.notes == []
    clash = source.replace("A = 1", "def _tb_twice(x):\n    return 2 * x")
    with pytest.raises(CodemodRefused, match="already defines _tb_twice differently"):
        apply_recipe(clash, r, SourceSpan(file="d.py", line_start=9, line_end=9))
    bad = recipe(match={"kind": "expression", "params": {"pattern": "$x * 2", "define": "print('side effect')"}},
                 replacement="$x", imports=[])
    with pytest.raises(CodemodRefused, match="may only hold def, class"):
        apply_recipe(source, bad, SourceSpan(file="d.py", line_start=8, line_end=8))


def test_decorate_recipe_and_call_absent_kwargs():
    compile_ = recipe(category="elementwise_chain", match={"kind": "decorate", "params": {"scope": "function"}},
                      replacement="torch.compile(dynamic=False)", imports=["import torch"])
    source = "import torch\n\n\n@staticmethod\ndef rope(x):\n    return x\n"
    edit = apply_recipe(source, compile_, SourceSpan(file="r.py", line_start=6, line_end=6))
    assert "@staticmethod\n@torch.compile(dynamic=False)\ndef rope(x):" in edit.source
    with pytest.raises(CodemodRefused, match="already decorated"):
        apply_recipe(edit.source, compile_, SourceSpan(file="r.py", line_start=7, line_end=7))
    sgd = recipe(category="optimizer_step", match={"kind": "call", "params": {
        "func": "torch.optim.SGD", "drop_kwargs": ["foreach"], "absent_kwargs": ["fused"]}},
        replacement="$func($args, fused=True)", imports=[])
    src = "import torch\nopt = torch.optim.SGD(ps, lr=0.1, foreach=False)\nother = torch.optim.SGD(ps, lr=0.1, fused=False)\n"
    assert "opt = torch.optim.SGD(ps, lr=0.1, fused=True)" in apply_recipe(src, sgd, SourceSpan(file="o.py", line_start=2, line_end=2)).source
    with pytest.raises(CodemodRefused, match="already passes fused"):
        apply_recipe(src, sgd, SourceSpan(file="o.py", line_start=3, line_end=3))


def test_template_parenthesises_bound_code_only_where_needed():
    r = recipe(match={"kind": "expression", "params": {"pattern": "$a.masked_fill($m, 0)"}},
               replacement="f(~$m, x=$a, y=$a.t())", imports=[])
    edit = apply_recipe("z = (p + q).masked_fill(r == 0, 0)\n", r, SourceSpan(file="t.py", line_start=1, line_end=1))
    assert "z = f(~(r == 0), x=(p + q), y=(p + q).t())" in edit.source
    plain = recipe(match={"kind": "expression", "params": {"pattern": "g($a)"}}, replacement="h($a, k=$a)", imports=[])
    assert "h(p + q, k=p + q)" in apply_recipe("g(p + q)\n", plain, SourceSpan(file="t.py", line_start=1, line_end=1)).source


def test_two_rewritten_logging_sites_in_one_file_keep_counters_of_their_own():
    """Found on a Modded-NanoGPT record: its print and its log-file write, both rewritten by host-sync-inline-log-every,
    shared one counter, so it advanced twice per step: the print ran every 5th step and the write never."""
    import torch
    import yaml

    path = Path(__file__).resolve().parent.parent / "knowledge" / "recipes" / "host-sync-inline-log-every.yaml"
    inline = parse_recipe(yaml.safe_load(path.read_text(encoding="utf-8")), path.name)
    source = (
        "import torch\n"
        "LOG = []\n"
        "def step(i, loss):\n"
        "    LOG.append(('print', i, loss.item()))\n"
        "    LOG.append(('write', i, loss.item()))\n"
    )
    once = apply_recipe(source, inline, SourceSpan(file="m.py", line_start=4, line_end=4)).source
    write_line = once.splitlines().index("    LOG.append(('write', i, loss.item()))") + 1
    twice = apply_recipe(once, inline, SourceSpan(file="m.py", line_start=write_line, line_end=write_line)).source
    namespace: dict = {}
    exec(compile(twice, "m.py", "exec"), namespace)
    for i in range(25):
        namespace["step"](i, torch.tensor(float(i)))
    logged = namespace["LOG"]
    assert [i for kind, i, _ in logged if kind == "print"] == [0, 10, 20]
    assert [i for kind, i, _ in logged if kind == "write"] == [0, 10, 20]
