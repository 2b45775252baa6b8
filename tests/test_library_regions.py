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
from trainbridge.agents.analyst.align import EARLIER_NOTE, RUNTIME_BASIS, align, library_kernels, merge  # noqa: E402
from trainbridge.agents.analyst.earlier_reference import earlier_lookup, earlier_references  # noqa: E402
from trainbridge.agents.retrieval.sites import site_fingerprint  # noqa: E402
from trainbridge.agents.analyst.library_scan import scan_library_regions  # noqa: E402
from trainbridge.agents.analyst.static.scan import scan_source  # noqa: E402
from trainbridge.agents.coder.candidate import CoderRefusal, make_candidate  # noqa: E402
from trainbridge.knowledge.schema import load_recipe_dir  # noqa: E402
from trainbridge.records import (Evidence, FusionGroup, Intent, IntentCategory, IntentSource, KernelKind, LibrarySpan,  # noqa: E402
                                 Phase, SourceSpan)
from trainbridge.tools.eager_profile import BoundaryRecorder, record_eager_ops  # noqa: E402
from trainbridge.tools.evidence_pack import read_pack  # noqa: E402
from trainbridge.tools.inductor.parser import parse_evidence_dir  # noqa: E402
from trainbridge.tools.library_code import library_path, library_span  # noqa: E402
from trainbridge.tools.report.sections import intent_record  # noqa: E402
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


def test_a_gated_activation_chosen_by_configuration_is_found_as_the_kind_that_ran(table):
    """LlamaMLP.forward gates `self.act_fn(...)`, `ACT2FN[config.hidden_act]`: the library scan matches it as any gated
    kind and keeps the one whose op ran (aten::silu: swiglu, no geglu); a user's own file is not read that way."""
    found, _ = scan_library_regions(table, target="cpu")
    gated = [i for i in found if str(i.category) in ("swiglu", "geglu")]
    assert [(str(i.category), i.library.function) for i in gated] == [("swiglu", "LlamaMLP.forward")]
    mlp_start, mlp_end = _lines_of("LlamaMLP.forward")
    assert mlp_start < gated[0].library.line_start <= gated[0].library.line_end <= mlp_end
    assert any("ACT2FN" in note for note in gated[0].evidence.notes)
    source = Path(modeling_llama.__file__).read_text()
    assert not [i for i in scan_source(source, LLAMA, target="cpu") if str(i.category) in ("swiglu", "geglu")]


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


def _record_table(root: Path):
    spec = importlib.util.spec_from_file_location(f"hf_steps_{root.name}", root / "hf_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return record_eager_ops(module.make_parts(), root, steps=1, warmup=1)


def test_a_later_analysis_takes_k_from_the_runs_reference_where_the_regions_code_is_unchanged(repo, table, reference,
                                                                                               tmp_path):
    """The run compiles its reference once, on the original. After an accepted library patch (its import line moves
    the entry script down a line) the head is analysed without compiling: K of the regions whose code is unchanged
    comes from the first analysis's records, found by site (their ids moved with their lines), not "?"."""
    first = align(affinity.detect(table, "AdamW"), table, reference.groups)
    records = {i.id: intent_record(i, site_fingerprint(repo, i)) for i in first}
    head = tmp_path / "head"
    head.mkdir()
    (head / "hf_steps.py").write_text("import os  # the patch module's import line stands here\n" + (repo / "hf_steps.py").read_text())
    moved = _record_table(head)
    later = align(affinity.detect(moved, "AdamW"), moved, None, earlier=earlier_lookup(records, lambda i: site_fingerprint(head, i)))
    for category in ("rmsnorm", "rope"):
        before, after = _intent(first, category), _intent(later, category)
        assert after.id != before.id and after.spans[0].line_start == before.spans[0].line_start + 1
        assert after.evidence.reference_kernels == before.evidence.reference_kernels is not None
        assert after.evidence.kernels == before.evidence.kernels and "inductor" in after.evidence.detectors
        assert after.estimate_basis == RUNTIME_BASIS and EARLIER_NOTE in after.evidence.notes
        assert after.evidence.target_ops == before.evidence.target_ops  # N: counted on the head's own profile
    blind = align(affinity.detect(moved, "AdamW"), moved, None)  # what a later analysis had before: K unknown
    assert _intent(blind, "rmsnorm").evidence.reference_kernels is None
    # the call site's code changed since (a rewrite of that line): the reference never compiled it, K stays unknown
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "hf_steps.py").write_text((head / "hf_steps.py").read_text().replace("labels=tokens)", "labels=tokens.clone())"))
    other = align(affinity.detect(moved, "AdamW"), moved, None, earlier=earlier_lookup(records, lambda i: site_fingerprint(changed, i)))
    assert _intent(other, "rmsnorm").evidence.reference_kernels is None
    assert EARLIER_NOTE not in _intent(other, "rmsnorm").evidence.notes


