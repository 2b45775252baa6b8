"""Render a suite record (the JSON `suite.py` writes) as markdown and PNG charts.

Pure functions of the record: nothing here measures. `speedup_table` is the table the README
carries; `render_markdown` is the whole results page; `write_charts` draws the speed-up bars and
the analysis-scaling lines with matplotlib (Agg, imported only when drawing).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from fresh_arms import BRANCH, BRANCH_COMPILE, COMPILE, EAGER, EAGER_AGAIN
from speedup import VARIANTS

NA = "n/a"
PHASE_ORDER = ("static_scan", "target_profile", "reference", "advisor_rules", "align")  # the analyst's, in pipeline order


def _ms(seconds: float | None) -> str:
    return NA if seconds is None else f"{1000 * seconds:.1f}"


def _s(seconds: float | None) -> str:
    return NA if seconds is None else f"{seconds:.0f}" if seconds >= 100 else f"{seconds:.1f}"


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return NA
    return f"{r['ratio']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"


def _ratio_of(workload: dict[str, Any], num: str, den: str) -> dict[str, Any] | None:
    return ((workload.get("summary") or {}).get("ratios") or {}).get(f"{num} / {den}")


def goal_status(workload: dict[str, Any]) -> dict[str, str]:
    """The issue's two goals for one workload, judged on the measured ratios and their intervals."""
    tb_vs_compile = _ratio_of(workload, BRANCH, COMPILE)
    both_vs_compile = _ratio_of(workload, BRANCH_COMPILE, COMPILE)
    out = {}
    if tb_vs_compile is None:
        out["tb_le_compile"] = NA
    elif tb_vs_compile["ratio"] <= 1.0:
        out["tb_le_compile"] = "met" + ("" if tb_vs_compile["ci"][1] <= 1.0 else " (CI includes >1)")
    else:
        out["tb_le_compile"] = "not met" + ("" if tb_vs_compile["ci"][0] > 1.0 else " (CI includes <=1)")
    if both_vs_compile is None:
        out["tb_compile_faster"] = NA
    elif both_vs_compile["ci"][1] < 1.0:
        out["tb_compile_faster"] = "met"
    elif both_vs_compile["ratio"] < 1.0:
        out["tb_compile_faster"] = "faster, not significant"
    else:
        out["tb_compile_faster"] = "not met"
    return out


def _coverage(w: dict[str, Any]) -> str:
    c = w.get("coverage")
    if not c:
        return NA
    left = len(c.get("left_with_recipe") or [])
    return f"{c.get('reached', 0)}, all with a recipe" if not left else f"{c.get('reached', 0)}, {left} with a recipe left"


def _gap(w: dict[str, Any]) -> str:
    g = (w.get("summary") or {}).get("gap_closed")
    if not g:
        return "compile not faster" if (w.get("summary") or {}).get("ratios") else NA
    return f"{100 * g['share']:.0f}% [{100 * g['ci'][0]:.0f}%, {100 * g['ci'][1]:.0f}%]"


