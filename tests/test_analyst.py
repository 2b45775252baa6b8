"""The analyst's alignment: advisor rules over eager ops, merging detectors, K vs N from real evidence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainbridge.agents.analyst import affinity
from trainbridge.agents.analyst.align import NO_REFERENCE_BASIS, RUNTIME_BASIS, align, merge
from trainbridge.agents.analyst.analyze import HOST_REFERENCE, analyze_repo, reference_backend
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, Phase, SourceSpan
from trainbridge.sandbox.backends import npu_selection
from trainbridge.sandbox.workload import load_workload
from trainbridge.tools.eager_profile import EagerOp, EagerOpTable

FIXTURES = Path(__file__).parent / "fixtures"


def op(index: int, name: str, line: int, phase: Phase = Phase.forward, file: str = "m.py", time_us: float = 10.0) -> EagerOp:
    return EagerOp(step=0, index=index, name=f"aten::{name}", phase=phase, span=SourceSpan(file=file, line_start=line, line_end=line),
                   time_us=time_us, host_time_us=time_us, shapes="[]")


def table(ops: list[EagerOp]) -> EagerOpTable:
    return EagerOpTable(backend="cpu", device="cpu", steps=1, ops=ops, step_times_us=[1000.0], profiled_step_times_us=[1200.0],
                        profile_wall_s=0.1, unlinked_backward_ops=0)


def test_advisor_patterns_match_whole_op_names_with_optional_tokens_at_either_end():
    rms = affinity.translate("(pow){0,1}-(mean){0,1}-(add){0,1}-rsqrt-mul-(type_as){0,1}")
    assert rms.search("x-pow-mean-add-rsqrt-mul-mul-") is not None
    assert rms.search("x-rsqrt-addcmul-") is None  # 'mul' must be a whole name, not the tail of addcmul
    fill = affinity.translate("softmax-(mul){0,1}-(masked_fill_)")
    assert fill.search("softmax-masked_fill-") is not None  # in-place and out-of-place are the same op here
    with pytest.raises(ValueError, match="unsupported advisor pattern token"):
        affinity.translate("a-b.c")


def test_advisor_detector_finds_rms_norm_attention_rope_and_the_optimizer_at_the_ops_lines():
    ops = [op(0, "pow", 10), op(1, "mean", 10), op(2, "add", 10), op(3, "rsqrt", 10), op(4, "mul", 10), op(5, "mul", 10),
           # q @ k.T: the matmul's own reshapes on the same line are folded into it; the mask is a constant
           op(6, "view", 20), op(7, "bmm", 20), op(8, "_unsafe_view", 20), op(9, "mul", 20), op(10, "ones", 21), op(11, "triu", 21),
           op(12, "masked_fill", 22), op(13, "_softmax", 23), op(14, "view", 24), op(15, "bmm", 24),
           op(16, "slice", 30), op(17, "neg", 30), op(18, "cat", 30), op(19, "mul", 31), op(20, "add", 31),
           op(21, "mul_", 40, Phase.optimizer, file="train.py")]
    found = {(i.category, tuple(str(s) for s in i.spans)) for i in affinity.detect(table(ops), optimizer_class="AdamW")}
    assert (IntentCategory.rmsnorm, ("m.py:10",)) in found
    assert (IntentCategory.attention, ("m.py:20", "m.py:22", "m.py:23", "m.py:24")) in found
    assert (IntentCategory.rope, ("m.py:30", "m.py:31")) in found
    assert (IntentCategory.optimizer_step, ("train.py:40",)) in found
    unknown_optimizer = affinity.detect(table(ops), optimizer_class=None)
    assert IntentCategory.optimizer_step not in {i.category for i in unknown_optimizer}


def intent(category: str, lines: tuple[int, int], source: IntentSource, detector: str, file: str = "m.py") -> Intent:
    spans = [SourceSpan(file=file, line_start=lines[0], line_end=lines[1])]
    return Intent(id=Intent.make_id(category, spans), category=category, spans=spans, confidence=0.5, source=source,
                  evidence=Evidence(detectors=[detector]))


def test_merge_keeps_static_spans_and_unites_detectors_and_program_level_categories():
    merged = merge([intent("rmsnorm", (10, 10), IntentSource.advisor_rule, "msprof_affinity"),
                    intent("rmsnorm", (8, 12), IntentSource.static, "static"),
                    intent("optimizer_step", (70, 72), IntentSource.static, "static", file="train.py"),
                    intent("optimizer_step", (59, 59), IntentSource.advisor_rule, "msprof_affinity", file="train.py"),
                    intent("attention", (40, 44), IntentSource.static, "static")])
    by_category = {i.category: i for i in merged}
    assert len(merged) == 3
    assert [str(s) for s in by_category["rmsnorm"].spans] == ["m.py:8-12"]
    assert by_category["rmsnorm"].evidence.detectors == ["msprof_affinity", "static"]
    assert [str(s) for s in by_category["optimizer_step"].spans] == ["train.py:70-72"]


def test_merge_keeps_two_source_findings_of_a_program_level_category_apart():
    merged = merge([intent("optimizer_step", (70, 72), IntentSource.static, "static", file="train.py"),
                    intent("optimizer_step", (20, 31), IntentSource.static, "static", file="optim.py"),  # a Muon loop
                    intent("optimizer_step", (59, 59), IntentSource.advisor_rule, "msprof_affinity", file="train.py")])
    assert sorted(str(i.spans[0]) for i in merged) == ["optim.py:20-31", "train.py:70-72"]
    assert sorted(d for i in merged for d in i.evidence.detectors) == ["msprof_affinity", "static", "static"]


def test_align_counts_ops_per_region_and_labels_estimates():
    ops = [op(i, name, 10) for i, name in enumerate(["pow", "mean", "add", "rsqrt", "mul", "mul"])] + [op(6, "mm", 50, time_us=500.0)]
    ranked = align([intent("rmsnorm", (8, 12), IntentSource.static, "static"), intent("gelu", (30, 30), IntentSource.static, "static")], table(ops))
    rms, gelu = ranked
    assert rms.evidence.target_ops == 6 and rms.evidence.target_time_us == 60.0
    assert rms.estimate_basis == NO_REFERENCE_BASIS and rms.estimated_saving_us == 30.0
    assert rms.evidence.target_time_share == pytest.approx(60.0 / 560.0, rel=1e-3)
    assert gelu.estimated_saving_us is None and gelu.confidence <= 0.3  # nothing ran there


@pytest.mark.slow
def test_analysis_of_a_real_step_against_a_real_compiled_reference(tmp_path):
    """The tiny llama's eager step profiled here, aligned with the Inductor evidence pack captured from
    the same source on another root: K and N come from real artifacts on both sides."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(FIXTURES / "inductor" / "models" / "tiny_llama.py", repo / "tiny_llama.py")
    (repo / "entry.py").write_text("import torch\nfrom tiny_llama import make_parts\n\n\ndef build(device, seed):\n    return make_parts()\n")
    (repo / "trainbridge.toml").write_text('entry = "entry:build"\nwarmup_steps = 1\nsteps = 1\ntimeout_s = 600\n')
    source = (repo / "tiny_llama.py").read_text().splitlines()
    rsqrt_line = next(i for i, line in enumerate(source, 1) if "torch.rsqrt" in line)

    analysis = analyze_repo(load_workload(repo), reference_pack=FIXTURES / "inductor" / "cpu_llama" / "evidence.tar.gz")

    assert analysis.mode == "runtime" and set(analysis.phase_seconds) >= {"static_scan", "target_profile", "reference", "align"}
    rms = next(i for i in analysis.intents if i.category == IntentCategory.rmsnorm)
    assert any(s.line_start <= rsqrt_line <= s.line_end for s in rms.spans)
    assert rms.evidence.reference_kernels is not None and 1 <= rms.evidence.reference_kernels < rms.evidence.target_ops
    assert any("rsqrt" in k for k in rms.evidence.kernels)
    assert rms.estimate_basis == RUNTIME_BASIS and rms.estimated_saving_us > 0
    assert {"static", "eager_profile", "inductor"} <= set(rms.evidence.detectors)
    categories = {i.category for i in analysis.intents}
    assert {IntentCategory.rope, IntentCategory.attention, IntentCategory.cross_entropy} <= categories
    savings = [i.estimated_saving_us for i in analysis.intents if i.estimated_saving_us is not None]
    assert savings == sorted(savings, reverse=True)


