"""Regions located where they are (issue 26, item 1): a model that lives in a library (transformers' LlamaForCausalLM,
built from a config with random weights) is profiled and compiled per library line, and its intents carry the library
location (file, class and function, lines, distribution and version) beside the user's call site (the `model(...)`
line), with their own N eager ops and K reference kernels.

The reference comes from a real captured evidence pack of the same model (fixtures/library_regions/, regenerate.py
beside it): compiling a Llama takes minutes on a small CPU, reading its kernels' stacks takes a second.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject's dev extra, pinned in constraints.txt)

from transformers.models.llama import modeling_llama  # noqa: E402

from trainbridge.agents.analyst import affinity  # noqa: E402
from trainbridge.agents.analyst.align import align, merge  # noqa: E402
from trainbridge.agents.analyst.library_scan import scan_library_regions  # noqa: E402
from trainbridge.agents.coder.candidate import CoderRefusal, make_candidate  # noqa: E402
from trainbridge.knowledge.schema import load_recipe_dir  # noqa: E402
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, LibrarySpan, SourceSpan  # noqa: E402
from trainbridge.tools.eager_profile import BoundaryRecorder, record_eager_ops  # noqa: E402
from trainbridge.tools.evidence_pack import read_pack  # noqa: E402
from trainbridge.tools.inductor.parser import parse_evidence_dir  # noqa: E402
from trainbridge.tools.library_code import library_path, library_span  # noqa: E402
from script_repos import commit_all  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "library_regions"
RECIPES = Path(__file__).resolve().parents[1] / "knowledge" / "recipes"
LLAMA = "transformers/models/llama/modeling_llama.py"


def _lines_of(qualname: str) -> tuple[int, int]:
    """The def line (decorators excluded) and last line of a function of modeling_llama, by its qualified name."""
    tree = ast.parse(Path(modeling_llama.__file__).read_text())
    scopes = [(tree, "")]
    while scopes:
        node, prefix = scopes.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if name == qualname:
                    return child.lineno, child.end_lineno
                scopes.append((child, name + "."))
    raise AssertionError(f"{qualname} is not in {modeling_llama.__file__}")


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-repo")
    shutil.copy(FIXTURE / "repo" / "hf_steps.py", root / "hf_steps.py")
    return root


@pytest.fixture(scope="module")
def table(repo):
    spec = importlib.util.spec_from_file_location("hf_steps_under_test", repo / "hf_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return record_eager_ops(module.make_parts(), repo, steps=1, warmup=1)


@pytest.fixture(scope="module")
def reference(repo, tmp_path_factory):
    pinned = json.loads((FIXTURE / "versions.json").read_text())["transformers"]
    assert pinned == transformers.__version__, (f"the evidence pack holds transformers {pinned}'s line numbers, this is "
                                                f"{transformers.__version__}: run tests/fixtures/library_regions/regenerate.py")
    unpacked = read_pack(FIXTURE / "evidence.tar.gz", tmp_path_factory.mktemp("pack"))
    return parse_evidence_dir(unpacked.evidence_dir, repo)


def _intent(intents: list[Intent], category: str) -> Intent:
    found = [i for i in intents if i.category == category]
    assert len(found) == 1, [i.where() for i in found]
    return found[0]


def test_library_files_are_named_under_their_import_root_and_torch_stays_transparent():
    assert library_path("/opt/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py") == LLAMA
    assert library_path("C:\\py\\Lib\\site-packages\\timm\\layers\\mlp.py") == "timm/layers/mlp.py"
    assert library_path("/usr/lib/python3/dist-packages/open_clip/model.py") == "open_clip/model.py"
    for transparent in (torch.nn.functional.__file__, "/opt/venv/lib/python3.11/site-packages/trainbridge/records.py",
                        json.__file__, "<frozen importlib._bootstrap>", "/home/u/proj/model.py"):
        assert library_path(transparent) is None, transparent
    span = library_span(LLAMA, 62, 67, "LlamaRMSNorm.forward")
    assert (span.module, span.class_name, span.function_name) == ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "forward")
    assert (span.distribution, span.version) == ("transformers", transformers.__version__)
    assert library_span(LLAMA, 127, 149, "apply_rotary_pos_emb").class_name is None


def test_eager_ops_of_a_library_model_carry_their_library_frames_and_the_users_call_site(repo, table):
    call = SourceSpan(file="hf_steps.py", line_start=_line_of(repo / "hf_steps.py", "model(input_ids"),
                      line_end=_line_of(repo / "hf_steps.py", "model(input_ids"), function="train_step")
    norm_start, norm_end = _lines_of("LlamaRMSNorm.forward")
    in_norm = [op for op in table.ops if table.library_of(op) and table.library_of(op)[0].function.function == "LlamaRMSNorm.forward"]
    assert {op.phase.value for op in in_norm} == {"forward", "backward"}  # backward ops have their forward op's frames
    assert all(op.span == call for op in in_norm)
    frame = table.library_of(in_norm[0])[0]
    assert frame.function.file == LLAMA and (frame.function.line_start, frame.function.line_end) == (norm_start, norm_end)
    assert norm_start < frame.line <= norm_end
    assert (frame.function.distribution, frame.function.version) == ("transformers", transformers.__version__)
    # the innermost library frame, never torch's own files; the stack goes up to the user's line
    assert not any(f.function.file.startswith("torch/") for f in table.library_frames)
    callers = [f.function.function for f in table.library_of(in_norm[0])]
    assert callers.index("LlamaRMSNorm.forward") < callers.index("LlamaDecoderLayer.forward") < callers.index("LlamaForCausalLM.forward")


def test_regions_of_one_user_line_are_distinct_intents_with_their_own_counts(repo, table):
    intents = align(affinity.detect(table, "AdamW"), table)
    rms, rope = _intent(intents, "rmsnorm"), _intent(intents, "rope")
    call = _line_of(repo / "hf_steps.py", "model(input_ids")
    for intent in (rms, rope):
        assert intent.library is not None and intent.library.file == LLAMA and intent.source == IntentSource.advisor_rule
        assert [(s.file, s.line_start) for s in intent.spans] == [("hf_steps.py", call)]
    assert (rms.library.class_name, rms.library.function_name) == ("LlamaRMSNorm", "forward")
    assert (rope.library.class_name, rope.library.function) == (None, "apply_rotary_pos_emb")
    rope_start, rope_end = _lines_of("apply_rotary_pos_emb")
    assert rope_start <= rope.library.line_start < rope.library.line_end <= rope_end  # q's and k's lines: one region
    assert rms.id != rope.id and len({i.id for i in intents}) == len(intents)
    at_call = sum(1 for op in table.ops if op.span.line_start == call)
    assert 0 < rope.evidence.target_ops < rms.evidence.target_ops < at_call  # each region its own N, not the line's
    assert rms.evidence.reference_kernels is None  # no reference given here
    assert rms.where() == f"{LLAMA}:LlamaRMSNorm.forward:{rms.library.lines()} (transformers {transformers.__version__}) via hf_steps.py:{call}"


def test_the_static_scan_reads_the_library_files_the_step_ran_and_keeps_what_ran(repo, table):
    found, notes = scan_library_regions(table, target="cpu")
    call = _line_of(repo / "hf_steps.py", "model(input_ids")
    rms = _intent(found, "rmsnorm")
    norm_start, norm_end = _lines_of("LlamaRMSNorm.forward")
    assert rms.source == IntentSource.static and rms.library.file == LLAMA and rms.library.function == "LlamaRMSNorm.forward"
    assert norm_start < rms.library.line_start < rms.library.line_end == norm_end  # the written-out norm through its weight
    assert [(s.file, s.line_start) for s in rms.spans] == [("hf_steps.py", call)]
    assert not any(i.library.function == "eager_attention_forward" for i in found)  # found in the file, never ran (SDPA did)
    assert all("not scanned" in note for note in notes)
    merged = _intent(align(found + affinity.detect(table, "AdamW"), table), "rmsnorm")
    assert {"static", "msprof_affinity"} <= set(merged.evidence.detectors) and merged.library == rms.library  # static lines win


def test_the_reference_maps_kernels_to_library_lines_so_k_is_known(table, reference):
    norm_start, norm_end = _lines_of("LlamaRMSNorm.forward")
    norm_kernels = [g for g in reference.groups if any(line.file == LLAMA and norm_start < line.line_start <= norm_end
                                                       for line in g.library_lines)]
    assert {g.phase.value for g in norm_kernels} == {"forward", "backward"}
    assert any("rsqrt" in g.kernel for g in norm_kernels)
    assert not any(g.spans for g in reference.groups)  # the compiled forward is the library's: no user line on the stacks
    intents = align(affinity.detect(table, "AdamW"), table, reference.groups)
    rms, rope = _intent(intents, "rmsnorm"), _intent(intents, "rope")
    for intent in (rms, rope):
        assert intent.evidence.reference_kernels is not None and 0 < intent.evidence.reference_kernels < intent.evidence.target_ops
        assert "inductor" in intent.evidence.detectors and intent.estimated_saving_us > 0
    assert any("rsqrt" in k for k in rms.evidence.kernels) and any("cat" in k and "neg" in k for k in rope.evidence.kernels)


def _library_intent(category: str, function: str, lines: tuple[int, int], user_line: int = 9) -> Intent:
    spans = [SourceSpan(file="train.py", line_start=user_line, line_end=user_line)]
    library = library_span(LLAMA, *lines, function)
    return Intent(id=Intent.make_id(category, spans, library), category=category, spans=spans, library=library,
                  evidence=Evidence(detectors=["msprof_affinity"]), confidence=0.5, source=IntentSource.advisor_rule)


def test_merge_joins_lines_of_one_library_function_and_keeps_functions_and_user_code_apart():
    q, k = _library_intent("rope", "apply_rotary_pos_emb", (147, 147)), _library_intent("rope", "apply_rotary_pos_emb", (148, 148))
    other = _library_intent("rope", "GemmaRotary.apply", (20, 21))
    mine = Intent(id="rope-mine", category=IntentCategory.rope, spans=[SourceSpan(file="train.py", line_start=9, line_end=9)],
                  confidence=0.5, source=IntentSource.advisor_rule)
    merged = merge([q, k, other, mine])
    assert len(merged) == 3
    rope = next(i for i in merged if i.library is not None and i.library.function == "apply_rotary_pos_emb")
    assert (rope.library.line_start, rope.library.line_end) == (147, 148) and rope.id == Intent.make_id("rope", rope.spans, rope.library)
    assert rope.id not in (q.id, k.id) and merged[-1].library is None


def test_the_coder_refuses_in_repo_recipes_for_a_library_region_without_touching_the_repository():
    recipe = next(r for r in load_recipe_dir(RECIPES) if str(r.category) == "rmsnorm")
    made = make_candidate(None, _library_intent("rmsnorm", "LlamaRMSNorm.forward", (62, 67)), recipe)  # no workspace: never used
    assert isinstance(made, CoderRefusal) and made.recipe_id == recipe.id
    assert "library code" in made.reason and LLAMA in made.reason and "LlamaRMSNorm.forward" in made.reason
    assert "train.py:9" in made.reason and "patch module" in made.reason


BACKWARD_WINDOW = """import torch


