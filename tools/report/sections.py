"""The report's sections below its result: each accepted commit (SHA, the gate's rounds as a plot, its diff), the
intents table `trainbridge analyze` prints, every candidate, the knowledge-base entries this run added, the eager
op counts and the loop's own cost. Pure functions of the run's state: markdown lines, and SVG charts to write.
"""

from __future__ import annotations

import re
from typing import Any

from trainbridge.records import Intent
from trainbridge.tools.report.page import escape_cell
from trainbridge.tools.report.claims import ci_label, ms
from trainbridge.tools.report.rounds_svg import gate_rounds_svg, look_positions
from trainbridge.tools.tables import INTENT_COLUMNS, intent_cells

UNMEASURED = "speed unmeasured (no NPU)"
DETAIL_CHARS = 240  # a candidate's message in its table cell; the whole message is in run.json
INTENT_ROWS = 12  # intents shown in the open table; the untried ones past them go in a collapsed block
DIFF_LINES = 400  # lines of an accepted commit's diff shown in the report (`git show SHA` has the rest)


def clip_words(text: str, limit: int) -> str:
    """`text` on one line, cut at a word boundary before `limit` characters (never inside a word), with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit + 1].rsplit(" ", 1)[0] if " " in text[:limit + 1] else text[:limit]
    return cut.rstrip(" ,;:") + " …"


def table(header: list[str], rows: list[list[str]], align: list[str] | None = None, code: tuple[int, ...] = ()) -> list[str]:
    """A markdown table; every cell escaped so that it renders as exactly its text. Columns in `code` (identifiers: recipe
    and outcome ids) are code spans, which the page keeps on one line (an id broke at every hyphen)."""
    marks = [("---:" if a == "right" else "---") for a in (align or ["left"] * len(header))]
    return (["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
            + ["| " + " | ".join(code_span(cell) if k in code else escape_cell(cell) for k, cell in enumerate(row)) + " |"
               for row in rows])


def code_span(text: str) -> str:
    """`text` as a code span in a table cell (a plain escaped cell when it holds what a span cannot: a backtick, a bar)."""
    if not text or text == "-" or "`" in text or "|" in text or "\n" in text:
        return escape_cell(text)
    return f"`{text}`"


def accepted_commits(state: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Per accepted commit: its SHA, the gate's figures, a plot of its rounds and its diff (collapsed). Returns the
    markdown lines and the SVG charts they reference (file name -> SVG text)."""
    accepted = state.get("accepted") or []
    if not accepted:
        return [], {}
    lines, charts = ["## Accepted commits", ""], {}
    for number, record in enumerate(accepted, start=1):
        sha = record.get("sha") or ""
        lines += [f"### {number}. {escape_cell(str(record.get('category')))}: commit `{sha[:12] or '?'}`", ""]
        lines.append(f"- commit: `{sha or 'not recorded'}` on `{state.get('run_branch')}`; recipe "
                     f"`{record.get('recipe_id') or 'LLM patch'}`; candidate `{record.get('candidate')}`")
        lines.append(f"- the gate: {_gate_figures(record)}")
        if record.get("precision_change"):
            lines.append(f"- **precision changes, review it**: {record['precision_change']}")
        gate = record.get("gate") or {}
        svg = gate_rounds_svg(gate, ratio=record.get("ratio"), ratio_ci=record.get("ratio_ci"),
                              title=f"gate rounds of commit {number} ({record.get('category')}, {sha[:12]})")
        lines.append("")
        if svg is not None:
            name = f"gate_rounds_{number}.svg"
            charts[name] = svg
            lines += [f"![the gate's rounds for commit {number}]({name})", ""]
        else:
            lines += ["(the gate's rounds were not kept for this commit: a run from before they were)", ""]
        lines += diff_details(record.get("diff") or "", sha)
    return lines, charts


def _gate_figures(record: dict[str, Any]) -> str:
    gate = record.get("gate") or {}
    parts = []
    if record.get("ratio"):
        parts.append(f"step-time ratio {record['ratio']:.3f}")
    if record.get("ratio_ci"):
        parts.append(f"{ci_label(record)} {record['ratio_ci'][0]:.3f}–{record['ratio_ci'][1]:.3f}")
    if gate.get("rounds"):
        parts.append(f"{gate['rounds']} interleaved rounds")
    if gate.get("busy_rounds"):
        parts.append(f"{len(gate['busy_rounds'])} left out (the machine was busy) and measured again")
    looks = look_positions(gate, gate.get("rounds") or 0)
    if looks:
        parts.append("looked at " + ", ".join(f"{look} counted rounds (after round {after})" for look, after in looks))
    if gate.get("wall_s"):
        parts.append(f"the gate took {gate['wall_s']:.0f} s")
    return ", ".join(parts) or "no figures recorded"


