"""The torch_npu profiler parser on fixture directories (tests/fixtures/npu_profiler/, one per case).

The fixtures are constructed to the documented formats (see their README). Cross-file checks
(operator_details device time vs kernel_details durations, trace records vs file lines) make the
assertions independent of how any one file was parsed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainbridge.records import Phase
from trainbridge.tools.npu_profile.parser import (
    OUTPUT_DIR,
    UNATTRIBUTED_FILE,
    NpuProfileError,
    device_time_by_op_type,
    find_output_dir,
    kernels_per_step,
    load_npu_profile,
    normalise_shapes,
    parse_call_stack,
    profiled_steps,
    read_trace_view,
    step_times_us,
    to_target_profile,
)

FIXTURES = Path(__file__).parent / "fixtures" / "npu_profiler"
RUN = "devbox_4242_20260101120000123_ascend_pt"
REPO = "/home/dev/work/llm"


def output(case: str) -> Path:
    return FIXTURES / case / RUN / OUTPUT_DIR


@pytest.fixture(scope="module")
def normal():
    return load_npu_profile(FIXTURES / "normal")


def _span(profile, where: str, phase: Phase):
    found = [s for s in profile.spans if str(s.span) == where and s.phase is phase]
    assert len(found) == 1, f"{where} {phase}: {[(str(s.span), s.phase) for s in profile.spans]}"
    return found[0]


# --- parsing ------------------------------------------------------------------------------------
def test_any_level_of_the_output_tree_is_accepted():
    expected = output("normal")
    for path in (FIXTURES / "normal", FIXTURES / "normal" / RUN, expected):
        assert find_output_dir(path) == expected


def test_normal_run_parses_into_typed_rows(normal):
    assert len(normal.kernels) == 72 and {k.step_id for k in normal.kernels} == {5, 6}
    first = normal.kernels[0]
    assert (first.name, first.type, first.accelerator_core, first.block_num) == (
        "aclnnAddmm_MatMulCommon_MatMulV2", "MatMulV2", "AI_CORE", 24)
    assert first.duration_us == 10.0 and first.start_us == pytest.approx(1767268800000042.0)
    linear = normal.operators[0]
    assert linear.name == "aten::linear" and linear.call_stack[0].file.endswith("torch/nn/modules/linear.py")
    assert (linear.call_stack[3].file, linear.call_stack[3].line, linear.call_stack[3].function) == (f"{REPO}/model.py", 31, "forward")
    assert normal.profiler_info["cann_version"] == "8.1.RC1"
    assert [r.step for r in normal.step_trace] == [5, 6]
    assert len(normal.trace_events) == 360 and not normal.trace_truncated
    assert all(isinstance(e.ts_us, float) for e in normal.trace_events if e.ph == "X")  # string ts converted


def test_analyses_agree_across_files(normal):
    assert profiled_steps(normal) == 2
    assert kernels_per_step(normal) == 36
    assert step_times_us(normal) == [522.0, 523.5]
    by_type = device_time_by_op_type(normal)  # from op_statistic.csv
    kernel_total = sum(k.duration_us for k in normal.kernels)
    assert sum(total for _, _, total in by_type) == pytest.approx(kernel_total)
    assert by_type[0][:2] == ("MatMulV2", 6)
    without_statistic = normal.model_copy(update={"op_statistic": None})  # falls back to kernel rows
    assert device_time_by_op_type(without_statistic)[0][0] == "MatMulV2"


def test_block_dim_variant_reads_the_same_values(normal):
    variant = load_npu_profile(FIXTURES / "block_dim_variant")
    assert [k.block_num for k in variant.kernels] == [k.block_num for k in normal.kernels]
    assert [k.start_us for k in variant.kernels] == [k.start_us for k in normal.kernels]  # tab-suffixed cells
    assert [r.communication_not_overlapped_us for r in variant.step_trace] == [0.0, 0.0]  # spaced header found
    assert [e.ts_us for e in variant.trace_events] == [e.ts_us for e in normal.trace_events]  # numeric vs string ts
    assert to_target_profile(variant, REPO) == to_target_profile(normal, REPO)


def test_no_step_id_variant(normal):
    table = load_npu_profile(FIXTURES / "no_step_id")
    assert all(k.step_id is None for k in table.kernels) and table.step_trace[0].step is None
    assert profiled_steps(table) == 1  # nothing in the files says how many steps the capture had
    once = to_target_profile(table, REPO)
    assert once.total_ops_per_step == 72
    two = to_target_profile(table, REPO, steps=2)
    reference = to_target_profile(normal, REPO)
    assert [(str(s.span), s.phase, s.ops_per_step, s.op_names) for s in two.spans] == \
        [(str(s.span), s.phase, s.ops_per_step, s.op_names) for s in reference.spans]
    assert two.step_time_us == pytest.approx(table.step_trace[0].stage_us / 2)


def test_truncated_trace_keeps_every_complete_record():
    path = output("truncated_trace") / "trace_view.json"
    events, truncated = read_trace_view(path)
    complete = 0
    for line in path.read_text().splitlines()[1:]:
        try:
            json.loads(line.rstrip(","))
            complete += 1
        except json.JSONDecodeError:
            break
    assert truncated and len(events) == complete and 0 < complete < 360
    assert not path.read_text().rstrip().endswith("]")


def test_truncated_trace_still_links_the_backward_ops_it_holds():
    table = load_npu_profile(FIXTURES / "truncated_trace")
    profile = to_target_profile(table, REPO)
    assert profile.total_ops_per_step == 36  # ops come from operator_details.csv, whole
    norm_bw = _span(profile, "model.py:20", Phase.backward)
    assert 6 <= norm_bw.ops_per_step < 12  # step 5 fully linked, step 6 cut off part-way
    lost = _span(profile, f"{UNATTRIBUTED_FILE}:1", Phase.backward)
    assert "aten::div" in lost.op_names or "aten::mm" in lost.op_names


# --- the target profile -------------------------------------------------------------------------
def test_target_profile_attributes_ops_to_source_lines(normal):
    profile = to_target_profile(normal, REPO)
    assert (profile.backend, profile.steps_profiled, profile.step_time_us) == ("npu", 2, 522.75)
    norm = _span(profile, "model.py:20", Phase.forward)
    assert norm.op_names == ["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"]
    assert norm.span.function == "forward" and norm.shapes[0] == "[[16, 64], []]"
    assert norm.self_time_us_per_step == pytest.approx(2.0 + 2.5 + 1.0 + 1.0 + 1.5 + 1.5)
    norm_bw = _span(profile, "model.py:20", Phase.backward)  # linked through evaluate_function seq numbers
    assert norm_bw.ops_per_step == 12 and {"aten::div", "aten::pow", "aten::sum"} <= set(norm_bw.op_names)
    assert _span(profile, "model.py:31", Phase.forward).op_names == ["aten::addmm"]  # linear's t launches nothing
    assert _span(profile, "model.py:31", Phase.backward).op_names == ["aten::mm", "aten::mm", "aten::sum"]
    assert _span(profile, "train.py:12", Phase.backward).op_names == ["aten::ones_like"]  # the grad seed
    optimizer = _span(profile, "train.py:13", Phase.optimizer)
    assert optimizer.ops_per_step == 9 and optimizer.span.function == "train_step"
    accumulate = _span(profile, f"{UNATTRIBUTED_FILE}:1", Phase.backward)  # AccumulateGrad: no forward op
    assert accumulate.op_names == ["aten::add_"] * 3


def test_target_profile_counts_each_kernel_launch_once(normal):
    profile = to_target_profile(normal, REPO)
    assert profile.total_ops_per_step == kernels_per_step(normal)
    device_us_per_step = sum(k.duration_us for k in normal.kernels) / 2
    assert sum(s.self_time_us_per_step for s in profile.spans) == pytest.approx(device_us_per_step)


def test_repo_root_selects_the_user_frames(normal):
    assert to_target_profile(normal, [REPO + "/"]) == to_target_profile(normal, REPO)
    elsewhere = to_target_profile(normal, "/srv/other_repo")
    assert {s.span.file for s in elsewhere.spans} == {UNATTRIBUTED_FILE}
    assert elsewhere.total_ops_per_step == 36


def test_host_only_capture_falls_back_to_leaf_ops(normal):
    host_only = normal.model_copy(update={"operators": [
        row.model_copy(update={"device_self_us": 0.0, "device_total_us": 0.0}) for row in normal.operators]})
    profile = to_target_profile(host_only, REPO)
    norm = _span(profile, "model.py:20", Phase.forward)
    assert norm.op_names == ["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"]
    linear = _span(profile, "model.py:31", Phase.forward)
    assert linear.op_names == ["aten::t", "aten::addmm"]  # leaves, not aten::linear


def test_target_profile_refuses_what_it_cannot_attribute(normal):
    no_stacks = normal.model_copy(update={"operators": [r.model_copy(update={"call_stack": []}) for r in normal.operators]})
    with pytest.raises(NpuProfileError, match="with_stack=True"):
        to_target_profile(no_stacks, REPO)
    with pytest.raises(NpuProfileError, match="operator_details.csv is missing"):
        to_target_profile(normal.model_copy(update={"operators": None}), REPO)
    no_timing = normal.model_copy(update={"step_trace": None, "trace_events": None})
    with pytest.raises(NpuProfileError, match="pass step_time_us"):
        to_target_profile(no_timing, REPO)
    assert to_target_profile(no_timing, REPO, step_time_us=500.0).step_time_us == 500.0


# --- garbage ------------------------------------------------------------------------------------
def test_missing_required_column_names_file_and_column():
    with pytest.raises(NpuProfileError) as caught:
        load_npu_profile(FIXTURES / "garbage_missing_column")
    assert Path(caught.value.file).name == "operator_details.csv"
    assert caught.value.column == "Device Self Duration(us)"
    assert "Device Self Duration(us)" in str(caught.value) and "operator_details.csv" in str(caught.value)


def test_non_numeric_duration_names_file_column_and_line():
    with pytest.raises(NpuProfileError) as caught:
        load_npu_profile(FIXTURES / "garbage_non_numeric")
    error = caught.value
    assert (Path(error.file).name, error.column, error.line) == ("kernel_details.csv", "Duration(us)", 4)
    assert "'fast' is not a number" in str(error)


def test_malformed_complete_trace_record_is_an_error_not_a_truncation():
    with pytest.raises(NpuProfileError) as caught:
        load_npu_profile(FIXTURES / "garbage_trace_record")
    assert Path(caught.value.file).name == "trace_view.json" and caught.value.line == 3


def test_not_a_profiler_directory():
    with pytest.raises(NpuProfileError, match="not a torch_npu profiler directory"):
        load_npu_profile(FIXTURES / "not_a_profiler_dir")


def test_directory_edge_cases(tmp_path):
    with pytest.raises(NpuProfileError, match="not a directory"):
        find_output_dir(tmp_path / "missing")
    raw = tmp_path / "raw_ascend_pt"
    (raw / "FRAMEWORK").mkdir(parents=True)
    with pytest.raises(NpuProfileError, match="analyse"):
        find_output_dir(raw)
    (raw / OUTPUT_DIR).mkdir()
    (raw / OUTPUT_DIR / "readme.txt").write_text("nothing")
    with pytest.raises(NpuProfileError, match="no profiler files"):
        find_output_dir(raw)
    two = tmp_path / "two_ranks"
    for rank in ("a_ascend_pt", "b_ascend_pt"):
        shutil.copytree(output("normal"), two / rank / OUTPUT_DIR)
    with pytest.raises(NpuProfileError, match="2 profiler outputs"):
        find_output_dir(two)


def test_trace_view_shapes(tmp_path):
    path = tmp_path / "trace_view.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "a", "ts": "1.5\t", "dur": 2}]}))
    events, truncated = read_trace_view(path)
    assert (events[0].ts_us, events[0].dur_us, truncated) == (1.5, 2.0, False)
    path.write_text('[{"ph": "X", "name": "a", "ts": "soon", "dur": 2}]')
    with pytest.raises(NpuProfileError, match="event 0 ts"):
        read_trace_view(path)
    path.write_text('[{"ph": "X", "name": "a", "dur": 2}]')
    with pytest.raises(NpuProfileError, match="without 'ts'"):
        read_trace_view(path)
    path.write_text("name,ts\na,1\n")
    with pytest.raises(NpuProfileError, match="JSON array"):
        read_trace_view(path)
    path.write_text('[{"ph": "M", "name": "process_name", "args": {"name": "Python"}}, {"ph": "X", "name": "cut", "args": {"Call stack": "a.py(1): f;')
    events, truncated = read_trace_view(path)  # cut inside a string of the second record
    assert truncated and [e.name for e in events] == ["process_name"]


def test_empty_csv_is_rejected(tmp_path):
    out = tmp_path / OUTPUT_DIR
    out.mkdir()
    (out / "step_trace_time.csv").write_text("")
    with pytest.raises(NpuProfileError, match="empty file"):
        load_npu_profile(tmp_path)


# --- small pieces -------------------------------------------------------------------------------
def test_call_stack_and_shape_formats():
    frames = parse_call_stack("/r/m.py(20): forward;\r\n/r/t.py(11):train_step;/x/y.py(3): <module>")
    assert [(f.file, f.line, f.function) for f in frames] == [
        ("/r/m.py", 20, "forward"), ("/r/t.py", 11, "train_step"), ("/x/y.py", 3, "<module>")]
    assert parse_call_stack("") == []
    assert normalise_shapes("16,64;\r\n64") == "[[16, 64], [64]]"
    assert normalise_shapes("16,64;") == "[[16, 64], []]"  # a scalar second input
    assert normalise_shapes("") == "[]"
    assert normalise_shapes("dynamic") == "dynamic"
