"""A recipe that reads a module's attributes is applied only to the kind of module it is right for."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainbridge.knowledge.schema import load_recipe_file
from trainbridge.records import SourceSpan
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe

ROOT = Path(__file__).resolve().parents[1]
ADD_RMS_NORM = load_recipe_file(ROOT / "knowledge" / "recipes" / "add-rms-norm-npu.yaml")

BLOCK = '''import torch
from torch import nn


class {norm_class}(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.norm = {constructed}(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, delta):
        h = x + self.mix(delta)
        return self.out(self.norm(h))
'''


def _apply(norm_class: str, constructed: str):
    source = BLOCK.format(norm_class=norm_class, constructed=constructed)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "h = x + self.mix" in text)
    return apply_recipe(source, ADD_RMS_NORM, SourceSpan(file="m.py", line_start=line, line_end=line + 1))


@pytest.mark.parametrize("norm_class, constructed", [("RMSNorm", "RMSNorm"), ("LlamaRMSNorm", "LlamaRMSNorm"),
                                                     ("Unused", "nn.RMSNorm")])
def test_add_rms_norm_rewrites_an_add_before_an_rms_norm_module(norm_class, constructed):
    edit = _apply(norm_class, constructed)
    assert "_TbAddRmsNorm.apply(x, self.mix(delta), self.norm.weight, self.norm.eps)" in edit.source


@pytest.mark.parametrize("norm_class, constructed, named", [("LayerNorm", "LayerNorm", "LayerNorm"),
                                                            ("Unused", "nn.LayerNorm", "nn.LayerNorm")])
def test_add_rms_norm_refuses_a_layer_norm_which_has_weight_and_eps_too(norm_class, constructed, named):
    # clip's `x = torch.cat(...) + self.positional_embedding; x = self.ln_pre(x)` was rewritten and crashed
    with pytest.raises(CodemodRefused) as refused:
        _apply(norm_class, constructed)
    assert any(f"self.norm is a {named}, not a RMSNorm" in text for text in [refused.value.reason, *refused.value.close])


def test_a_module_the_file_never_constructs_is_refused():
    source = BLOCK.format(norm_class="RMSNorm", constructed="RMSNorm").replace("self.norm = RMSNorm(dim)", "pass")
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "h = x + self.mix" in text)
    with pytest.raises(CodemodRefused) as refused:
        apply_recipe(source, ADD_RMS_NORM, SourceSpan(file="m.py", line_start=line, line_end=line + 1))
    assert any("self.norm is not constructed in this file" in text for text in refused.value.close)
