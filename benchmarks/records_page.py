"""The records benchmark's results page (benchmarks/records.py): the published NPU speedup beside our kernel
reduction per record, what ran and why not, what the port left, and where each record's code is."""

from __future__ import annotations

from typing import Any

from records_catalog import ARGPARSE, BY_NUMBER, EARLY, LATE


BAR_VERIFIED, BAR_CUT = 3, 0.30


def meets_bar(row: dict[str, Any]) -> bool:
    before, after = row.get("npu_kernels_per_step_before"), row.get("npu_kernels_per_step_after")
    return bool(row["ran"] and row["pending_numerics_ok"] >= BAR_VERIFIED and before and after is not None
                and after <= before * (1 - BAR_CUT))


def short_of_bar(row: dict[str, Any]) -> str:
    """Why a record that ran falls short of the bar, from its row: too few verified rewrites (and what the others
    were judged), too small a cut (what the pending head keeps), or both; a hand-written `short_why` is added."""
    if not row["ran"] or meets_bar(row):
        return ""
    parts = []
    verified = row["pending_numerics_ok"]
    if verified < BAR_VERIFIED:
        judged = [v for v in row.get("verdicts") or [] if v["reason"] not in ("not_applicable", "speed_unmeasured_numerics_ok")]
        others = ", ".join(f"{v['recipe']} {v['reason']}" for v in judged) or "no other recipe applied"
        parts.append(f"{verified} numerics-verified rewrite(s), {BAR_VERIFIED} needed (the others: {others})")
    before, after = row.get("npu_kernels_per_step_before"), row.get("npu_kernels_per_step_after")
    if before and after is not None and after > before * (1 - BAR_CUT):
        parts.append(f"kernels per step cut {1 - after / before:.0%}, {BAR_CUT:.0%} needed (the pending head keeps "
                     f"{after} of {before})")
    if row.get("short_why"):
        parts.append(row["short_why"])
    return "; ".join(parts)


def _change(row: dict[str, Any]) -> str:
    before, after = row.get("npu_kernels_per_step_before"), row.get("npu_kernels_per_step_after")
    if not before or after is None:
        return "n/a"
    return f"{(after / before - 1) * 100:+.0f}%".replace("-", "\u2212")


def _reference(row: dict[str, Any]) -> str:
    ref = row.get("reference_kernels") or {}
    return f"{ref.get('forward', 0)} + {ref.get('backward', 0)}" if ref else "n/a"


def _speedup(row: dict[str, Any]) -> str:
    return "not in the table" if row.get("published_speedup") is None else f"{row['published_speedup']:.2f}x"


def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| record | name | published NPU speedup | ran | NPU kernels/step before \u2192 pending head | change | "
             "torch.compile reference fwd + bwd | numerics-verified pending | torch_npu APIs on the pending branch | "
             "crashed | baseline step (emulated, not NPU speed) | wall |",
             "|---:|---|---:|:-:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        kernels = (f"{r['npu_kernels_per_step_before']} \u2192 {_cell(r['npu_kernels_per_step_after'])}"
                   if r.get("npu_kernels_per_step_before") else "n/a")
        step = f"{r['baseline_step_ms']:.0f} ms" if r.get("baseline_step_ms") else "n/a"
        wall = f"{r['wall_s']:.0f} s" if r.get("wall_s") is not None else "n/a"
        lines.append(f"| {r['record']} | {r['name']} | {_speedup(r)} | {'yes' if r['ran'] else 'no'} | "
                     f"{kernels} | {_change(r)} | {_reference(r)} | {r['pending_numerics_ok']} | "
                     f"{', '.join(r['pending_apis']) or '-'} | {r['crashed']} | {step} | {wall} |")
    return lines


def _profile(name: str, overrides: dict[str, Any]) -> str:
    return f"- **{name}**: " + ", ".join(f"`{key} = {value!r}`" for key, value in overrides.items())