def forward(model, x):
    h = model(x)
    return (h * h).mean()
"""


def test_a_window_from_one_backward_to_the_next_links_its_backward_to_the_forward_one_step_later(tmp_path):
    """Script mode records from backward(k) to backward(k+1): backward(k)'s forward was never recorded."""
    (tmp_path / "window.py").write_text(BACKWARD_WINDOW)
    spec = importlib.util.spec_from_file_location("window_under_test", tmp_path / "window.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = BoundaryRecorder(tmp_path)
    loss = module.forward(model, torch.randn(4, 8))
    recorder.start()  # at backward(k), as sandbox/script/hooks.py starts it
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss = module.forward(model, torch.randn(4, 8))
    recorder.stop()  # at backward(k+1)
    table = recorder.table(backend="cpu", device="cpu", step_times_us=[1.0])
    backward = [op for op in table.ops if op.phase.value == "backward" and op.node and "AccumulateGrad" not in op.node]
    assert backward and {op.span.file for op in backward} == {"window.py"}
    assert {op.span.line_start for op in backward} == {5, 6}  # the forward's lines (model(x), the loss), not the test's
    assert table.unlinked_backward_ops == sum(1 for op in table.ops if op.node and "AccumulateGrad" in op.node)


TRAIN = '''"""A plain training loop over a tiny Hugging Face Llama built from its config (random weights, random tokens)."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        out = model(input_ids=tokens, labels=tokens)
        loss = out.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
'''


def test_analyze_of_a_plain_loop_over_a_hf_llama_in_script_mode_shows_both_locations(tmp_path):
    from trainbridge.graph.cli.app import build_app

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(TRAIN)
    (repo / "trainbridge.toml").write_text('launch = "python train.py"\nwarmup_steps = 1\nsteps = 1\n')
    commit_all(repo)
    call = _line_of(repo / "train.py", "model(input_ids")
    result = CliRunner().invoke(build_app(), ["analyze", str(repo), "--reference", str(FIXTURE / "evidence.tar.gz"),
                                              "--json", "-"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    analysis = json.loads(result.stdout)
    assert analysis["mode"] == "runtime"
    intents = [Intent.model_validate(i) for i in analysis["intents"]]
    rms, rope = _intent(intents, "rmsnorm"), _intent(intents, "rope")
    assert (rms.library.class_name, rms.library.function_name, rope.library.function) == ("LlamaRMSNorm", "forward", "apply_rotary_pos_emb")
    for intent in (rms, rope):
        assert intent.library.file == LLAMA and intent.library.version == transformers.__version__
        assert [(s.file, s.line_start) for s in intent.spans] == [("train.py", call)]
        assert intent.evidence.reference_kernels is not None and intent.evidence.reference_kernels > 0
        # backward ops count too: script mode's window links them to the forward one step later
        assert intent.evidence.target_ops > len([n for n in intent.evidence.target_op_names])
    optimizer = _intent(intents, "optimizer_step")
    assert optimizer.library is None and optimizer.spans[0].file == "train.py"  # in-repo intents as before
    # the table (on stderr with --json -) shows both locations
    table = result.stderr
    assert f"{LLAMA}:LlamaRMSNorm.forward:{rms.library.lines()}" in table and f"{LLAMA}:apply_rotary_pos_emb:" in table, table
    assert table.count(f"(transformers {transformers.__version__}) via train.py:{call}") >= 2, table  # rmsnorm, rope, ...
