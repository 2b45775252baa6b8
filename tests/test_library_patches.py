"""Library regions rewritten from the user's repository (issue 26, item 2): for an intent located in transformers'
LlamaRMSNorm.forward or apply_rotary_pos_emb, the coder writes `trainbridge_patches.py` beside the entry script and
one import line into it; the patched model trains like the library's (loss and gradients), a second patch lands in
the same module, and a library version outside the recipe's range is refused by the coder and left alone by the
module. The tiny HF Llama script repo and its intents are tests/test_library_regions.py's (a model from a config,
random weights, never a download); the NPU patches run in a child with the emulated torch_npu on its path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import git
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama  # noqa: E402

from trainbridge.agents.analyst import affinity  # noqa: E402
from trainbridge.agents.analyst.align import align  # noqa: E402
from trainbridge.agents.coder.candidate import Candidate, CoderRefusal, make_candidate  # noqa: E402
from trainbridge.agents.retrieval.choose import own_recipes  # noqa: E402
from trainbridge.knowledge.schema import load_recipe_dir  # noqa: E402
from trainbridge.records import Intent  # noqa: E402
from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env  # noqa: E402
from trainbridge.tests.git_ops_support import no_global_git_identity, workspace  # noqa: E402,F401 - autouse fixture
from trainbridge.tools.codemods.library_patch import IMPORT_LINE, PATCH_MODULE  # noqa: E402
from trainbridge.tools.eager_profile import record_eager_ops  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "library_regions"
RECIPES = {r.id: r for r in load_recipe_dir(Path(__file__).resolve().parents[1] / "knowledge" / "recipes")}
SCRIPT = "hf_steps.py"


@pytest.fixture(scope="module")
def intents(tmp_path_factory) -> dict[str, Intent]:
    """The rmsnorm and rope intents the analyst finds in the library for the fixture's training step."""
    root = tmp_path_factory.mktemp("hf-profile")
    shutil.copy(FIXTURE / "repo" / SCRIPT, root / SCRIPT)
    spec = importlib.util.spec_from_file_location("hf_steps_for_patches", root / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = record_eager_ops(module.make_parts(), root, steps=1, warmup=1)
    found = {str(i.category): i for i in align(affinity.detect(table, "AdamW"), table) if i.library is not None}
    assert {"rmsnorm", "rope"} <= set(found), [i.where() for i in found.values()]
    return found


def _repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    shutil.copy(FIXTURE / "repo" / SCRIPT, root / SCRIPT)
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    return repo


def _loss_and_grads(steps_module) -> tuple[float, dict[str, torch.Tensor]]:
    parts = steps_module.make_parts(seed=0)
    model, tokens = parts["model"], steps_module.batch(0)
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rmsnorm_patch_is_a_module_and_an_import_line_and_trains_like_the_library(tmp_path, intents, monkeypatch):
    repo = _repo(tmp_path / "user")
    rms = intents["rmsnorm"]
    assert own_recipes(_Kb(), rms, "cpu", None)[0] == "rmsnorm-hf-llama-patch-rms-norm"  # retrieval offers it first
    made = make_candidate(workspace(repo, tmp_path), rms, RECIPES["rmsnorm-hf-llama-patch-rms-norm"])
    assert isinstance(made, Candidate), made
    tree = Path(made.worktree)
    assert sorted(made.files) == [SCRIPT, PATCH_MODULE]
    script = (tree / SCRIPT).read_text().splitlines()
    imports_end = max(i for i, line in enumerate(script) if line.startswith(("import ", "from ")) and "trainbridge" not in line)
    assert script[imports_end + 1] == IMPORT_LINE and script.count(IMPORT_LINE) == 1  # after the script's own imports
    patch = (tree / PATCH_MODULE).read_text()
    assert "_install('transformers', '>=4.45,<6', 'transformers.models.llama.modeling_llama', 'LlamaRMSNorm.forward'," in patch
    assert "+" + IMPORT_LINE in made.diff and f"+++ b/{PATCH_MODULE}" in made.diff
    message = repo.git.log("-1", "--format=%B", made.sha)
    assert "Library patch: transformers.models.llama.modeling_llama.LlamaRMSNorm.forward" in message
    assert "modeling_llama.py:LlamaRMSNorm.forward" in message  # the intent's library location and call site
    assert (Path(repo.working_tree_dir) / SCRIPT).read_text() == (FIXTURE / "repo" / SCRIPT).read_text()

    base_loss, base_grads = _loss_and_grads(_load(FIXTURE / "repo" / SCRIPT, "hf_steps_unpatched"))
    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", original)  # restored after the test
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, "trainbridge_patches", raising=False)
    patched_steps = _load(tree / SCRIPT, "hf_steps_patched")  # its import line installs the patch
    patches = sys.modules["trainbridge_patches"]
    monkeypatch.delitem(sys.modules, "trainbridge_patches")
    assert modeling_llama.LlamaRMSNorm.forward is not original
    assert patches.INSTALLED == ["transformers.models.llama.modeling_llama.LlamaRMSNorm.forward"]
    assert modeling_llama.LlamaRMSNorm.forward.__trainbridge_original__ is original
    loss, grads = _loss_and_grads(patched_steps)
    assert loss == pytest.approx(base_loss, rel=1e-5)
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class _Kb:
    """The seed recipes as the knowledge base ranks them (categories and targets; no outcomes)."""

    def ranking_inputs(self, intent, target, categories, strict_target):
        return [(r, 0.0) for r in RECIPES.values() if target in r.targets], []


