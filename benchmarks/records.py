"""The Modded-NanoGPT records benchmark (issue 28): TrainBridge on the records of the published NPU table, record by
record, as a user runs it.

For each record (benchmarks/records_catalog.py maps its number to its folder under records/track_1_short/ of
KellerJordan/modded-nanogpt) this takes the training script from the record's log in a fetched mirror into a
temporary git repository with random, git-ignored token shards in the format it reads and a trainbridge.toml
holding the launch line (one process), the data and the shrink overrides (benchmarks/record_repos.py); then runs
`trainbridge port <repo> --to npu --out <repo>-npu` (the port to review, its report), and `trainbridge run <repo>
--target npu` with the compile reference, which ports again as its first commit, judges each rewrite's numerics on
the emulated NPU and stacks the verified ones on the pending branch. From the port report and the run's final state
(benchmarks/npu_kernels.py's summary) it writes one row per record.

    .venv/bin/python benchmarks/records.py --mirror /work/.mirror/KellerJordan+modded-nanogpt/repo
    .venv/bin/python benchmarks/records.py --mirror <dir> --records 4,5,6 --budget 1200 --max-candidates 6 --slots 2

Writes benchmarks/results/<date>-records.json and .md (--out to choose). Public code is read from the mirror and
never written into this repository. NPU speed is unmeasured here: the kernel counts are the emulated device's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_cost import run_loop  # noqa: E402
from npu_kernels import summarise  # noqa: E402
from record_repos import MirrorError, build_repo, record_script  # noqa: E402
from records_catalog import BY_NUMBER, RECORDS, RecordSource  # noqa: E402
from records_page import markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Say = Callable[[str], None]


def port(repo: Path, home: Path) -> dict[str, Any]:
    """`trainbridge port <repo> --to npu --out <repo>-npu`: whether it wrote the port, and what it left (file:line)."""
    report_dir = repo.parent / "port-report"
    argv = [sys.executable, "-m", "trainbridge", "port", str(repo), "--to", "npu", "--out", str(repo.parent / "npu"),
            "--report-dir", str(report_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TRAINBRIDGE_HOME": str(home),
                                                                       "COLUMNS": "160"})
    report = report_dir / "port-report.json"
    if done.returncode != 0 or not report.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"ported": False, "not_ported": [], "port_changes": 0, "port_error": " | ".join(tail)}
    payload = json.loads(report.read_text(encoding="utf-8"))
    left = [f"{s['file']}:{s['line']} {s['category']}{' (blocking)' if s['blocking'] else ''}: {s['code'].strip()[:120]}"
            for s in payload.get("skipped") or []]
    return {"ported": bool(payload.get("files_written")), "not_ported": left, "port_changes": len(payload.get("changes") or [])}


def _why(summary: dict[str, Any], run_json: dict[str, Any], failure: Path) -> str:
    """The run's error (its --json record, else the failure.json in its folder), else its output's last lines."""
    error = run_json.get("error") or (run_json.get("state") or {}).get("error")
    if not error and failure.exists():
        error = json.loads(failure.read_text(encoding="utf-8")).get("error")
    if error:
        return str(error if isinstance(error, str) else json.dumps(error))[:600]
    tail = [line for line in summary.get("output_tail") or [] if line.strip()]
    return " | ".join(tail[-4:])[:600] or "the run measured no baseline"


def run_record(source: RecordSource, mirror: Path, work: Path, home: Path, *, budget_s: float, max_candidates: int,
               gate_rounds: int, categories: tuple[str, ...] = (), port_only: str = "",
               say: Say = print) -> dict[str, Any]:
    """One record through port and run (only intents of `categories` when given; with `port_only`, the port alone
    and that text as the row's why); the row of the results page."""
    started = time.monotonic()
    row: dict[str, Any] = {"record": source.number, "name": source.name, "folder": source.folder,
                           "published_speedup": source.published_speedup, "ported": False, "not_ported": [],
                           "ran": False, "baseline_step_ms": None, "pending_numerics_ok": 0, "pending_apis": [],
                           "crashed": 0, "npu_kernels_per_step_before": None, "npu_kernels_per_step_after": None,
                           "reference_kernels": {}, "wall_s": None, "why": None, "note": source.note,
                           "overrides": source.overrides_all(), "launch": source.launch()}
    try:
        script = record_script(mirror, source)
    except MirrorError as error:
        row.update(why=f"not in the mirror: {error}", wall_s=0.0)
        return row
    repo = build_repo(work / f"record-{source.number}" / "repo", source, script)
    row.update(port(repo, home))
    say(f"record {source.number}: port {'written' if row['ported'] else 'failed'}, {len(row['not_ported'])} left")
    if port_only:
        row.update(why=port_only, wall_s=round(time.monotonic() - started, 1))
        return row
    run_id = f"record-{source.number}"
    json_path = work / f"record-{source.number}" / "run.json"
    run = run_loop(repo, run_id, home, budget_s=budget_s, max_candidates=max_candidates, gate_rounds=gate_rounds,
                   target="npu", compile_reference=source.reference, say=lambda line: say(f"  r{source.number} {line.strip()}"),
                   extra_args=("--json", str(json_path), *(a for c in categories for a in ("--category", c))))
    summary = summarise(f"record {source.number}", run, repo)
    run_json = json.loads(json_path.read_text(encoding="utf-8")) if json_path.exists() else {}
    baseline_s = (run["state"] or {}).get("baseline_step_s")
    row.update({key: summary[key] for key in ("pending_numerics_ok", "pending_apis", "crashed",
                                               "npu_kernels_per_step_before", "npu_kernels_per_step_after",
                                               "reference_kernels", "change")})
    # ran: the record's baseline was measured on the emulated npu and the run ended without an error
    row.update(ran=baseline_s is not None and run["exit_code"] == 0,
               baseline_step_ms=round(baseline_s * 1000, 1) if baseline_s else None,
               exit_code=run["exit_code"], stop_reason=(run["state"] or {}).get("stop_reason"),
               verdicts=summary["verdicts"], wall_s=round(time.monotonic() - started, 1))
    if not row["ran"]:
        row["why"] = _why(summary, run_json, home / "runs" / run_id / "failure.json")
    if not source.reference:
        row["reference_why"] = source.reference_why
    return row


def run_records(sources: list[RecordSource], mirror: Path, work: Path, home: Path, *, slots: int, budget_s: float,
                max_candidates: int, gate_rounds: int, categories: tuple[str, ...] = (), port_only: str = "",
                say: Say = print) -> list[dict[str, Any]]:
    """Every record in `sources`, `slots` at a time (each run's gates use the run's own `threads`)."""
    def one(source: RecordSource) -> dict[str, Any]:
        return run_record(source, mirror, work, home / f"record-{source.number}", budget_s=budget_s,
                          max_candidates=max_candidates, gate_rounds=gate_rounds, categories=categories,
                          port_only=port_only, say=say)

    with ThreadPoolExecutor(max_workers=max(1, slots)) as pool:
        return list(pool.map(one, sources))


def default_slots() -> int:
    """One record per 4 cores (a run's gate uses 2 threads, its analysis and compile reference more)."""
    return max(1, (os.cpu_count() or 1) // 4)


def pick(records: str) -> list[RecordSource]:
    if not records.strip():
        return list(RECORDS)
    numbers = [int(part) for part in records.split(",") if part.strip()]
    unknown = [n for n in numbers if n not in BY_NUMBER]
    if unknown:
        raise SystemExit(f"unknown record(s) {unknown}: the catalog has {', '.join(str(n) for n in sorted(BY_NUMBER))}")
    return [BY_NUMBER[n] for n in numbers]


def write_results(rows: list[dict[str, Any]], out: Path, argv: list[str], date: str,
                  batches: list[list[str]] | None = None) -> tuple[Path, Path]:
    """<out>.json and <out>.md; `batches`: the argv of every command whose rows are merged here."""
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": date, "argv": argv, "batches": batches or [argv],
               "speed": "NPU speed unmeasured: kernels counted on the emulated npu", "records": rows}
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    json_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(markdown(rows, argv, date, batches), encoding="utf-8")
    return json_path, md_path


def merge(previous: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's rows over an earlier results file's (the benchmark runs in as many sessions as it takes)."""
    if not previous.exists():
        return rows
    kept = {r["record"]: r for r in json.loads(previous.read_text(encoding="utf-8")).get("records") or []}
    kept.update({r["record"]: r for r in rows})
    return [kept[n] for n in sorted(kept)]


def _batches(previous: Path) -> list[list[str]]:
    return json.loads(previous.read_text(encoding="utf-8")).get("batches") or [] if previous.exists() else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", type=Path, required=True, help="a fetched git mirror of KellerJordan/modded-nanogpt "
                        "(bare or not): the records' code is read from it, never copied here")
    parser.add_argument("--records", default="", help="comma-separated record numbers (default: all 20 of the table)")
    parser.add_argument("--slots", type=int, default=default_slots(), help="records run side by side (default: one "
                        "per 4 cores)")
    parser.add_argument("--budget", type=float, default=1800, help="each run's --budget in seconds (default 1800)")
    parser.add_argument("--max-candidates", type=int, default=12, help="each run's --max-candidates (default 12)")
    parser.add_argument("--rounds", type=int, default=6, help="each run's --rounds (default 6)")
    parser.add_argument("--category", action="append", default=[], help="only intents of this category (repeatable; "
                        "default: all)")
    parser.add_argument("--port-only", default="", metavar="WHY", help="only build and port each record (no run); WHY "
                        "is the row's why (e.g. that this session had no time for its run)")
    parser.add_argument("--work", type=Path, default=None, help="keep each record's repository, port and run branches "
                        "here (default: a temporary folder, removed); e.g. for benchmarks/record_kernels.py --patch")
    parser.add_argument("--home", type=Path, default=None, help="TRAINBRIDGE_HOME for the runs (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix "
                        "(default benchmarks/results/<date>-records)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of records not run now from the results "
                        "file already at --out")
    args = parser.parse_args(argv)
    if not (args.mirror / "HEAD").exists() and not (args.mirror / ".git").exists():
        parser.error(f"--mirror {args.mirror}: not a git directory (fetch KellerJordan/modded-nanogpt first)")
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"{date}-records"
    sources = pick(args.records)
    with tempfile.TemporaryDirectory(prefix="trainbridge-records-") as tmp:
        home = args.home or Path(tmp) / "home"
        work = args.work.resolve() if args.work else Path(tmp)
        rows = run_records(sources, args.mirror.resolve(), work, home, slots=args.slots, budget_s=args.budget,
                           max_candidates=args.max_candidates, gate_rounds=args.rounds, categories=tuple(args.category),
                           port_only=args.port_only)
    batches = None
    if args.merge:
        rows, batches = merge(out.with_suffix(".json"), rows), _batches(out.with_suffix(".json")) + [argv]
    for r in rows:
        print(f"record {r['record']}: ran={r['ran']} {r['npu_kernels_per_step_before']} -> "
              f"{r['npu_kernels_per_step_after']} kernels/step, {r['pending_numerics_ok']} verified"
              + (f"; why: {r['why']}" if r.get("why") else ""), flush=True)
    json_path, md_path = write_results(rows, out, argv, date, batches)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
