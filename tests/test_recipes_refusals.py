"""Recipes refuse code that looks like their pattern but computes something else, and the NPU
regional-compile helper tells TorchAir from torch_npu's silent eager fallback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from trainbridge.records import SourceSpan
from recipe_lab import PYTHON, RECIPES, VARIANTS, Case, apply_case
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe

# ------------------------------------------------------------------------------------------------
# refusals on code that looks like a recipe's pattern but computes something else


def _apply_text(recipe_id: str, source: str, start: int, end: int):
    return apply_recipe(source, RECIPES[recipe_id], SourceSpan(file="m.py", line_start=start, line_end=end))


def test_layernorm_recipe_refuses_an_unbiased_variance():
    source = (
        "import torch\n\n\nclass Norm(torch.nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(d))\n        self.bias = torch.nn.Parameter(torch.zeros(d))\n"
        "        self.eps = 1e-5\n\n    def forward(self, x):\n        mu = x.mean(-1, keepdim=True)\n"
        "        var = x.var(-1, keepdim=True)\n        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias\n"
    )
    with pytest.raises(CodemodRefused, match="known forms"):
        _apply_text("layernorm-f-layer-norm", source, 4, 14)


def test_host_sync_recipes_refuse_when_the_synced_value_is_used_later():
    source = (
        "def train_step(model, optimizer, batch):\n    loss = model(batch)\n    loss.backward()\n"
        "    value = loss.item()\n    print(value)\n    return value\n"
    )
    with pytest.raises(CodemodRefused, match="value \\(line 6\\) is read after"):
        _apply_text("host-sync-log-every", source, 4, 5)
    with pytest.raises(CodemodRefused):
        _apply_text("host-sync-inline-log-every", "def f(loss):\n    return loss.item()\n", 2, 2)


def test_attention_recipe_refuses_a_non_causal_mask_and_a_reused_probability():
    masked = (
        "import torch\n\n\ndef attn(q, k, v, keep):\n    s = (q @ k.transpose(-2, -1)) * 0.125\n"
        "    m = torch.triu(torch.ones(8, 8, dtype=torch.bool, device=q.device), diagonal=2)\n"
        "    s = s.masked_fill(m, float('-inf'))\n    p = torch.softmax(s, dim=-1)\n    return p @ v\n"
    )
    with pytest.raises(CodemodRefused, match="no statement sequence"):  # diagonal=2 is not causal
        _apply_text("attention-sdpa-causal", masked, 5, 9)
    reused = (
        "import torch\n\n\ndef attn(q, k, v):\n    s = (q @ k.transpose(-2, -1)) * 0.125\n"
        "    m = torch.triu(torch.ones(8, 8, dtype=torch.bool, device=q.device), diagonal=1)\n"
        "    s = s.masked_fill(m, float('-inf'))\n    p = torch.softmax(s, dim=-1)\n    out = p @ v\n"
        "    return out, p\n"
    )
    with pytest.raises(CodemodRefused, match="p \\(line 10\\) is read after"):
        _apply_text("attention-sdpa-causal", reused, 5, 9)


def test_swiglu_recipe_keeps_the_gate_first_whatever_the_source_order():
    source = "import torch.nn.functional as F\n\n\ndef mlp(x, w_gate, w_up):\n    return w_up(x) * F.silu(w_gate(x))\n"
    edit = _apply_text("swiglu-npu-swiglu", source, 5, 5)
    assert "torch_npu.npu_swiglu(torch.cat((w_gate(x), w_up(x)), dim=-1), dim=-1)" in edit.source


# ------------------------------------------------------------------------------------------------
# compile-regional-npu: the helper tells TorchAir from torch_npu's silent eager fallback

FAKE_TORCH_NPU = '''
import warnings
from torch._dynamo import register_backend

def {name}(gm, example_inputs):
    return gm.forward

register_backend(name="npu")({name})
'''

COMPILE_CHILD = r'''
import sys, json
sys.path.insert(0, sys.argv[1])
import torch
sys.path.insert(0, sys.argv[2])
from lm import rope
x = torch.randn(2, 4, 8, 6)
cos, sin = torch.randn(1, 1, 8, 6), torch.randn(1, 1, 8, 6)
half = 3
expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
print(json.dumps({"max_abs": float((rope(x, cos, sin) - expected).abs().max())}))
'''


@pytest.mark.parametrize("torchair, backend_name, outcome", [
    (False, "_eager_npu_backend", "would silently run eager"),  # torch_npu built without torchair
    (True, "_eager_npu_backend", "would silently run eager"),
    (True, "npu_backend", "ok"),  # a real (here: trivial, graph-running) TorchAir backend
])
def test_npu_compile_helper_refuses_the_silent_eager_fallback(tmp_path, torchair, backend_name, outcome):
    fake = tmp_path / "fake"
    package = fake / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH_NPU.format(name=backend_name))
    if torchair:
        (package / "dynamo" / "torchair").mkdir(parents=True)
    program = tmp_path / "program"
    shutil.copytree(VARIANTS / "variant_lm", program)
    applied = apply_case(Case("compile-regional-npu", "variant_lm", "npu", "rope"), program)
    assert applied.file == "lm.py" and "@_tb_npu_compile" in applied.after
    done = subprocess.run([PYTHON, "-c", COMPILE_CHILD, str(fake), str(program)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    if outcome == "ok":
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["max_abs"] < 1e-6
    else:
        assert done.returncode != 0 and outcome in done.stderr, done.stderr[-3000:]
