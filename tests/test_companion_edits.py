"""A recipe's companion edits (`Recipe.also`): the calls its new API needs changed, wherever the repository makes them.
The torch_npu fused optimizers raise on `zero_grad(set_to_none=True)` and train on stale gradients after a module's
`zero_grad()` (issue 26: NpuFusedAdamW candidates crashed on nanoGPT-style loops), so their recipes zero in place."""

from __future__ import annotations

from pathlib import Path

import git

from trainbridge.agents.coder.candidate import Candidate, make_candidate
from trainbridge.knowledge.schema import CompanionEdit, load_recipe_dir
from trainbridge.records import Intent, SourceSpan
from trainbridge.tests.git_ops_support import no_global_git_identity, workspace  # noqa: F401 - autouse fixture
from trainbridge.tools.codemods.engine import apply_companion

RECIPES = Path(__file__).resolve().parents[1] / "knowledge" / "recipes"
MODEL = """import torch


def configure_optimizers(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
"""
TRAIN = """import torch
from model import configure_optimizers


def train(model, batches):
    optimizer = configure_optimizers(model, 1e-3)
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()
    model.zero_grad()  # tidy up
    return optimizer
"""
UNRELATED = "def zero_grad():\n    return 0\n"  # names the word, matches no pattern: left as is


def _repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    for name, text in (("model.py", MODEL), ("train.py", TRAIN), ("tools.py", UNRELATED)):
        (root / name).write_text(text)
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    return repo


def test_the_npu_fused_optimizer_recipe_zeroes_in_place_in_every_file(tmp_path):
    repo = _repo(tmp_path / "user")
    recipe = {r.id: r for r in load_recipe_dir(RECIPES)}["adamw-npu-fused"]
    span = SourceSpan(file="model.py", line_start=5, line_end=5, function="configure_optimizers")
    intent = Intent(id=Intent.make_id("optimizer_step", [span]), category="optimizer_step", spans=[span], confidence=0.9,
                    source="static")
    candidate = make_candidate(workspace(repo, tmp_path), intent, recipe)

    assert isinstance(candidate, Candidate), candidate
    tree = Path(candidate.worktree)
    assert "torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=lr)" in (tree / "model.py").read_text()
    train = (tree / "train.py").read_text()
    assert "optimizer.zero_grad(set_to_none=False)" in train and "model.zero_grad(set_to_none=False)  # tidy up" in train
    assert "set_to_none=True" not in train and train.count("\n") == TRAIN.count("\n")
    assert (tree / "tools.py").read_text() == UNRELATED
    assert sorted(candidate.files) == ["model.py", "train.py"]
    message = repo.git.log("-1", "--format=%B", candidate.sha)
    assert "also changed train.py line(s) 8, 11" in message and "raises on zero_grad(set_to_none=True)" in message
    assert (Path(repo.working_tree_dir) / "train.py").read_text() == TRAIN  # the user's checkout is untouched


def test_a_companion_edit_leaves_a_file_that_does_not_match_or_parse_alone():
    edit = CompanionEdit(pattern="$o.zero_grad()", replacement="$o.zero_grad(set_to_none=False)", why="in place")
    assert apply_companion("x = 1\n", "a.py", edit) is None
    assert apply_companion("def f(:\n    o.zero_grad()\n", "b.py", edit) is None
    assert apply_companion("o.zero_grad(set_to_none=False)\n", "c.py", edit) is None  # already in place