def test_a_library_version_outside_the_range_is_refused_by_the_coder_and_left_alone_by_the_module(tmp_path, intents,
                                                                                                   monkeypatch):
    rms = intents["rmsnorm"]
    old = rms.model_copy(update={"library": rms.library.model_copy(update={"version": "4.40.2"})})
    refused = make_candidate(None, old, RECIPES["rmsnorm-hf-llama-patch-rms-norm"])  # refused before any worktree
    assert isinstance(refused, CoderRefusal)
    assert "checked against transformers >=4.45,<6" in refused.reason and "transformers 4.40.2 ran here" in refused.reason
    wrong = make_candidate(None, rms, RECIPES["rope-hf-llama-patch-npu"])
    assert isinstance(wrong, CoderRefusal) and "not transformers.models.llama.modeling_llama.LlamaRMSNorm.forward" in wrong.reason

    repo = _repo(tmp_path / "user")
    made = make_candidate(workspace(repo, tmp_path), rms, RECIPES["rmsnorm-hf-llama-patch-rms-norm"])
    assert isinstance(made, Candidate), made
    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", original)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.1")  # transformers swaps its module object
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches = _load(Path(made.worktree) / PATCH_MODULE, "trainbridge_patches_v6")
    assert modeling_llama.LlamaRMSNorm.forward is original and patches.INSTALLED == []
    assert any("transformers 6.0.1 is outside >=4.45,<6" in str(w.message) and "left alone" in str(w.message) for w in caught)


_CHILD = textwrap.dedent("""
    import importlib.util, json, sys
    import torch
    import torch_npu

    fixture, tree = sys.argv[1], sys.argv[2]
    count = torch_npu.__trainbridge_kernels_launched__

    def load(path, name):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def step(steps):
        parts = steps.make_parts(seed=0)
        model = parts["model"].to("npu")
        tokens = steps.batch(0).to("npu")
        before = count()
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        kernels = count() - before
        return out.loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}, kernels

    base_loss, base_grads, base_kernels = step(load(fixture, "hf_steps_unpatched"))
    sys.path.insert(0, tree)
    patched = load(tree + "/hf_steps.py", "hf_steps_patched")
    import trainbridge_patches
    from transformers.models.llama import modeling_llama
    loss, grads, kernels = step(patched)
    worst = max(float(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))) for n, g in base_grads.items())
    cosine = min(float(torch.nn.functional.cosine_similarity(grads[n].flatten(), g.flatten(), dim=0))
                 for n, g in base_grads.items() if g.abs().max() > 0)
    print("RESULT " + json.dumps({"installed": trainbridge_patches.INSTALLED, "base_loss": base_loss, "loss": loss,
                                  "worst_rel": worst, "cosine": cosine, "base_kernels": base_kernels, "kernels": kernels,
                                  "rope_patched": modeling_llama.apply_rotary_pos_emb.__name__}))
""")


