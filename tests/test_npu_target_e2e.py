"""Issue 25's done-when, in CI: `trainbridge run --target npu` with the default compile reference on the llama example,
as a user runs it, on a host without an NPU. The port, the host CPU's torch.compile reference of the ported program,
the eager profile on the emulated device, numerics-only gates stacking verified rewrites on the pending branch, and
the report's NPU kernels per step before and after. The intents are the five the issue names (norm, rotary, SwiGLU,
attention, the optimizer) to keep the suite's clock; benchmarks/npu_kernels.py runs the four examples unrestricted.
The run's first analysis is also issue 25's host reference: the rmsnorm region's evidence holds the host CPU's
Inductor kernels beside the eager ops counted on the emulated device.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loop_cost import git_copy, run_loop
from npu_kernels import summarise

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama_pretrain"
CATEGORIES = ("rmsnorm", "rope", "swiglu", "attention", "optimizer_step")


@pytest.mark.slow
def test_run_target_npu_on_llama_puts_every_named_fused_api_on_the_pending_branch(tmp_path):
    repo = git_copy(EXAMPLE, tmp_path / "llama")
    extra = tuple(arg for category in CATEGORIES for arg in ("--category", category))
    run = run_loop(repo, "npu-e2e-llama", tmp_path / "home", budget_s=2400, max_candidates=12, gate_rounds=6,
                   target="npu", extra_args=extra, say=lambda line: None)
    assert run["exit_code"] == 0, run["output_tail"]
    summary = summarise("llama_pretrain", run, repo)
    reasons = [(v["recipe"], v["reason"]) for v in summary["verdicts"]]
    assert summary["crashed"] == 0, reasons  # no candidate crashes (recipes that cannot run here are not tried)
    apis = set(summary["pending_apis"])
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"} <= apis, (apis, reasons)
    assert any(api.startswith("NpuFused") for api in apis), (apis, reasons)  # a fused optimizer
    assert summary["pending_numerics_ok"] >= 5
    # the compile reference ran on the host CPU (the emulated device has no compiler) and aligned with the eager profile
    # on the emulated npu by source line; its step time is not compared with the target's
    assert summary["reference_kernels"].get("forward", 0) > 0 and summary["reference_kernels"].get("backward", 0) > 0
    assert run["state"]["reference_step_s"] is None
    norms = [e["evidence"] for e in run["state"]["intent_evidence"].values() if e["category"] == "rmsnorm"]
    assert any(1 <= (e.get("reference_kernels") or 0) < e["target_ops"] and {"eager_profile", "inductor"} <= set(e["detectors"])
               for e in norms), norms
    # and the kernels per step fell on the pending head
    before, after = summary["npu_kernels_per_step_before"], summary["npu_kernels_per_step_after"]
    assert before and after and after < before
    report = Path(run["state"]["report_paths"][0]).read_text(encoding="utf-8")
    assert re.search(rf"NPU kernels per step {before} \u2192 {after}, \u2212\d+%", report), report[:3000]
    assert "speed unmeasured" in report
    # a fused kernel that rounds once where the original rounds per op is flagged for review (the recipe's precision_change)
    flagged = [v for v in run["state"]["verdicts"] if v.get("precision_change")]
    assert any(v["recipe_id"].startswith("rmsnorm") for v in flagged), reasons
    assert all(v["reason"] == "speed_unmeasured_numerics_ok" for v in flagged), flagged
    assert "**precision changes, review it**" in report
