"""A run's report: `report.md`, a self-contained `report.html` (tools/report_html.py) and PNG charts.

Figures come from the run's state only: measured step times (baseline, per accepted commit, final),
the gate's ratios and confidence intervals, op counts from the analyst. Estimates never appear as
speedups; without an NPU, NPU candidates say "speed unmeasured (no NPU)".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainbridge.tools.report_html import escape_cell, render_html

UNMEASURED = "speed unmeasured (no NPU)"


def write_report(state: dict[str, Any], config, out_dir: Path, *, final_step_s: float | None, stop_reason: str,
                 emulated_npu: bool, kb_stats: dict[str, Any] | None, final_comparison: dict[str, Any] | None = None) -> list[Path]:
    """`final_comparison`: agents.profiler.final.FinalComparison as JSON (the headline when present);
    `final_step_s`: a single plain measurement of the final head (used when there is no comparison)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {**state, "final_comparison": final_comparison}
    charts = _charts(state, out_dir, final_step_s)
    markdown = _markdown(state, config, final_step_s, stop_reason, emulated_npu, kb_stats, charts)
    md_path = out_dir / "report.md"
    md_path.write_text(markdown, encoding="utf-8")
    html_path = out_dir / "report.html"
    html_path.write_text(render_html(markdown, charts, title=f"TrainBridge run {config.run_id}"), encoding="utf-8")
    (out_dir / "run.json").write_text(json.dumps({"state": state, "final_step_s": final_step_s, "stop_reason": stop_reason},
                                                  indent=2, default=str), encoding="utf-8")
    return [md_path, html_path, *charts]


def _ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1000:.1f} ms"


def _speedup_line(baseline: float | None, final: float | None, accepted: list[dict[str, Any]]) -> str:
    """The headline is the gate's measurements (interleaved A/B rounds per commit, with CIs); a single
    re-measurement of the final head is shown beside it, labelled as such (it is not interleaved)."""
    if not accepted:
        return "No rewrite was accepted: the run branch equals the base commit."
    ratios = [a["ratio"] for a in accepted if a.get("ratio")]
    lines = []
    if ratios:
        product = math.prod(ratios)
        per_commit = "; ".join(
            f"{a.get('category')} {a['ratio']:.3f}" + (f" (95% CI {a['ratio_ci'][0]:.3f}–{a['ratio_ci'][1]:.3f})" if a.get("ratio_ci") else "")
            for a in accepted if a.get("ratio"))
        combined = combined_ci([(a["ratio"], tuple(a["ratio_ci"])) for a in accepted if a.get("ratio") and a.get("ratio_ci")])
        interval = (f" (approximate 95% CI of the product {combined[0]:.3f}–{combined[1]:.3f}: the commits' intervals combined "
                    "in quadrature on the log scale)") if combined and len(ratios) > 1 else ""
        lines.append(f"Gate-measured step-time ratios per accepted commit (candidate / previous head, interleaved A/B): {per_commit}. "
                     f"Their product: ratio {product:.3f}{interval}, **{1 / product:.2f}x faster** than the baseline of {_ms(baseline)}.")
    if baseline and final:
        lines.append(f"A single re-measurement of the final head (not interleaved, so noisier): {_ms(final)} vs {_ms(baseline)} "
                     f"at the start ({baseline / final:.2f}x).")
    return " ".join(lines) or "Accepted commits have no measured ratio (numerics-only verdicts)."


def combined_ci(ratios: list[tuple[float, tuple[float, float]]]) -> tuple[float, float] | None:
    """Approximate CI of a product of independently measured ratios: each interval's half-widths in
    log space, combined in quadrature (upper and lower sides separately)."""
    if not ratios:
        return None
    log_point = sum(math.log(r) for r, _ in ratios)
    low = math.sqrt(sum((math.log(r) - math.log(ci[0])) ** 2 for r, ci in ratios))
    high = math.sqrt(sum((math.log(ci[1]) - math.log(r)) ** 2 for r, ci in ratios))
    return math.exp(log_point - low), math.exp(log_point + high)


def _ci(figure: dict[str, float]) -> str:
    return f"{figure['ratio']:.3f} (95% CI {figure['ci_low']:.3f}–{figure['ci_high']:.3f})"


