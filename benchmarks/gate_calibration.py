"""How often the speed gate is fooled, and how often it catches a real slowdown.

    .venv/bin/python benchmarks/gate_calibration.py                       # 8 gate runs x 10 rounds
    .venv/bin/python benchmarks/gate_calibration.py --gates 4 --rounds 6  # quicker, coarser

Conditions, measured on one workload (default benchmarks/workloads/mlp) and its variants with a
planted slowdown (every step spins for a fixed fraction of its own real work time, so the variant is
(1 + f)x slower whatever the machine's load):

- A/A: identical code on both sides. The gate must not accept (target: < 5% of gate runs).
- +2%, +5%, +10% slowdown as the candidate: the gate should call it slower (target at 5%: >= 80%).
- -5% (the +5% variant as the baseline, the original as the candidate, a ratio of 1/1.05): the
  gate should accept a real gain of that size.
- An exact 5% slowdown and gain on the machine's own noise: the A/A rounds with the candidate
  side's steps scaled by 1.05 and 1/1.05 (`decide_shifted`), for when a planted variant does not
  read its nominal size.

Design: every round runs fresh sandbox children exactly as the gate's are run (`gate.run_pair` or
`gate.run_side`: probe, then parent-timed steps), all on the round's seed and batch indices. Under
the gate's default pairing on the CPU ("paired"), a round pairs the baseline with each other program
in turn (baseline again, +2%, +5%, +10%: two children alive at once, their steps alternated, the
baseline leading on even rounds as the gate's does); under "sequential", every program runs once,
in an order rotated from round to round. Consecutive blocks of ``--rounds`` rounds form independent
gate runs; each is decided by the sequential rule exactly as `run_gate` decides (`sequential.replay`
feeds the recorded rounds to the gate's own `SequentialGate`). Rates over sliding windows of rounds are reported too (more decisions, but overlapping, so not
independent), and one decision over all rounds pooled (what a gate of that many rounds would
say). Prints markdown tables, writes JSON (raw samples included) to
benchmarks/results/gate_calibration.json after every round, so a killed run keeps its data;
``--from-json`` re-decides saved samples (e.g. with another ``--rounds``) without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainbridge.agents.profiler.gate import PAIRINGS, PROBE_STEPS, RoundInputs, default_pairing, run_pair, run_side
from trainbridge.agents.profiler.quiet import busy_rounds
from trainbridge.agents.profiler.sequential import FUTILITY_POWER, look_levels, looks, replay
from trainbridge.agents.profiler.stats import SpeedOutcome, decide_speed
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.child.fork_server import SPAWN_KINDS, default_spawn
from trainbridge.sandbox.workload import Workload, load_workload

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_WORKLOAD = HERE / "workloads" / "mlp"


PLANTED_MODULE = "tb_planted_slowdown"
PLANTED_WRAPPER = '''"""Written by benchmarks/gate_calibration.py: the workload's own entry, its train_step made
(1 + SLOWDOWN) times slower by spinning for SLOWDOWN times the time its real work took."""
import importlib
import time

SLOWDOWN = {slowdown!r}
ENTRY = {entry!r}


def entry(device, seed):
    module, function = ENTRY.split(":")
    parts = getattr(importlib.import_module(module), function)(device=device, seed=seed)
    step = parts["train_step"]

    def train_step(model, optimizer, batch):
        started = time.perf_counter()
        loss = step(model, optimizer, batch)
        float(loss.detach()) if hasattr(loss, "detach") else None  # the work is done (synchronised) before the spin
        until = time.perf_counter() + SLOWDOWN * (time.perf_counter() - started)
        while time.perf_counter() < until:
            pass
        return loss

    return {{**parts, "train_step": train_step}}
'''


def planted_variant(source: Path, dest: Path, slowdown: float) -> Workload:
    """A copy of `source` that is (1 + `slowdown`)x slower (the candidate worktree of a 'rewrite').
    A workload whose step.py defines `SLOWDOWN = ...` gets that value; any other gets a wrapper
    module around its entry, named as the entry in the copy's trainbridge.toml."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    step = dest / "step.py"
    if step.is_file() and re.search(r"^SLOWDOWN = .*$", step.read_text(encoding="utf-8"), flags=re.M):
        text = re.sub(r"^SLOWDOWN = .*$", f"SLOWDOWN = {slowdown!r}", step.read_text(encoding="utf-8"), count=1, flags=re.M)
        step.write_text(text, encoding="utf-8")
        return load_workload(dest)
    workload = load_workload(dest)
    if workload.config.mode != "entry":
        raise SystemExit(f"{source}: planting a slowdown needs an entry = \"module:function\" workload")
    (dest / f"{PLANTED_MODULE}.py").write_text(PLANTED_WRAPPER.format(slowdown=slowdown, entry=workload.config.entry), encoding="utf-8")
    toml = dest / "trainbridge.toml"
    text, count = re.subn(r"^entry\s*=.*$", f'entry = "{PLANTED_MODULE}:entry"', toml.read_text(encoding="utf-8"), flags=re.M)
    if count != 1:
        raise SystemExit(f"{toml}: expected one 'entry = ...' line to redirect")
    toml.write_text(text, encoding="utf-8")
    return load_workload(dest)