def speedup_table(section: dict[str, Any]) -> str:
    """Markdown table: per workload the intents reached, the accepted rewrites, the four step times
    (ms), the gap closed, the ratios to compile and the A/A control with 95% intervals; the README's."""
    lines = [
        "| workload | intents reached | accepted rewrites | eager ms | TrainBridge ms | compile ms | TrainBridge + compile ms | "
        "gap closed | TrainBridge / compile | TrainBridge + compile / compile | A/A control | median s per judged candidate |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in section.get("workloads", []):
        if w.get("error") and not w.get("summary"):
            lines.append(f"| {w['workload']} | failed: {w['error'].splitlines()[0][:120]} |" + "  |" * 10)
            continue
        medians = (w.get("summary") or {}).get("median_step_s") or {}
        accepted = w.get("accepted") or []
        rewrites = ", ".join(f"{a['category']} ({a['recipe_id']})" for a in accepted) or "none"
        judge = (w.get("per_candidate") or {}).get("median_judge_s")
        lines.append(
            f"| {w['workload']} | {_coverage(w)} | {rewrites} | {_ms(medians.get(EAGER))} | {_ms(medians.get(BRANCH))} | "
            f"{_ms(medians.get(COMPILE))} | {_ms(medians.get(BRANCH_COMPILE))} | {_gap(w)} | {_ratio(_ratio_of(w, BRANCH, COMPILE))} | "
            f"{_ratio(_ratio_of(w, BRANCH_COMPILE, COMPILE))} | {_ratio(_ratio_of(w, EAGER_AGAIN, EAGER))} | {_s(judge)} |")
    return "\n".join(lines)


def _speedup_notes(section: dict[str, Any]) -> list[str]:
    settings = section.get("settings") or {}
    lines = [
        "",
        f"Each workload: a real `trainbridge run` (CPU, budget {settings.get('run_budget_s', '?')} s, at most "
        f"{settings.get('max_candidates', '?')} candidates, {settings.get('gate_rounds', '?')} gate rounds), then its step time in "
        f"{settings.get('rounds', '?')} rounds, a fresh sandboxed child per arm and round (as the gate runs them), "
        f"{settings.get('steps', '?')} timed steps each, the arms in a rotating (Williams) order: eager original, the eager original "
        "again (the A/A control: its interval is how far two identical arms read apart here), the final branch, `torch.compile` "
        "of each. Ratios: median of the paired per-round ratios, 95% bootstrap interval in brackets (< 1: faster). Gap closed: "
        "(1 - TrainBridge/eager) / (1 - compile/eager), the share of the eager -> torch.compile step-time gap the branch closes. "
        "Median s per judged candidate: the profiler node's wall time (region lab and gate) over the run's judged candidates.",
        "",
        "| workload | goal: TrainBridge / compile <= 1.00 | goal: TrainBridge + compile faster than compile | judged candidates | "
        "judge s per candidate (each) |",
        "|---|---|---|---:|---|",
    ]
    for w in section.get("workloads", []):
        goals = goal_status(w)
        per = w.get("per_candidate") or {}
        each = ", ".join(f"{x:.0f}" for x in per.get("judge_s") or []) or NA
        if per.get("median_gate_s") is not None:
            each += f" (median gate alone {per['median_gate_s']:.1f} s, region lab {per.get('median_region_s') or 0:.1f} s)"
        lines.append(f"| {w['workload']} | {goals['tb_le_compile']} | {goals['tb_compile_faster']} | {per.get('judged', NA)} | {each} |")
    judged = [goal_status(w) for w in section.get("workloads", []) if w.get("summary")]
    if judged:
        met_1 = sum(g["tb_le_compile"].startswith("met") for g in judged)
        met_2 = sum(g["tb_compile_faster"] == "met" for g in judged)
        lines.append(f"\nGoals met: TrainBridge's branch at least as fast as torch.compile of the original on {met_1} of "
                     f"{len(judged)} workload(s); TrainBridge + compile significantly faster than compile alone on {met_2} of {len(judged)}.")
    lines += _judged_overall(section)
    for w in section.get("workloads", []):
        if w.get("rerun"):
            rerun = w["rerun"]
            lines.append(f"\n{w['workload']}: from a separate run, {rerun.get('why')} (`{rerun.get('command')}`, started "
                         f"{rerun.get('date')}, trainbridge {rerun.get('trainbridge')}).")
        measured = w.get("measured") or {}
        if measured.get("failures"):
            lines.append(f"\n{w['workload']}: arms left out: " + "; ".join(f"{k} ({v})" for k, v in measured["failures"].items()))
        if (w.get("summary") or {}).get("branch_is_original"):
            lines.append(f"\n{w['workload']}: no accepted commit, so the branch is the original; its arms were not run again "
                         "(their ratios to the original are 1 by definition).")
    return lines


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def intents_section(section: dict[str, Any]) -> list[str]:
    lines = ["", "### What each run found, and why an intent has no winning recipe", ""]
    for w in section.get("workloads", []):
        run = w.get("run") or {}
        lines.append(f"**{w['workload']}** — run `{run.get('run_id', NA)}`: {_s(run.get('wall_s'))} s, "
                     f"stop: {run.get('stop_reason') or NA}, exit code {run.get('exit_code', NA)}")
        lines.append("")
        intents = w.get("intents") or []
        if not intents:
            lines.append("(no intents recorded)\n")
            continue
        lines += ["| intent | where | status | recipes tried (verdict, ratio) | compile's kernels there (eager ops -> kernels) |",
                  "|---|---|---|---|---|"]
        for i in intents:
            tried = "; ".join(f"{t['recipe_id'] or 'LLM'}: {t['reason']}" + (f" {t['ratio']:.3f}" if t.get("ratio") else "")
                              for t in i["tried"]) or "—"
            kernels = ", ".join(f"`{k}`" for k in (i.get("compile_kernels") or [])[:4]) or "—"
            if i.get("eager_ops") is not None or i.get("reference_kernels") is not None:
                kernels += f" ({_or_unknown(i.get('eager_ops'))} eager ops -> {_or_unknown(i.get('reference_kernels'))} kernels)"
            lines.append(f"| {i['category']} | {i.get('where') or NA} | {i['status']} | {tried} | {kernels} |")
        lines.append("")
    return lines


def _judged_overall(section: dict[str, Any]) -> list[str]:
    """The median judge time per candidate over every workload of `section` (empty when none was judged)."""
    every = [x for w in section.get("workloads", []) for x in (w.get("per_candidate") or {}).get("judge_s") or []]
    if not every:
        return []
    return [f"\nAll workloads together: median {statistics.median(every):.1f} s per judged candidate over {len(every)} candidates "
            "(the profiler node's wall time: region lab and gate)."]


def loop_cost_table(section: dict[str, Any], *, judge_times: bool = True) -> list[str]:
    """`judge_times`: also list each run's judge time per candidate (the speed section lists them when it ran)."""
    phases = ("evidence", "compile", "retrieval", "codemod", "measurement")
    lines = ["| workload | run wall s | " + " | ".join(f"{p} s" for p in phases) + " | other s | candidates | accepted | candidates / accepted | stop |",
             "|---|---:|" + "---:|" * len(phases) + "---:|---:|---:|---:|---|"]
    notes = []
    for w in section.get("workloads", []):
        b, c = w.get("breakdown") or {}, w.get("candidates") or {}
        per = c.get("candidates_per_accepted")
        lines.append(f"| {w['workload']} | {_s(b.get('wall_s'))} | " + " | ".join(_s((b.get("phases") or {}).get(p)) for p in phases)
                     + f" | {_s(b.get('other_s'))} | {c.get('candidates_tried', NA)} | {c.get('accepted', NA)} | "
                     f"{NA if per is None else f'{per:.1f}'} | {c.get('stop_reason') or NA} |")
        if b.get("note"):
            notes.append(f"{w['workload']}: {b['note']}.")
    judged = [(w["workload"], w["per_candidate"]) for w in section.get("workloads", []) if (w.get("per_candidate") or {}).get("judge_s")]
    if judge_times and judged:
        lines += ["", "| workload | judged candidates | judge s per candidate (each) | median s |", "|---|---:|---|---:|"]
        lines += [f"| {name} | {per['judged']} | {', '.join(f'{x:.0f}' for x in per['judge_s'])} | {per['median_judge_s']:.1f} |"
                  for name, per in judged]
        lines += _judged_overall(section)
    lines.append("")
    lines.append("evidence = the analyst's static scan and eager profile; compile = its torch.compile reference; "
                 "codemod = the coder; measurement = baseline, gate and final measurement (prepare, profiler, report); "
                 "other = decide, graph and process overhead.")
    return lines + ([""] + notes if notes else [])


def calibration_table(section: dict[str, Any]) -> list[str]:
    rows = section.get("summary_independent") or []
    sliding = {r["condition"]: r for r in section.get("summary_sliding") or []}
    config = section.get("config") or {}
    first = config.get("rounds", "?")
    most = config.get("max_rounds") or first
    looks = f"{first} rounds"
    if most != first:
        looks += (f", a second look over {most} when the first is inconclusive but its estimate is off 1 by the minimum "
                  "gain or more, as `run_gate` decides")
    lines = [f"{config.get('gates', '?')} independent gate runs ({looks}) of {config.get('steps_per_round', '?')} steps "
             "per round and condition (fresh sandbox child per program and round); in brackets the rate over all "
             "overlapping windows of that many rounds.", "",
             "| condition | true ratio | accepted | called slower | not significant | second look | median ratio | median CI half-width |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = sliding.get(r["condition"], {})
        pct = lambda key: f"{100 * r[key]:.0f}%" + (f" [{100 * s[key]:.0f}% of {s['gate_runs']}]" if s.get(key) is not None else "")  # noqa: E731
        lines.append(f"| {r['condition']} | {r['true_ratio']:.3f} | {pct('accepted')} | {pct('slower')} | {pct('not_significant')} | "
                     f"{100 * (r.get('second_looks') or 0):.0f}% | {r['median_ratio']:.3f} | ±{100 * r['median_ci_halfwidth']:.1f}% |")
    lines += ["", "A/A: 'accepted' is the false-accept rate (target < 5%). Planted slowdowns: 'called slower' is the power."]
    return lines


def analysis_table(section: dict[str, Any]) -> list[str]:
    rows = section.get("rows") or []
    seen = {k for r in rows for k in r["phases"]}
    phases = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))
    lines = ["| layers | total s | " + " | ".join(f"{p} s" for p in phases) + " | intents | eager ops / step |",
             "|---:|---:|" + "---:|" * len(phases) + "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['depth']} | {_s(r['wall_s'])} | " + " | ".join(_s(r["phases"].get(p)) for p in phases)
                     + f" | {r['intents']} | {r.get('eager_ops_per_step') or NA} |")
    fits = section.get("fits") or {}
    if "total" in fits:
        lines.append("")
        for name, fit in fits.items():
            if name != "total" and max((r["phases"].get(name, 0.0) for r in rows), default=0.0) < 1.0:
                continue  # phases under a second at every depth: their fit says nothing
            lines.append(f"- {name}: {fit['verdict']}; fit {fit['intercept']:.1f} s + {fit['slope']:.2f} s/layer (R² {fit['r2']:.3f}); "
                         "per-layer increments " + ", ".join(f"{x:.2f}" for x in fit["per_layer_increments_s"]) + " s")
    return lines