MIN_RESULT_ROUNDS = 6  # fewer interleaved rounds give no interval worth the name (the gate's first look is 6 too)


def _few_rounds(comparison: dict[str, Any] | None) -> bool:
    return bool(comparison) and (comparison.get("rounds") or 0) < MIN_RESULT_ROUNDS


def _comparison_lines(comparison: dict[str, Any]) -> list[str]:
    """The end-to-end figures: final head vs the original, and vs torch.compile of the original. From fewer than
    `MIN_RESULT_ROUNDS` rounds they are stated as indicative only: no interval, no verdict, no bold."""
    medians = comparison.get("median_step_s") or {}
    rounds = comparison.get("rounds")
    final = comparison.get("final_vs_original")
    lines = []
    if _few_rounds(comparison):
        compiled = comparison.get("compiled_vs_original")
        if final:
            lines.append(f"Final head vs the original over only {rounds} interleaved round(s): step-time ratio {final['ratio']:.3f} "
                         f"(original {_ms(medians.get('original'))}, final {_ms(medians.get('final'))}): indicative only, too few "
                         f"rounds for an interval (it takes {MIN_RESULT_ROUNDS}; `--final-rounds`).")
        if compiled:
            lines.append(f"torch.compile of the original in the same rounds: ratio to the original {compiled['ratio']:.3f} "
                         "(indicative only).")
        return lines
    if final:
        verdict = (f"{1 / final['ratio']:.2f}x faster" if final["ci_high"] < 1 else
                   f"{final['ratio']:.2f}x the step time, slower" if final["ci_low"] > 1 else
                   f"{1 / final['ratio']:.2f}x, but the interval includes no change: more rounds would be needed to tell")
        lines.append(f"**Final head vs the original: step-time ratio {_ci(final)}, {verdict}** "
                     f"(original {_ms(medians.get('original'))}, final {_ms(medians.get('final'))}; medians of {rounds} "
                     "interleaved rounds, a fresh sandbox child per program and round, rotated order).")
    versus = comparison.get("final_vs_compiled")
    compiled = comparison.get("compiled_vs_original")
    if versus and compiled:
        side = "faster than" if versus["ci_high"] < 1 else "slower than" if versus["ci_low"] > 1 else "not distinguishable from"
        lines.append(f"torch.compile of the original (Inductor, measured in the same rounds): {_ms(medians.get('original_compiled'))}, "
                     f"ratio to the original {_ci(compiled)}. Final head / torch.compile of the original: {_ci(versus)}: "
                     f"the final head is {side} torch.compile.")
    for arm, why in (comparison.get("failures") or {}).items():
        lines.append(f"The {arm.replace('_', ' ')} arm failed and is left out: {why}.")
    return lines


def _reference_line(state: dict[str, Any], final: float | None) -> str | None:
    reference = state.get("reference_step_s")
    if not reference or (state.get("final_comparison") or {}).get("final_vs_compiled"):
        return None
    baseline = state.get("baseline_step_s")
    text = (f"torch.compile of the original (Inductor, measured once while the analyst compiled it, not interleaved): "
            f"{_ms(reference)}")
    if baseline:
        text += f", {baseline / reference:.2f}x the baseline's speed"
    if final:
        text += f"; the final head is {reference / final:.2f}x its speed ({'faster' if final < reference else 'slower'} than torch.compile)"
    return text + "."


def _loop_cost(state: dict[str, Any]) -> list[str]:
    times = state.get("phase_times") or []
    if not times:
        return []
    totals: dict[str, list[float]] = {}
    parts: dict[str, float] = {}
    for entry in times:
        totals.setdefault(entry["node"], []).append(entry["wall_s"])
        for name, seconds in (entry.get("parts") or {}).items():
            parts[f"{entry['node']}.{name}"] = parts.get(f"{entry['node']}.{name}", 0.0) + seconds
    lines = ["## Loop cost", "", "| node | runs | wall time | of which |", "|---|---|---|---|"]
    for node, walls in totals.items():
        detail = ", ".join(f"{k.split('.', 1)[1]} {v:.1f} s" for k, v in parts.items() if k.startswith(node + "."))
        lines.append(f"| {node} | {len(walls)} | {sum(walls):.1f} s | {detail or '-'} |")
    accepted = len(state.get("accepted") or [])
    tried = state.get("candidates_tried") or 0
    lines += ["", f"Candidates tried per accepted commit: {tried / accepted:.1f}." if accepted else
              f"Candidates tried: {tried}, none accepted.", ""]
    return lines