def write_json(path: Path, record: dict) -> None:
    """Atomically: a reader (or a killed run) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    tmp.replace(path)


def _inputs(programs: dict[str, Workload], seed: int, steps: int) -> RoundInputs:
    return RoundInputs.draw(random.Random(seed), numerics_steps=PROBE_STEPS, warmup=next(iter(programs.values())).config.warmup_steps,
                            steps=steps, index_range=256)


def _times(side, name: str) -> list[float]:
    if side.run.failure is not None or not side.run.step_times_s:
        raise SystemExit(f"{name} failed in a calibration round: {side.run.failure}")
    return side.run.step_times_s


def _cores(side) -> float | None:
    return side.run.watch.cores_used if side.run.watch is not None else None


def run_round(programs: dict[str, Workload], order: list[str], seed: int, steps: int,
              backend: str) -> tuple[dict[str, list[float]], dict[str, float | None]]:
    """One sequential round: every program once, in a gate child exactly as `run_gate` runs each side
    under sequential pairing (the probe, then warm-up, measured and cool-down steps on the round's
    batch indices, timed by this process). Returns the step times and the cores of each program."""
    inputs = _inputs(programs, seed, steps)
    samples, cores = {}, {}
    for name in order:
        side = run_side(programs[name], inputs, backend=backend, extra_env=None, work_dir=None, label="baseline")
        samples[name], cores[name] = _times(side, name), _cores(side)
    return samples, cores


def run_paired_round(programs: dict[str, Workload], index: int, seed: int, steps: int, backend: str) -> dict[str, dict[str, list[float]]]:
    """One paired round, exactly as `run_gate` pairs its sides: "base" beside every other program in
    turn (two children alive at once, steps alternated), "base" leading on even rounds (the gate's
    baseline leads on even rounds). All pairs of a round share its seed and batch indices."""
    inputs = _inputs(programs, seed, steps)
    pairs = {}
    for name in [n for n in programs if n != "base"]:
        lead_base = index % 2 == 0
        first, second = ("base", name) if lead_base else (name, "base")
        a, b = run_pair((programs[first], programs[second]), inputs, backend=backend, extra_env=None, work_dir=None,
                        orphans_to=1 if lead_base else 0)
        pairs[name] = {first: _times(a, first), second: _times(b, second), "cores": {first: _cores(a), second: _cores(b)},
                       "confined": {first: a.run.confined, second: b.run.confined}}
    return pairs


def confinement_line(rounds: list[dict]) -> str:
    """How many of the recorded children ran confined (bubblewrap's namespaces or the forked child's own)."""
    flags = [flag for r in rounds for pair in (r.get("pairs") or {}).values() for flag in (pair.get("confined") or {}).values()]
    if not flags:
        return "not recorded"
    return f"{sum(flags)} of {len(flags)}"


def round_sides(round_record: dict, base: str, cand: str) -> tuple[list[float], list[float], float | None]:
    """The two sides of a condition in one round (from the same pair when the round was paired),
    and the cores the condition's baseline got over its timed steps (None: not recorded)."""
    if "pairs" in round_record:
        pair = round_record["pairs"][cand if base == "base" else base]
        return pair[base], pair[cand], (pair.get("cores") or {}).get(base)
    return round_record["samples"][base], round_record["samples"][cand], (round_record.get("cores") or {}).get(base)


def truncated(record: dict, steps: int) -> dict:
    """`record` with every side of every round cut to its first `steps` measured steps."""
    def cut(value):
        return value[:steps] if isinstance(value, list) else value

    rounds = []
    for r in record["rounds"]:
        if "pairs" in r:
            pairs = {name: {side: cut(times) for side, times in pair.items()} for name, pair in r["pairs"].items()}
            rounds.append({**r, "pairs": pairs})
        else:
            rounds.append({**r, "samples": {name: cut(times) for name, times in r["samples"].items()}})
    config = {**record["config"], "steps_per_round": steps, "truncated_from": record["config"]["steps_per_round"]}
    return {**record, "config": config, "rounds": rounds}