def _section(title: str, section: dict[str, Any] | None, body) -> list[str]:
    lines = ["", f"## {title}", ""]
    if not section:
        return lines + ["not run (excluded with --only)"]
    if section.get("error"):
        lines.append(f"**failed**: {section['error'].splitlines()[0]}")
        lines.append("")
    if section.get("status") == "ok" or section.get("workloads") or section.get("rows") or section.get("summary_independent"):
        lines += body(section)
    if section.get("wall_s") is not None:
        lines += ["", f"(section wall time {section['wall_s']:.0f} s)"]
    return lines


def render_markdown(record: dict[str, Any], charts: list[str] | None = None) -> str:
    m, v, s = record.get("machine", {}), record.get("versions", {}), record.get("sections", {})
    lines = [
        f"# TrainBridge benchmarks, {record.get('date')}" + ("" if record.get("status") == "complete" else f" ({record.get('status')})"),
        "",
        f"Command: `{record.get('command')}`" + (f"; {record['wall_s'] / 60:.1f} min" if record.get("wall_s") else ""),
        "",
        f"Machine: {m.get('cpu_model', NA)}, {m.get('cpus', NA)} cores, {m.get('memory_gib', NA)} GiB; load average (1 min) "
        f"{m.get('loadavg_start', [NA])[0]} at start, {(m.get('loadavg_end') or [NA])[0]} at end. "
        f"Versions: torch {v.get('torch', NA)}, python {v.get('python', NA)}, trainbridge {v.get('trainbridge', NA)}.",
    ]
    speed = s.get("speedup")
    lines += _section("Speed: TrainBridge's branch and torch.compile (CPU)", speed,
                      lambda sec: [speedup_table(sec), *_speedup_notes(sec), *intents_section(sec)])
    for chart in charts or []:
        lines += ["", f"![{Path(chart).stem}]({Path(chart).name})"]
    lines += _section("The loop's own cost (per `trainbridge run`)", s.get("loop_cost"),
                      lambda sec: loop_cost_table(sec, judge_times=speed is None))
    lines += _section("Gate calibration", s.get("calibration"), calibration_table)
    lines += _section("Knowledge-base query latency", s.get("kb_latency"), lambda sec: [sec.get("markdown", "")])
    lines += _section("Analysis time against model depth (llama)", s.get("analysis_scaling"), analysis_table)
    lines += _section("torchrun: one process and 2 ranks (gpt2_pretrain, script mode)", s.get("ranks"),
                      lambda sec: [sec.get("markdown", "")])
    return "\n".join(lines) + "\n"


