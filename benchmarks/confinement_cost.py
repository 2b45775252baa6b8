"""What confining the gate's forked children costs: paired gate rounds with children that confine themselves
(sandbox/child/self_confinement.py) against the same rounds with confinement turned off (TRAINBRIDGE_CONFINE=0),
interleaved, from one warm fork server, in one process.

    .venv/bin/python benchmarks/confinement_cost.py                              # llama_pretrain, 6 pairs
    .venv/bin/python benchmarks/confinement_cost.py --workloads examples/gpt2_pretrain --pairs 4

Each pair runs one round of each arm, the order alternating (confined first, then unconfined first, ...), so the
machine's drift falls on both. A round is exactly a gate's (`gate_cost.timed_round`: the baseline beside an
identical candidate, both alive at once). Prints a markdown table (medians and the confined / unconfined ratio)
and, per child, the time `confine()` itself takes (median of 30 throw-away forks); writes every round's wall time
to benchmarks/results/confinement_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gate_cost import ROOT, timed_round

from trainbridge.agents.profiler.gate import PROBE_STEPS, RoundInputs
from trainbridge.sandbox.child import fork_server, self_confinement
from trainbridge.sandbox.confinement import CONFINE_ENV
from trainbridge.sandbox.workload import load_workload

HERE = Path(__file__).resolve().parent
ARMS = ("confined", "unconfined")


def confine_call_s(forks: int = 30) -> list[float]:
    """How long `confine()` takes in a freshly forked process, `forks` times."""
    folders = [tempfile.mkdtemp(prefix="tb-confine-cost-") for _ in range(3)]
    times = []
    for _ in range(forks):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            started = time.perf_counter()
            self_confinement.confine(folders)
            os.write(write_end, repr(time.perf_counter() - started).encode())
            os._exit(0)
        os.close(write_end)
        times.append(float(os.read(read_end, 64)))
        os.close(read_end)
        os.waitpid(pid, 0)
    return times


def measure(path: Path, pairs: int, rng: random.Random) -> dict:
    workload = load_workload(path)
    config = workload.config
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}

    def draw() -> RoundInputs:
        return RoundInputs.draw(rng, numerics_steps=PROBE_STEPS, warmup=config.warmup_steps, steps=config.steps, index_range=256)

    with fork_server.serving("fork-server") as pool:
        first = timed_round(workload, draw(), "fork-server")  # starts the server
        for i in range(pairs):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                if arm == "unconfined":
                    os.environ[CONFINE_ENV] = "0"
                try:
                    walls[arm].append(timed_round(workload, draw(), arm))
                finally:
                    os.environ.pop(CONFINE_ENV, None)
                print(f"{path.name}: pair {i + 1}/{pairs} {arm}: {walls[arm][-1]:.2f} s (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
        fallbacks = list(pool.fallbacks)
    return {"workload": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "round_wall_s": walls,
            "first_round_s": first, "fork_fallbacks": fallbacks}


def table(entries: list[dict], confine_s: list[float]) -> str:
    lines = ["| workload | paired round, confined (median s) | unconfined (median s) | confined / unconfined | pairs |",
             "|---|---|---|---|---|"]
    for e in entries:
        on, off = (statistics.median(e["round_wall_s"][arm]) for arm in ARMS)
        lines.append(f"| {e['workload']} | {on:.2f} | {off:.2f} | {on / off:.3f} | {len(e['round_wall_s']['confined'])} |")
    lines.append(f"\n`confine()` per forked child: median {statistics.median(confine_s) * 1e3:.1f} ms, "
                 f"max {max(confine_s) * 1e3:.1f} ms over {len(confine_s)} forks")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=Path, nargs="+", default=[ROOT / "examples" / "llama_pretrain"])
    parser.add_argument("--pairs", type=int, default=6, help="interleaved (confined, unconfined) round pairs per workload")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "confinement_cost.json")
    args = parser.parse_args(argv)
    refused = self_confinement.probe([tempfile.gettempdir()])
    if refused is not None:
        raise SystemExit(f"this host does not let a forked child confine itself ({refused}): nothing to measure")
    confine_s = confine_call_s()
    entries = [measure(path, args.pairs, random.Random(11)) for path in args.workloads]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"entries": entries, "confine_call_s": confine_s}, indent=2) + "\n", encoding="utf-8")
    print(table(entries, confine_s))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
