"""What a gate round costs with each way of starting its children: forked from a warm server, or exec'd.

    .venv/bin/python benchmarks/gate_cost.py                                   # llama_pretrain and resnet_classify
    .venv/bin/python benchmarks/gate_cost.py --workloads examples/gpt2_pretrain --pairs 5

For each workload, `--pairs` times: one paired gate round with exec'd children and one with forked
children, in alternating order (exec first, then fork first, ...), so that the machine's drift falls
on both. A round is exactly a gate's (`gate.run_pair`: the baseline beside an identical candidate,
both alive at once; the numerics probe, warm-up, measured and cool-down steps timed by this
process, the parameters' changes). The fork-server pool stays open across the workload's fork
rounds, as it does across one gate's rounds; its first round, which starts the server (interpreter
and `import torch` once), is reported apart. Per judged candidate, the estimate is: the first round
with the server start, plus the drift child (one more single child), plus the later rounds at the
median round cost, for the mean rounds the sequential rule used in the calibration (`--mean-rounds`).
Prints a markdown table; writes JSON with every round's wall time to benchmarks/results/gate_cost.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from trainbridge.agents.profiler.gate import PROBE_STEPS, RoundInputs, run_pair, run_side
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.workload import load_workload

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_WORKLOADS = [ROOT / "examples" / "llama_pretrain", ROOT / "examples" / "resnet_classify"]


def timed_round(workload, inputs: RoundInputs, kind: str) -> float:
    """One paired gate round (baseline beside itself); its wall time. A failure is an error here."""
    started = time.monotonic()
    a, b = run_pair((workload, workload), inputs, backend="cpu", extra_env=None, work_dir=None, orphans_to=1)
    wall = time.monotonic() - started
    for side in (a, b):
        if side.run.failure is not None:
            raise SystemExit(f"{workload.root.name}: a {kind} round failed: {side.run.failure}")
    return wall


def timed_single(workload, inputs: RoundInputs) -> float:
    """One single gate child (what the drift check adds once per gate)."""
    started = time.monotonic()
    side = run_side(workload.with_overrides(threads=1), inputs, backend="cpu", extra_env=None, work_dir=None, label="reference")
    if side.run.failure is not None:
        raise SystemExit(f"{workload.root.name}: a single child failed: {side.run.failure}")
    return time.monotonic() - started


def measure_workload(path: Path, pairs: int, rng: random.Random, *, steps: int | None, warmup: int | None, singles: bool) -> dict:
    workload = load_workload(path).with_overrides(steps=steps, warmup_steps=warmup)
    config = workload.config

    def draw() -> RoundInputs:
        return RoundInputs.draw(rng, numerics_steps=PROBE_STEPS, warmup=config.warmup_steps, steps=config.steps, index_range=256)

    walls: dict[str, list[float]] = {"exec": [], "fork-server": []}
    children: dict[str, list[float]] = {"exec": [], "fork-server": []}
    first_fork = None
    with fork_server.serving("fork-server") as pool:
        assert pool is not None
        first_fork = timed_round(workload, draw(), "fork-server")  # starts the server
        print(f"{path.name}: first fork-server round (server start included) {first_fork:.1f} s", file=sys.stderr, flush=True)
        for i in range(pairs):
            for kind in (("exec", "fork-server") if i % 2 == 0 else ("fork-server", "exec")):
                inputs = draw()
                with fork_server.exec_only() if kind == "exec" else contextlib.nullcontext():  # the pool stays open
                    walls[kind].append(timed_round(workload, inputs, kind))
                    if singles:
                        children[kind].append(timed_single(workload, inputs))
                print(f"{path.name}: pair {i + 1}/{pairs} {kind}: round {walls[kind][-1]:.1f} s"
                      + (f", single child {children[kind][-1]:.1f} s" if singles else "") + f" (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
        fallbacks = list(pool.fallbacks)
    return {"workload": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "steps": config.steps,
            "warmup_steps": config.warmup_steps, "round_wall_s": walls, "single_child_wall_s": children,
            "first_fork_round_s": first_fork, "fork_fallbacks": fallbacks}


def per_candidate(entry: dict, kind: str, mean_rounds: float) -> float:
    """Estimated wall per judged candidate: first round (+ server start for the fork server), the drift
    child, then the later rounds at the median round cost."""
    round_s = statistics.median(entry["round_wall_s"][kind])
    first = entry["first_fork_round_s"] if kind == "fork-server" else round_s
    single = entry["single_child_wall_s"][kind]
    drift = statistics.median(single) if single else round_s  # not measured: counted as one more round (it is one child, not two)
    return first + drift + (mean_rounds - 1) * round_s


def table(entries: list[dict], mean_rounds: float) -> str:
    lines = ["| workload | round, exec (median s) | round, fork server (median s) | fork / exec | first fork round (server start) | "
             f"per judged candidate at {mean_rounds:g} rounds, exec | ... fork server |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        ex, fk = statistics.median(e["round_wall_s"]["exec"]), statistics.median(e["round_wall_s"]["fork-server"])
        lines.append(f"| {e['workload']} | {ex:.2f} | {fk:.2f} | {fk / ex:.2f} | {e['first_fork_round_s']:.2f} | "
                     f"{per_candidate(e, 'exec', mean_rounds):.0f} s | {per_candidate(e, 'fork-server', mean_rounds):.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=Path, nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--pairs", type=int, default=4, help="interleaved (exec, fork-server) round pairs per workload")
    parser.add_argument("--mean-rounds", type=float, default=10.4,
                        help="rounds per judged candidate (the sequential rule's mean in the offline llama calibration)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per child (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per child (default: the workload's)")
    parser.add_argument("--no-singles", action="store_true", help="skip the single (drift) child of each pair")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gate_cost.json")
    args = parser.parse_args(argv)
    rng = random.Random()
    record = {"benchmark": "gate_cost", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_start": os.getloadavg(),
              "cpus": os.cpu_count(), "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup, "mean_rounds": args.mean_rounds, "workloads": []}
    for path in args.workloads:
        record["workloads"].append(measure_workload(path.resolve(), args.pairs, rng, steps=args.steps, warmup=args.warmup,
                                                    singles=not args.no_singles))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    record["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(table(record["workloads"], args.mean_rounds))
    print(f"\nload average start {record['loadavg_start']}, end {record['loadavg_end']}; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