def _markdown(state, config, final, stop_reason, emulated_npu, kb_stats, charts) -> str:
    baseline = state.get("baseline_step_s")
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
        f"- baseline step: {_ms(baseline)} (the unmodified program, measured when the run started)",
        f"- stopped because: {stop_reason}",
        f"- candidates tried: {state.get('candidates_tried') or 0}, accepted: {len(accepted)}",
        *([f"- {state['intent_coverage']['line']}"] if (state.get("intent_coverage") or {}).get("line") else []),
        "",
        "## Result",
        "",
    ]
    comparison = state.get("final_comparison")
    if comparison and accepted and _few_rounds(comparison):  # the gate's per-commit figures are the result
        lines += [_speedup_line(baseline, None, accepted), "", " ".join(_comparison_lines(comparison)), ""]
    elif comparison and accepted:
        lines += [" ".join(_comparison_lines(comparison)), "", "Per commit: " + _speedup_line(baseline, None, accepted), ""]
    else:
        lines += [_speedup_line(baseline, final, accepted), ""]
    reference = _reference_line(state, final)
    if reference:
        lines += [reference, ""]
    if state.get("eager_ops_before") is not None:
        lines += [f"Eager ops per step: {state['eager_ops_before']} before, {state.get('eager_ops_now')} at the last analysis.", ""]
    lines += ["## Candidates", "", "| # | intent | recipe | verdict | ratio (CI) | detail |", "|---|---|---|---|---|---|"]
    for number, record in enumerate(verdicts, start=1):
        ratio = "-" if record.get("ratio") is None else f"{record['ratio']:.3f}"
        if record.get("ratio_ci"):
            ratio += f" ({record['ratio_ci'][0]:.3f}–{record['ratio_ci'][1]:.3f})"
        if record.get("reason") == "speed_unmeasured_numerics_ok":
            ratio = UNMEASURED
        detail = escape_cell((record.get("message") or "")[:240])
        lines.append(f"| {number} | {record.get('category')} | {record.get('recipe_id') or '-'} | "
                     f"{'accepted' if record.get('accepted') else record.get('reason')} | {ratio} | {detail} |")
    lines += [""] + _loop_cost(state)
    if kb_stats:
        lines += ["", "## Knowledge base", "", "```", json.dumps(kb_stats, indent=2, default=str), "```"]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{p.stem}]({p.name})" for p in charts]
    return "\n".join(lines) + "\n"


def _charts(state, out_dir: Path, final: float | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    comparison = state.get("final_comparison") or {}
    medians = comparison.get("median_step_s") or {}
    baseline = medians.get("original") or state.get("baseline_step_s")
    final = medians.get("final") or final
    reference = medians.get("original_compiled") or state.get("reference_step_s")
    if baseline:
        labels, values = ["original"], [baseline * 1000]
        for record in state.get("accepted") or []:
            if record.get("ratio"):
                labels.append(record.get("category") or "?")
                values.append(values[-1] * record["ratio"])
        if final:
            labels.append("final (measured)")
            values.append(final * 1000)
        fig, axis = plt.subplots(figsize=(7, 3.5))
        axis.bar(range(len(values)), values, color=["#888"] + ["#2a7"] * (len(values) - 1))
        axis.set_xticks(range(len(values)), labels, rotation=20, ha="right")
        axis.set_ylabel("step time (ms)")
        if reference:
            axis.axhline(reference * 1000, color="#c33", linestyle="--", label="torch.compile of the original")
            axis.legend()
        axis.set_title("Step time per accepted commit (gate ratios applied to the baseline)")
        fig.tight_layout()
        path = out_dir / "step_time.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    if state.get("eager_ops_before") is not None and state.get("eager_ops_now") is not None:
        fig, axis = plt.subplots(figsize=(4, 3))
        axis.bar(["before", "after"], [state["eager_ops_before"], state["eager_ops_now"]], color=["#888", "#2a7"])
        axis.set_ylabel("eager ops per step")
        fig.tight_layout()
        path = out_dir / "eager_ops.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
