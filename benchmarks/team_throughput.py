"""Candidates judged per hour with 1 and 2 gate slots on this machine (issue 17: `--devices cpu:N`).

    .venv/bin/python benchmarks/team_throughput.py                          # 6 candidates, slots 1 and 2
    .venv/bin/python benchmarks/team_throughput.py --candidates 2 --rounds 2  # a smoke run (a few minutes)

What it measures: the same stream of gates the loop's batch path sends (graph/team/fanout.py), without
the rest of the loop. Each candidate is a copy of the workload (default benchmarks/workloads/mlp)
with a planted 10% slowdown, judged against the workload by the real gate (numerics + interleaved
timing) in a process pinned to one slot (graph/gate_jobs.judge_on_slot), exactly as `trainbridge run
--devices cpu:N` runs it. With N slots, N gates run at once, each on its own cores; the wall time of
the whole stream gives candidates per hour. Every gate must reach the same verdict (slower: the
planted slowdown) whatever the slot count, or the figure is not of a working gate.

On a 2-core machine two slots have one core each, and a CPU gate's work is the CPU's: expect little
gain. On a device host the device does the step; the host cores of a slot only drive it, so an
8-device host's figure is 8 x the one-slot rate times the efficiency measured here for two slots
(printed as the estimate; measure it there with --slots 1,8 and `--devices npu:0-7` to know).
Writes benchmarks/results/team_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: the sibling modules (benchmarks/ is not a package)
    sys.path.insert(0, str(HERE))

RESULTS = HERE / "results"
DEFAULT_WORKLOAD = HERE / "workloads" / "mlp"
SLOWDOWN = 0.10


def judge_stream(baseline: Path, candidates: list[Path], slots: int, rounds: int) -> dict:
    """Judge every candidate against `baseline` with `slots` gates at once; wall time and verdicts."""
    from trainbridge.graph.team.devices import host_slots
    from trainbridge.graph.team.gate_jobs import GateJob, judge_on_slot

    free: queue.Queue = queue.Queue()
    for slot in host_slots(f"cpu:{slots}", target="cpu"):
        free.put(slot)

    def judge(index: int) -> dict:
        slot = free.get()
        try:
            job = GateJob(index=index, candidate={"name": f"planted-{index}"}, baseline_root=str(baseline), baseline_sha="-",
                          candidate_root=str(candidates[index]), candidate_sha="-", target="cpu", rounds=rounds,
                          max_rounds=rounds, min_gain=0.05, slot=slot.index)
            started = time.monotonic()
            verdict = judge_on_slot(job, slot)
            return {"slot": slot.index, "cores": list(slot.cores), "wall_s": round(time.monotonic() - started, 2),
                    "reason": verdict["reason"], "ratio": verdict.get("ratio")}
        finally:
            free.put(slot)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=slots) as pool:
        gates = list(pool.map(judge, range(len(candidates))))
    wall = time.monotonic() - started
    return {"slots": slots, "candidates": len(candidates), "wall_s": round(wall, 1),
            "per_hour": round(len(candidates) * 3600 / wall, 1), "gates": gates}


def main(argv: list[str] | None = None) -> int:
    from gate_calibration import planted_variant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=6, help="gates per slot count (default 6)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per gate (default 6)")
    parser.add_argument("--slots", default="1,2", help="slot counts to measure, comma-separated (default 1,2)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--out", type=Path, default=RESULTS / "team_throughput.json")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.slots.split(",")]
    with tempfile.TemporaryDirectory(prefix="trainbridge-throughput-") as folder:
        candidates = [planted_variant(args.workload, Path(folder) / f"candidate-{i}", SLOWDOWN).root
                      for i in range(args.candidates)]
        runs = []
        for slots in counts:
            print(f"judging {args.candidates} candidates with {slots} slot(s) ...", flush=True)
            runs.append(judge_stream(args.workload.resolve(), candidates, slots, args.rounds))
            print(f"  {runs[-1]['per_hour']} candidates/hour ({runs[-1]['wall_s']} s)", flush=True)
    one = next((r for r in runs if r["slots"] == 1), None)
    rows = ["| slots | candidates | wall (s) | candidates/hour | speed-up | verdicts |", "|---|---|---|---|---|---|"]
    for run in runs:
        gain = f"{run['per_hour'] / one['per_hour']:.2f}x" if one else "n/a"
        verdicts = ", ".join(sorted({g["reason"] for g in run["gates"]}))
        rows.append(f"| {run['slots']} | {run['candidates']} | {run['wall_s']} | {run['per_hour']} | {gain} | {verdicts} |")
    two = next((r for r in runs if r["slots"] == 2), None)
    estimate = None
    if one and two:
        efficiency = two["per_hour"] / (2 * one["per_hour"])
        estimate = round(8 * one["per_hour"] * efficiency, 1)
        rows.append(f"\nPer-slot efficiency with 2 slots: {efficiency:.2f}. An 8-device host by the same measurement "
                    f"(8 x one slot x that efficiency): ~{estimate} candidates/hour; its slots' work is on the devices, "
                    f"so expect an efficiency nearer 1 there than on a 2-core CPU.")
    print("\n".join(rows))
    record = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workload": str(args.workload), "rounds": args.rounds,
              "slowdown_planted": SLOWDOWN, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                        "load_avg": os.getloadavg()},
              "runs": runs, "eight_device_estimate_per_hour": estimate}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    bad = [g for run in runs for g in run["gates"] if g["reason"] not in ("slower", "not_significant")]
    if bad:
        print(f"warning: gates that did not call the planted slowdown slower or not faster: {bad}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
