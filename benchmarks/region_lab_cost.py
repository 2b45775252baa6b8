"""What the region lab costs per candidate: its child forked from the run's warm server, or exec'd.

    .venv/bin/python benchmarks/region_lab_cost.py --workload examples/llama_pretrain --reps 5

One region of the workload (default: llama's RMSNorm.forward, rewritten to `F.rms_norm` in a copy)
is timed by `region_lab.time_region` exactly as the judge node calls it, inside one `warm_scope` (as
a run holds one), alternately with TRAINBRIDGE_GATE_SPAWN=fork-server and =exec, the order swapped
every repetition. The first forked call pays the server's start (torch and the lab imported once);
the later ones are what every further candidate of a run pays. Prints a table; writes JSON with
every wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainbridge.agents.profiler.region_lab import time_region
from trainbridge.records import SourceSpan
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.child.fork_server import SPAWN_ENV, SPAWN_KINDS

HERE = Path(__file__).resolve().parent
RMSNORM = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight"
FUSED = "return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=HERE.parent / "examples" / "llama_pretrain")
    parser.add_argument("--file", default="model.py", help="the file holding the region")
    parser.add_argument("--lines", default="32-33", help="the region's lines (START-END) in --file")
    parser.add_argument("--function", default="forward")
    parser.add_argument("--reps", type=int, default=5, help="calls per spawn kind")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "region_lab_cost.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start, end = (int(n) for n in args.lines.split("-"))
    site = SourceSpan(file=args.file, line_start=start, line_end=end, function=args.function)
    walls: dict[str, list[float]] = {kind: [] for kind in SPAWN_KINDS}
    saved = os.environ.get(SPAWN_ENV)
    with tempfile.TemporaryDirectory(prefix="tb-region-lab-cost-") as tmp:
        base, cand = Path(tmp) / "base", Path(tmp) / "cand"
        shutil.copytree(args.workload, base, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(args.workload, cand, ignore=shutil.ignore_patterns("__pycache__"))
        text = (cand / args.file).read_text(encoding="utf-8")
        if RMSNORM in text:
            (cand / args.file).write_text(text.replace(RMSNORM, FUSED), encoding="utf-8")
        try:
            with fork_server.warm_scope():
                for rep in range(args.reps):
                    for kind in (SPAWN_KINDS if rep % 2 == 0 else SPAWN_KINDS[::-1]):
                        os.environ[SPAWN_ENV] = kind
                        timing = time_region(base, cand, [site])
                        if timing.spawn != kind:
                            raise SystemExit(f"asked for {kind}, the lab's child started as {timing.spawn}: {timing.message}")
                        walls[kind].append(timing.wall_s)
                        print(f"rep {rep + 1}/{args.reps} {kind}: {timing.wall_s:.2f} s ({timing.verdict}, ratio "
                              f"{timing.ratio if timing.ratio is None else round(timing.ratio, 3)})", file=sys.stderr, flush=True)
        finally:
            if saved is None:
                os.environ.pop(SPAWN_ENV, None)
            else:
                os.environ[SPAWN_ENV] = saved
    rows = {kind: {"median_s": statistics.median(w), "first_s": w[0], "later_median_s": statistics.median(w[1:] or w)}
            for kind, w in walls.items()}
    print("| spawn | median s per candidate | first call s | later calls, median s |\n|---|---:|---:|---:|")
    for kind, row in rows.items():
        print(f"| {kind} | {row['median_s']:.2f} | {row['first_s']:.2f} | {row['later_median_s']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "region_lab_cost", "command": "python benchmarks/region_lab_cost.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "workload": str(args.workload), "site": str(site),
              "cpus": os.cpu_count(), "walls_s": walls, "summary": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
