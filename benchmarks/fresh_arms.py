"""Step time of a workload's variants with a fresh sandboxed child per arm and round, as the gate runs them.

Arms: the original eager program, the original again (the A/A control: the same program in the same
rounds, so its interval says how far two identical arms read apart here), TrainBridge's final branch,
`torch.compile` of the original and `torch.compile` of the branch. Every round runs each arm once, in
a fresh child (sandbox/runner.py `run_workload`, mode "measure": build, warm-up, timed steps), on the
round's seed, in an order from a Williams design (each arm takes each position equally often), so the
machine's drift and carry-over fall on every arm alike, and process-level offsets (memory layout,
allocator state) average out over rounds instead of staying with one arm for the whole measurement,
as they do in persistent workers (speedup.py). Every arm gets the same environment, and the
compiled arms share its Inductor cache folder: the first round compiles cold, later rounds read the
cache (compile time is never in a step time: the warm-up steps take it).

Ratios are the gate's: the median of per-round ratios of round medians, with a bootstrap interval
(`stats.paired_ratio_ci`). "Gap closed" is the share of the eager -> torch.compile step-time gap the
branch closes: (1 - branch/eager) / (1 - compile/eager), with a bootstrap interval over rounds;
undefined when compile is not faster than eager.

    .venv/bin/python benchmarks/fresh_arms.py ORIGINAL_REPO BRANCH_REPO --rounds 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainbridge.agents.profiler.stats import paired_ratio_ci, paired_ratios
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import Workload, load_workload

EAGER, EAGER_AGAIN, BRANCH, COMPILE, BRANCH_COMPILE = "eager", "eager (A/A)", "trainbridge", "compile", "trainbridge+compile"
ARMS = (EAGER, EAGER_AGAIN, BRANCH, COMPILE, BRANCH_COMPILE)
COMPILED = (COMPILE, BRANCH_COMPILE)
# (numerator, denominator): < 1 means the numerator is faster
COMPARISONS = ((EAGER_AGAIN, EAGER), (BRANCH, EAGER), (COMPILE, EAGER), (BRANCH_COMPILE, EAGER), (BRANCH, COMPILE),
               (BRANCH_COMPILE, COMPILE))
BOOTSTRAP = 2000
Say = Callable[[str], None]


class ArmError(RuntimeError):
    """An eager arm failed: no comparison can be made."""


def williams_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The arms' order in each round, cycling through a Williams design (speedup.py's)."""
    from speedup import round_orders

    return round_orders(names, rounds)


def measure_fresh(original: Workload, branch: Workload | None, *, rounds: int, steps: int, backend: str = "cpu",
                  cache_dir: Path | None = None, say: Say = print, rng: random.Random | None = None) -> dict[str, Any]:
    """`rounds` rounds of every arm in a fresh child. `branch` None: no accepted commit, the branch is
    the original (its arms are not run, their ratios to the original are exactly 1 and marked so).
    A compiled arm that fails is reported and left out; an eager arm that fails raises ArmError."""
    rng = rng or random.SystemRandom()
    arms = [EAGER, EAGER_AGAIN, COMPILE] + ([BRANCH, BRANCH_COMPILE] if branch is not None else [])
    programs = {EAGER: original, EAGER_AGAIN: original, COMPILE: original, BRANCH: branch, BRANCH_COMPILE: branch}
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)} if cache_dir is not None else None
    samples: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    failures: dict[str, str] = {}
    orders = williams_orders(arms, rounds)
    with fork_server.serving(fork_server.default_spawn(backend)):
        for index, order in enumerate(orders):
            seed = rng.randrange(1, 2**31 - 1)
            for arm in order:
                if arm in failures:
                    continue
                # the branch under the original's settings, as the gate runs it
                workload = Workload(root=programs[arm].root, config=original.with_overrides(seed=seed, steps=steps).config)
                run = run_workload(workload, backend=backend, mode="measure", extra_request={"compile": arm in COMPILED},
                                   extra_env=env)
                if run.failure is not None or not run.step_times_s:
                    why = f"{run.failure.kind}: {run.failure.message[:300]}" if run.failure else "no measured step"
                    if arm not in COMPILED:
                        raise ArmError(f"the {arm} arm failed in round {index + 1} ({why})")
                    failures[arm] = why
                    samples.pop(arm, None)
                    say(f"  {arm} failed and is left out: {why}")
                    continue
                samples[arm].append(run.step_times_s)
            say(f"  round {index + 1}/{rounds}: " + ", ".join(f"{a} {1000 * statistics.median(samples[a][-1]):.1f} ms"
                                                             for a in arms if a in samples and samples[a]))
    return {"rounds": rounds, "steps_per_round": steps, "orders": orders, "samples": samples, "failures": failures,
            "branch_is_original": branch is None, "design": "fresh child per arm and round (benchmarks/fresh_arms.py)"}


