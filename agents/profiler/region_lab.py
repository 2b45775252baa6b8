"""The region lab ("supernode lab"): time a candidate's rewritten region alone before the whole-step gate.

`time_region` starts one sandboxed child (sandbox/region_bench.py) confined like any gate child:
scrubbed environment, address-space cap, own process group killed on timeout, no network where the
host allows. On the CPU it is forked from a warm fork server, as gate children are (torch and the
lab imported once per run, not once per candidate; sandbox/child/fork_server.py), else exec'd. The child
captures the region's real inputs from one baseline step and times baseline region against
candidate region, forward + backward, interleaved, for a few hundred repetitions.

The lab only ranks and skips: `clearly_slower` is the one rule that lets a candidate skip the gate,
and it is conservative (the whole interval on the ratio above `SLOWER_BOUND`). A region that is
faster never accepts anything; a region that cannot be isolated changes nothing (the gate runs).
`TRAINBRIDGE_REGION_LAB=off` turns the lab off.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.agents.profiler.tamper import changed, digest_tree
from trainbridge.agents.profiler.integrity import Finding, FindingKind
from trainbridge.agents.profiler.verdict import Verdict, VerdictReason
from trainbridge.records import SourceSpan
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox.backends import Backend
from trainbridge.sandbox.confinement import child_sandbox
from trainbridge.sandbox.isolation import default_memory_limit_mb, network_isolation, scrubbed_env
from trainbridge.sandbox.runner import forked_writable, run_confined
from trainbridge.sandbox.scratch import scratch_dir
from trainbridge.sandbox.workload import Workload, load_workload

SWITCH = "TRAINBRIDGE_REGION_LAB"
SLOWER_BOUND = 1.10  # a skip must be safe: the region's whole interval at least 10% slower
DEFAULT_BUDGET_S = 1.0  # timing per region (up to max_reps per side): a few hundred repetitions of a small region fit
DEFAULT_TIMEOUT_S = 120.0
LAB_THREADS = 1  # see time_region: a few-millisecond region at 2 threads on a shared 2-core host times OpenMP spin-waits
_MATCH = {True: "agree", False: "differ", None: "not compared"}
RegionVerdict = Literal["faster", "slower", "same", "unisolated"]


class RegionTiming(BaseModel):
    """One region timed alone: baseline region vs candidate region on the step's own inputs."""

    model_config = ConfigDict(extra="forbid")

    site: SourceSpan | None = Field(default=None, description="the site that was timed (the first whose function could be named)")
    qualname: str | None = Field(default=None, description="the region's callable: a function or Class.method")
    module_path: str | None = Field(default=None, description="for a method: the instance's path in the model (named_modules)")
    shapes: dict[str, str] = Field(default_factory=dict, description="argument name -> shape, dtype, grad of the captured inputs")
    reps: int = Field(default=0, description="forward + backward repetitions per side")
    baseline_median_s: float | None = None
    candidate_median_s: float | None = None
    ratio: float | None = Field(default=None, description="median over repetitions of candidate / baseline time; < 1 is faster")
    interval: tuple[float, float] | None = Field(default=None, description="95% order-statistic interval on that median")
    threads: int | None = None
    outputs_match: bool | None = Field(default=None, description="both regions' outputs agree on the captured inputs (no grad, "
                                       "rtol 1e-3); only a region known to agree is ever skipped (the gate's numerics "
                                       "check reports the others)")
    verdict: RegionVerdict
    message: str
    baseline_times_s: list[float] = Field(default_factory=list, description="every repetition, in order")
    candidate_times_s: list[float] = Field(default_factory=list)
    written: list[str] = Field(default_factory=list, description="files the child changed in the two worktrees "
                               "(baseline/..., candidate/...): gate-gaming, as in a gate child")
    wall_s: float = 0.0
    network_isolated: bool = False
    spawn: str = Field(default="exec", description="how the child started: forked from a warm server (fork-server, on the "
                       "CPU, as gate children are) or exec'd; 'not started' when nothing needed timing")


def lab_enabled(environ: dict[str, str] | None = None) -> bool:
    """False when TRAINBRIDGE_REGION_LAB is off / 0 / false / no."""
    value = (environ if environ is not None else os.environ).get(SWITCH, "on").strip().lower()
    return value not in ("off", "0", "false", "no")


