"""The datasheet cost model: the device table's provenance, op arithmetic, and intent savings on a
real eager op table of a tiny model. Everything it returns is an estimate; nothing here measures."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from trainbridge.agents.analyst.cost_model import (
    DEVICES_FILE,
    count_flops_and_bytes,
    device_spec,
    estimate_intent_saving,
    estimate_op,
    estimate_saving,
    load_devices,
)
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, Phase, SourceSpan

MODEL_DIR = Path(__file__).parent / "fixtures" / "eager_model"


# --- the device table -----------------------------------------------------------------------------

def test_device_table_has_the_four_devices_each_figure_sourced_and_dated():
    devices = load_devices()
    assert set(devices) == {"ascend_910b", "ascend_910c", "h100", "h200"}
    for spec in devices.values():
        figures = [*spec.peak_flops.values(), spec.hbm_bandwidth, spec.launch_overhead_us]
        assert set(spec.peak_flops) == {"float16", "bfloat16", "float32"}
        for figure in figures:
            assert figure.source.strip() and figure.date.strip() and figure.checked.strip()
            if figure.value is None:
                assert figure.confidence == "unknown"
                continue
            assert figure.low is not None and figure.high is not None and figure.low <= figure.value <= figure.high
            if figure.confidence != "vendor":  # an uncertain figure says so
                assert figure.note.strip(), f"{spec.key}: a {figure.confidence} figure without a note"
        assert spec.launch_overhead_us.confidence == "assumption"


def test_hopper_peaks_are_dense_halves_of_the_sparse_datasheet_figure():
    for key in ("h100", "h200"):
        spec = device_spec(key)
        assert spec.peak_flops["bfloat16"].value == pytest.approx(1979e12 / 2, rel=1e-3)
        assert "sparsity" in spec.peak_flops["float16"].source
    assert device_spec("h200").hbm_bandwidth.value > device_spec("h100").hbm_bandwidth.value
    assert device_spec("910C").key == "ascend_910c"
    with pytest.raises(KeyError, match="choose one of"):
        device_spec("tpu_v5")


def test_the_yaml_names_no_speedup():
    text = DEVICES_FILE.read_text(encoding="utf-8").lower()
    assert "estimate" in text and "speedup" not in text.replace("speed-up is ever", "")
    yaml.safe_load(text)


# --- one op ---------------------------------------------------------------------------------------

def test_matmul_flops_bytes_and_roofline():
    m, k, n = 4096, 4096, 4096
    flops, moved, launches, _ = count_flops_and_bytes("aten::mm", f"[[{m}, {k}], [{k}, {n}]]", 2)
    assert flops == 2 * m * k * n and moved == (m * k + k * n + m * n) * 2 and launches == 1
    est = estimate_op("aten::mm", f"[[{m}, {k}], [{k}, {n}]]", "h100", "bfloat16")
    assert est.label == "estimate" and est.bound == "compute"
    assert est.compute_us == pytest.approx(2 * m * k * n / 989.5e12 * 1e6)
    assert est.time_us == pytest.approx(est.compute_us + 10.0)
    addmm, *_ = count_flops_and_bytes("aten::addmm", "[[64], [32, 16], [16, 64]]", 4)
    assert addmm == 2 * 32 * 16 * 64 + 32 * 64
    bmm, *_ = count_flops_and_bytes("aten::bmm", "[[8, 32, 16], [8, 16, 64]]", 4)
    assert bmm == 2 * 8 * 32 * 16 * 64


def test_small_pointwise_op_is_launch_bound_and_views_launch_nothing():
    est = estimate_op("aten::mul", "[[16, 64], [16, 1]]", "ascend_910b", "float16")
    assert est.bound == "launch" and est.launch_us == 20.0
    assert est.bytes == (16 * 64 + 16 + 16 * 64) * 2
    view = estimate_op("aten::view", "[[16, 64], []]", "ascend_910b", "float16")
    assert view.launches == 0 and view.time_us == 0.0 and view.bound == "none"


def test_convolution_attention_and_tensor_lists():
    conv, _, _, notes = count_flops_and_bytes("aten::convolution", "[[2, 3, 8, 8], [16, 3, 3, 3], [16], [], [], [], [], [], []]", 4)
    assert conv == 2 * 2 * 16 * 64 * 27 and "stride 1" in notes[0]
    back, *_ = count_flops_and_bytes("aten::convolution_backward", "[[2, 16, 4, 4], [2, 3, 8, 8], [16, 3, 3, 3], []]", 4)
    assert back == 2 * 2 * 2 * 16 * 16 * 27
    attn, *_ = count_flops_and_bytes("aten::_scaled_dot_product_flash_attention_for_cpu", "[[2, 4, 128, 32], [2, 4, 128, 32], [2, 4, 128, 32]]", 4)
    assert attn == 4 * 2 * 4 * 128 * 128 * 32
    flops, moved, _, _ = count_flops_and_bytes("aten::_foreach_mul_", "[[[64, 32], [64]], []]", 4)
    assert flops == 64 * 32 + 64 and moved == (64 * 32 + 64) * 2 * 4


def test_no_published_fp32_peak_gives_a_labelled_lower_bound():
    est = estimate_op("aten::mm", "[[1024, 1024], [1024, 1024]]", "ascend_910b", "float32")
    assert est.compute_us is None and est.bound in ("memory", "launch")
    assert any("lower bound" in note for note in est.notes)
    assert est.time_us == pytest.approx(est.memory_us + est.launch_us)
    with pytest.raises(ValueError, match="not modelled"):
        estimate_op("aten::mm", "[[2, 2], [2, 2]]", "h100", "float64")


# --- regions and intents ----------------------------------------------------------------------------

class _Op:
    def __init__(self, name: str, shapes: str):
        self.name, self.shapes = name, shapes


RMSNORM_OPS = [_Op("aten::pow", "[[4096, 1024], []]"), _Op("aten::mean", "[[4096, 1024], [], [], []]"),
               _Op("aten::add", "[[4096, 1], [], []]"), _Op("aten::rsqrt", "[[4096, 1]]"),
               _Op("aten::mul", "[[4096, 1024], [4096, 1]]"), _Op("aten::mul", "[[1024], [4096, 1024]]")]


def test_fusing_a_norm_region_saves_launches_and_traffic_and_is_labelled_an_estimate():
    est = estimate_saving(RMSNORM_OPS, 1, "ascend_910b", dtype="bfloat16")
    assert est.label == "estimate" and "not a measurement" in est.basis
    assert est.eager_ops == 6 and est.reference_kernels == 1
    assert est.eager_us == pytest.approx(sum(estimate_op(o.name, o.shapes, "ascend_910b", "bfloat16").time_us for o in RMSNORM_OPS))
    assert est.launch_saving_us == pytest.approx(5 * 20.0)
    assert 0 < est.fused_us < est.eager_us and est.saving_us == pytest.approx(est.eager_us - est.fused_us)
    assert "reported" in est.figures["hbm_bandwidth"] and "assumption" in est.figures["launch_overhead"]
    dumped = json.dumps(est.model_dump()).lower()
    assert "speedup" not in dumped and "speed_up" not in dumped
    on_h100 = estimate_saving(RMSNORM_OPS, 1, "h100", dtype="bfloat16")
    assert est.saving_us > on_h100.saving_us  # slower memory and dearer launches: the NPU gains more from fusing


def test_k_not_smaller_than_n_saves_nothing_and_steps_divide():
    same = estimate_saving(RMSNORM_OPS, 6, "h100", dtype="bfloat16")
    assert same.saving_us == pytest.approx(0.0, abs=1e-6)  # memory-bound ops: same traffic, same launches
    more = estimate_saving(RMSNORM_OPS, 9, "h100", dtype="bfloat16")
    assert any("capped" in n for n in more.notes) and more.launch_saving_us == 0.0
    two_steps = estimate_saving(RMSNORM_OPS * 2, 1, "h100", dtype="bfloat16", steps=2)
    one_step = estimate_saving(RMSNORM_OPS, 1, "h100", dtype="bfloat16")
    assert two_steps.eager_us == pytest.approx(one_step.eager_us) and two_steps.eager_ops == 6


@pytest.fixture(scope="module")
def tiny_table():
    from trainbridge.tools.eager_profile import record_eager_ops

    spec = importlib.util.spec_from_file_location("trainbridge_test_tiny_model_cost", MODEL_DIR / "tiny_model.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return record_eager_ops(tiny.trainbridge_entry(seed=0), MODEL_DIR, steps=2, warmup=1)


def _marker_line(name: str) -> int:
    lines = (MODEL_DIR / "tiny_model.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# marker: {name}"))


def test_intent_saving_on_a_real_eager_op_table(tiny_table):
    line = _marker_line("rmsnorm")
    span = SourceSpan(file="tiny_model.py", line_start=line, line_end=line)
    intent = Intent(id=Intent.make_id("rmsnorm", [span]), category=IntentCategory.rmsnorm, spans=[span],
                    evidence=Evidence(reference_kernels=2), confidence=0.8, source=IntentSource.runtime)
    region = [op for op in tiny_table.ops if op.span.file == "tiny_model.py" and op.span.line_start == line]
    launched = [op for op in region if estimate_op(op.name, op.shapes, "ascend_910c").launches]
    assert len(launched) > 4  # forward and backward of a hand-written RMSNorm: many small ops
    est = estimate_intent_saving(intent, tiny_table, "ascend_910c", dtype="float16")
    assert est.eager_ops == pytest.approx(len(launched) / tiny_table.steps)
    assert est.reference_kernels == 2 and est.saving_us > 0 and est.label == "estimate"
    # tiny shapes: the region is all launch overhead, and so is nearly all of the saving
    assert est.launch_saving_us == pytest.approx((est.eager_ops - 2) * 20.0)
    assert est.saving_us <= est.launch_saving_us + 1.0


def test_optimizer_intent_takes_the_optimizer_phase(tiny_table):
    span = SourceSpan(file="tiny_model.py", line_start=_marker_line("step"), line_end=_marker_line("step"))
    intent = Intent(id="optimizer_step-x", category=IntentCategory.optimizer_step, spans=[span], confidence=0.5,
                    source=IntentSource.static)
    est = estimate_intent_saving(intent, tiny_table, "h200")
    opt_ops = [op for op in tiny_table.ops if op.phase == Phase.optimizer]
    assert est.eager_ops == pytest.approx(sum(estimate_op(o.name, o.shapes, "h200").launches for o in opt_ops) / tiny_table.steps)
    assert any("K=1 assumed" in note for note in est.notes) and not math.isnan(est.saving_us)
