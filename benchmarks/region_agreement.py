"""How often the region lab's verdict agrees with the whole-step gate's, on candidates built by the recipes.

    .venv/bin/python benchmarks/region_agreement.py                                  # llama_pretrain
    .venv/bin/python benchmarks/region_agreement.py --workloads examples/gpt2_pretrain --max-candidates 4
    .venv/bin/python benchmarks/region_agreement.py --no-gate                        # region timings only (seconds each)
    .venv/bin/python benchmarks/region_agreement.py --planted --max-candidates 4     # planted effects, tests' small workload

For each workload: the static scan's CPU intents (agents/analyst/static/scan.py), every CPU recipe of
the intent's category applied to a copy of the workload as the coder applies it
(tools/codemods/engine.py `apply_recipe`, its `sites`), then for each candidate the region lab
(agents/profiler/region_lab.py `time_region`) and the whole-step gate (`run_gate`) on the same two
copies. The region verdict (faster / slower / same / unisolated) stands beside the gate's reason and
ratio; "agrees" means faster ~ accepted, slower ~ slower, same ~ not_significant; the figure that
matters for skipping is "a clearly slower region whose gate accepted" (a skip that would have lost a
win). Prints the table; writes every timing and verdict to benchmarks/results/region_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from trainbridge.agents.analyst.static.scan import scan_repo
from trainbridge.agents.profiler.gate import run_gate
from trainbridge.agents.profiler.region_lab import RegionTiming, clearly_slower, time_region
from trainbridge.knowledge.schema import Target, load_recipe_dir
from trainbridge.knowledge.store import SEED_DIR
from trainbridge.records import SourceSpan
from trainbridge.sandbox.workload import load_workload
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_WORKLOADS = [ROOT / "examples" / "llama_pretrain"]
AGREEING = {"faster": "accepted", "slower": "slower", "same": "not_significant"}
PLANTED_FIXTURE = ROOT / "tests" / "fixtures" / "region_lab" / "base"
NORM_BODY = """        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-6) * self.scale"""
NORM_SLOW = """        for _ in range(20):
            variance = x.pow(2).mean(-1, keepdim=True)
            out = x * torch.rsqrt(variance + 1e-6) * self.scale
        return out"""
MIX_BODY = """    gate = torch.sigmoid(x @ weight)
    return x * gate"""
MIX_SLOW = """    for _ in range(20):
        gate = torch.sigmoid(x @ weight)
        out = x * gate
    return out"""
# (name, baseline's rewrite, candidate's rewrite, the site): planted effects of known sign on the tests' small workload
PLANTED = [
    ("norm-20x-slower", None, (NORM_BODY, NORM_SLOW), SourceSpan(file="model.py", line_start=22, line_end=23, function="forward")),
    ("norm-20x-faster", (NORM_BODY, NORM_SLOW), None, SourceSpan(file="model.py", line_start=22, line_end=23, function="forward")),
    ("mix-20x-slower", None, (MIX_BODY, MIX_SLOW), SourceSpan(file="model.py", line_start=8, line_end=9, function="mix")),
    ("mix-equivalent", None, (MIX_BODY, "    return x * torch.sigmoid(x @ weight)"),
     SourceSpan(file="model.py", line_start=8, line_end=9, function="mix")),
]


def candidates(example: Path, scratch: Path) -> list[dict]:
    """One folder per (intent, recipe) that applies: the rewritten copy, its sites, what it is."""
    recipes = [r for r in load_recipe_dir(SEED_DIR) if Target.cpu in r.targets]
    found = []
    for intent in scan_repo(example, target="cpu"):
        for recipe in (r for r in recipes if r.category == intent.category):
            for span in intent.spans:
                source = (example / span.file).read_text(encoding="utf-8")
                try:
                    edit = apply_recipe(source, recipe, span)
                except CodemodRefused:
                    continue
                folder = scratch / f"{len(found):02d}-{recipe.id}"
                shutil.copytree(example, folder)
                (folder / span.file).write_text(edit.source, encoding="utf-8")
                found.append({"intent": intent.id, "recipe": recipe.id, "root": folder, "sites": edit.sites})
                break
    return found


def planted(scratch: Path) -> list[tuple[Path, dict]]:
    """(baseline, candidate) folder pairs with planted region effects (PLANTED)."""
    pairs = []
    for name, base_edit, cand_edit, site in PLANTED:
        folders = []
        for side, edit in (("baseline", base_edit), ("candidate", cand_edit)):
            folder = scratch / f"{name}-{side}"
            shutil.copytree(PLANTED_FIXTURE, folder)
            if edit is not None:
                text = (folder / "model.py").read_text(encoding="utf-8")
                (folder / "model.py").write_text(text.replace(*edit), encoding="utf-8")
            folders.append(folder)
        pairs.append((folders[0], {"intent": "planted", "recipe": name, "root": folders[1], "sites": [site]}))
    return pairs


def judge(baseline: Path, entry: dict, *, gate: bool, rounds: int, budget_s: float, steps: int | None) -> dict:
    started = time.monotonic()
    timing = time_region(baseline, entry["root"], entry["sites"], budget_s=budget_s)
    row = {"intent": entry["intent"], "recipe": entry["recipe"], "sites": [str(s) for s in entry["sites"]],
           "region": timing.model_dump(mode="json"), "region_wall_s": round(time.monotonic() - started, 2)}
    if gate:
        started = time.monotonic()
        verdict = run_gate(load_workload(baseline), load_workload(entry["root"]), backend="cpu", rounds=rounds, max_rounds=rounds,
                           steps_per_round=steps, on_progress=lambda phase, done, total: print(
                               f"  gate {phase} {done}/{total} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True))
        row["gate"] = {"reason": str(verdict.reason), "ratio": verdict.ratio, "ratio_ci": verdict.ratio_ci,
                       "message": verdict.message, "wall_s": round(time.monotonic() - started, 2)}
    return row


def agreement(rows: list[dict]) -> dict:
    """Counts over the rows that have both a region timing (isolated) and a gate speed verdict."""
    both = [r for r in rows if "gate" in r and r["region"]["verdict"] != "unisolated" and r["gate"]["reason"] in AGREEING.values()]
    agree = [r for r in both if AGREEING[r["region"]["verdict"]] == r["gate"]["reason"]]
    same_direction = [r for r in both if r["gate"]["ratio"] is not None and (r["region"]["ratio"] < 1) == (r["gate"]["ratio"] < 1)]
    skipped = [r for r in rows if clearly_slower(RegionTiming.model_validate(r["region"]))]
    lost = [r for r in skipped if "gate" in r and r["gate"]["reason"] == "accepted"]
    return {"candidates": len(rows), "isolated": sum(r["region"]["verdict"] != "unisolated" for r in rows),
            "compared": len(both), "agree": len(agree), "same_direction": len(same_direction),
            "skips": len(skipped),
            "skips_that_lost_a_win": len(lost)}


def table(rows: list[dict]) -> str:
    lines = ["| recipe | region (qualname) | region ratio [95%] | region verdict | gate reason | gate ratio [CI] | region s | gate s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        region, gate = r["region"], r.get("gate")
        interval = f" [{region['interval'][0]:.2f}, {region['interval'][1]:.2f}]" if region["interval"] else ""
        ratio = f"{region['ratio']:.3f}{interval}" if region["ratio"] is not None else region["message"][:70]
        if gate:
            ci = f" [{gate['ratio_ci'][0]:.3f}, {gate['ratio_ci'][1]:.3f}]" if gate["ratio_ci"] else ""
            gate_cells = f"{gate['reason']} | {gate['ratio']:.3f}{ci}" if gate["ratio"] is not None else f"{gate['reason']} | -"
        else:
            gate_cells = "- | -"
        lines.append(f"| {r['recipe']} | {region['qualname'] or '-'} | {ratio} | {region['verdict']} | {gate_cells} | "
                     f"{r['region_wall_s']:.1f} | {gate['wall_s'] if gate else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=Path, nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--max-candidates", type=int, default=3, help="per workload, in the scan's order")
    parser.add_argument("--recipes", nargs="*", default=None, help="only these recipe ids")
    parser.add_argument("--rounds", type=int, default=6, help="the whole-step gate's rounds (first look = cap)")
    parser.add_argument("--steps", type=int, default=None, help="the gate's measured steps per round (default: the workload's)")
    parser.add_argument("--budget-s", type=float, default=3.0, help="the region lab's timing budget per candidate")
    parser.add_argument("--planted", action="store_true", help="the planted candidates on the tests' small workload "
                        "(tests/fixtures/region_lab) instead of the recipes' on --workloads")
    parser.add_argument("--no-gate", action="store_true", help="region timings only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "region_agreement.json")
    args = parser.parse_args(argv)
    if args.planted:
        args.workloads = [PLANTED_FIXTURE]
    record = {"benchmark": "region_agreement", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_start": os.getloadavg(),
              "rounds": args.rounds, "steps": args.steps, "budget_s": args.budget_s, "workloads": []}
    with tempfile.TemporaryDirectory(prefix="trainbridge-run-region-agreement-") as tmp:
        for path in args.workloads:
            path = path.resolve()
            scratch = Path(tmp) / path.name
            scratch.mkdir()
            baseline = scratch / "baseline"
            shutil.copytree(path, baseline)
            if args.planted:
                pairs = planted(scratch)
            else:
                pairs = [(baseline, c) for c in candidates(path, scratch) if args.recipes is None or c["recipe"] in args.recipes]
            built = [entry for _, entry in pairs]
            rows = []
            for baseline, entry in pairs[: args.max_candidates]:
                rows.append(judge(baseline, entry, gate=not args.no_gate, rounds=args.rounds, budget_s=args.budget_s,
                                  steps=args.steps))
                print(f"{path.name}: {entry['recipe']}: region {rows[-1]['region']['verdict']}"
                      + (f", gate {rows[-1]['gate']['reason']}" if "gate" in rows[-1] else "") + f" (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
                record_rows = {"workload": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
                               "candidates_built": [c["recipe"] for c in built], "rows": rows, "agreement": agreement(rows)}
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({**record, "workloads": [*record["workloads"], record_rows]}, indent=1), encoding="utf-8")
            record["workloads"].append(record_rows if rows else {"workload": str(path), "rows": [], "agreement": agreement([])})
    record["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    for entry in record["workloads"]:
        print(f"\n{entry['workload']}\n{table(entry['rows'])}\nagreement: {entry['agreement']}")
    print(f"\nload average start {record['loadavg_start']}, end {record['loadavg_end']}; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