def test_two_npu_patches_land_in_one_module_and_train_like_the_library_on_the_emulated_npu(tmp_path, intents):
    repo = _repo(tmp_path / "user")
    work = workspace(repo, tmp_path)
    rms = make_candidate(work, intents["rmsnorm"], RECIPES["rmsnorm-hf-llama-patch-npu"])
    assert isinstance(rms, Candidate), rms
    rope = make_candidate(work, intents["rope"], RECIPES["rope-hf-llama-patch-npu"], overlay=rms.sha)  # the pending head
    assert isinstance(rope, Candidate), rope
    tree = Path(rope.worktree)
    patch = (tree / PATCH_MODULE).read_text()
    assert patch.count("# === TrainBridge patch ") == 2 and patch.count("import torch_npu") == 1
    assert "'LlamaRMSNorm.forward', _tb_llama_rms_norm_forward_npu)" in patch
    assert "'apply_rotary_pos_emb', _tb_llama_apply_rotary_pos_emb_npu)" in patch
    assert (tree / SCRIPT).read_text().count(IMPORT_LINE) == 1  # the second patch reuses the import line
    assert not (tree / "trainbridge_patches_2.py").exists() and sorted(p.name for p in tree.glob("*.py")) == [SCRIPT, PATCH_MODULE]
    again = make_candidate(work, intents["rmsnorm"], RECIPES["rmsnorm-hf-llama-patch-npu"], attempt=1, overlay=rope.sha)
    assert isinstance(again, CoderRefusal) and "already patches" in again.reason

    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if not k.startswith("TRAINBRIDGE_NPU_EMULATION")})
    child = tmp_path / "child.py"
    child.write_text(_CHILD)
    proc = subprocess.run([sys.executable, str(child), str(FIXTURE / "repo" / SCRIPT), str(tree)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert r["installed"] == ["transformers.models.llama.modeling_llama.LlamaRMSNorm.forward",
                              "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
    assert r["rope_patched"] == "_tb_llama_apply_rotary_pos_emb_npu"
    assert r["loss"] == pytest.approx(r["base_loss"], rel=1e-5)
    assert r["worst_rel"] < 1e-3 and r["cosine"] > 0.99999, r
    assert r["kernels"] < r["base_kernels"], r  # fused norm and rotary: fewer NPU kernels per forward and backward


ENTRY = '''"""The tiny HF Llama in entry mode: the gate builds it, on the emulated NPU for --target npu."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(device: str, seed: int) -> dict:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def batch(step: int):
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed * 1000 + step))
        return tokens.to(device)

    def loss_fn(model, tokens):
        return model(input_ids=tokens, labels=tokens).loss

    def train_step(model, optimizer, tokens):
        optimizer.zero_grad()
        loss = loss_fn(model, tokens)
        loss.backward()
        optimizer.step()
        return loss

    return {"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, "train_step": train_step}
'''


def test_the_gate_judges_a_library_patch_like_any_candidate_numerics_verified_on_the_emulated_npu(tmp_path, intents):
    from trainbridge.agents.profiler.judge import judge_candidate
    from trainbridge.agents.profiler.verdict import VerdictReason
    from trainbridge.records import SourceSpan

    root = tmp_path / "user"
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    (root / "train.py").write_text(ENTRY)
    (root / "trainbridge.toml").write_text('entry = "train:build"\nwarmup_steps = 1\nsteps = 2\ntimeout_s = 240\n')
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    call = next(i for i, line in enumerate(ENTRY.splitlines(), start=1) if "model(input_ids" in line)
    rms = intents["rmsnorm"].model_copy(update={"spans": [SourceSpan(file="train.py", line_start=call, line_end=call)]})
    recipe = RECIPES["rmsnorm-hf-llama-patch-npu"]
    work = workspace(repo, tmp_path)
    made = make_candidate(work, rms, recipe)
    assert isinstance(made, Candidate), made
    assert (Path(made.worktree) / "train.py").read_text().splitlines()[3] == IMPORT_LINE  # after the two imports
    verdict = judge_candidate(work.worktree, Path(made.worktree), target="npu", recipe_numerics=recipe.numerics, rounds=2,
                              max_rounds=2, min_gain=0.01)
    assert verdict.reason == VerdictReason.speed_unmeasured_numerics_ok and not verdict.accepted, verdict.message
    assert verdict.numerics.passed and verdict.candidate_versions["torch_npu"].endswith("(emulated)")
    kernels = verdict.device_kernels
    assert kernels is not None and 0 < kernels.candidate < kernels.baseline, verdict.message  # the fused norm


def test_the_import_line_goes_after_the_scripts_own_imports_once_and_version_ranges_compare_release_numbers():
    from trainbridge.knowledge.versions import check_range, version_in_range
    from trainbridge.tools.codemods.library_patch import add_import_line

    script = '#!/usr/bin/env python\n"""Doc."""\nfrom __future__ import annotations\n\nimport torch\nfrom x import (a,\n    b)\n# setup\nMODEL = 1\nimport late\n'
    patched, line = add_import_line(script, "train.py")
    assert patched.splitlines()[line - 1] == IMPORT_LINE and line == 8  # after the parenthesised import, before the code
    assert patched.replace(IMPORT_LINE + "\n", "") == script
    assert add_import_line(patched, "train.py") == (patched, 0)  # a second patch adds no second line
    bare, line = add_import_line("print(1)", "run.py")
    assert bare == IMPORT_LINE + "\nprint(1)\n" and line == 1
    assert version_in_range("5.25.0", ">=4.45,<6") and version_in_range("4.45.0.dev0", ">=4.45,<6")
    assert not version_in_range("6.0.0", ">=4.45,<6") and not version_in_range("4.44.2", ">=4.45,<6")
    assert version_in_range("4.48", "==4.48.0") and not version_in_range("4.48.1", "!=4.48.1")
    with pytest.raises(ValueError, match="not OP RELEASE"):
        check_range(">=4.45,~6")


def test_eager_attention_goes_through_the_librarys_own_sdpa_switch_with_the_same_loss_and_gradients(tmp_path, intents,
                                                                                                     monkeypatch):
    from trainbridge.tools.library_code import library_span

    root = tmp_path / "user"
    _repo(root)
    eager = (root / SCRIPT).read_text().replace("use_cache=False)", 'use_cache=False, attn_implementation="eager")')
    assert 'attn_implementation="eager"' in eager
    (root / SCRIPT).write_text(eager)
    repo = git.Repo(root)
    repo.git.commit("-am", "eager attention")
    lines = [i for i, line in enumerate(Path(modeling_llama.__file__).read_text().splitlines(), start=1)
             if line.startswith("def eager_attention_forward(")]
    library = library_span("transformers/models/llama/modeling_llama.py", lines[0], lines[0] + 20, "eager_attention_forward")
    spans = intents["rmsnorm"].spans  # the model(...) line of the same script
    attention = Intent(id=Intent.make_id("attention", spans, library), category="attention", spans=spans, library=library,
                       confidence=0.5, source="advisor_rule")
    assert own_recipes(_Kb(), attention, "cpu", None)[0] == "attention-hf-llama-patch-sdpa"
    made = make_candidate(workspace(repo, tmp_path), attention, RECIPES["attention-hf-llama-patch-sdpa"])
    assert isinstance(made, Candidate), made
    tree = Path(made.worktree)

    base_loss, base_grads = _loss_and_grads(_load(root / SCRIPT, "hf_steps_eager"))
    original = modeling_llama.eager_attention_forward
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", original)
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, "trainbridge_patches", raising=False)
    patched_steps = _load(tree / SCRIPT, "hf_steps_eager_patched")
    monkeypatch.delitem(sys.modules, "trainbridge_patches")
    assert modeling_llama.eager_attention_forward.__trainbridge_original__ is original
    fused, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    loss, grads = _loss_and_grads(patched_steps)
    assert len(calls) == 2  # one fused attention per layer: the library's SDPA path ran, not the eager matmuls
    assert loss == pytest.approx(base_loss, rel=1e-5)
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_patch_module_leaves_the_library_alone_when_the_function_is_missing_or_its_signature_differs(monkeypatch):
    from trainbridge.tools.codemods.library_patch import add_patch

    recipe = RECIPES["rmsnorm-hf-llama-patch-rms-norm"]

    def variant(rid: str, replacement: str, **params):
        match = recipe.match.model_copy(update={"params": {**recipe.match.params, **params}})
        return recipe.model_copy(update={"id": rid, "match": match, "replacement": replacement})

    missing = variant("a-missing", recipe.replacement.replace("_tb_llama_rms_norm_forward", "_tb_a"), function="NoSuchNorm.forward")
    moved = variant("b-moved", recipe.replacement.replace("_tb_llama_rms_norm_forward", "_tb_b"),
                    module="transformers.models.no_such_model.modeling")
    other = variant("c-signature", recipe.replacement.replace("(self, hidden_states)", "(self, x, residual)"))
    text = add_patch(add_patch(add_patch(None, missing, SCRIPT), moved, SCRIPT), other, SCRIPT)
    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", original)
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(text, PATCH_MODULE, "exec"), namespace)  # the user's script keeps running
    assert namespace["INSTALLED"] == [] and modeling_llama.LlamaRMSNorm.forward is original
    said = [str(w.message) for w in caught]
    assert any("NoSuchNorm.forward not patched: this version of transformers" in m for m in said), said
    assert any("no_such_model.modeling does not import" in m for m in said), said
    assert any("its signature is not the patch's ((self, hidden_states: torch.Tensor) -> torch.Tensor vs (self, x, residual))" in m
               for m in said), said


def test_eager_attention_becomes_one_npu_fusion_attention_that_trains_like_the_library(tmp_path, intents):
    """The NPU counterpart of the SDPA patch above (attention-hf-llama-patch-npu): one npu_fusion_attention per layer,
    the patched model training like the library's on the emulated NPU, with fewer NPU kernels."""
    from trainbridge.tools.library_code import library_span

    root = tmp_path / "user"
    _repo(root)
    eager = (root / SCRIPT).read_text().replace("use_cache=False)", 'use_cache=False, attn_implementation="eager")')
    assert 'attn_implementation="eager"' in eager
    (root / SCRIPT).write_text(eager)
    repo = git.Repo(root)
    repo.git.commit("-am", "eager attention")
    lines = [i for i, line in enumerate(Path(modeling_llama.__file__).read_text().splitlines(), start=1)
             if line.startswith("def eager_attention_forward(")]
    library = library_span("transformers/models/llama/modeling_llama.py", lines[0], lines[0] + 20, "eager_attention_forward")
    spans = intents["rmsnorm"].spans  # the model(...) line of the same script
    attention = Intent(id=Intent.make_id("attention", spans, library), category="attention", spans=spans, library=library,
                       confidence=0.5, source="advisor_rule")
    assert own_recipes(_Kb(), attention, "npu", None)[0] == "attention-hf-llama-patch-npu"
    made = make_candidate(workspace(repo, tmp_path), attention, RECIPES["attention-hf-llama-patch-npu"])
    assert isinstance(made, Candidate), made
    tree = Path(made.worktree)
    assert "'eager_attention_forward', _tb_llama_eager_attention_npu)" in (tree / PATCH_MODULE).read_text()

    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if not k.startswith("TRAINBRIDGE_NPU_EMULATION")})
    child = tmp_path / "child.py"
    child.write_text(_CHILD.replace("modeling_llama.apply_rotary_pos_emb.__name__", "None"))  # rope is not patched here
    proc = subprocess.run([sys.executable, str(child), str(root / SCRIPT), str(tree)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert r["installed"] == ["transformers.models.llama.modeling_llama.eager_attention_forward"]
    assert r["loss"] == pytest.approx(r["base_loss"], rel=1e-5)
    assert r["worst_rel"] < 1e-3 and r["cosine"] > 0.99999, r
    assert r["kernels"] < r["base_kernels"], r  # one fused attention each way instead of repeat_kv, matmuls, mask, softmax