def conditions(slowdowns: list[float]) -> list[tuple[str, str, str, float]]:
    """(label, baseline program, candidate program, true ratio)."""
    out = [("A/A", "base", "base_again", 1.0)]
    out += [(f"+{100 * f:g}% slower", "base", f"slow_{f:g}", 1.0 + f) for f in slowdowns]
    if 0.05 in slowdowns:
        out.append(("-4.8% (5% gain)", "slow_0.05", "base", 1.0 / 1.05))
    return out


def decide_window(window: list[tuple[list[float], list[float], float | None]], args) -> dict:
    """One gate run over recorded rounds, decided exactly as `run_gate` decides: the sequential rule
    (`sequential.replay`: a look at 6, 8, ... kept rounds, busy rounds left out, stopping at the
    first look that decides or shows futility)."""
    gate = replay([b for b, _, _ in window], [c for _, c, _ in window], [k for _, _, k in window], rounds=args.rounds,
                  max_rounds=args.max_rounds, min_gain=args.min_gain, confidence=args.confidence)
    d = gate.decision
    if d is None:  # the rounds ran out before the rule stopped (busy rounds): decided over what there is
        d = decide_speed(*gate.kept(), args.min_gain, args.confidence)
    return {"outcome": d.outcome.value, "ratio": d.ratio, "ci": [d.ci_low, d.ci_high], "rounds_used": len(gate.baseline_rounds),
            "looks": len(gate.looks_taken), "stopped": gate.stopped or "rounds ran out", "busy_rounds": gate.busy}


def decide_blocks(rounds: list[dict], block: int, args, slowdowns: list[float], sliding: bool,
                  sequential: bool = True) -> dict[str, list[dict]]:
    """Decide every block of `block` rounds per condition: as `run_gate` does (`sequential`), or as
    one decision over the whole block (the pooled figure)."""
    starts = range(0, len(rounds) - block + 1) if sliding else range(0, len(rounds) - block + 1, block)
    decisions: dict[str, list[dict]] = {}
    for label, base, cand, truth in conditions(slowdowns):
        for start in starts:
            window = [round_sides(r, base, cand) for r in rounds[start:start + block]]
            if sequential:
                item = decide_window(window, args)
            else:
                busy = set(busy_rounds([cores for _, _, cores in window], block))
                d = decide_speed([b for i, (b, _, _) in enumerate(window) if i not in busy],
                                 [c for i, (_, c, _) in enumerate(window) if i not in busy], args.min_gain, args.confidence, seed=start)
                item = {"outcome": d.outcome.value, "ratio": d.ratio, "ci": [d.ci_low, d.ci_high], "rounds_used": len(window),
                        "busy_rounds": sorted(busy)}
            decisions.setdefault(label, []).append({"start": start, "truth": truth, **item})
    return decisions


def decide_consecutive(rounds: list[dict], args, slowdowns: list[float]) -> dict[str, list[dict]]:
    """Independent gate runs as a live sequence of gates would make them: each starts where the last
    one stopped (a gate that stops early leaves its rounds to the next); a last gate the recorded
    rounds cannot finish is left out."""
    decisions: dict[str, list[dict]] = {}
    for label, base, cand, truth in conditions(slowdowns):
        start = 0
        while start < len(rounds):
            window = [round_sides(r, base, cand) for r in rounds[start:start + args.max_rounds]]
            item = decide_window(window, args)
            if item["stopped"] == "rounds ran out":
                break
            decisions.setdefault(label, []).append({"start": start, "truth": truth, **item})
            start += item["rounds_used"]
    return decisions


def decide_resampled(rounds: list[dict], args, slowdowns: list[float], gates: int, seed: int = 0) -> dict[str, list[dict]]:
    """`gates` simulated gate runs per condition, each on `max_rounds` rounds drawn with replacement
    from the recorded ones (a round is the unit: both sides of a pair stay together), decided as
    `run_gate` decides. More decisions than the windows, for the rates and the mean rounds used;
    not independent measurements (they reuse the recorded rounds)."""
    decisions: dict[str, list[dict]] = {}
    for label, base, cand, truth in conditions(slowdowns):
        rng = random.Random(seed)
        for g in range(gates):
            window = [round_sides(rounds[rng.randrange(len(rounds))], base, cand) for _ in range(args.max_rounds)]
            decisions.setdefault(label, []).append({"start": g, "truth": truth, **decide_window(window, args)})
    return decisions


