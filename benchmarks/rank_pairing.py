"""Paired or sequential gate rounds for a torchrun group of ranks? A/A rounds of the 2-rank DDP fixture, both ways.

    .venv/bin/python benchmarks/rank_pairing.py                 # 6 rounds of each, interleaved
    .venv/bin/python benchmarks/rank_pairing.py --rounds 3 --nproc 2 --steps 6

Every round runs the same program on both sides, exactly as the gate's rounds run (`gate.run_pair`:
two groups alive at once, 2 x nproc processes, their steps alternated; `gate.run_side` twice: one
group after the other), on the round's fresh seed and batch indices; a paired round and a
sequential round alternate, so the machine's load drifts fall on both. Reported per pairing: the
spread of the A/A step-time ratio (median of B's measured steps / A's; the gate's noise, smaller is
better), the round's wall time, and what the gate's conduct checks (`gate.judge_conduct`) say of
an honest program (must be nothing). Writes benchmarks/results/rank_pairing.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainbridge.agents.profiler import gate
from trainbridge.sandbox.workload import load_workload
from script_repos import ddp_repo

RESULTS = Path(__file__).resolve().parent / "results" / "rank_pairing.json"


def _toml(nproc: int, warmup: int, steps: int) -> str:
    return (f'launch = "torchrun --standalone --nproc_per_node {nproc} train.py --batch_size=4 --block_size=64"\ndata = ["data/"]\n'
            f"warmup_steps = {warmup}\nsteps = {steps}\ntimeout_s = 300\n")


def one_round(workload, rng: random.Random, pairing: str, index: int) -> dict:
    inputs = gate.RoundInputs.draw(rng, numerics_steps=2, warmup=workload.config.warmup_steps, steps=workload.config.steps,
                                   index_range=256)
    started = time.monotonic()
    if pairing == "paired":
        a, b = gate.run_pair((workload, workload), inputs, backend="cpu", extra_env=None, work_dir=None, orphans_to=1)
    else:
        a = gate.run_side(workload, inputs, backend="cpu", extra_env=None, work_dir=None, label="a")
        b = gate.run_side(workload, inputs, backend="cpu", extra_env=None, work_dir=None, label="b")
    wall = time.monotonic() - started
    failures = [side.run.failure.message for side in (a, b) if side.run.failure is not None]
    if failures:
        return {"pairing": pairing, "round": index, "wall_s": wall, "failures": failures}
    findings = gate.judge_conduct(a, b, workload.config.threads, f"round {index}")
    med_a, med_b = statistics.median(a.run.step_times_s), statistics.median(b.run.step_times_s)
    return {"pairing": pairing, "round": index, "wall_s": wall, "ratio": med_b / med_a, "median_a_s": med_a, "median_b_s": med_b,
            "findings": [f.message for f in findings], "cores_a": a.run.watch.cores_used if a.run.watch else None,
            "rank_times_a": (a.run.extra.get("script") or {}).get("ranks", {}).get("step_times_s")}


def summary(rows: list[dict], pairing: str) -> dict:
    done = [r for r in rows if r["pairing"] == pairing and "ratio" in r]
    logs = [math.log(r["ratio"]) for r in done]
    return {"pairing": pairing, "rounds": len(done), "failed": sum(1 for r in rows if r["pairing"] == pairing and "failures" in r),
            "log_ratio_sd": statistics.stdev(logs) if len(logs) > 1 else None,
            "max_abs_log_ratio": max(map(abs, logs)) if logs else None,
            "median_wall_s": statistics.median(r["wall_s"] for r in done) if done else None,
            "median_step_s": statistics.median(r["median_a_s"] for r in done) if done else None,
            "rounds_with_findings": sum(1 for r in done if r["findings"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rng = random.SystemRandom()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tb-rank-pairing-") as tmp:
        repo = ddp_repo(Path(tmp) / "ddp", _toml(args.nproc, args.warmup, args.steps))
        workload = load_workload(repo)
        for index in range(args.rounds):
            for pairing in (("paired", "sequential") if index % 2 == 0 else ("sequential", "paired")):
                rows.append(one_round(workload, rng, pairing, index))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "rank_times_a"}), flush=True)
    result = {"nproc": args.nproc, "warmup": args.warmup, "steps": args.steps, "rows": rows,
              "summary": [summary(rows, p) for p in ("paired", "sequential")]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print("| pairing | rounds | failed | sd of log A/A ratio | max abs log ratio | median round wall | median step | rounds with findings |")
    print("|---|---|---|---|---|---|---|---|")
    for s in result["summary"]:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"| {s['pairing']} | {s['rounds']} | {s['failed']} | {fmt(s['log_ratio_sd'], '.4f')} | {fmt(s['max_abs_log_ratio'], '.4f')} | "
              f"{fmt(s['median_wall_s'], '.1f')} s | {fmt(s['median_step_s'] and s['median_step_s'] * 1e3, '.1f')} ms | "
              f"{s['rounds_with_findings']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
