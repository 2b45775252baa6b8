"""Eager step profiling: every ATen op attributed to its exact source line and phase.

Runs a real small model (tests/fixtures/eager_model/tiny_model.py) on the CPU. Lines are found
through `# marker: <name>` comments in that file, never hard-coded.
"""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from trainbridge.records import Phase, SourceSpan
from trainbridge.tools.eager_profile import (
    UNATTRIBUTED_FILE,
    EagerOp,
    EagerOpTable,
    ops_per_step_by_step,
    profile_eager_step,
    record_eager_ops,
    to_target_profile,
)

MODEL_DIR = Path(__file__).parent / "fixtures" / "eager_model"
MODEL_FILE = MODEL_DIR / "tiny_model.py"


def _load_model_module():
    spec = importlib.util.spec_from_file_location("trainbridge_test_tiny_model", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _marker_lines() -> dict[str, int]:
    lines = {}
    for number, text in enumerate(MODEL_FILE.read_text().splitlines(), start=1):
        found = re.search(r"# marker: (\w+)", text)
        if found:
            lines[found.group(1)] = number
    return lines


@pytest.fixture(scope="module")
def single_thread():
    # Two shared cores: OpenMP's second thread stalls for milliseconds under load.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return _load_model_module()


@pytest.fixture(scope="module")
def table(tiny, single_thread) -> EagerOpTable:
    return record_eager_ops(tiny.trainbridge_entry(seed=0), MODEL_DIR, steps=2, warmup=1)


@pytest.fixture(scope="module")
def lines() -> dict[str, int]:
    return _marker_lines()


def _ops_at(table: EagerOpTable, line: int, phase: Phase, step: int = 0) -> list[EagerOp]:
    return [op for op in table.ops if op.span.file == "tiny_model.py" and op.span.line_start == line
            and op.phase is phase and op.step == step]


def _stats(profile, line: int, phase: Phase):
    found = [s for s in profile.spans if s.span.file == "tiny_model.py" and s.span.line_start == line and s.phase is phase]
    assert len(found) == 1, f"expected one span at line {line} ({phase}), found {len(found)}"
    return found[0]


def test_rmsnorm_line_gets_its_forward_ops_in_launch_order(table, lines):
    profile = to_target_profile(table)
    stats = _stats(profile, lines["rmsnorm"], Phase.forward)
    names = [n for n in stats.op_names if n != "aten::detach"]  # rsqrt saves its result via detach
    assert names == ["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"]
    assert stats.span.function == "RMSNorm.forward"
    assert stats.ops_per_step == len(stats.op_names)
    assert stats.shapes[0] == "[[16, 64], []]"  # pow(x, 2): x is [batch 16, hidden 64], 2 a scalar
    assert len(stats.shapes) == len(stats.op_names)


def test_rmsnorm_backward_ops_are_linked_to_the_forward_line(table, lines):
    ops = _ops_at(table, lines["rmsnorm"], Phase.backward)
    nodes = {op.node for op in ops}
    assert {"PowBackward0", "MeanBackward1", "RsqrtBackward0", "MulBackward0"} <= nodes
    by_node = {node: [op.name for op in ops if op.node == node] for node in nodes}
    assert "aten::div" in by_node["MeanBackward1"]
    assert "aten::pow" in by_node["PowBackward0"] and "aten::pow" in by_node["RsqrtBackward0"]
    # No backward op of the norm leaks onto the line that calls the module.
    assert not _ops_at(table, lines["norm_call"], Phase.backward)


def test_other_lines_get_their_own_forward_and_backward_ops(table, lines):
    for key in ("up", "down"):
        forward = [op.name for op in _ops_at(table, lines[key], Phase.forward)]
        backward = [op.name for op in _ops_at(table, lines[key], Phase.backward)]
        assert forward == ["aten::t", "aten::addmm"], key
        assert "aten::mm" in backward, key
    silu_bw = {op.node for op in _ops_at(table, lines["silu"], Phase.backward)}
    assert "SigmoidBackward0" in silu_bw
    loss_fw = [op.name for op in _ops_at(table, lines["loss"], Phase.forward)]
    loss_bw = [op.name for op in _ops_at(table, lines["loss"], Phase.backward)]
    assert "aten::nll_loss_forward" in loss_fw and "aten::nll_loss_backward" in loss_bw


def test_optimizer_phase_and_gradient_accumulation(table, lines):
    step_ops = _ops_at(table, lines["step"], Phase.optimizer)
    names = Counter(op.name for op in step_ops)
    params = 5  # up.weight, up.bias, norm.weight, down.weight, down.bias
    assert names["aten::addcdiv_"] == params and names["aten::lerp_"] == params
    # Gradient clipping runs with grad disabled after backward: the update, not the forward.
    assert _ops_at(table, lines["clip"], Phase.optimizer)
    assert not _ops_at(table, lines["clip"], Phase.forward)
    # AccumulateGrad has no forward op: its ops stay on the backward() call line, with the
    # gradient seed that backward() makes before the engine starts.
    on_backward_line = _ops_at(table, lines["backward"], Phase.backward)
    assert [op.name for op in on_backward_line if op.node is None] == ["aten::ones_like"]
    accumulate = [op for op in on_backward_line if op.node is not None]
    assert {op.node for op in accumulate} == {"torch::autograd::AccumulateGrad"} and len(accumulate) == params
    assert not _ops_at(table, lines["backward"], Phase.forward)
    assert table.unlinked_backward_ops == params * table.steps


def test_totals_times_and_per_step_stability(table):
    profile = to_target_profile(table)
    counts = ops_per_step_by_step(table)
    assert counts[0] == counts[1] > 50
    assert profile.total_ops_per_step == counts[0]
    assert sum(s.ops_per_step for s in profile.spans) == pytest.approx(profile.total_ops_per_step)
    assert profile.step_time_us > 0 and profile.steps_profiled == 2
    assert all(op.time_us > 0 for op in table.ops)
    assert {op.span.file for op in table.ops} == {"tiny_model.py"}
    assert profile.backend == "cpu" and profile.device == "cpu"


def test_counts_are_stable_across_two_runs(tiny, single_thread):
    first = profile_eager_step(tiny.trainbridge_entry(seed=0), MODEL_DIR, steps=1, warmup=1)
    second = profile_eager_step(tiny.trainbridge_entry(seed=1), MODEL_DIR, steps=1, warmup=2)

    def shape(profile):
        return [(str(s.span), s.phase, s.ops_per_step, tuple(s.op_names)) for s in profile.spans]

    assert shape(first) == shape(second)


def test_profiler_timer_attributes_the_same_ops(tiny, table, single_thread):
    marked = record_eager_ops(tiny.trainbridge_entry(seed=0), MODEL_DIR, steps=2, warmup=1, cpu_timer="profiler")
    assert [(op.name, str(op.span), op.phase) for op in marked.ops] == [(op.name, str(op.span), op.phase) for op in table.ops]
    assert all(op.time_us > 0 for op in marked.ops)  # every op joined to its profiler marker


def test_frames_outside_the_repo_root_are_not_attributed(tiny, tmp_path, single_thread):
    table = record_eager_ops(tiny.trainbridge_entry(seed=0), tmp_path, steps=1, warmup=0)
    assert {op.span.file for op in table.ops} == {UNATTRIBUTED_FILE}


def test_bad_arguments_say_what_to_fix(tiny, tmp_path):
    parts = tiny.trainbridge_entry(seed=0)
    del parts["optimizer"]
    with pytest.raises(ValueError, match="optimizer"):
        record_eager_ops(parts, MODEL_DIR)
    with pytest.raises(ValueError, match="not a directory"):
        record_eager_ops(tiny.trainbridge_entry(seed=0), tmp_path / "missing")
    with pytest.raises(ValueError, match="cpu_timer"):
        record_eager_ops(tiny.trainbridge_entry(seed=0), MODEL_DIR, cpu_timer="wall")


def test_aggregation_is_per_span_and_phase_averaged_over_steps():
    a = SourceSpan(file="m.py", line_start=3, line_end=3, function="f")
    b = SourceSpan(file="m.py", line_start=9, line_end=9, function="g")

    def op(step, index, name, span, phase, time_us):
        return EagerOp(step=step, index=index, name=name, phase=phase, span=span, time_us=time_us,
                       host_time_us=time_us, shapes="[]")

    table = EagerOpTable(
        backend="cpu", device="cpu", steps=2, step_times_us=[100.0, 300.0, 200.0], profiled_step_times_us=[1.0, 1.0],
        profile_wall_s=0.1, unlinked_backward_ops=0,
        ops=[
            op(0, 0, "aten::mul", a, Phase.forward, 2.0), op(0, 1, "aten::add", a, Phase.forward, 4.0),
            op(0, 2, "aten::mul", a, Phase.backward, 6.0),
            op(1, 3, "aten::mul", a, Phase.forward, 2.0), op(1, 4, "aten::add", a, Phase.forward, 4.0),
            op(1, 5, "aten::mul", a, Phase.backward, 6.0), op(1, 6, "aten::item", b, Phase.forward, 8.0),
        ],
    )
    profile = to_target_profile(table)
    assert [(str(s.span), s.phase) for s in profile.spans] == [
        ("m.py:3", Phase.forward), ("m.py:3", Phase.backward), ("m.py:9", Phase.forward)]
    fwd, bwd, late = profile.spans
    assert fwd.op_names == ["aten::mul", "aten::add"] and fwd.ops_per_step == 2 and fwd.self_time_us_per_step == 6.0
    assert bwd.ops_per_step == 1 and bwd.self_time_us_per_step == 6.0
    assert late.op_names == ["aten::item"] and late.ops_per_step == 0.5  # only in the second step
    assert profile.total_ops_per_step == 3.5
    assert profile.step_time_us == 200.0  # the median of the unprofiled steps
