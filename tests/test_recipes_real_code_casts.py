"""The redundant_cast detector on real-code forms (issue 13), with the near-misses it must leave alone.

A redundant cast copies the whole tensor and changes nothing: an fp32 cast of a factory that
already makes fp32, or an upcast and the cast back around ops that are exact in any precision.
An upcast around arithmetic (rotary products, a norm's mean, a softmax) is deliberate precision
and must not be reported. (Kept beside the recipe tests of the same issue; the detector is
agents/analyst/static/layout.py.)
"""

from __future__ import annotations

import pytest

from trainbridge.agents.analyst.static.scan import scan_source

HEADER = "import torch\nimport torch.nn.functional as F\n\n\ndef f(x, y, c, s, logits, targets):\n    return {}\n"


def _found(expression: str) -> list[tuple[str, str]]:
    return [(str(i.category), str(i.spans[0])) for i in scan_source(HEADER.format(expression), "m.py")]


@pytest.mark.parametrize("expression", [
    "x.float().transpose(1, 2).type_as(x)",  # a relayout done in fp32 and cast back
    "x.float().view(-1, 4).to(x.dtype)",
    "(-x.float()[..., :4]).type_as(x)",  # slicing and negation are exact
    "x.to(torch.float32).permute(0, 2, 1, 3).contiguous().type_as(x)",
    "torch.randn(3, 4).float()",  # the default float dtype already
    "torch.zeros(3).to(torch.float32)",
    "torch.linspace(0, 1, steps=8).float()",
])
def test_redundant_casts_in_real_code_forms(expression):
    assert _found(expression) == [("redundant_cast", "m.py:6")]


@pytest.mark.parametrize("expression", [
    "torch.arange(8).float()",  # int64 -> fp32: a real conversion
    "torch.randint(0, 5, (3,)).float()",
    "torch.full((3,), 1).float()",  # an integer fill makes int64
    "torch.zeros_like(x).float()",  # x's dtype is unknown
    "torch.randn(3).bfloat16()",  # a real down-cast
    "(x.float() * c).type_as(x)",  # rotary-style products in fp32: deliberate precision
    "torch.cat((x.float()[..., :2] * c, x.float()[..., 2:] * s), -1).type_as(x)",
    "torch.softmax(x.float(), dim=-1).type_as(x)",
    "y.float().transpose(1, 2).type_as(x)",  # cast to another tensor's dtype
    "x.float().transpose(1, 2)",  # no cast back
    "x.float().transpose(1, 2).to(torch.bfloat16)",  # x's dtype is not known to be bf16
])
def test_casts_that_are_not_redundant_are_not_reported(expression):
    assert [c for c, _ in _found(expression) if c == "redundant_cast"] == []


def test_upcast_norm_and_rotary_in_methods_are_not_redundant_casts():
    code = '''import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, h):
        kept = h.dtype
        wide = h.to(torch.float32)
        wide = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + 1e-6)
        return self.weight * wide.to(kept)


class Rotary(nn.Module):
    def forward(self, x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * self.c + x2 * self.s, x2 * self.c - x1 * self.s), 3).type_as(x)


def relayout(x):
    moved = x.float().transpose(1, 2)
    return moved.reshape(x.size(0), -1).type_as(x)
'''
    found = [(str(i.category), str(i.spans[0])) for i in scan_source(code, "m.py")]
    assert [f for f in found if f[0] == "redundant_cast"] == [("redundant_cast", "m.py:20-21")]
