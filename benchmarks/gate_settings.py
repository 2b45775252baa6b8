"""Which measured steps per child and which futility threshold the gate should run with, from recorded rounds.

    .venv/bin/python benchmarks/gate_settings.py \
        --from-json benchmarks/results/2026-12-01-gate-calibration-llama-warm.json --steps 8 6 4 3 --futility 0.05 0.1 0.2

Re-decides the A/A rounds that benchmarks/gate_calibration.py recorded (the baseline beside itself, every
measured step of every child kept), exactly as `run_gate` decides (`sequential.replay`), for every pair of
settings: each child cut to its first K measured steps (`gate_calibration.truncated`: what a round of K
measured steps would have timed), `sequential.FUTILITY_POWER` set to F and, with `--round-level`, each side's
per-round level (`stats.round_level`) taken as the median of its steps (the gate's) or the mean of their faster half.
Per combination: the A/A false-accept
rate and mean rounds, and on the shift model (`gate_calibration.decide_shifted`: the candidate side's steps
scaled by 1.05, 1/1.05 and 1/1.02) the power and mean rounds. The cost column is the expected wall time of a
candidate's gate in units of one training step: rounds x (both children's probe, warm-up, K measured and
cool-down steps, plus `--overhead-steps` for each child's start), averaged over the candidate mix of
`--mix` (share of candidates with no effect, a 2% gain, a 5% gain). Offline and deterministic: no measuring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gate_calibration  # noqa: E402  (benchmarks/ is not a package)

from trainbridge.agents.profiler import sequential, stats  # noqa: E402
from trainbridge.agents.profiler.gate import PROBE_STEPS, gate_warmup  # noqa: E402

SHIFTS = ((1.05, "5% slowdown"), (1 / 1.05, "5% gain"), (1 / 1.02, "2% gain"))
ROUND_LEVELS = {"median": stats.round_level, "faster-half": lambda steps: statistics.fmean(sorted(steps)[: (len(steps) + 1) // 2])}
# the gate's, and one it did not take: the faster half reads a candidate that alternates fast and slow steps as fast (stats.py)


def rates(record: dict, args, gates: int) -> dict:
    """A/A and shift-model outcomes of `gates` resampled gate runs each, at the module's current settings."""
    rounds = record["rounds"]
    aa = gate_calibration.decide_resampled(rounds, args, [], gates)["A/A"]
    out = {"aa_accept": _share(aa, "accepted"), "aa_rounds": _mean_rounds(aa)}
    shifted = gate_calibration.decide_shifted(rounds, args, gates, shifts=SHIFTS)
    for _, label in SHIFTS:
        items = shifted[label]
        wanted = "slower" if "slowdown" in label else "accepted"
        out[f"{label} power"] = _share(items, wanted)
        out[f"{label} rounds"] = _mean_rounds(items)
    return out


def _share(items: list[dict], outcome: str) -> float:
    return sum(i["outcome"] == outcome for i in items) / len(items)


def _mean_rounds(items: list[dict]) -> float:
    return sum(i["rounds_used"] for i in items) / len(items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-json", type=Path, required=True, help="a gate_calibration.py recording (A/A rounds, every step)")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 6, 4], help="measured steps per child to try")
    parser.add_argument("--futility", type=float, nargs="+", default=[sequential.FUTILITY_POWER],
                        help="sequential.FUTILITY_POWER values to try")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-rounds", type=int, default=20)
    parser.add_argument("--gates", type=int, default=400, help="resampled gate runs per condition")
    parser.add_argument("--round-level", nargs="+", choices=sorted(ROUND_LEVELS), default=["median"],
                        help="a side's step time in a round: the median of its steps (the gate's) or the mean of their faster half")
    parser.add_argument("--warmup", type=int, default=2, help="the workload's warm-up steps (the probe's steps count towards them)")
    parser.add_argument("--probe-steps", type=int, default=PROBE_STEPS, help="the probe's training steps per child (run_gate's numerics_steps)")
    parser.add_argument("--overhead-steps", type=float, default=1.0, help="a child's start and files, in steps (llama, 0.22 s steps: "
                        "~0.2 s from fork to ready, the probe ~0.3 s past its steps, so 1-2)")
    parser.add_argument("--mix", type=float, nargs=3, default=[0.5, 0.25, 0.25], metavar=("NONE", "GAIN2", "GAIN5"),
                        help="share of candidates with no effect, a 2%% gain and a 5%% gain (an assumed mix: the demo judged 9, 6 not "
                        "significant and 3 accepted)")
    parser.add_argument("--min-gain", type=float, default=0.01)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    recorded = json.loads(args.from_json.read_text(encoding="utf-8"))
    rows = []
    saved = sequential.FUTILITY_POWER, stats.round_level
    try:
        for level in args.round_level:
            stats.round_level = ROUND_LEVELS[level]  # stats.round_levels, which every decision goes through, looks it up per call
            for steps in args.steps:
                record = gate_calibration.truncated(recorded, steps)
                for futility in args.futility:
                    sequential.FUTILITY_POWER = futility
                    figures = rates(record, args, args.gates)
                    per_round = 2 * (args.probe_steps + gate_warmup(args.warmup, args.probe_steps) + steps + 1 + args.overhead_steps)
                    none, gain2, gain5 = args.mix
                    rounds = none * figures["aa_rounds"] + gain2 * figures["2% gain rounds"] + gain5 * figures["5% gain rounds"]
                    rows.append({"round_level": level, "steps": steps, "futility": futility, **figures, "step_units_per_round": per_round,
                                 "expected_rounds": rounds, "expected_cost_steps": rounds * per_round})
                    print(_row(rows[-1]), flush=True)
    finally:
        sequential.FUTILITY_POWER, stats.round_level = saved
    baseline = rows[0]
    print()
    print("| round level | measured steps | futility | A/A accepted | A/A rounds | power 5% slower | power 5% gain | power 2% gain | rounds (mix) "
          "| cost, steps | cost / first row |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['round_level']} | {r['steps']} | {r['futility']:g} | {r['aa_accept']:.1%} | {r['aa_rounds']:.1f} | {r['5% slowdown power']:.0%} | "
              f"{r['5% gain power']:.0%} | {r['2% gain power']:.0%} | {r['expected_rounds']:.1f} | {r['expected_cost_steps']:.0f} | "
              f"{r['expected_cost_steps'] / baseline['expected_cost_steps']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "gate_settings", "from_json": str(args.from_json), "settings": vars(args) | {
            "from_json": str(args.from_json), "out": str(args.out)}, "rows": rows}, indent=1), encoding="utf-8")
        print(f"JSON: {args.out}")
    return 0


def _row(r: dict) -> str:
    return (f"{r['round_level']}, steps {r['steps']} futility {r['futility']:g}: A/A accept {r['aa_accept']:.3f} rounds {r['aa_rounds']:.1f}; power 5% slower "
            f"{r['5% slowdown power']:.2f}, 5% gain {r['5% gain power']:.2f} ({r['5% gain rounds']:.1f} rounds), 2% gain "
            f"{r['2% gain power']:.2f} ({r['2% gain rounds']:.1f} rounds); cost {r['expected_cost_steps']:.0f} steps")


if __name__ == "__main__":
    sys.exit(main())