def test_sites_whose_records_disagree_on_k_lend_none_and_regions_outside_the_graphs_stay_noted():
    def record(site, kernels, notes=()):
        return {"site": site, "evidence": {"reference_kernels": kernels, "kernels": ["k0"] if kernels else [], "notes": list(notes)}}

    records = {"a": record("s1", 3), "b": record("s1", 3), "c": record("s2", 3), "d": record("s2", 4), "e": record(None, 5),
               "f": record("s3", None, ["no compiled kernel maps to these lines: the region was outside the compiled graphs"]),
               "g": record("s4", None)}  # an analysis without a reference: lends nothing
    known = earlier_references(records)
    assert set(known) == {"s1", "s3"} and known["s1"].kernels == 3 and known["s1"].names == ("k0",)
    assert known["s3"].kernels is None
    assert earlier_lookup({"g": record("s4", None)}, lambda i: "s4") is None


def _library_intent(category: str, function: str, lines: tuple[int, int], user_line: int = 9) -> Intent:
    spans = [SourceSpan(file="train.py", line_start=user_line, line_end=user_line)]
    library = library_span(LLAMA, *lines, function)
    return Intent(id=Intent.make_id(category, spans, library), category=category, spans=spans, library=library,
                  evidence=Evidence(detectors=["msprof_affinity"]), confidence=0.5, source=IntentSource.advisor_rule)


def _kernel(name: str, library_line: int, user_line: int, function: str = "forward") -> FusionGroup:
    return FusionGroup(kernel=name, phase=Phase.forward, kind=KernelKind.fused,
                       spans=[SourceSpan(file="train.py", line_start=user_line, line_end=user_line, function=function)],
                       library_lines=[library_span(LLAMA, library_line, library_line, "LlamaRMSNorm.forward")])


def test_library_kernels_of_a_reference_compiled_before_the_run_moved_the_users_lines():
    """The reference is compiled on the original; a library patch's import line moves the entry script down a line.
    Kernels are found by the library lines (never edited) and the call site's enclosing function, not its old line."""
    norm = _library_intent("rmsnorm", "LlamaRMSNorm.forward", (62, 67))
    first = SourceSpan(file="train.py", line_start=20, line_end=20, function="Net.forward")  # the eager profile's qualname
    kernels = [_kernel("cpp_fused_rsqrt_0", 65, 20), _kernel("cpp_fused_rsqrt_1", 65, 22),
               _kernel("cpp_fused_rsqrt_2", 65, 40, function="evaluate"),  # another function's call of the norm
               _kernel("cpp_fused_gelu_3", 200, 20)]  # another library region from the same line
    original = norm.model_copy(update={"spans": [first]})
    assert [k.kernel for k in library_kernels(original, kernels)] == ["cpp_fused_rsqrt_0"]  # lines hold: the call's own
    moved = norm.model_copy(update={"spans": [first.model_copy(update={"line_start": 21, "line_end": 21})]})
    # no line matches any more: the function's calls of the region (both of them: which moved where is not known here)
    assert [k.kernel for k in library_kernels(moved, kernels)] == ["cpp_fused_rsqrt_0", "cpp_fused_rsqrt_1"]
    elsewhere = norm.model_copy(update={"spans": [SourceSpan(file="train.py", line_start=9, line_end=9, function="main")]})
    assert library_kernels(elsewhere, kernels) == []  # no call of the region from that function in the reference


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


def test_the_run_reports_intents_table_shows_a_library_intents_location_as_analyze_does():
    """The run keeps every intent an analysis found (state's intent_evidence) for the report's intents table; a library
    intent found by an earlier analysis only (done, or its id moved with its lines) showed only the user's line."""
    from trainbridge.tools.report.sections import intent_record, intents_section

    norm = _library_intent("rmsnorm", "LlamaRMSNorm.forward", (62, 67))
    kept = intent_record(norm, site="abc")
    assert LibrarySpan.model_validate(kept["library"]) == norm.library and kept["site"] == "abc"
    rows = "\n".join(intents_section({"intent_evidence": {norm.id: kept}, "done_intents": [norm.id]}))
    assert f"| 1 | rmsnorm | {norm.where().replace('_', chr(92) + '_')} | ? vs ? |" in rows, rows  # markdown-escaped
    assert norm.where().startswith(f"{LLAMA}:LlamaRMSNorm.forward:62-67 (transformers ") and norm.where().endswith(" via train.py:9")