SHIFTS = ((1.05, "A/A, candidate x 1.05 (a true 5% slowdown)"), (1 / 1.05, "A/A, candidate / 1.05 (a true 5% gain)"))


def decide_shifted(rounds: list[dict], args, gates: int, seed: int = 0,
                   shifts: tuple[tuple[float, str], ...] = SHIFTS) -> dict[str, list[dict]]:
    """Power at a known effect on this machine's own noise: the recorded A/A rounds (the baseline beside
    itself), every candidate-side step multiplied by a factor (`SHIFTS`), `gates` resampled gate runs
    each, decided as `run_gate` decides. A shift model: the effect is exact, the noise is measured
    (unlike the planted variants, whose spin is a second program with noise of its own)."""
    decisions: dict[str, list[dict]] = {}
    for factor, label in shifts:
        rng = random.Random(seed)
        for g in range(gates):
            window = []
            for _ in range(args.max_rounds):
                base, cand, cores = round_sides(rounds[rng.randrange(len(rounds))], "base", "base_again")
                window.append((base, [t * factor for t in cand], cores))
            decisions.setdefault(label, []).append({"start": g, "truth": factor, **decide_window(window, args)})
    return decisions


def summarise(decisions: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for label, items in decisions.items():
        n = len(items)
        count = {o.value: sum(i["outcome"] == o.value for i in items) for o in SpeedOutcome}
        rows.append({
            "condition": label,
            "true_ratio": items[0]["truth"] if items else None,
            "gate_runs": n,
            "accepted": count["accepted"] / n if n else None,
            "slower": count["slower"] / n if n else None,
            "not_significant": count["not_significant"] / n if n else None,
            "median_ratio": statistics.median(i["ratio"] for i in items) if n else None,
            "median_ci_halfwidth": statistics.median((i["ci"][1] - i["ci"][0]) / 2 for i in items) if n else None,
            "mean_rounds": statistics.fmean(i["rounds_used"] for i in items) if n else None,
            "stopped_for_futility": sum(i.get("stopped") == "futility" for i in items) / n if n else None,
        })
    return rows


def table(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| condition | true ratio | gate runs | accepted | slower | not significant | mean rounds used | futility stops | median ratio | median CI half-width |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["gate_runs"]:
            continue
        lines.append(f"| {r['condition']} | {r['true_ratio']:.3f} | {r['gate_runs']} | {100 * r['accepted']:.0f}% | "
                     f"{100 * r['slower']:.0f}% | {100 * r['not_significant']:.0f}% | {r['mean_rounds']:.1f} | "
                     f"{100 * (r.get('stopped_for_futility') or 0):.0f}% | "
                     f"{r['median_ratio']:.3f} | "
                     f"±{100 * r['median_ci_halfwidth']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--gates", type=int, default=8, help="independent gate runs per condition")
    parser.add_argument("--rounds", type=int, default=10, help="as run_gate's rounds: the looks start at 6 (or at this, when fewer)")
    parser.add_argument("--max-rounds", type=int, default=None,
                        help="the sequential rule's last look (default: twice --rounds, as `trainbridge run`); the "
                             "measurement takes --gates x this many rounds")
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[0.02, 0.05, 0.10])
    parser.add_argument("--min-gain", type=float, default=0.01)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--pairing", choices=PAIRINGS, default=None,
                        help="how a round's sides run, as the gate does (default: the gate's default for --backend)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gate_calibration.json")
    parser.add_argument("--from-json", type=Path, default=None, help="re-decide the samples saved in this JSON; no measuring")
    parser.add_argument("--truncate-steps", type=int, default=None,
                        help="with --from-json: re-decide as if each round had measured only its first K steps (what a "
                             "round of K measured steps would have timed: the same warm-up, then the first K)")
    parser.add_argument("--resampled", type=int, default=400, help="simulated gate runs on recorded rounds drawn with replacement")
    parser.add_argument("--spawn", choices=SPAWN_KINDS, default=None,
                        help="how the children start, as the gate does (default: the gate's default for --backend)")
    args = parser.parse_args(argv)
    args.pairing = args.pairing or default_pairing(args.backend)
    args.spawn = args.spawn or default_spawn(args.backend)
    args.max_rounds = args.max_rounds or 2 * args.rounds
    if args.max_rounds < args.rounds:
        parser.error(f"--max-rounds ({args.max_rounds}) must be at least --rounds ({args.rounds})")
    if args.from_json:
        record = json.loads(args.from_json.read_text(encoding="utf-8"))
        if args.truncate_steps:
            record = truncated(record, args.truncate_steps)
        report(record, args, record["config"]["slowdowns"])
    else:
        record = measure(args)
        report(record, args, args.slowdowns)
    write_json(args.out, record)
    print(f"JSON: {args.out}")
    return 0


