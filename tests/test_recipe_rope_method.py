"""A rotary written as a module's forward over its own cos/sin buffers (issue 28: Modded-NanoGPT record 27's form,
``q, k = self.rotary(q), self.rotary(k)``) gets one torch_npu.npu_rotary_mul from rope-method-npu-rotary-mul:
matched by behaviour on a stand-in module (tools/codemods/region_probe.py), refused for near misses (output halves
in the other order, tables that are parameters, a forward that reads more of its module), and the rewritten module
trains like the original under the NPU emulation in float32 and bf16 with the same parameters and state_dict.
Team-written code in the records' style, never a record's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recipe_lab import RECIPES
from trainbridge.agents.analyst.static.scan import scan_source
from trainbridge.agents.coder.semantic_match import apply_semantically, probes
from trainbridge.records import SourceSpan
from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.region_probe import ProbeError, build_probe

RECIPE = RECIPES["rope-method-npu-rotary-mul"]

RECORD = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch import Tensor


    class Rotary(nn.Module):
        def __init__(self, dim: int, max_seq_len: int):
            super().__init__()
            freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
            freq = torch.cat([freq, freq.new_zeros(dim // 4)])  # half of the pairs keep their angle
            angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freq)
            self.cos = nn.Buffer(angle.cos(), persistent=False)
            self.sin = nn.Buffer(angle.sin(), persistent=False)

        def forward(self, x_BTHD: Tensor):
            assert self.cos.size(0) >= x_BTHD.size(-3)
            cos, sin = self.cos[None, :x_BTHD.size(-3), None, :], self.sin[None, :x_BTHD.size(-3), None, :]
            x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
            y1 = x1 * cos + x2 * sin
            y2 = x1 * (-sin) + x2 * cos
            return torch.cat((y1, y2), 3).type_as(x_BTHD)


    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int, max_seq_len: int):
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.rotary = Rotary(self.head_dim, max_seq_len)

        def forward(self, x: Tensor):
            B, T = x.size(0), x.size(1)
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
            q, k = self.rotary(q), self.rotary(k)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))
''').lstrip("\n")


def _forward_span(source: str) -> SourceSpan:
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines, 1) if "def forward(self, x_BTHD" in line)
    end = next(i for i, line in enumerate(lines, 1) if i > start and line.lstrip().startswith("return "))
    return SourceSpan(file="net.py", line_start=start, line_end=end)


def _variant(old: str, new: str) -> str:
    assert RECORD.count(old) == 1
    return RECORD.replace(old, new)


@pytest.fixture(scope="module")
def rewrite():
    """The static scan's rope intent on the record-style file, and the coder's rewrite of its span."""
    intents = [i for i in scan_source(RECORD, "net.py", "npu") if i.category == "rope"]
    assert len(intents) == 1
    span = intents[0].spans[0]
    edit, why = apply_semantically(RECORD, span, RECIPE)
    assert edit is not None, why
    return span, edit, why


def test_the_scans_span_is_the_forward_and_the_recipe_rewrites_it(rewrite):
    span, edit, why = rewrite
    expected = _forward_span(RECORD)
    assert (span.line_start, span.line_end) == (expected.line_start, expected.line_end)
    assert probes(RECIPE)
    with pytest.raises(CodemodRefused, match="matched by behaviour"):  # the syntactic pass leaves it to the probe
        apply_recipe(RECORD, RECIPE, span)
    # the function form refuses the method: it reads its object
    _, function_why = apply_semantically(RECORD, span, RECIPES["rope-function-npu-rotary-mul"])
    assert "reads its object" in function_why
    assert why.startswith("semantic match: Rotary.forward: equivalent") and "candidate 1 of" in why, why
    assert "largest diff 0)" in why  # float32: the same products, summed in the same pairs
    body = edit.source.split("def forward(self, x_BTHD: Tensor):", 1)[1].split("\nclass ", 1)[0]
    assert body.strip() == ("return torch_npu.npu_rotary_mul(x_BTHD, torch.cat((self.cos[None, :x_BTHD.size(1), None, :],) * 2, "
                            "dim=-1), -torch.cat((self.sin[None, :x_BTHD.size(1), None, :],) * 2, dim=-1))")
    assert edit.sites[0].line_start == span.line_start and edit.sites[0].function == "forward"
    assert "import torch_npu" in edit.source
    # nothing but the forward's body changes: __init__, its buffers and the caller stay as written
    before, after = RECORD.split("    def forward(self, x_BTHD")[0], edit.source.split("    def forward(self, x_BTHD")[0]
    assert after.replace("import torch_npu\n", "") == before
    assert edit.source.split("class Attention", 1)[1] == RECORD.split("class Attention", 1)[1]


def test_output_halves_in_the_other_order_match_no_candidate():
    """The static scan takes (y2, y1) too (q.k is unchanged when q and k are permuted alike); per tensor it is
    another function, and the probe says so."""
    swapped = _variant("torch.cat((y1, y2), 3)", "torch.cat((y2, y1), 3)")
    edit, why = apply_semantically(swapped, _forward_span(swapped), RECIPE)
    assert edit is None and why.startswith("Rotary.forward: no candidate computes the same"), why
    assert why.count("max abs diff") >= 2


def test_tables_that_are_parameters_or_a_forward_reading_more_are_refused_before_any_probe():
    learned = _variant("self.cos = nn.Buffer(angle.cos(), persistent=False)", "self.cos = nn.Parameter(angle.cos())")
    with pytest.raises(ProbeError, match=r"makes self.cos an nn.Parameter"):
        build_probe(learned, _forward_span(learned), RECIPE)
    with pytest.raises(CodemodRefused, match=r"makes self.cos an nn.Parameter"):
        apply_recipe(learned, RECIPE, _forward_span(learned))
    registered = _variant("self.sin = nn.Buffer(angle.sin(), persistent=False)",
                          'self.register_parameter("sin", nn.Parameter(angle.sin()))')
    edit, why = apply_semantically(registered, _forward_span(registered), RECIPE)
    assert edit is None and "makes self.sin an nn.Parameter" in why
    scaled = _variant("return torch.cat((y1, y2), 3)", "return self.scale * torch.cat((y1, y2), 3)")
    with pytest.raises(ProbeError, match=r"reads self.scale, which recipe rope-method-npu-rotary-mul does not bind"):
        build_probe(scaled, _forward_span(scaled), RECIPE)


# --- the rewritten module against the original, on the emulated NPU device ------------------------------------------

CHILD = textwrap.dedent('''
    import importlib.util, json, sys
    import torch
    import torch_npu

    count = torch_npu.__trainbridge_kernels_launched__


    def load(name):
        spec = importlib.util.spec_from_file_location(name, name + ".py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


    def compare(a, b):
        a, b = a.detach().double().cpu().flatten(), b.detach().double().cpu().flatten()
        return {"max_abs": (a - b).abs().max().item(), "scale": a.abs().max().item(),
                "cosine": float(a @ b) / (a.norm().item() * b.norm().item())}


    def run(net, dtype):
        torch.manual_seed(0)
        attn = net.Attention(64, 4, 32).npu()
        attn.qkv.to(dtype), attn.proj.to(dtype)  # the rotary tables stay float32, as the records keep them
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 24, 64, generator=g).to(dtype).npu().requires_grad_()
        q = torch.randn(2, 24, 4, 16, generator=g).to(dtype).npu().requires_grad_()
        y = attn(x)
        y.backward(torch.randn(y.shape, generator=g).to(dtype).npu())
        before = count()
        r = attn.rotary(q)
        forward = count() - before
        dr = torch.randn(r.shape, generator=g).to(dtype).npu()
        before = count()
        (dq,) = torch.autograd.grad(r, q, dr)
        backward = count() - before
        grads = {n: p.grad for n, p in attn.named_parameters()}
        return {"y": y, "dx": x.grad, "r": r, "dq": dq, **grads}, {
            "kernels": [forward, backward], "params": [n for n, _ in attn.named_parameters()],
            "state": sorted(attn.state_dict()), "buffers": {n: [str(b.dtype), list(b.shape)] for n, b in attn.named_buffers()},
            "r_dtype": str(r.dtype)}


    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        want, meta_want = run(load("original"), dtype)
        have, meta_have = run(load("rewritten"), dtype)
        out[str(dtype)] = {"diff": {k: compare(want[k], have[k]) for k in want}, "original": meta_want, "rewritten": meta_have}
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def emulated(rewrite, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rope-method")
    (folder / "original.py").write_text(RECORD)
    (folder / "rewritten.py").write_text(rewrite[1].source)
    (folder / "child.py").write_text(CHILD)
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if not k.startswith("TRAINBRIDGE_NPU_EMULATION")})
    proc = subprocess.run([sys.executable, "child.py"], env=env, cwd=folder, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_float32_outputs_and_gradients_agree_to_float32_rounding(emulated):
    diff = emulated["torch.float32"]["diff"]
    assert diff["r"]["max_abs"] == 0.0 and diff["dq"]["max_abs"] <= 1e-6 * diff["dq"]["scale"]  # the method itself
    for name, figures in diff.items():  # through attention: the input's and every parameter's gradient
        assert figures["max_abs"] <= 1e-6 * max(figures["scale"], 1.0) and figures["cosine"] > 0.999999, (name, figures)


def test_bf16_outputs_and_gradients_agree_within_the_recipes_tolerance(emulated):
    """In bf16 the kernel rounds the float32 tables to bf16 first and its output once: about one ulp apart."""
    numerics = RECIPE.numerics
    diff = emulated["torch.bfloat16"]["diff"]
    for name, figures in diff.items():
        assert figures["max_abs"] <= numerics.atol + numerics.rtol * figures["scale"], (name, figures)
        assert figures["cosine"] >= numerics.grad_cosine_min, (name, figures)
    assert 0.0 < diff["r"]["max_abs"] <= 2 ** -7 * diff["r"]["scale"]  # not identical, within two bf16 ulps of the largest


def test_parameters_buffers_and_state_dict_are_unchanged_and_the_method_launches_fewer_kernels(emulated):
    for dtype in ("torch.float32", "torch.bfloat16"):
        original, rewritten = emulated[dtype]["original"], emulated[dtype]["rewritten"]
        assert rewritten["params"] == original["params"] == ["qkv.weight", "proj.weight"]
        assert rewritten["state"] == original["state"] == ["proj.weight", "qkv.weight"]  # the tables are not persistent
        assert rewritten["buffers"] == original["buffers"] == {"rotary.cos": ["torch.float32", [32, 8]],
                                                               "rotary.sin": ["torch.float32", [32, 8]]}
        assert rewritten["r_dtype"] == original["r_dtype"] == dtype
        (forward, backward), (forward_before, backward_before) = rewritten["kernels"], original["kernels"]
        assert forward < forward_before and backward < backward_before, (rewritten["kernels"], original["kernels"])