def _resolved(measured: dict[str, Any]) -> dict[str, list[list[float]]]:
    samples = dict(measured["samples"])
    if measured.get("branch_is_original"):
        samples.setdefault(BRANCH, samples[EAGER])
        if COMPILE in samples:
            samples.setdefault(BRANCH_COMPILE, samples[COMPILE])
    return samples


def gap_closed(eager: list[list[float]], branch: list[list[float]], compiled: list[list[float]], *, confidence: float = 0.95,
               seed: int = 0) -> dict[str, Any] | None:
    """Share of the eager -> compile gap the branch closes, (1 - b/e) / (1 - c/e) on the median
    per-round ratios, with a percentile bootstrap over rounds; None when compile is not faster."""
    rb, rc = paired_ratios(eager, branch), paired_ratios(eager, compiled)

    def share(b: list[float], c: list[float]) -> float | None:
        gap = 1.0 - statistics.median(c)
        return None if gap <= 0 else (1.0 - statistics.median(b)) / gap

    point = share(rb, rc)
    if point is None:
        return None
    rng, n, draws = random.Random(seed), len(rb), []
    for _ in range(BOOTSTRAP):
        picks = [rng.randrange(n) for _ in range(n)]
        value = share([rb[i] for i in picks], [rc[i] for i in picks])
        if value is not None:
            draws.append(value)
    draws.sort()
    tail = (1.0 - confidence) / 2.0
    low = draws[int(tail * len(draws))] if draws else float("nan")
    high = draws[min(len(draws) - 1, int((1.0 - tail) * len(draws)))] if draws else float("nan")
    return {"share": point, "ci": [low, high], "confidence": confidence, "defined_in_resamples": len(draws) / BOOTSTRAP}


def summarise(measured: dict[str, Any], *, confidence: float = 0.95) -> dict[str, Any]:
    """Per arm the median of its round medians; per comparison the paired ratio with its interval;
    the gap closed (eager branch against compile of the original)."""
    samples = _resolved(measured)
    medians = {arm: statistics.median(statistics.median(r) for r in rounds) for arm, rounds in samples.items()}
    ratios = {}
    for index, (num, den) in enumerate(COMPARISONS):
        if num in samples and den in samples:
            ratio, low, high = paired_ratio_ci(samples[den], samples[num], confidence=confidence, seed=index)
            ratios[f"{num} / {den}"] = {"ratio": ratio, "ci": [low, high], "confidence": confidence,
                                        "round_ratios": paired_ratios(samples[den], samples[num])}
    gap = None
    if COMPILE in samples:
        gap = gap_closed(samples[EAGER], samples[BRANCH], samples[COMPILE], confidence=confidence)
    return {"median_step_s": medians, "ratios": ratios, "gap_closed": gap, "branch_is_original": measured.get("branch_is_original")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original", type=Path, help="the original workload (a folder with trainbridge.toml)")
    parser.add_argument("branch", type=Path, nargs="?", help="the branch's checkout (default: none, the original itself)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=None, help="Inductor cache folder for the compiled arms")
    parser.add_argument("--out", type=Path, default=None, help="write the samples and summary as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    measured = measure_fresh(load_workload(args.original), load_workload(args.branch) if args.branch else None, rounds=args.rounds,
                             steps=args.steps, cache_dir=args.cache_dir, say=lambda m: print(m, file=sys.stderr, flush=True))
    summary = summarise(measured)
    for name, r in summary["ratios"].items():
        print(f"{name}: {r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]")
    if summary["gap_closed"]:
        g = summary["gap_closed"]
        print(f"gap closed: {100 * g['share']:.0f}% [{100 * g['ci'][0]:.0f}%, {100 * g['ci'][1]:.0f}%]")
    if args.out:
        args.out.write_text(json.dumps({"measured": measured, "summary": summary}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
