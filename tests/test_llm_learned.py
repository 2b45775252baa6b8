"""Learned recipes: an accepted LLM patch becomes a recipe that rewrites the same code elsewhere, or is
refused when no recipe kind expresses it.

Every test runs on a real temporary git repository (the user's checkout) and a real run workspace;
a socket guard makes any connection or name lookup beyond loopback fail the test (tests/llm_coder_support.py).
"""

from __future__ import annotations

import pytest

from trainbridge.agents.coder.candidate import Candidate
from trainbridge.agents.coder.learned import LearnedRecipeError, learned_recipe
from trainbridge.agents.coder.llm.patch import llm_candidate
from trainbridge.records import IntentCategory, SourceSpan
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tests.llm_coder_support import (  # noqa: F401 (fixtures)
    GELU_FUSED,
    GELU_LINE,
    RMS_BODY,
    RMS_SPAN,
    VALID_GELU,
    block,
    config_for,
    loopback_only,
    make_intent,
    no_global_git_identity,
    server,
    user_repo,
    workspace,
)


# --- learned recipes -----------------------------------------------------------------------------------


def test_learned_expression_recipe_reproduces_the_accepted_patch(server, workspace, user_repo):
    server.script = [(200, VALID_GELU)]
    intent = make_intent()
    made = llm_candidate(workspace, intent, config_for(server))
    assert isinstance(made, Candidate)
    workspace.accept_candidate(made.name)
    recipe = learned_recipe(made, intent, repo_root=user_repo, target="cpu", model="fake-coder")
    assert recipe.provenance.kind == "learned" and recipe.match.kind == "expression"
    assert recipe.match.params["pattern"] == GELU_LINE.strip().removeprefix("return ")
    assert recipe.replacement == GELU_FUSED.strip().removeprefix("return ")
    assert recipe.category == IntentCategory.gelu and [str(t) for t in recipe.targets] == ["cpu"]
    assert f"commit {made.sha}" in recipe.provenance.sources and "aten::tanh" in recipe.keywords
    # the same code elsewhere (another copy, reformatted) is rewritten by the recipe alone
    elsewhere = "import math\nimport torch\n\ndef act(x):\n    return 0.5*x*(1.0 + torch.tanh(math.sqrt(2.0/math.pi)*(x + 0.044715*torch.pow(x, 3.0))))\n"
    edit = apply_recipe(elsewhere, recipe, SourceSpan(file="other.py", line_start=4, line_end=5))
    assert 'return torch.nn.functional.gelu(x, approximate="tanh")' in edit.source
    # literal names: a differently named variable is not matched
    renamed = elsewhere.replace("x", "h")
    with pytest.raises(CodemodRefused, match="no expression"):
        apply_recipe(renamed, recipe, SourceSpan(file="other.py", line_start=4, line_end=5))


def test_learned_semantic_recipe_from_an_npu_forward_rewrite(server, workspace, user_repo):
    fused = "        return torch_npu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]"
    server.script = [(200, block(RMS_BODY, fused) + "<<<<<<< IMPORTS\nimport torch_npu\n>>>>>>> IMPORTS\n")]
    intent = make_intent(RMS_SPAN, IntentCategory.rmsnorm)
    made = llm_candidate(workspace, intent, config_for(server), target="npu")
    assert isinstance(made, Candidate), made  # imported in a child against the torch_npu emulation
    assert "+import torch_npu" in made.diff and "+" + fused in made.diff
    recipe = learned_recipe(made, intent, repo_root=user_repo, target="npu")
    assert recipe.match.kind == "semantic" and recipe.imports == ["import torch_npu"]
    assert recipe.match.params["scope"] == "module_forward" and recipe.match.params["signature"] == ["x"]
    assert recipe.match.params["attributes"] == ["eps", "weight"]
    assert recipe.replacement == "torch_npu.npu_rms_norm($x, $self_weight, epsilon=$self_eps)[0]"
    # a differently named RMSNorm with the same body form gets the same rewrite
    other = ("import torch\n\n\nclass Norm(torch.nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
             "        self.eps = 1e-5\n        self.weight = torch.nn.Parameter(torch.ones(d))\n\n"
             "    def forward(self, h):\n        variance = h.pow(2).mean(-1, keepdim=True)\n"
             "        h = h * torch.rsqrt(variance + self.eps)\n        return self.weight * h\n")
    edit = apply_recipe(other, recipe, SourceSpan(file="n.py", line_start=10, line_end=13))
    assert "return torch_npu.npu_rms_norm(h, self.weight, epsilon=self.eps)[0]" in edit.source


def test_learned_recipe_refuses_patches_no_recipe_kind_expresses(server, workspace, user_repo):
    two = block("        variance = x.pow(2).mean(-1, keepdim=True)\n        x = x * torch.rsqrt(variance + self.eps)",
                "        variance = x.square().mean(-1, keepdim=True)\n        x = x * (variance + self.eps).rsqrt()")
    server.script = [(200, two)]
    intent = make_intent(RMS_SPAN, IntentCategory.rmsnorm)
    made = llm_candidate(workspace, intent, config_for(server))
    assert isinstance(made, Candidate), made
    with pytest.raises(LearnedRecipeError, match="no recipe kind expresses it"):
        learned_recipe(made, intent, repo_root=user_repo, target="cpu")
