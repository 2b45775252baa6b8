"""The gate's precision reference: a rewrite that computes a region more exactly than the original (a fused kernel
in fp32 where the original rounds to a narrow dtype) does not match the original, and passes when it matches the
original computed in higher precision; a rewrite that computes something else matches neither and stays
rejected. Real gate children on small classifiers whose loss rounds its logits to fp8 (e5m2, as coarse as a bf16
log-probability near -10 is: a few percent), so the two trajectories part at the first step. Nothing here asserts
speed (the gate stops after its numerics check: `emulated_speed`)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import git
import pytest
import yaml

from trainbridge.agents.coder.candidate import Candidate, make_candidate
from trainbridge.agents.coder.precision_reference import make_reference, reference_recipe
from trainbridge.agents.profiler.gate import run_gate
from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.graph import npu_pending
from trainbridge.knowledge.schema import Numerics, Recipe
from trainbridge.records import Intent, SourceSpan
from trainbridge.tests.git_ops_support import no_global_git_identity, workspace  # noqa: F401 - autouse fixture
from trainbridge.sandbox.workload import load_workload
from trainbridge.tools.codemods.engine import apply_recipe

RECIPES = Path(__file__).resolve().parents[1] / "knowledge" / "recipes"

STEP = '''"""A classifier over 64 classes; its loss is `loss_of` (the region under test)."""
import torch
import torch.nn.functional as F


def loss_of(logits, y):
{region}


def build(device: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 64)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = torch.randn(256, 16, generator=generator)
    labels = torch.randint(0, 64, (256,), generator=generator)

    def batch(step: int):
        rows = torch.arange(32) + (step * 32) % 224
        return inputs[rows].to(device), labels[rows].to(device)

    def loss_fn(model, batch):
        x, y = batch
        return loss_of(model(x), y)

    def train_step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    return {{"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, "train_step": train_step}}
'''

REGIONS = {
    # the original: its logits rounded to a narrow float before the loss (forward and backward)
    "coarse": "    return F.cross_entropy(logits.to(torch.float8_e5m2).float(), y)",
    # the rewrite under test: the same loss computed exactly (log-softmax and the mean by hand, as a fused kernel does)
    "exact": "    rows = -torch.log_softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)\n    return rows.sum() / rows.numel()",
    # the precision reference: the original's call on the unrounded logits
    "reference": "    return F.cross_entropy(logits, y)",
    # computes something else: the exact loss, halved (its gradients with it)
    "exact_halved": "    rows = -torch.log_softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)\n    return 0.5 * rows.sum() / rows.numel()",
    "reference_raises": "    raise RuntimeError('the reference cannot run here')",
}


def workload(root: Path, region: str):
    folder = root / region
    folder.mkdir(parents=True)
    (folder / "step.py").write_text(STEP.format(region=REGIONS[region]), encoding="utf-8")
    (folder / "trainbridge.toml").write_text('entry = "step:build"\nwarmup_steps = 1\nsteps = 3\ntimeout_s = 120\n', encoding="utf-8")
    return load_workload(folder)


def gate(tmp_path: Path, candidate: str, reference: str | None, what: str | None = None):
    return run_gate(workload(tmp_path, "coarse"), workload(tmp_path, candidate), rounds=2, emulated_speed=True,
                    rng=random.Random(11), reference=workload(tmp_path, reference) if reference else None, reference_what=what)


def cross_entropy_recipe() -> Recipe:
    return Recipe.model_validate(yaml.safe_load((RECIPES / "cross-entropy-library-npu.yaml").read_text(encoding="utf-8")))


def cross_entropy_repo(tmp_path: Path, keywords: str):
    """A user's repository whose model.py:6 calls F.cross_entropy(logits, targets<keywords>), its run workspace and the
    cross_entropy intent on that line."""
    root = tmp_path / "user"
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    (root / "model.py").write_text("import torch\nimport torch.nn.functional as F\n\n\ndef loss_of(logits, targets):\n"
                                   f"    return F.cross_entropy(logits, targets{keywords})\n", encoding="utf-8")
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    span = SourceSpan(file="model.py", line_start=6, line_end=6, function="loss_of")
    intent = Intent(id=Intent.make_id("cross_entropy", [span]), category="cross_entropy", spans=[span], confidence=0.9,
                    source="static")
    return repo, workspace(repo, tmp_path), intent


@pytest.mark.timeout(600)
def test_an_exact_rewrite_of_a_rounding_region_fails_against_the_original_and_passes_against_its_precision_reference(tmp_path):
    alone = gate(tmp_path / "alone", "exact", None)  # as the gate judged it before: the original's own rounding is the bar
    assert alone.reason in (VerdictReason.numerics_mismatch, VerdictReason.skipped_work), alone.message
    assert alone.precision_reference is None

    judged = gate(tmp_path / "with", "exact", "reference")
    assert judged.reason == VerdictReason.speed_unmeasured_numerics_ok, judged.message
    assert judged.precision_reference == "matched_reference" and judged.numerics.passed
    assert "computed in higher precision" in judged.message and "against the original as it rounds" in judged.message


@pytest.mark.timeout(600)
def test_a_rewrite_that_computes_something_else_matches_neither_and_stays_rejected(tmp_path):
    judged = gate(tmp_path, "exact_halved", "reference", what="the verified pending head it stacks on")
    assert judged.reason == VerdictReason.numerics_mismatch, judged.message
    assert judged.precision_reference == "differs_from_both"
    assert "nor does it match the verified pending head it stacks on" in judged.message


@pytest.mark.timeout(600)
def test_a_reference_that_cannot_run_leaves_the_comparison_with_the_original_standing(tmp_path):
    judged = gate(tmp_path, "exact", "reference_raises")
    assert judged.reason in (VerdictReason.numerics_mismatch, VerdictReason.skipped_work), judged.message
    assert judged.precision_reference == "reference_failed"
    assert "(the recipe's precision reference) could not be compared (RuntimeError: the reference cannot run here)" in judged.message


def test_the_fused_cross_entropy_recipe_names_a_reference_that_applies_where_the_recipe_does():
    recipe = cross_entropy_recipe()
    reference = reference_recipe(recipe)
    assert reference is not None and reference.id == "cross-entropy-library-npu-precision-reference" and reference.also == []
    source = ("import torch\nimport torch.nn.functional as F\n\n\ndef loss_of(logits, targets):\n"
              "    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1, reduction='sum')\n")
    span = SourceSpan(file="model.py", line_start=6, line_end=6)
    rewritten, referenced = apply_recipe(source, recipe, span).source, apply_recipe(source, reference, span).source
    assert "_tb_npu_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1" in rewritten
    assert "_tb_reference_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1" in referenced
    assert "torch_npu" not in referenced and "input.float()" in referenced
    assert reference_recipe(recipe.model_copy(update={"numerics": Numerics(class_="exact")})) is None


def test_a_precision_reference_needs_the_sentence_the_report_flags():
    with pytest.raises(ValueError, match="precision_reference needs precision_change"):
        Numerics.model_validate({"class": "tolerance", "rtol": 1e-2, "atol": 1e-6,
                                 "precision_reference": {"replacement": "f($x)"}})
    with pytest.raises(ValueError, match="class 'exact' takes no"):
        Numerics.model_validate({"class": "exact", "precision_reference": {"replacement": "f($x)"}})


def test_the_reference_is_made_beside_the_candidate_on_the_same_span_and_leaves_nothing_in_the_run(tmp_path):
    repo, space, intent = cross_entropy_repo(tmp_path, ", ignore_index=-1")
    recipe = cross_entropy_recipe()
    candidate = make_candidate(space, intent, recipe)
    reference = make_reference(space, intent, recipe, overlay=None)
    assert isinstance(candidate, Candidate) and isinstance(reference, Candidate) and reference.name != candidate.name
    assert "_tb_npu_cross_entropy(logits, targets" in (Path(candidate.worktree) / "model.py").read_text(encoding="utf-8")
    assert "_tb_reference_cross_entropy(logits, targets" in (Path(reference.worktree) / "model.py").read_text(encoding="utf-8")
    run_head = space.head_sha
    space.reject_candidate(reference.name)
    assert not Path(reference.worktree).exists() and space.head_sha == run_head
    assert any("precision-reference" in ref.name for ref in repo.refs) is False  # its branch went with it
    assert any("cross-entropy-library-npu" in ref.name for ref in repo.refs)  # the candidate's stays
    assert make_reference(space, intent, recipe.model_copy(update={"numerics": Numerics(class_="exact")}), overlay=None) is None


def test_a_candidate_stacked_on_a_precision_change_is_given_the_pending_head_as_its_reference(tmp_path):
    repo, space, intent = cross_entropy_repo(tmp_path, "")
    recipe = cross_entropy_recipe()
    ctx = SimpleNamespace(config=SimpleNamespace(target="npu", run_id=space.run_id))
    assert npu_pending.pending_reference(ctx, space, {"verdicts": []}) is None  # no pending branch yet
    branch, _ = npu_pending.stack_on_pending(ctx, space, make_candidate(space, intent, recipe))
    plain = {"verdicts": [{"pending_branch": branch, "reason": "speed_unmeasured_numerics_ok"}]}
    assert npu_pending.pending_reference(ctx, space, plain) is None  # pending rewrites that matched the original itself
    stacked = {"verdicts": [{"pending_branch": branch, "reason": "speed_unmeasured_numerics_ok",
                             "precision_reference": "matched_reference"}]}
    view = npu_pending.pending_reference(ctx, space, stacked)
    assert view is not None and "_tb_npu_cross_entropy(logits, targets)" in (view / "model.py").read_text(encoding="utf-8")
    assert "F.cross_entropy(logits, targets)" in (Path(repo.working_tree_dir) / "model.py").read_text(encoding="utf-8")  # the user's checkout
