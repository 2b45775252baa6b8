"""TrainBridge's benchmark suite: one command, six measurements, one dated results page.

    .venv/bin/python benchmarks/suite.py            # everything (about 40 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/suite.py --quick    # a few minutes: one workload, tiny sizes (checks the machinery)
    .venv/bin/python benchmarks/suite.py --only calibration,kb_latency

Sections (`--only` takes a comma-separated list of these names):

  speedup           per bundled example: a real `trainbridge run` (CPU) on a git copy, then its step time in
                    four variants (eager original, TrainBridge's final branch, torch.compile of each), measured
                    in persistent sandboxed workers, interleaved round by round (speedup.py)
  loop_cost         the same runs' wall time split by phase, candidates tried per accepted commit (loop_cost.py)
  calibration       the speed gate's A/A false-accept rate and power against planted 2%, 5%, 10% slowdowns
                    (gate_calibration.py)
  kb_latency        knowledge-base query latency at 10k and 100k outcomes, embedded and on a loopback
                    Chroma server (kb_latency.py, run as is)
  analysis_scaling  analyst wall time for the llama example at 2, 4, 8, 16 layers (analysis_scaling.py)
  ranks             gpt2_pretrain's data-parallel variant in script mode: one process against
                    `torchrun --nproc_per_node 2` (the group's step, the slowest rank's; per-rank medians) (ranks_scaling.py)

Writes benchmarks/results/<YYYY-MM-DD>.md, .json and .png (plus <date>-analysis.png); --quick writes
<date>-quick.*. The JSON is rewritten atomically after every section (status "incomplete" until the
end), so a killed suite keeps what it measured; the markdown and charts are written at the end.
Run it on a quiet machine: every figure is a wall-clock measurement.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # run as a script: the sibling modules (benchmarks/ is not a package)
    sys.path.insert(0, str(HERE))

SECTIONS = ("speedup", "loop_cost", "calibration", "kb_latency", "analysis_scaling", "ranks")
EXAMPLES = ("llama_pretrain", "gpt2_pretrain", "resnet_classify", "clip_pretrain")
FULL = dict(workloads=list(EXAMPLES), run_budget_s=420.0, max_candidates=40, gate_rounds=10, run_reference=True,
            rounds=6, steps=8, calibration_gates=2, calibration_rounds=8, calibration_steps=20,
            kb_sizes=[10_000, 100_000], kb_queries=40, depths=[2, 4, 8, 16], ranks_rounds=4)
QUICK = dict(workloads=["llama_pretrain"], run_budget_s=60.0, max_candidates=1, gate_rounds=6, run_reference=False,
             rounds=2, steps=3, calibration_gates=1, calibration_rounds=2, calibration_steps=5,
             kb_sizes=[1_000], kb_queries=10, depths=[1, 2], ranks_rounds=1)


class Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"{datetime.now():%H:%M:%S} +{(time.monotonic() - self.started) / 60:4.1f} min  {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny settings to check the machinery (one workload, 2 rounds, ...)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections (default all: {','.join(SECTIONS)})")
    parser.add_argument("--workloads", nargs="+", choices=EXAMPLES, help="bundled examples for speedup/loop_cost")
    parser.add_argument("--run-budget-s", type=float, help=f"wall-clock budget of each `trainbridge run` (full: {FULL['run_budget_s']:g})")
    parser.add_argument("--max-candidates", type=int, help=f"candidate limit of each run (full: {FULL['max_candidates']})")
    parser.add_argument("--gate-rounds", type=int, help=f"gate rounds per candidate in the runs (full: {FULL['gate_rounds']}), "
                                                       f"and per calibration gate run (full: {FULL['calibration_rounds']})")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds of the speed measurement (full: {FULL['rounds']})")
    parser.add_argument("--steps", type=int, help=f"timed steps per variant and round (full: {FULL['steps']})")
    parser.add_argument("--calibration-gates", type=int, help=f"independent gate runs per calibration condition (full: {FULL['calibration_gates']})")
    parser.add_argument("--kb-sizes", type=int, nargs="+", help=f"outcome counts for kb_latency (full: {' '.join(map(str, FULL['kb_sizes']))})")
    parser.add_argument("--depths", type=int, nargs="+", help=f"llama depths for analysis_scaling (full: {' '.join(map(str, FULL['depths']))})")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results", help="where the results go")
    parser.add_argument("--render", type=Path, metavar="JSON", help="only re-render the markdown and charts of a saved results JSON")
    parser.add_argument("--merge", type=Path, metavar="OTHER_JSON",
                        help="with --render: take the workloads OTHER_JSON measured (speedup and loop_cost) in place of the "
                             "same workloads in JSON, each marked on the page with that run's command and date and --why")
    parser.add_argument("--why", help="with --merge: why those workloads were measured again (printed on the page)")
    args = parser.parse_args(argv)
    if args.merge is not None and (args.render is None or not args.why):
        parser.error("--merge needs --render JSON (the page to update) and --why (said on the page)")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    settings = dict(QUICK if args.quick else FULL)
    for key in ("workloads", "run_budget_s", "max_candidates", "gate_rounds", "rounds", "steps", "calibration_gates", "kb_sizes", "depths"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.gate_rounds is not None:
        settings["calibration_rounds"] = args.gate_rounds
    args.settings, args.sections = settings, only
    return args


def estimate_s(settings: dict[str, Any], sections: list[str]) -> dict[str, float]:
    """A rough plan (seconds), from costs seen on a 2-core machine: llama compiles in ~45 s, a sandbox
    child costs ~4 s, 100k outcomes take ~3 min to insert per knowledge-base mode."""
    out: dict[str, float] = {}
    n = len(settings["workloads"])
    if "speedup" in sections or "loop_cost" in sections:
        out["runs"] = n * (settings["run_budget_s"] + 50)
    if "speedup" in sections:
        out["speedup"] = n * (60 + settings["rounds"] * 4 * (settings["steps"] + 1) * 0.15)
    if "calibration" in sections:
        # each independent gate run measures the second look's rounds too (twice the first look's)
        out["calibration"] = settings["calibration_gates"] * 2 * settings["calibration_rounds"] * 5 * 3.0  # 3.0 s per child measured
    if "kb_latency" in sections:
        out["kb_latency"] = 2 * (30 + max(settings["kb_sizes"]) * 0.0008)  # 0.8 s per 1k outcomes inserted, measured
    if "analysis_scaling" in sections:
        out["analysis_scaling"] = sum(20 + 8.5 * d for d in settings["depths"])
    if "ranks" in sections:
        out["ranks"] = settings["ranks_rounds"] * 2 * (15 + 3 * (settings["steps"] + 3) * 0.3)  # a sandbox + 2 ranks' start: ~15 s
    return out


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu_model": model, "cpus": os.cpu_count(), "memory_gib": round(memory, 1), "platform": platform.platform(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict[str, str]:
    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"torch": dist("torch"), "python": platform.python_version(), "chromadb": dist("chromadb"), "langgraph": dist("langgraph"),
            "trainbridge": (sha or "unknown") + (" (uncommitted changes)" if dirty else "")}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# --- sections -------------------------------------------------------------------------------------


def run_workloads(settings: dict[str, Any], sections: list[str], tmp: Path, say: Progress,
                  on_workload=None) -> tuple[dict, dict]:
    """For each workload: a real run, then (if asked) the speed measurement; `on_workload(speed, cost)`
    after each one (the suite saves what it has: a killed suite keeps its finished workloads)."""
    import fresh_arms
    import loop_cost
    from trainbridge.sandbox.workload import load_workload

    speed: dict[str, Any] = {"settings": {**{k: settings[k] for k in ("rounds", "steps", "run_budget_s", "max_candidates", "gate_rounds",
                                                                    "run_reference")},
                                          "compile_cache": "a fresh TORCHINDUCTOR_CACHE_DIR per workload: the first round compiles cold, "
                                                           "later rounds read the cache",
                                          "design": "a fresh sandboxed child per arm and round (benchmarks/fresh_arms.py)"},
                             "workloads": []}
    cost: dict[str, Any] = {"workloads": []}
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for name in settings["workloads"]:
        entry: dict[str, Any] = {"workload": name}
        speed["workloads"].append(entry)
        try:
            repo = loop_cost.git_copy(ROOT / "examples" / name, tmp / "repos" / name)
            say(f"[{name}] trainbridge run (budget {settings['run_budget_s']:g} s, at most {settings['max_candidates']} candidates, "
                f"{settings['gate_rounds']} gate rounds)")
            run = loop_cost.run_loop(repo, f"bench-{name.replace('_', '-')}-{stamp}", tmp / "home" / name,
                                     budget_s=settings["run_budget_s"], max_candidates=settings["max_candidates"],
                                     gate_rounds=settings["gate_rounds"], compile_reference=settings["run_reference"], say=say)
            state = run.pop("state")
            stats = loop_cost.candidate_stats(state)
            entry["run"] = {**run, "stop_reason": state.get("stop_reason"), "run_branch": state.get("run_branch"), **stats}
            entry["coverage"] = state.get("intent_coverage")
            entry["per_candidate"] = loop_cost.per_candidate_seconds(state)
            entry["intents"] = loop_cost.intent_outcomes(state)
            entry["accepted"] = loop_cost.accepted_commits(state)
            cost["workloads"].append({"workload": name, "breakdown": loop_cost.phase_breakdown(state, run["wall_s"]), "candidates": stats,
                                      "per_candidate": entry["per_candidate"]})  # also when the speedup section is not run
            say(f"[{name}] run finished in {run['wall_s']:.0f} s (exit {run['exit_code']}): {stats['candidates_tried']} candidate(s), "
                f"{stats['accepted']} accepted; {state.get('stop_reason')}")
            if run["exit_code"] != 0 and not state:
                raise RuntimeError("trainbridge run failed before recording any state:\n" + "\n".join(run["output_tail"][-15:]))
            if "speedup" not in sections:
                continue
            original = load_workload(repo)
            branch = load_workload(loop_cost.export_branch(repo, state["run_branch"], tmp / "branches" / name)) if entry["accepted"] else None
            arms = 5 if branch is not None else 3
            say(f"[{name}] speed: {arms} arms (eager, eager again as the A/A control, compile{', the branch and its compile' if branch else ''}), "
                f"a fresh child per arm and round, {settings['rounds']} rounds x {settings['steps']} steps")
            t_measure = time.monotonic()
            measured = fresh_arms.measure_fresh(original, branch, rounds=settings["rounds"], steps=settings["steps"],
                                                cache_dir=tmp / "inductor-cache" / name, say=say)
            measured["wall_s"] = time.monotonic() - t_measure
            entry["measured"] = measured
            entry["summary"] = fresh_arms.summarise(measured)
            say(f"[{name}] " + ", ".join(f"{k} {v['ratio']:.3f}" for k, v in entry["summary"]["ratios"].items()))
        except Exception as exc:  # one workload's failure is reported in the table; the others still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            say(f"[{name}] failed: {entry['error'][:300]}")
        if on_workload is not None:
            on_workload(speed, cost)
    return speed, cost


def run_calibration(settings: dict[str, Any], tmp: Path, say: Progress) -> dict[str, Any]:
    import gate_calibration

    out = tmp / "gate_calibration.json"
    argv = ["--gates", str(settings["calibration_gates"]), "--rounds", str(settings["calibration_rounds"]),
            "--steps-per-round", str(settings["calibration_steps"]), "--slowdowns", "0.02", "0.05", "0.10", "--out", str(out)]
    say(f"gate calibration: gate_calibration.py {' '.join(argv[:-2])}")
    gate_calibration.main(argv)
    record = json.loads(out.read_text(encoding="utf-8"))
    return {k: record.get(k) for k in ("config", "summary_independent", "summary_sliding", "summary_pooled", "wall_s", "rounds")}


def run_kb_latency(settings: dict[str, Any], tmp: Path, say: Progress) -> dict[str, Any]:
    out = tmp / "kb_latency.json"
    argv = [sys.executable, str(HERE / "kb_latency.py"), "--sizes", *map(str, settings["kb_sizes"]), "--modes", "embedded", "server",
            "--queries", str(settings["kb_queries"]), "--out", str(out)]
    say(f"knowledge-base latency: {' '.join(argv[1:-2])}")
    done = subprocess.run(argv)  # its progress (stderr) and markdown table (stdout) show as it goes
    if done.returncode != 0:
        raise RuntimeError(f"kb_latency.py exited with code {done.returncode} (its progress and error are above)")
    record = json.loads(out.read_text(encoding="utf-8"))
    return {"rows": record["rows"], "markdown": record["markdown"], "args": record["args"]}


def run_ranks(settings: dict[str, Any], say: Progress) -> dict[str, Any]:
    import ranks_scaling

    say(f"ranks: gpt2_pretrain/train_ddp.py, one process and 2 torchrun ranks, {settings['ranks_rounds']} rounds x {settings['steps']} steps")
    return ranks_scaling.measure(rounds=settings["ranks_rounds"], steps=settings["steps"], say=say)


def run_analysis_scaling(settings: dict[str, Any], say: Progress) -> dict[str, Any]:
    import analysis_scaling

    say(f"analysis scaling: llama at {', '.join(map(str, settings['depths']))} layers, torch.compile reference on")
    return analysis_scaling.measure(settings["depths"], say=say)


# --- driver ---------------------------------------------------------------------------------------


def merge(record: dict[str, Any], other: dict[str, Any], why: str) -> list[str]:
    """Put `other`'s speedup and loop_cost entries in place of `record`'s for the same workloads, each
    marked with where it came from (`rerun`); the names of the workloads taken."""
    taken: list[str] = []
    for section in ("speedup", "loop_cost"):
        theirs = {w["workload"]: w for w in (other.get("sections", {}).get(section) or {}).get("workloads", [])}
        ours = (record.get("sections", {}).get(section) or {}).get("workloads", [])
        for index, entry in enumerate(ours):
            if entry["workload"] in theirs:
                ours[index] = {**theirs[entry["workload"]], "rerun": {"command": other.get("command"), "date": other.get("started"),
                                                                     "trainbridge": (other.get("versions") or {}).get("trainbridge"),
                                                                     "why": why}}
                taken.append(entry["workload"])
    if not taken:
        raise SystemExit("--merge: the other results JSON measured none of this page's workloads")
    return sorted(set(taken))


def render(path: Path, merge_from: Path | None = None, why: str | None = None) -> list[Path]:
    """Rewrite <stem>.md and the charts beside a results JSON (no measuring); with `merge_from`, first
    take that JSON's workloads in place of the same ones here (`merge`) and save the JSON."""
    import report

    record = json.loads(path.read_text(encoding="utf-8"))
    if merge_from is not None:
        merge(record, json.loads(merge_from.read_text(encoding="utf-8")), why or "")
        write_atomic(path, json.dumps(record, indent=1, default=str) + "\n")
    stem = path.with_suffix("")
    charts = report.write_charts(record, stem)
    write_atomic(stem.with_suffix(".md"), report.render_markdown(record, [str(p) for p in charts]))
    return [stem.with_suffix(".md"), *charts]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        print("\n".join(str(p) for p in render(args.render, args.merge, args.why)))
        return 0
    say = Progress()
    settings, sections = args.settings, args.sections
    date = datetime.now().strftime("%Y-%m-%d")
    stem = args.out_dir / (f"{date}-quick" if args.quick else date)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plan = estimate_s(settings, sections)
    command = "python benchmarks/suite.py" + ("" if argv is None and len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:] if argv is None else argv))
    record: dict[str, Any] = {"suite": "trainbridge-benchmarks", "format": 1, "status": "incomplete", "date": date, "command": command,
                              "started": datetime.now().isoformat(timespec="seconds"), "machine": machine(), "versions": versions(),
                              "settings": settings, "estimate_s": plan, "sections": {}}
    say(f"sections {', '.join(sections)}; rough plan {sum(plan.values()) / 60:.0f} min (" +
        ", ".join(f"{k} {v / 60:.1f}" for k, v in plan.items()) + f"); results: {stem}.md/.json/.png")
    started = time.monotonic()

    def save() -> None:
        record["wall_s"] = time.monotonic() - started
        write_atomic(stem.with_suffix(".json"), json.dumps(record, indent=1, default=str) + "\n")

    def section(name: str, body) -> None:
        t0 = time.monotonic()
        try:
            result = body()
            record["sections"][name] = {"status": "ok", **result, "wall_s": time.monotonic() - t0}
        except Exception as exc:  # a broken section is reported; the others still run
            record["sections"][name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()[-3000:], "wall_s": time.monotonic() - t0}
            say(f"{name} failed: {exc}")
        save()

    with tempfile.TemporaryDirectory(prefix="tb-suite-") as tmp_name:
        tmp = Path(tmp_name)
        if "speedup" in sections or "loop_cost" in sections:
            t0 = time.monotonic()
            try:
                def partial(speed: dict, cost: dict) -> None:
                    if "speedup" in sections:
                        record["sections"]["speedup"] = {"status": "incomplete", **speed, "wall_s": time.monotonic() - t0}
                    if "loop_cost" in sections:
                        record["sections"]["loop_cost"] = {"status": "incomplete", **cost}
                    save()

                speed, cost = run_workloads(settings, sections, tmp, say, on_workload=partial)
                speed, cost = {"status": "ok", **speed}, {"status": "ok", **cost}
            except Exception as exc:  # per-workload failures are caught inside; this is the machinery itself
                speed = cost = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                say(f"speedup/loop_cost failed: {exc}")
            wall = time.monotonic() - t0
            if "speedup" in sections:
                record["sections"]["speedup"] = {**speed, "wall_s": wall}
            if "loop_cost" in sections:  # the same runs: their own wall times are in the table
                record["sections"]["loop_cost"] = cost
            save()
        if "calibration" in sections:
            section("calibration", lambda: run_calibration(settings, tmp, say))
        if "analysis_scaling" in sections:
            section("analysis_scaling", lambda: run_analysis_scaling(settings, say))
        if "kb_latency" in sections:
            section("kb_latency", lambda: run_kb_latency(settings, tmp, say))
        if "ranks" in sections:
            section("ranks", lambda: run_ranks(settings, say))

    record["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    record["finished"] = datetime.now().isoformat(timespec="seconds")
    record["status"] = "complete"
    save()
    charts = render(stem.with_suffix(".json"))[1:]
    say(f"done in {(time.monotonic() - started) / 60:.1f} min: {stem}.md, {stem}.json" + "".join(f", {p.name}" for p in charts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