def diff_details(diff: str, sha: str) -> list[str]:
    """The diff in a collapsed `<details>` block, fenced so that nothing in it closes the fence."""
    if not diff.strip():
        return ["(no diff recorded)", ""]
    lines = diff.rstrip("\n").splitlines()
    files = sum(1 for line in lines if line.startswith("diff --git"))
    shown = lines[:DIFF_LINES]
    if len(lines) > DIFF_LINES:
        shown.append(f"... {len(lines) - DIFF_LINES} more lines: git show {sha[:12]}")
    longest = max((len(run) for run in re.findall(r"`+", diff)), default=0)
    fence = "`" * max(3, longest + 1)
    summary = f"diff of {sha[:12] or 'the commit'}: {files or 1} file(s), {len(lines)} lines"
    return ["<details><summary>" + summary + "</summary>", "", fence + "diff", *shown, fence, "", "</details>", ""]


def intent_record(intent: Intent, site: str | None) -> dict[str, Any]:
    """What the run keeps of every intent an analysis found (the state's `intent_evidence`), enough for the intents
    table to show it as `trainbridge analyze` does: an intent in a library keeps its library location beside its call
    sites (without it the table showed only the user's line), `site` is its code's digest (agents/retrieval/sites.py)."""
    return {"category": str(intent.category), "spans": [str(s) for s in intent.spans],
            "library": intent.library.model_dump(mode="json") if intent.library is not None else None,
            "evidence": intent.evidence.model_dump(mode="json"), "confidence": intent.confidence,
            "estimated_saving_us": intent.estimated_saving_us, "site": site}


def intents_section(state: dict[str, Any]) -> list[str]:
    """Every intent the run's analyses found, as `trainbridge analyze` tabulates them, with what the run did about it."""
    found = dict(state.get("intent_evidence") or {})
    for intent in state.get("intents") or []:  # the latest analysis: complete records
        found[intent["id"]] = {**found.get(intent["id"], {}), **intent}
    if not found:
        return []
    outcome: dict[str, list[str]] = {}
    for record in state.get("verdicts") or []:
        if record.get("intent_id"):
            what = f"accepted {(record.get('sha') or '')[:12]}" if record.get("accepted") else str(record.get("reason"))
            outcome.setdefault(record["intent_id"], []).append(what)
    done = set(state.get("done_intents") or [])
    rows, untried = [], []
    for rank, (intent_id, intent) in enumerate(found.items(), start=1):
        did = counted(outcome.get(intent_id, [])) or ("done, nothing applied" if intent_id in done else "not tried")
        (untried if did == "not tried" and len(rows) >= INTENT_ROWS else rows).append([*intent_cells(rank, intent), did])
    header = [name for name, _ in INTENT_COLUMNS] + ["this run"]
    align = [justify for _, justify in INTENT_COLUMNS] + ["left"]
    lines = ["## Intents", "", "What the analyses found (K vs N: reference kernels vs eager ops per step on those lines; "
             "savings are estimates, never measurements) and what the run did about each.", "", *table(header, rows, align), ""]
    if untried:  # a long tail of intents nobody tried buried the ones the run worked on (40 rows in a records run)
        lines += [f"<details><summary>{len(untried)} more intent(s) the run did not try</summary>", "",
                  *table(header, untried, align), "", "</details>", ""]
    return lines


def counted(outcomes: list[str]) -> str:
    """Outcomes in the order first seen, a repeated one once with its count ('not_applicable ×3, accepted 1a2b3c')."""
    seen: dict[str, int] = {}
    for what in outcomes:
        seen[what] = seen.get(what, 0) + 1
    return ", ".join(what if times == 1 else f"{what} ×{times}" for what, times in seen.items())


def candidates_section(state: dict[str, Any]) -> list[str]:
    lines = ["## Candidates", "", "| # | intent | recipe | verdict | ratio (CI) | detail |", "|---:|---|---|---|---:|---|"]
    for number, record in enumerate(state.get("verdicts") or [], start=1):
        ratio = "-" if record.get("ratio") is None else f"{record['ratio']:.3f}"
        if record.get("ratio_ci"):
            ratio += f" ({record['ratio_ci'][0]:.3f}–{record['ratio_ci'][1]:.3f})"
        if record.get("reason") == "speed_unmeasured_numerics_ok":
            ratio = UNMEASURED
        detail = escape_cell(clip_words(record.get("message") or "", DETAIL_CHARS))
        if record.get("precision_change"):  # the whole sentence: it is what a reviewer checks
            detail = f"**precision changes, review it**: {escape_cell(record['precision_change'])} {detail}"
        lines.append(f"| {number} | {record.get('category')} | {record.get('recipe_id') or '-'} | "
                     f"{'accepted' if record.get('accepted') else record.get('reason')} | {ratio} | {detail} |")
    return lines + [""]


