"""Step time of a workload's variants, measured side by side in persistent sandboxed workers.

Variants of one workload: the original eager program, TrainBridge's final branch, `torch.compile`
of the original and `torch.compile` of the final branch. Each variant gets one persistent worker
(`bench_worker.py`) started through the sandbox's isolation; workers build (and compile) once, in
parallel, before any timing. Then, round by round, every worker runs a few steps in an order that
changes from round to round (a Williams design: each variant takes each position equally often,
and for an even number of variants each one directly follows every other one equally often), so
slow drift of the machine and carry-over from the previous variant hit all variants alike.

The evidence of a comparison is the per-round ratio of round medians (`stats.paired_ratios`);
its estimate is the median of the log-ratios, its interval a percentile bootstrap
(`stats.paired_ratio_ci`), exactly as the speed gate computes them.

Used by `suite.py`; on its own:

    .venv/bin/python benchmarks/speedup.py REPO_A REPO_B --rounds 6 --steps 8   # eager and compiled, A vs B
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainbridge.agents.profiler.stats import paired_ratio_ci, paired_ratios
from trainbridge.sandbox.backends import Backend
from trainbridge.sandbox.isolation import default_memory_limit_mb, limit_memory, network_isolation, scrubbed_env
from trainbridge.sandbox.workload import Workload, load_workload

WORKER = Path(__file__).resolve().parent / "bench_worker.py"
EAGER, BRANCH, COMPILE, BRANCH_COMPILE = "eager", "trainbridge", "compile", "trainbridge+compile"
VARIANTS = (EAGER, BRANCH, COMPILE, BRANCH_COMPILE)
# (numerator, denominator): < 1 means the numerator is faster
COMPARISONS = ((BRANCH, EAGER), (COMPILE, EAGER), (BRANCH_COMPILE, EAGER), (BRANCH, COMPILE), (BRANCH_COMPILE, COMPILE))
Say = Callable[[str], None]


class WorkerError(RuntimeError):
    """A worker failed to build, compile or run its variant; the message carries its error and stderr tail."""


def williams_rows(n: int) -> list[list[int]]:
    """Rows of a Williams design for n treatments: n rows when n is even, 2n when odd. Every treatment
    takes every position equally often; every ordered pair of neighbours occurs equally often."""
    if n < 1:
        raise ValueError("need at least one variant")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [list(reversed(row)) for row in rows]
    return rows


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of `names` in each of `rounds` rounds, cycling through a Williams design."""
    rows = williams_rows(len(names))
    return [[names[i] for i in rows[r % len(rows)]] for r in range(rounds)]


