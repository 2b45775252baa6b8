"""A run's report: `report.md`, a self-contained `report.html` (tools/report/page.py), PNG charts and an SVG plot of
each accepted commit's gate rounds.

Figures come from the run's state only: measured step times (baseline, per accepted commit, final), the gate's
ratios and confidence intervals, op counts from the analyst. Estimates never appear as speedups; without an NPU,
NPU candidates say "speed unmeasured (no NPU)". What may be claimed from which figure is tools/report/claims.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainbridge.tools.report.npu_kernels import npu_kernels_line
from trainbridge.tools.report.page import render_html
from trainbridge.tools.report.claims import MIN_RESULT_ROUNDS, combined_ci, ms, result_lines
from trainbridge.tools.report.sections import (UNMEASURED, accepted_commits, candidates_section, eager_ops_line,
                                               final_head_analysed, intents_section, knowledge_section, loop_cost)

__all__ = ["MIN_RESULT_ROUNDS", "UNMEASURED", "combined_ci", "write_report"]


def write_report(state: dict[str, Any], config, out_dir: Path, *, final_step_s: float | None, stop_reason: str,
                 emulated_npu: bool, kb_stats: dict[str, Any] | None, final_comparison: dict[str, Any] | None = None,
                 kb_added: list[dict[str, Any]] | None = None) -> list[Path]:
    """`final_comparison`: agents.profiler.final.FinalComparison as JSON; `final_step_s`: a single plain measurement of
    the final head (used when there is no comparison); `kb_added`: the knowledge-base entries this run recorded
    ({kind, id, recipe_id, category, verdict, ratio})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {**state, "final_comparison": final_comparison}
    commits, svgs = accepted_commits(state)
    charts = _charts(state, out_dir, final_step_s)
    for name, svg in svgs.items():
        (out_dir / name).write_text(svg, encoding="utf-8")
        charts.append(out_dir / name)
    markdown = _markdown(state, config, final_step_s, stop_reason, emulated_npu, kb_stats, kb_added, commits, charts)
    md_path = out_dir / "report.md"
    md_path.write_text(markdown, encoding="utf-8")
    html_path = out_dir / "report.html"
    html_path.write_text(render_html(markdown, charts, title=f"TrainBridge run {config.run_id}"), encoding="utf-8")
    (out_dir / "run.json").write_text(json.dumps({"state": state, "final_step_s": final_step_s, "stop_reason": stop_reason,
                                                  "kb_added": kb_added}, indent=2, default=str), encoding="utf-8")
    return [md_path, html_path, *charts]


def _markdown(state, config, final, stop_reason, emulated_npu, kb_stats, kb_added, commits, charts) -> str:
    accepted = state.get("accepted") or []
    verdicts = state.get("verdicts") or []
    lines = [
        f"# TrainBridge run `{config.run_id}`",
        "",
        f"- repository: `{config.repo}` (base commit `{(state.get('base_sha') or '')[:12]}`, never modified)",
        f"- run branch: `{state.get('run_branch')}` — one commit per accepted rewrite",
        f"- target: `{config.target}`" + (f" — {UNMEASURED}: numerics verified on the CPU emulation; candidates wait on "
                                            f"`{state.get('run_branch')}.pending-npu` for `trainbridge verify` on an NPU host" if emulated_npu else ""),
        *([f"- sandbox: UNCONFINED (--unconfined): {sum(1 for v in verdicts if v.get('unconfined'))} candidate(s) ran without "
           "the sandbox's confinement: they could write wherever the run could and see its processes"]
          if any(v.get("unconfined") for v in verdicts) else []),
        f"- baseline step: {ms(state.get('baseline_step_s'))} (the unmodified program, measured when the run started)",
        f"- stopped because: {stop_reason}",
        f"- candidates tried: {state.get('candidates_tried') or 0}, accepted: {len(accepted)}",
        *([f"- {state['intent_coverage']['line']}"] if (state.get("intent_coverage") or {}).get("line") else []),
        "",
        "## Result",
        "",
    ]
    for paragraph in result_lines(state, final):
        lines += [paragraph, ""]
    eager = eager_ops_line(state)
    if eager:
        lines += [eager, ""]
    kernels = npu_kernels_line(state)
    if kernels:
        lines += [kernels, ""]
    lines += commits
    lines += intents_section(state)
    lines += candidates_section(state)
    lines += loop_cost(state)
    lines += knowledge_section(kb_stats, kb_added)
    pngs = [p for p in charts if p.suffix == ".png"]
    if pngs:
        lines += ["## Charts", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(lines).rstrip("\n") + "\n"


def _charts(state, out_dir: Path, final: float | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    comparison = state.get("final_comparison") or {}
    medians = comparison.get("median_step_s") or {}
    baseline = medians.get("original") or state.get("baseline_step_s")
    final = medians.get("final") or final
    reference = medians.get("original_compiled")
    reference_label = "torch.compile of the original"
    if reference is None and state.get("reference_step_s"):
        reference, reference_label = state["reference_step_s"], "torch.compile of the original (one-shot)"
    if baseline and state.get("accepted"):  # with nothing accepted there is one bar: no chart
        labels, values = ["original"], [baseline * 1000]
        for record in state.get("accepted") or []:
            if record.get("ratio"):
                labels.append(record.get("category") or "?")
                values.append(values[-1] * record["ratio"])
        if final:
            labels.append("final (closing comparison)" if medians.get("final") else "final (one-shot)")
            values.append(final * 1000)
        fig, axis = plt.subplots(figsize=(7, 3.5))
        axis.bar(range(len(values)), values, color=["#888"] + ["#2a7"] * (len(values) - 1))
        axis.set_xticks(range(len(values)), labels, rotation=20, ha="right")
        axis.set_ylabel("step time (ms)")
        if reference:
            axis.axhline(reference * 1000, color="#c33", linestyle="--", label=reference_label)
            axis.legend()
        axis.set_title("Step time per accepted commit (gate ratios applied to the baseline)")
        fig.tight_layout()
        path = out_dir / "step_time.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    if state.get("eager_ops_before") is not None and final_head_analysed(state):
        fig, axis = plt.subplots(figsize=(4, 3))
        axis.bar(["before", "after (final head)"], [state["eager_ops_before"], state["eager_ops_now"]], color=["#888", "#2a7"])
        axis.set_ylabel("eager ops per step")
        fig.tight_layout()
        path = out_dir / "eager_ops.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