def eager_ops_line(state: dict[str, Any]) -> str | None:
    """Eager ops per step before, and after only when the last analysis counted the final head."""
    before = state.get("eager_ops_before")
    if before is None:
        return None
    landed = [v.get("sha") for v in state.get("verdicts") or [] if v.get("sha")]
    if not landed:
        return f"Eager ops per step: {before} (nothing was committed, so the final head is the original)."
    head = analysed_head_name(state)
    if final_head_analysed(state):
        return (f"Eager ops per step: {before} before, {state['eager_ops_now']} after (an analysis of the {head} "
                f"`{landed[-1][:12]}`{'; numerics verified, speed unmeasured' if head == 'pending head' else ''}).")
    return (f"Eager ops per step: {before} before; the {head} was not re-analysed after its last commit "
            f"`{landed[-1][:12]}`, so there is no after figure.")


def analysed_head_name(state: dict[str, Any]) -> str:
    """'final head', or 'pending head' when the last commit waits on the pending branch (an NPU target without one)."""
    landed = [v for v in state.get("verdicts") or [] if v.get("sha")]
    pending = bool(landed) and landed[-1].get("reason") == "speed_unmeasured_numerics_ok"
    return "pending head" if pending else "final head"


def final_head_analysed(state: dict[str, Any]) -> bool:
    landed = [v.get("sha") for v in state.get("verdicts") or [] if v.get("sha")]
    return bool(landed) and state.get("eager_ops_sha") == landed[-1] and state.get("eager_ops_now") is not None


def knowledge_section(kb_stats: dict[str, Any] | None, kb_added: list[dict[str, Any]] | None) -> list[str]:
    """The entries this run added to the knowledge base, as a short table, and where it is."""
    if not kb_stats and kb_added is None:
        return []
    lines = ["## Knowledge base", ""]
    if kb_stats and kb_stats.get("error"):
        return lines + [f"The knowledge base could not be read when the report was written: {escape_cell(str(kb_stats['error']))}", ""]
    added = kb_added or []
    where = f" at `{kb_stats['location']}`" if kb_stats and kb_stats.get("location") else ""
    totals = (f" It now holds {kb_stats.get('recipes')} recipe(s) and {kb_stats.get('outcomes')} outcome(s) "
              f"({kb_stats.get('accepted')} accepted, {kb_stats.get('rejected')} rejected).") if kb_stats and "recipes" in kb_stats else ""
    lines.append(f"This run added {len(added)} entr{'y' if len(added) == 1 else 'ies'} to the knowledge base{where}.{totals}")
    if added:
        rows = [[str(entry.get("kind", "outcome")), str(entry.get("id")), str(entry.get("recipe_id") or "-"),
                 str(entry.get("category") or "-"), clip_words(str(entry.get("verdict") or "-"), 80),
                 "-" if entry.get("ratio") is None else f"{entry['ratio']:.3f}"] for entry in added]
        lines += ["", *table(["kind", "id", "recipe", "category", "verdict", "ratio"], rows, code=(2,))]  # ids are long: they wrap
    return lines + [""]


def loop_cost(state: dict[str, Any], closing: dict[str, float] | None = None) -> list[str]:
    """Every phase's wall time: the nodes so far and `closing`, the report node's own measurements before it writes the
    report (the closing comparison, or the final head's one plain measurement), which were left out."""
    times = list(state.get("phase_times") or [])
    if closing:
        times.append({"node": "report", "wall_s": sum(closing.values()), "parts": closing})
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
    lines.append(f"| all phases | {len(times)} | {sum(e['wall_s'] for e in times):.1f} s | - |")
    accepted = len(state.get("accepted") or [])
    tried = state.get("candidates_tried") or 0
    lines += ["", f"Candidates tried per accepted commit: {tried / accepted:.1f}." if accepted else
              f"Candidates tried: {tried}, none accepted.", ""]
    return lines


__all__ = ["UNMEASURED", "accepted_commits", "analysed_head_name", "candidates_section", "clip_words", "eager_ops_line", "final_head_analysed",
           "intents_section", "knowledge_section", "loop_cost", "ms"]