class Worker:
    """One sandboxed `bench_worker.py` child holding one built variant."""

    def __init__(self, name: str, workload: Workload, *, compile: bool, warmup_steps: int, work_dir: Path,
                 backend: str = "cpu", extra_env: dict[str, str] | None = None):
        if workload.config.mode != "entry":
            raise WorkerError(f"{workload.root}: the speed benchmark needs entry = \"module:function\" in trainbridge.toml")
        self.name, self.workload, self.compile, self.backend = name, workload, compile, backend
        self.warmup_steps, self.work_dir, self.extra_env = warmup_steps, work_dir, extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.stderr_path = work_dir / f"{name.replace('+', '_')}.stderr.txt"
        self.ready: dict[str, Any] | None = None

    def start(self) -> None:
        config = self.workload.config
        request = {"root": str(self.workload.root), "entry": config.entry, "pythonpath": config.pythonpath,
                   "backend": self.backend, "seed": config.seed, "threads": config.threads,
                   "compile": self.compile, "warmup_steps": self.warmup_steps}
        request_path = self.work_dir / f"{self.name.replace('+', '_')}.request.json"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        env = scrubbed_env({**Backend(self.backend).child_env(), **self.extra_env}, threads=config.threads, seed=config.seed)
        memory_mb = config.memory_limit_mb or default_memory_limit_mb()
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [*network_isolation().prefix, sys.executable, "-P", str(WORKER), str(request_path)],
                cwd=self.workload.root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                start_new_session=True, preexec_fn=limit_memory(memory_mb),
            )

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        self.ready = self._read(timeout_s, "building" + (" and compiling" if self.compile else ""))
        return self.ready

    def run(self, steps: int, warmup: int, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": "run", "steps": steps, "warmup": warmup}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout_s, f"running {steps} steps")

    def _read(self, timeout_s: float, doing: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.close()
            raise WorkerError(f"{self.name}: no answer within {timeout_s:g} s while {doing}; killed{self._tail()}")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"{self.name}: the worker died (exit {code}) while {doing}{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            self.close()
            raise WorkerError(f"{self.name}: {reply['error']} while {doing}\n{reply.get('traceback_tail') or ''}")
        return reply

    def _tail(self) -> str:
        try:
            text = self.stderr_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        except FileNotFoundError:
            return ""
        return f"; stderr tail:\n{text}" if text.strip() else ""

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(b'{"cmd": "exit"}\n')
                proc.stdin.flush()
                proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()


def measure_variants(variants: dict[str, tuple[Workload, bool]], *, rounds: int, steps: int, warmup_steps: int = 3,
                     warmup_per_round: int = 1, build_timeout_s: float = 900, step_timeout_s: float = 300,
                     extra_env: dict[str, str] | None = None, say: Say = print) -> dict[str, Any]:
    """Build every variant ({name: (workload, compile?)}) in its worker, all at once, then run `rounds`
    interleaved rounds of `steps` timed steps each. Returns samples per variant and round, the orders,
    each worker's build report and the wall times; raises WorkerError when a variant cannot run."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-bench-workers-") as tmp:
        workers = {name: Worker(name, workload, compile=compiled, warmup_steps=warmup_steps, work_dir=Path(tmp), extra_env=extra_env)
                   for name, (workload, compiled) in variants.items()}
        try:
            for worker in workers.values():
                worker.start()
            say(f"building {', '.join(workers)} in parallel (compiled variants compile now)")
            ready = {}
            for name, worker in workers.items():
                ready[name] = worker.wait_ready(build_timeout_s)
                say(f"  {name} ready after {time.monotonic() - started:.0f} s: build {ready[name]['build_s']:.1f} s, "
                    f"first step {ready[name]['warmup_times_s'][0]:.2f} s" if ready[name]["warmup_times_s"] else f"  {name} ready")
            build_wall_s = time.monotonic() - started
            orders = round_orders(list(workers), rounds)
            samples: dict[str, list[list[float]]] = {name: [] for name in workers}
            graphs: dict[str, list[int]] = {name: [] for name in workers}
            for index, order in enumerate(orders):
                for name in order:
                    reply = workers[name].run(steps, warmup_per_round, step_timeout_s)
                    samples[name].append(reply["step_times_s"])
                    graphs[name].append(reply["graphs"])
                say(f"  round {index + 1}/{rounds}: " + ", ".join(f"{n} {1000 * statistics.median(samples[n][-1]):.1f} ms" for n in workers))
        finally:
            for worker in workers.values():
                worker.close()
    recompiled = [n for n in workers if graphs[n] and ready[n]["graphs"] and max(graphs[n]) > ready[n]["graphs"]]
    return {"rounds": rounds, "steps_per_round": steps, "warmup_steps": warmup_steps, "warmup_per_round": warmup_per_round,
            "orders": orders, "samples": samples,
            "build": {n: {k: r[k] for k in ("build_s", "warmup_times_s", "graphs")} for n, r in ready.items()},
            "versions": next(iter(ready.values()))["versions"] if ready else {},
            "recompiled_during_timing": recompiled, "build_wall_s": build_wall_s, "wall_s": time.monotonic() - started}


def ratio_summary(numerator: list[list[float]], denominator: list[list[float]], *, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Median over rounds of the paired round-median ratios numerator/denominator, with a bootstrap CI."""
    ratio, low, high = paired_ratio_ci(denominator, numerator, confidence=confidence, seed=seed)
    round_ratios = paired_ratios(denominator, numerator)
    return {"ratio": ratio, "ci": [low, high], "confidence": confidence, "rounds": len(round_ratios), "round_ratios": round_ratios}


def summarise(samples: dict[str, list[list[float]]], *, aliases: dict[str, str] | None = None, confidence: float = 0.95) -> dict[str, Any]:
    """Per variant the median of its round medians; per comparison the paired ratio with its CI.
    `aliases` maps a variant that was not measured to the one it is identical to (a branch without
    accepted commits is the original): its ratio to that variant is exactly 1."""
    aliases = aliases or {}
    resolved = {name: samples[aliases.get(name, name)] for name in [*samples, *aliases]}
    medians = {name: statistics.median(statistics.median(r) for r in rounds) for name, rounds in resolved.items()}
    ratios = {}
    for index, (num, den) in enumerate(COMPARISONS):
        if num in resolved and den in resolved:
            ratios[f"{num} / {den}"] = ratio_summary(resolved[num], resolved[den], confidence=confidence, seed=index)
    return {"median_step_s": medians, "ratios": ratios, "aliases": aliases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Interleaved step times of two workload versions, eager and under torch.compile.")
    parser.add_argument("original", type=Path, help="the original workload (a folder with trainbridge.toml)")
    parser.add_argument("branch", type=Path, help="the optimised version of it")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    parser.add_argument("--no-compile", action="store_true", help="only the two eager variants")
    args = parser.parse_args(argv)
    original, branch = load_workload(args.original), load_workload(args.branch)
    variants = {EAGER: (original, False), BRANCH: (branch, False)}
    if not args.no_compile:
        variants.update({COMPILE: (original, True), BRANCH_COMPILE: (branch, True)})
    measured = measure_variants(variants, rounds=args.rounds, steps=args.steps, say=lambda m: print(m, file=sys.stderr, flush=True))
    summary = summarise(measured["samples"])
    for name, seconds in summary["median_step_s"].items():
        print(f"{name}: {1000 * seconds:.2f} ms")
    for name, r in summary["ratios"].items():
        print(f"{name}: {r['ratio']:.3f} (95% CI {r['ci'][0]:.3f}-{r['ci'][1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
