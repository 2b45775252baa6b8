"""One process against 2 torchrun ranks: the gpt2_pretrain example's data-parallel variant in script mode.

    .venv/bin/python benchmarks/ranks_scaling.py                  # 4 rounds x 8 steps
    .venv/bin/python benchmarks/ranks_scaling.py --rounds 2 --steps 4 --nproc 2

`examples/gpt2_pretrain/train_ddp.py` runs unmodified, as its README launches it: `python
train_ddp.py` (one process, the run's threads) and `torchrun --standalone --nproc_per_node N
train_ddp.py` (N gloo ranks sharing those threads), each in a fresh sandbox per round, the order
alternating from round to round. Reported per variant: the median step the gate would judge (for
the group: the slowest rank's, on the parent's clock), each rank's own median, and how often each
rank was the slowest. On a 2-core CPU two ranks do twice the work per step (each its own batch)
on the same cores plus the gradient all-reduce, so the group's step is expected near 2x the one
process's; the figure to watch is how much more than that the all-reduce and the ranks' waiting
cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt2_pretrain"


def _variants(nproc: int) -> dict[str, str]:
    return {"one process": "python train_ddp.py --steps 1000",
            f"{nproc} ranks": f"torchrun --standalone --nproc_per_node {nproc} train_ddp.py --steps 1000"}


def measure(*, rounds: int, steps: int, nproc: int = 2, say: Callable[[str], None] = print) -> dict:
    from trainbridge.sandbox.runner import run_workload
    from trainbridge.sandbox.workload import workload_for_launch

    rows = []
    with tempfile.TemporaryDirectory(prefix="tb-ranks-") as tmp:
        repo = Path(tmp) / "gpt2_pretrain"
        shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", "trainbridge.toml"))
        variants = _variants(nproc)
        names = list(variants)
        for index in range(rounds):
            for name in (names if index % 2 == 0 else names[::-1]):
                workload = workload_for_launch(repo, variants[name])
                workload = workload.with_overrides(warmup_steps=2, steps=steps, timeout_s=600)
                result = run_workload(workload)
                if result.failure is not None:
                    raise RuntimeError(f"{name}: {result.failure.kind}: {result.failure.message}")
                ranks = (result.extra.get("script") or {}).get("ranks") or {}
                rows.append({"variant": name, "round": index, "median_s": statistics.median(result.step_times_s),
                             "step_times_s": result.step_times_s, "rank_step_times_s": ranks.get("step_times_s"),
                             "slowest_rank": ranks.get("slowest_rank"), "cores_used": result.watch.cores_used if result.watch else None})
                say(f"round {index} {name}: median step {rows[-1]['median_s'] * 1e3:.1f} ms")
    return {"nproc": nproc, "rounds": rounds, "steps": steps, "launch": _variants(nproc), "rows": rows, "markdown": markdown(rows)}


def markdown(rows: list[dict]) -> str:
    lines = ["| variant | rounds | median step (the gate's) | per-rank medians | slowest rank (share of steps) |", "|---|---|---|---|---|"]
    base = None
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        median = statistics.median(r["median_s"] for r in mine)
        base = base or median
        per_rank, shares = "-", "-"
        if mine[0]["rank_step_times_s"]:
            world = len(mine[0]["rank_step_times_s"])
            per_rank = ", ".join(f"rank {k} {statistics.median(t for r in mine for t in r['rank_step_times_s'][k]) * 1e3:.1f} ms"
                                 for k in range(world))
            slowest = [s for r in mine for s in r["slowest_rank"]]
            shares = ", ".join(f"rank {k} {slowest.count(k) / len(slowest):.0%}" for k in range(world))
        lines.append(f"| {name} | {len(mine)} | {median * 1e3:.1f} ms ({median / base:.2f}x) | {per_rank} | {shares} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    record = measure(rounds=args.rounds, steps=args.steps, nproc=args.nproc, say=lambda m: print(m, file=sys.stderr, flush=True))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(record["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