def write_charts(record: dict[str, Any], out_stem: Path) -> list[Path]:
    """<stem>.png: step time of each variant relative to eager, per workload, with 95% CIs;
    <stem>-analysis.png: analyst time against depth. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    speed = (record.get("sections") or {}).get("speedup") or {}
    workloads = [w for w in speed.get("workloads", []) if w.get("summary")]
    if workloads:
        fig, ax = plt.subplots(figsize=(max(6.0, 2.2 + 2.0 * len(workloads)), 4.2))
        width = 0.8 / len(VARIANTS)
        for k, variant in enumerate(VARIANTS):
            heights, errors = [], [[], []]
            for w in workloads:
                r = _ratio_of(w, variant, EAGER) if variant != EAGER else {"ratio": 1.0, "ci": [1.0, 1.0]}
                r = r or {"ratio": 0.0, "ci": [0.0, 0.0]}
                heights.append(r["ratio"])
                errors[0].append(max(0.0, r["ratio"] - r["ci"][0]))
                errors[1].append(max(0.0, r["ci"][1] - r["ratio"]))
            xs = [i + (k - (len(VARIANTS) - 1) / 2) * width for i in range(len(workloads))]
            bars = ax.bar(xs, heights, width, yerr=errors, capsize=3, label=variant)
            ax.bar_label(bars, labels=[f"{h:.2f}" for h in heights], fontsize=7, padding=2)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(workloads)), [w["workload"] for w in workloads])
        ax.set_ylabel("step time / eager original (lower is faster)")
        ax.set_title(f"Step time relative to eager, CPU, {record.get('date')}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_stem.with_suffix(".png")
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    scaling = (record.get("sections") or {}).get("analysis_scaling") or {}
    rows = scaling.get("rows") or []
    if len(rows) >= 2:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        depths = [r["depth"] for r in rows]
        ax.plot(depths, [r["wall_s"] for r in rows], "o-", label="total")
        for phase in PHASE_ORDER:
            values = [r["phases"].get(phase, 0.0) for r in rows]
            if max(values) >= 1.0:
                ax.plot(depths, values, ".--", label=phase)
        ax.set_xlabel("decoder layers")
        ax.set_ylabel("analyst wall time, s")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_stem.parent / f"{out_stem.name}-analysis.png"
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
