"""benchmarks/recipe_apply_rate.py without its children: the recipe queue an intent gets (its own
recipes for the target, else the regional-compile last resort on cpu/cuda), which intents sit in
a method, and how the table counts (an intent passes through any candidate that passes numerics;
NPU regional compiles that cannot be judged here are counted apart)."""

from __future__ import annotations

from trainbridge.agents.analyst.static.scan import scan_repo
from trainbridge.benchmarks.recipe_apply_rate import IntentRow, _method_of, _queue, table
from recipe_lab import REAL_STYLE


def test_queues_and_methods_on_the_real_style_programs():
    folder = REAL_STYLE / "real_speedrun"
    cpu = {(str(i.category), str(i.spans[0])): i for i in scan_repo(folder, target="cpu")}
    rope = cpu[("rope", "train_gpt.py:61-64")]
    assert _queue(rope, "cpu") == ["compile-regional"]  # no cpu rope recipe: the last rung
    assert _method_of(folder, rope) == "Rotary.forward"
    npu = {(str(i.category), str(i.spans[0])): i for i in scan_repo(folder, target="npu")}
    assert "rope-chunk-npu-rotary-mul" in _queue(npu[("rope", "train_gpt.py:61-64")], "npu")
    # a pointwise chain queues its category's NPU recipes: the regional compile, and the matrix blends that apply only
    # where the region holds a matmul (the coder finds no match elsewhere, before any gate)
    chain = _queue(npu[("elementwise_chain", "train_gpt.py:93")], "npu")
    assert chain[0] == "compile-regional-npu" and set(chain) == {
        "compile-regional-npu", "matmul-blend-addmm-npu", "newton-schulz-addmm-npu"}
    rms = npu[("rmsnorm", "train_gpt.py:49-50")]
    assert _method_of(folder, rms) is None  # a module-level helper


def _row(**kw) -> IntentRow:
    base = dict(program="p", target="npu", category="rope", spans=["m.py:1"], nth=0, queue=["a", "b"], in_method="M.f")
    return IntentRow(**{**base, **kw})


def test_the_table_counts_an_intent_once_through_any_passing_candidate():
    rows = [
        _row(applied={"a": True, "b": True}, numerics={"a": "fail: x", "b": "pass"}, compile_rung=True),
        _row(applied={"a": True}, numerics={"a": "unverifiable: needs TorchAir"}, compile_rung=True),
        _row(applied={"a": False, "b": False}, refusals={"a": "no", "b": "no"}, compile_rung=False),
        _row(queue=[], in_method=None),
    ]
    text, summary = table(rows)
    assert summary["all"] == {"intents": 4, "with_rewrite": 3, "applies": 2, "passes": 1, "unverifiable": 1,
                              "in_method": 3, "rung": 2}
    assert "1/3 (33%) of the intents with a known rewrite; 1/2 (50%) of those whose numerics were judged" in text