def test_an_npu_target_without_an_npu_takes_its_compile_reference_from_the_host_cpu():
    """Issue 25: the emulated npu device has no compiler, so an NPU target's torch.compile reference is compiled on
    the host CPU and the analysis says so; CPU and CUDA targets compile where they run. The whole path (the host's
    Inductor kernels beside the eager ops counted on the emulated device, no reference step time) is asserted on a
    real run in tests/test_npu_target_e2e.py."""
    assert npu_selection().mode != "real"  # this host has no NPU: the emulation is what `npu` selects
    assert reference_backend("npu") == ("cpu", HOST_REFERENCE)
    assert reference_backend("cpu") == ("cpu", "compiled here") and reference_backend("cuda") == ("cuda", "compiled here")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_pretrain", "gpt2_pretrain", "resnet_classify", "clip_pretrain"])
def test_runtime_analysis_of_each_example_finds_its_patterns_and_nothing_false(name):
    """`trainbridge analyze` (profiled step, no compile here to keep CI short): every hand-written pattern
    the source scan expects is found at its lines with eager ops attached; the only additions are the
    advisor's reshape+transpose findings, each on a line that really reshapes and transposes."""
    from trainbridge.tests.static_scan_expectations import EXPECTED_EXAMPLES

    root = Path(__file__).resolve().parents[1] / "examples" / name
    analysis = analyze_repo(load_workload(root), compile_reference=False)
    found = {(i.category.value, i.spans[0].file, i.spans[0].line_start, i.spans[0].line_end): i for i in analysis.intents}
    expected = set(EXPECTED_EXAMPLES[name])
    assert expected <= set(found), f"missing: {sorted(expected - set(found))}"
    for row in expected:
        if row[0] not in ("conv_layout",):
            assert found[row].evidence.target_ops, f"{row}: no eager op attributed to these lines"
    for row, intent in found.items():
        if row in expected:
            continue
        assert intent.category == IntentCategory.permute_reshape, f"unexpected intent {row}"
        line = (root / row[1]).read_text().splitlines()[row[2] - 1]
        assert any(w in line for w in ("view", "reshape", "flatten")) and any(w in line for w in ("transpose", "permute")), line
