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
from trainbridge.tools.report.claims import MIN_RESULT_ROUNDS, combined_ci, few_rounds, ms, result_lines
from trainbridge.tools.report.sections import (UNMEASURED, accepted_commits, analysed_head_name, candidates_section, eager_ops_line,
                                               final_head_analysed, intents_section, knowledge_section, loop_cost)

__all__ = ["MIN_RESULT_ROUNDS", "UNMEASURED", "combined_ci", "write_report"]


def write_report(state: dict[str, Any], config, out_dir: Path, *, final_step_s: float | None, stop_reason: str,
                 emulated_npu: bool, kb_stats: dict[str, Any] | None, final_comparison: dict[str, Any] | None = None,
                 kb_added: list[dict[str, Any]] | None = None, closing_s: dict[str, float] | None = None) -> list[Path]:
    """`final_comparison`: agents.profiler.final.FinalComparison as JSON; `final_step_s`: a single plain measurement of
    the final head (used when there is no comparison); `kb_added`: the knowledge-base entries this run recorded
    ({kind, id, recipe_id, category, verdict, ratio}); `closing_s`: the seconds the report node measured for before
    writing ({"final_comparison": s} or {"final_measure": s}), a row of the loop-cost table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {**state, "final_comparison": final_comparison}
    commits, svgs = accepted_commits(state)
    charts = _charts(state, out_dir, final_step_s)
    for name, svg in svgs.items():
        (out_dir / name).write_text(svg, encoding="utf-8")
        charts.append(out_dir / name)
    markdown = _markdown(state, config, final_step_s, stop_reason, emulated_npu, kb_stats, kb_added, commits, charts,
                         closing_s)
    md_path = out_dir / "report.md"
    md_path.write_text(markdown, encoding="utf-8")
    html_path = out_dir / "report.html"
    html_path.write_text(render_html(markdown, charts, title=f"TrainBridge run {config.run_id}"), encoding="utf-8")
    (out_dir / "run.json").write_text(json.dumps({"state": state, "final_step_s": final_step_s, "stop_reason": stop_reason,
                                                  "kb_added": kb_added}, indent=2, default=str), encoding="utf-8")
    return [md_path, html_path, *charts]


def _markdown(state, config, final, stop_reason, emulated_npu, kb_stats, kb_added, commits, charts, closing_s=None) -> str:
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
    lines += loop_cost(state, closing_s)
    lines += knowledge_section(kb_stats, kb_added)
    pngs = [p for p in charts if p.suffix == ".png"]
    if pngs:
        lines += ["## Charts", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(lines).rstrip("\n") + "\n"


def step_time_bars(state: dict[str, Any], final: float | None):
    """The step-time chart's bars: (labels, values in ms, whether the last bar is weak, the torch.compile line in s and
    its label), or None with nothing accepted. A closing comparison of fewer than MIN_RESULT_ROUNDS rounds is
    indicative only, as the text says, and so are its bar and line; a one-shot final is labelled one-shot."""
    comparison = state.get("final_comparison") or {}
    medians = comparison.get("median_step_s") or {}
    baseline = medians.get("original") or state.get("baseline_step_s")
    final = medians.get("final") or final
    if not (baseline and state.get("accepted")):
        return None
    reference = medians.get("original_compiled")
    indicative = f" ({comparison.get('rounds')} rounds, indicative)" if few_rounds(comparison) else ""
    reference_label = "torch.compile of the original" + indicative
    if reference is None and state.get("reference_step_s"):
        reference, reference_label = state["reference_step_s"], "torch.compile of the original (one-shot)"
    labels, values = ["original"], [baseline * 1000]
    for record in state.get("accepted") or []:
        if record.get("ratio"):
            labels.append(record.get("category") or "?")
            values.append(values[-1] * record["ratio"])
    if final:
        labels.append(("final" + (indicative or " (closing comparison)")) if medians.get("final") else "final (one-shot)")
        values.append(final * 1000)
    weak = bool(final) and (bool(indicative) or not medians.get("final"))
    return labels, values, weak, reference, reference_label


def _charts(state, out_dir: Path, final: float | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    bars = step_time_bars(state, final)
    if bars is not None:  # with nothing accepted there is one bar: no chart
        labels, values, weak, reference, reference_label = bars
        fig, axis = plt.subplots(figsize=(7, 3.5))
        drawn = axis.bar(range(len(values)), values, color=["#888"] + ["#2a7"] * (len(values) - 1))
        if weak:  # a one-shot or indicative last bar: pale
            drawn[-1].set_color("#bfe3d0")
            drawn[-1].set_edgecolor("#2a7")
        axis.set_xticks(range(len(values)), labels, rotation=20, ha="right")
        axis.set_ylabel("step time (ms)")
        axis.set_ylim(0, max(values + [reference * 1000 if reference else 0]) * 1.3)  # room for the legend above the bars
        if reference:
            axis.axhline(reference * 1000, color="#c33", linestyle="--", label=reference_label)
            axis.legend(loc="upper right", fontsize="small")
        axis.set_title("Step time per accepted commit (gate ratios applied to the baseline)")
        fig.tight_layout()
        path = out_dir / "step_time.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    if state.get("eager_ops_before") is not None and final_head_analysed(state):
        fig, axis = plt.subplots(figsize=(4, 3))
        after = "after (pending head)" if analysed_head_name(state).startswith("pending") else "after (final head)"
        axis.bar(["before", after], [state["eager_ops_before"], state["eager_ops_now"]], color=["#888", "#2a7"])
        axis.set_ylabel("eager ops per step")
        fig.tight_layout()
        path = out_dir / "eager_ops.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