def clearly_slower(timing: RegionTiming) -> bool:
    """True only when the whole interval on the region's ratio lies above SLOWER_BOUND and both regions were seen
    to give the same outputs (a rewrite with other math, or one not comparable, goes to the gate)."""
    return (timing.verdict == "slower" and timing.interval is not None and timing.interval[0] > SLOWER_BOUND
            and timing.outputs_match is True)


def classify(interval: tuple[float, float]) -> RegionVerdict:
    """slower: the whole interval above 1; faster: the whole interval below 1; else same."""
    low, high = interval
    return "slower" if low > 1.0 else "faster" if high < 1.0 else "same"


def time_region(baseline: Workload | Path, candidate: Workload | Path, sites: list[SourceSpan], *, backend: str = "cpu",
                timeout_s: float = DEFAULT_TIMEOUT_S, budget_s: float = DEFAULT_BUDGET_S, max_reps: int = 300,
                min_reps: int = 20, threads: int | None = LAB_THREADS) -> RegionTiming:
    """Time the candidate's region against the baseline's in one sandboxed child; never raises for the
    workloads' faults (they come back as verdict "unisolated" with the reason). The workloads may be given
    as their roots (their trainbridge.toml is read). `threads`: torch's thread count in the child (None: the
    workload's; the default, one thread, keeps a region's few-millisecond timings clear of OpenMP spin-waits
    when another process shares the cores)."""
    started = time.monotonic()
    baseline = baseline if isinstance(baseline, Workload) else load_workload(Path(baseline))
    candidate = candidate if isinstance(candidate, Workload) else load_workload(Path(candidate))
    isolation = network_isolation()

    spawned = {"spawn": "not started"}

    def unisolated(message: str) -> RegionTiming:
        return RegionTiming(verdict="unisolated", message=message, wall_s=time.monotonic() - started,
                            network_isolated=isolation.isolated, **spawned)

    if not sites:
        return unisolated("the candidate names no site to time")
    if baseline.config.mode != "entry" or candidate.config.mode != "entry":
        return unisolated(f"the region lab needs entry-mode workloads (this one is {baseline.config.mode} mode)")
    target = Backend(backend)
    config = baseline.config
    memory_limit_mb = config.memory_limit_mb or default_memory_limit_mb()
    threads = threads or config.threads
    env = lab_env(config, target.name, threads)
    before = {side: digest_tree(w.root) for side, w in (("baseline", baseline), ("candidate", candidate))}
    with scratch_dir("trainbridge-run-region-") as tmp_dir:
        request = {"backend": target.name, "threads": threads, "seed": config.seed, "budget_s": budget_s,
                   "max_reps": max_reps, "min_reps": min_reps, "result_path": str(tmp_dir / "result.json"),
                   "sites": [site.model_dump(mode="json") for site in sites],
                   "baseline": _side(baseline), "candidate": _side(candidate)}
        (tmp_dir / "request.json").write_text(json.dumps(request), encoding="utf-8")
        box = child_sandbox(tmp_dir, root=candidate.root, backend=target.name)  # exec'd: under bubblewrap
        argv = [*box.prefix, sys.executable, "-m", "trainbridge.sandbox.region_bench", str(tmp_dir / "request.json")]
        with fork_server.serving(fork_server.default_spawn(target.name), keep_warm=True):  # forked: under the isolation prefix
            outcome = run_confined(argv, cwd=candidate.root, env=env, memory_limit_mb=memory_limit_mb, timeout_s=timeout_s,
                                   tmp_dir=tmp_dir, forked=("region_bench", [str(tmp_dir / "request.json")]), exec_env=box.env,
                                   writable=forked_writable(tmp_dir, candidate.root))
        spawned = {"spawn": outcome.spawn}
        result_path = tmp_dir / "result.json"
        written = [f"{side}/{path}" for side, w in (("baseline", baseline), ("candidate", candidate))
                   for path in changed(before[side], digest_tree(w.root))]
        if written:
            timing = unisolated(f"the region child wrote into the worktrees under test ({', '.join(written[:5])})")
            return timing.model_copy(update={"written": written})
        if outcome.timed_out:
            return unisolated(f"the region child gave no result within {timeout_s:g} s; its process group was killed")
        if not result_path.exists():
            tail = outcome.stderr.strip().splitlines()[-1:] or [f"exit code {outcome.returncode}"]
            return unisolated(f"the region child died without a result ({tail[0][:300]})")
        try:
            payload = json.loads(result_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            return unisolated(f"the region child's result is not readable JSON ({exc})")
    if "unisolated" in payload:
        return unisolated(f"region not isolated: {payload['unisolated']}")
    if "failure" in payload:
        return unisolated(f"the region child failed ({payload['failure']['kind']}): {payload['failure']['message'][:500]}")
    try:
        return _timing(payload, threads, started, isolation.isolated).model_copy(update=spawned)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a malformed result never rejects: the gate decides
        return unisolated(f"the region child's result is malformed ({type(exc).__name__}: {exc})")


def lab_env(config, backend: str, threads: int | None = None) -> dict[str, str]:
    """The region child's environment (`threads`: the lab's, `LAB_THREADS` by default)."""
    return scrubbed_env(Backend(backend).child_env(), threads=threads or LAB_THREADS, seed=config.seed)


def _timing(payload: dict, threads: int, started: float, network_isolated: bool) -> RegionTiming:
    interval = (float(payload["interval"][0]), float(payload["interval"][1]))
    verdict = classify(interval)
    site = SourceSpan.model_validate(payload["site"])
    where = f"{payload['qualname']}" + (f" on model.{payload['module_path']}" if payload.get("module_path") else "")
    message = (f"region {where} ({site}) alone, forward + backward, {payload['reps']} interleaved repetitions per side, "
               f"{threads} thread(s): "
               f"baseline {payload['baseline_median_s'] * 1e3:.3f} ms, candidate {payload['candidate_median_s'] * 1e3:.3f} ms "
               f"(medians), paired ratio {payload['ratio']:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]: {verdict}; outputs "
               f"{_MATCH[payload.get('outputs_match')]}")
    return RegionTiming(site=site, qualname=payload["qualname"], module_path=payload.get("module_path"), shapes=payload["shapes"],
                        reps=payload["reps"], baseline_median_s=payload["baseline_median_s"],
                        candidate_median_s=payload["candidate_median_s"], ratio=payload["ratio"], interval=interval,
                        verdict=verdict, message=message, baseline_times_s=payload["baseline_times_s"],
                        candidate_times_s=payload["candidate_times_s"], threads=threads, outputs_match=payload.get("outputs_match"),
                        wall_s=time.monotonic() - started,
                        network_isolated=network_isolated)


def _side(workload: Workload) -> dict:
    return {"root": str(workload.root), "entry": workload.config.entry, "pythonpath": list(workload.config.pythonpath)}


def region_verdict(timing: RegionTiming, *, backend: str) -> Verdict | None:
    """The verdict that stops a candidate before the whole-step gate, or None (the gate runs): `region_slower`
    when the region is clearly slower, `tampered_harness` when the child wrote into a worktree under test.
    Anything else, an unisolated region included, lets the gate decide."""
    region = timing.model_dump(mode="json")
    if timing.written:
        finding = Finding(kind=FindingKind.tampered_harness, message=f"region lab: {timing.message}")
        return Verdict(accepted=False, reason=VerdictReason.tampered_harness, message=finding.message, backend=backend,
                       phase="region", findings=[finding], region=region, wall_s=timing.wall_s)
    if not clearly_slower(timing):
        return None
    message = (f"skipped the whole-step gate: {timing.message}; the whole interval lies above {SLOWER_BOUND:.2f}: the rewrite "
               "makes its own region clearly slower (set TRAINBRIDGE_REGION_LAB=off to gate it anyway)")
    return Verdict(accepted=False, reason=VerdictReason.region_slower, message=message, backend=backend, phase="region",
                   region=region, ratio=None, wall_s=timing.wall_s, phase_seconds={"region": round(timing.wall_s, 3)})


def rank(timings: dict[str, RegionTiming]) -> list[str]:
    """Candidate names for one region, best first: isolated ones by their ratio (the lower the better),
    then the unisolated in their given order. A ranking only orders the gates; the gate still decides."""
    isolated = sorted((name for name, t in timings.items() if t.ratio is not None and t.verdict != "unisolated"),
                      key=lambda name: timings[name].ratio)
    return isolated + [name for name in timings if name not in isolated]
