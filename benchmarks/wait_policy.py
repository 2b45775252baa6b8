"""Does OpenMP's wait policy change what a gate round measures when the machine is not quiet?

    .venv/bin/python benchmarks/wait_policy.py --workload examples/llama_pretrain --reps 3

On a 2-core machine a second busy process beside a measurement can slow a 2-thread step many times
over: OpenMP threads spin-wait at every barrier for a sibling that the kernel has descheduled. This
measures a paired gate round (`gate.run_pair`: the baseline beside itself, exactly as the gate runs
a round) under each OpenMP wait policy (the library default, and OMP_WAIT_POLICY=PASSIVE: idle
threads sleep instead of spinning), on a quiet machine and beside one competing busy process (a
spinning interpreter started by this script, stopped after each round), interleaved: every
repetition runs every (policy, load) cell once, in an order rotated from one repetition to the next.
Each cell runs two pairs: the workload beside itself (A/A: how far two identical arms read apart,
the noise the gate has to see through) and beside a copy planted 5% slower (does the gate read the
5% it is shown?). Per cell: the round's wall time, a side's median step time, the mean and spread
of the log ratio of the two sides' medians.
Prints a markdown table; writes JSON with every sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling benchmark modules (benchmarks/ is not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainbridge.agents.profiler.gate import PROBE_STEPS, RoundInputs, run_pair  # noqa: E402
from trainbridge.sandbox.child import fork_server  # noqa: E402
from trainbridge.sandbox.workload import load_workload  # noqa: E402

HERE = Path(__file__).resolve().parent
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
LOADS = ("quiet", "one busy process")
PLANTED = 0.05  # the second side of the non-A/A pair is this much slower (benchmarks/gate_calibration.py's planted variant)
PAIRS = ("A/A", f"+{100 * PLANTED:g}% planted")


def spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_round(workload, other, inputs: RoundInputs, env: dict[str, str], busy: bool) -> dict:
    competitor = spinner() if busy else None
    try:
        if competitor is not None:
            time.sleep(0.5)  # running before the children start
        started = time.monotonic()
        a, b = run_pair((workload, other), inputs, backend="cpu", extra_env=env or None, work_dir=None, orphans_to=1)
        wall = time.monotonic() - started
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    for side in (a, b):
        if side.run.failure is not None:
            raise SystemExit(f"a round failed: {side.run.failure}")
    ma, mb = statistics.median(a.run.step_times_s), statistics.median(b.run.step_times_s)
    return {"wall_s": wall, "median_step_s": [ma, mb], "aa_ratio": mb / ma, "steps_s": [a.run.step_times_s, b.run.step_times_s],
            "cores": [a.run.watch.cores_used if a.run.watch else None, b.run.watch.cores_used if b.run.watch else None],
            "loadavg": os.getloadavg()[0]}


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, default=HERE.parent / "examples" / "llama_pretrain")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "wait_policy.json")
    args = parser.parse_args(argv)
    import tempfile

    import gate_calibration

    workload = load_workload(args.workload)
    cells = [(p, load, pair) for p in POLICIES for load in LOADS for pair in PAIRS]
    samples: dict[str, list[dict]] = {f"{p} / {load} / {pair}": [] for p, load, pair in cells}
    rng = random.Random()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-wait-policy-") as tmp, \
            fork_server.serving(fork_server.default_spawn("cpu")):
        slow = gate_calibration.planted_variant(workload.root, Path(tmp) / "slow", PLANTED)
        others = {"A/A": workload, f"+{100 * PLANTED:g}% planted": slow}
        for rep in range(args.reps):
            order = cells[rep % len(cells):] + cells[:rep % len(cells)]
            for policy, load, pair in order:
                inputs = RoundInputs.draw(rng, numerics_steps=PROBE_STEPS, warmup=workload.config.warmup_steps, steps=workload.config.steps,
                                          index_range=256)
                result = one_round(workload, others[pair], inputs, POLICIES[policy], load != "quiet")
                samples[f"{policy} / {load} / {pair}"].append(result)
                write_json(args.out, {"workload": str(args.workload), "reps": args.reps, "samples": samples, "status": "incomplete",
                                      "wall_s": time.monotonic() - started})  # a cut run keeps what it measured
                print(f"rep {rep + 1}/{args.reps} {policy:8s} {load:16s} {pair:12s}: round {result['wall_s']:.1f} s, steps "
                      f"{1000 * result['median_step_s'][0]:.0f}/{1000 * result['median_step_s'][1]:.0f} ms, ratio {result['aa_ratio']:.3f}",
                      file=sys.stderr, flush=True)
    rows = []
    for name, runs in samples.items():
        logs = [math.log(r["aa_ratio"]) for r in runs]
        rows.append({"cell": name, "round_wall_s": statistics.median(r["wall_s"] for r in runs),
                     "median_step_ms": 1000 * statistics.median(r["median_step_s"][0] for r in runs),
                     "mean_log_ratio": statistics.fmean(logs), "sd_log_ratio": statistics.stdev(logs) if len(logs) > 1 else None})
    print("| OpenMP wait policy / load / pair | round wall s (median) | first side's step ms (median) | mean log ratio (second / first) "
          "| sd of log ratio |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        sd = f"{row['sd_log_ratio']:.3f}" if row["sd_log_ratio"] is not None else "n/a"
        print(f"| {row['cell']} | {row['round_wall_s']:.1f} | {row['median_step_ms']:.0f} | {row['mean_log_ratio']:+.3f} | {sd} |")
    write_json(args.out, {"workload": str(args.workload), "reps": args.reps, "rows": rows, "samples": samples, "status": "complete",
                          "wall_s": time.monotonic() - started})
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
