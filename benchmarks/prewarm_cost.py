"""What a regional-compile gate round costs with its children forked from a plain server or a prewarmed one.

    .venv/bin/python benchmarks/prewarm_cost.py --pairs 5

The candidate is the bundled llama example with its rotary function under `@torch.compile(dynamic=False)`
(what the compile-regional recipe writes), beside the unmodified example. A round is exactly a gate's
(`gate.run_pair`: both children alive at once, the probe, warm-up, measured and cool-down steps), all
children forked from one pool: from a server started with the children's plain environment, or from one
whose environment carries `fork_server.prewarm_env` (the server readies Inductor's imports, cache key and
vector ISA once: sandbox/fork_child.prewarm_inductor). Both servers start, and Inductor's on-disk cache
is filled, in one untimed round each before the timed ones, as in a run whose pool stays warm; then the
two kinds alternate (plain first, then prewarmed first, ...). Prints each round's wall time and the
medians; writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainbridge.agents.profiler.gate import PROBE_STEPS, RoundInputs, run_pair
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_pretrain"
COMPILED = ("def apply_rotary_pos_emb", "@torch.compile(dynamic=False)\ndef apply_rotary_pos_emb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="timed rounds of each kind, alternating")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainbridge-prewarm-cost-") as tmp:
        base, cand = Path(tmp) / "base", Path(tmp) / "cand"
        shutil.copytree(EXAMPLE, base)
        shutil.copytree(EXAMPLE, cand)
        model = cand / "model.py"
        model.write_text(model.read_text(encoding="utf-8").replace(*COMPILED), encoding="utf-8")
        workloads = (load_workload(base), load_workload(cand))
        rng = random.Random(0)
        envs = {"plain": None, "prewarmed": fork_server.prewarm_env([cand])}
        walls: dict[str, list[float]] = {name: [] for name in envs}

        def one_round(name: str) -> float:
            steps = workloads[0].config
            inputs = RoundInputs.draw(rng, numerics_steps=PROBE_STEPS, warmup=steps.warmup_steps, steps=steps.steps, index_range=256)
            started = time.monotonic()
            sides = run_pair(workloads, inputs, backend="cpu", extra_env=envs[name], work_dir=None)
            for side in sides:
                if side.run.failure is not None:
                    raise SystemExit(f"a {name} round failed: {side.run.failure}")
            return time.monotonic() - started

        with fork_server.serving("fork-server") as pool:
            for name in envs:
                print(f"untimed first round, {name}: {one_round(name):.2f} s (server start, Inductor's cache)", flush=True)
            for i in range(args.pairs):
                for name in (("plain", "prewarmed") if i % 2 == 0 else ("prewarmed", "plain")):
                    walls[name].append(one_round(name))
                    print(f"{name}: {walls[name][-1]:.2f} s", flush=True)
            prewarmed = sorted(str(s.prewarmed) for s in pool.servers.values())
    medians = {name: statistics.median(values) for name, values in walls.items()}
    print(f"median round: plain {medians['plain']:.2f} s, prewarmed {medians['prewarmed']:.2f} s, "
          f"ratio {medians['prewarmed'] / medians['plain']:.3f}; servers: {prewarmed}")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "prewarm_cost", "pairs": args.pairs, "round_wall_s": walls, "median_s": medians,
                                        "servers": prewarmed}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