def markdown(rows: list[dict[str, Any]], argv: list[str], date: str, batches: list[list[str]] | None = None) -> str:
    """The page; `batches`: the commands whose rows were merged into it (one per session's batch), else `argv`."""
    ran = [r for r in rows if r["ran"]]
    commands = [f"`.venv/bin/python benchmarks/records.py {' '.join(a)}`".replace(" `", "`") for a in batches or [argv]]
    lines = [f"# Modded-NanoGPT records, `trainbridge port` and `trainbridge run --target npu` record by record ({date})", "",
             ("Command: " if len(commands) == 1 else "Commands, their rows merged (--merge): ") + "; ".join(commands)
             + " (CPU host, no NPU).", "",
             "**NPU speed is unmeasured here.** The published speedup is the NPU port's own table (8x Ascend 910C, "
             "optimized against direct-port minutes); beside it stands what can be counted without an NPU: the NPU "
             "kernels one training step launches on the emulated device (forward, backward and optimizer; a fused "
             "torch_npu API is one kernel each way), the original against the pending head of numerics-verified "
             "rewrites. The reference column is what torch.compile (Inductor, host CPU) runs the model's forward and "
             "backward in. Every record runs shrunk (one process, tiny widths, short sequences), so the counts are "
             "the shrunk program's.", "",
             f"{len(ran)} of {len(rows)} records ran; {sum(meets_bar(r) for r in rows)} meet issue 28's bar (ran, at least "
             f"{BAR_VERIFIED} numerics-verified pending rewrites, kernels per step cut by at least {BAR_CUT:.0%} on the "
             "pending head).", ""]
    lines += table(rows)
    lines += ["", "## Records that did not run, and why", ""]
    lines += [f"- **{r['record']} {r['name']}**: {r['why'] or 'no baseline measured'}" for r in rows if not r["ran"]] or ["- none"]
    lines += ["", "## Records that ran short of the bar, and why", ""]
    lines += [f"- **{r['record']} {r['name']}**: {short_of_bar(r)}" for r in rows if short_of_bar(r)] or ["- none"]
    lines += ["", "## What the port left (file:line)", ""]
    for r in rows:
        left = r.get("not_ported") or []
        lines.append(f"- **{r['record']}** ({'ported' if r['ported'] else 'not ported'}): "
                     + ("; ".join(f"`{item}`" for item in left) if left else "nothing"))
    lines += ["", "## Where each record's code is, and its shrink", "",
              "Each record's script is the code at the head of its log in KellerJordan/modded-nanogpt "
              "(records/track_1_short/<folder>/<log>), read from a fetched mirror; the shrink is one profile per "
              "naming generation plus per-record overrides where a record's names differ.", "",
              _profile("early (records 4-10)", EARLY), _profile("argparse (record 2)", ARGPARSE),
              _profile("late (records 17 on)", LATE), "",
              "| record | folder | log | profile | per-record overrides | note |", "|---:|---|---|---|---|---|"]
    for r in rows:
        source = BY_NUMBER.get(r["record"])
        if source is None:
            continue
        extra = ", ".join(f"`{k} = {v!r}`" for k, v in source.overrides.items()) or "-"
        log = f"{source.log} at {source.commit[:8]}" if source.commit else source.log
        note = "; ".join(n for n in (source.note, source.reference_why) if n) or "-"
        lines.append(f"| {source.number} | {source.folder} | {log} | {source.profile} | {extra} | {note} |")
    lines += ["", "Every verdict per record:", ""]
    for r in rows:
        verdicts = r.get("verdicts") or []
        lines.append(f"- **{r['record']}**: " + ("; ".join(
            f"{v['recipe']} {v['reason']}" + (f" ({v['device_kernels']['baseline']} \u2192 {v['device_kernels']['candidate']})"
                                              if v.get("device_kernels") else "") for v in verdicts) or "none"))
    return "\n".join(lines) + "\n"