def measure(args) -> dict:
    source = load_workload(args.workload).root
    total = args.gates * args.max_rounds
    rng = random.Random()
    record = {
        "benchmark": "gate_calibration",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rounds": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-gate-calibration-") as tmp, fork_server.serving(args.spawn):
        programs = {"base": load_workload(source), "base_again": load_workload(source)}
        for f in args.slowdowns:
            programs[f"slow_{f:g}"] = planted_variant(source, Path(tmp) / f"slow_{f:g}", f)
        names = list(programs)
        for index in range(total):
            seed = rng.randrange(1, 2**31 - 1)
            if args.pairing == "paired":
                pairs = run_paired_round(programs, index, seed, args.steps_per_round, args.backend)
                entry = {"pairs": pairs, "loadavg": os.getloadavg()}
                shown = ", ".join(f"{n}/base {statistics.median(p[n]) / statistics.median(p['base']):.3f}" for n, p in pairs.items())
            else:
                shift = index % len(names)
                order = names[shift:] + names[:shift]
                samples, cores = run_round(programs, order, seed, args.steps_per_round, args.backend)
                entry = {"order": order, "samples": samples, "cores": cores, "loadavg": os.getloadavg()}
                shown = ", ".join(f"{n} {1000 * statistics.median(samples[n]):.2f} ms" for n in names)
            record["rounds"].append(entry)
            elapsed = time.monotonic() - started
            print(f"round {index + 1}/{total} done in {elapsed:.0f} s; {shown}", file=sys.stderr, flush=True)
            write_json(args.out, record)
    record["machine"]["loadavg_end"] = os.getloadavg()
    record["wall_s"] = time.monotonic() - started
    return record


def report(record: dict, args, slowdowns: list[float]) -> None:
    rounds = record["rounds"]
    schedule = looks(args.rounds, args.max_rounds)
    levels = look_levels(schedule, (1.0 - args.confidence) / 2.0)
    level = levels[-1]
    record["decision"] = {"rule": "sequential (agents/profiler/sequential.py)", "looks": list(schedule), "look_levels": list(levels),
                          "nominal_level": level,
                          "futility_power": FUTILITY_POWER, "max_rounds": args.max_rounds}
    record["summary_independent"] = summarise(decide_consecutive(rounds, args, slowdowns))
    record["summary_sliding"] = summarise(decide_blocks(rounds, args.max_rounds, args, slowdowns, sliding=True))
    record["summary_resampled"] = summarise(decide_resampled(rounds, args, slowdowns, args.resampled))
    record["summary_pooled"] = summarise(decide_blocks(rounds, len(rounds), args, slowdowns, sliding=False, sequential=False))
    record["summary_shifted"] = summarise(decide_shifted(rounds, args, args.resampled))
    steps = record["config"]["steps_per_round"]
    gate = (f"looks at {', '.join(map(str, schedule))} rounds, one-sided levels {', '.join(f'{x:.4g}' for x in dict.fromkeys(levels))} "
            f"(first look, then each later one), futility below {FUTILITY_POWER:g}")
    print(f"rule: {gate}; spawn: {record['config'].get('spawn', 'exec (not recorded)')}\n")
    print(table(record["summary_independent"], f"independent gate runs, each starting where the last stopped ({steps} steps a round)"))
    print()
    print(table(record["summary_sliding"], f"sliding windows of {args.max_rounds} rounds (overlapping, not independent)"))
    print()
    print(table(record["summary_resampled"], f"{args.resampled} gate runs on rounds drawn with replacement from the {len(rounds)} "
                "recorded (not independent)"))
    print()
    print(table(record["summary_pooled"], f"all {len(rounds)} rounds pooled as one decision"))
    print()
    print(table(record["summary_shifted"], f"power at an exact effect: {args.resampled} resampled gate runs on the recorded A/A "
                "rounds, the candidate side's steps scaled (not independent)"))
    machine = record["machine"]
    print(f"\nchildren confined: {confinement_line(rounds)}")
    print(f"\nload average start {machine['loadavg_start']}, end {machine.get('loadavg_end')}; "
          f"{record.get('wall_s', 0):.0f} s of measuring")


if __name__ == "__main__":
    sys.exit(main())
