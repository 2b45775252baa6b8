"""How a candidate behaved while it was timed (parent side, pure functions over what the parent saw).

The parent times every step with its own clock and reads the child's resources from the kernel
(sandbox/child/step_driver.py, sandbox/proc_watch.py). A candidate can still try to look faster than it
is; each check below names what it did:

- ``tampered_timing``: the child's own step clock disagrees with the parent's (a rebound
  `time.perf_counter`, a patched harness clock or device sync): its in-process times are not the
  time the steps took;
- ``tampered_resources``: more cores than the gate gives (threads beyond the configured count,
  work handed to helper processes), a priority above the gate's (nice, real-time policy), or a
  process that escaped the child's process group and outlived it (it could slow the next run);
- ``tampered_resources`` too, in a paired round (both sides alive at once, their steps alternated):
  CPU the candidate used while the baseline was being timed beyond what the baseline used while the
  candidate was (work that slows its partner), and anything done *to* the baseline (stopped by a
  signal, its priority lowered, its cores narrowed): only the candidate runs beside it;
- ``tampered_harness``: messages on the control channel that the harness did not send, or files
  written into the worktree under test (state kept between runs can tell one run from another or
  carry results across).

The baseline is the reference for everything that depends on the program (a baseline that uses
helper processes may use them in the candidate too).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from trainbridge.agents.profiler.integrity import Finding, FindingKind
from trainbridge.sandbox.results import RunResult

# The child's clock covers a step from reading its command to writing its reply; the parent's adds the
# pipe's round trip (a fraction of a millisecond) and the scheduling of both processes around it.
INNER_RATIO_MIN = 0.5
INNER_SLACK_S = 0.005
INNER_FAST_SLACK_S = 0.001
RATE_TOLERANCE = 0.1
RATE_SLACK_S = 0.015
CORES_RATIO = 1.15
CORES_SLACK = 0.25
MIN_CORES_WALL_S = 0.05  # shorter timed phases: the kernel's CPU accounting is too coarse to judge
HELPER_SHARE = 0.1  # helpers' CPU beyond the baseline's, as a share of the timed wall time
MAX_LISTED = 5
IDLE_SHARE = 0.05  # CPU while the partner is timed, beyond the baseline's, as a share of the partner's step time
IDLE_SLACK_S = 0.02
SPIN_PER_STEP_S = 0.005  # right after its own step a side may spin-wait this long into the partner's (observed: ~4 ms, compiled code)


_TIMING_NAMES = ("time.", "torch.cuda.synchronize", "torch.cuda.Event", "torch.npu.synchronize", "trainbridge.sandbox.backends.")


def check_replaced(baseline: RunResult, candidate: RunResult, where: str) -> list[Finding]:
    """Clocks, synchronisation or harness functions the candidate rebound and the baseline did not."""
    if candidate.watch is None or baseline.watch is None:
        return []
    own = [n for n in candidate.watch.replaced if n not in set(baseline.watch.replaced)]
    if not own:
        return []
    timing = [n for n in own if n.startswith(_TIMING_NAMES) or n.endswith(".time")]
    harness = [n for n in own if n.startswith("trainbridge.") and n not in timing]
    other = [n for n in own if n not in timing and n not in harness]
    findings = []
    if timing:
        findings.append(Finding(kind=FindingKind.tampered_timing, message=(
            f"{where}: the candidate replaced what the gate's harness times and synchronises with: {', '.join(timing[:MAX_LISTED])}")))
    if harness:
        findings.append(Finding(kind=FindingKind.tampered_harness, message=(
            f"{where}: the candidate replaced functions of the gate's harness: {', '.join(harness[:MAX_LISTED])}")))
    if other:
        findings.append(Finding(kind=FindingKind.tampered_harness, message=(
            f"{where}: the candidate replaced torch functions the harness relies on: {', '.join(other[:MAX_LISTED])}")))
    return findings


def check_clock(run: RunResult, where: str) -> list[Finding]:
    """The child's clock against the parent's: its rate over the timed steps (from the first step's
    reply to the last: both clocks span the same events, up to one scheduling delay at each end), and
    the median step on each clock (the parent's also holds the pipe's round trip and, on a busy
    machine, the wait for a core: only a gross disagreement counts there)."""
    findings: list[Finding] = []
    if run.timing_source != "parent":
        return findings
    if run.clock_span_s is not None:
        parent_span, child_span = run.clock_span_s
        allowed = RATE_TOLERANCE * parent_span + RATE_SLACK_S
        if child_span == child_span and parent_span > 0 and abs(child_span - parent_span) > allowed:
            findings.append(Finding(kind=FindingKind.tampered_timing, message=(
                f"{where}: over its timed steps the candidate's clock advanced {child_span * 1e3:.1f} ms while the gate's advanced "
                f"{parent_span * 1e3:.1f} ms (rate {child_span / parent_span:.3f}): it changed how time is measured inside its process")))
            return findings
    inner = [t for t in run.inner_step_times_s if t == t]  # NaN: the harness reported none
    outer = [*run.warmup_times_s, *run.step_times_s, *run.cooldown_times_s]
    if not inner or len(inner) != len(outer):
        return findings
    inner_median, outer_median = statistics.median(inner), statistics.median(outer)
    if inner_median < INNER_RATIO_MIN * outer_median - INNER_SLACK_S or inner_median > outer_median + INNER_FAST_SLACK_S:
        findings.append(Finding(kind=FindingKind.tampered_timing, message=(
            f"{where}: the candidate's own clock says its median step took {inner_median * 1e3:.2f} ms, the gate's clock "
            f"{outer_median * 1e3:.2f} ms: it changed how time is measured inside its process (a rebound clock or synchronisation)")))
    return findings


def check_resources(baseline: RunResult, candidate: RunResult, threads: int, where: str) -> list[Finding]:
    findings: list[Finding] = []
    watch, base = candidate.watch, baseline.watch
    if watch is None:
        return findings
    if watch.survivors:
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: the candidate left processes running after its run ({', '.join(watch.survivors[:MAX_LISTED])}), "
            "outside its process group: they were killed")))
    if watch.raised_priority:
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: the candidate raised its scheduling priority: {'; '.join(watch.raised_priority[:MAX_LISTED])}")))
    if watch.threads_in_use is not None and watch.threads_in_use > threads and (base is None or (base.threads_in_use or 0) <= threads):
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: the candidate runs torch with {watch.threads_in_use} threads; the gate gives {threads}")))
    base_helpers = (base.helper_cpu_s or 0.0) if base is not None else 0.0
    if watch.helper_cpu_s is not None and watch.wall_s and watch.helper_cpu_s > HELPER_SHARE * watch.wall_s + base_helpers:
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: helper processes of the candidate used {watch.helper_cpu_s:.2f} s of CPU during {watch.wall_s:.2f} s of "
            f"timed steps (the baseline's: {base_helpers:.2f} s): work was handed to other processes")))
    if watch.cores_used is not None and base is not None and base.cores_used is not None and (watch.wall_s or 0.0) >= MIN_CORES_WALL_S:
        allowed = max(float(threads), base.cores_used) * CORES_RATIO + CORES_SLACK
        if watch.cores_used > allowed:
            helpers = f", with {len(watch.extra_processes)} helper process(es)" if watch.extra_processes else ""
            findings.append(Finding(kind=FindingKind.tampered_resources, message=(
                f"{where}: the candidate used {watch.cores_used:.2f} cores while timed{helpers}; the gate gives "
                f"{threads} thread(s) and the baseline used {base.cores_used:.2f}: it took more of the machine than "
                "the baseline was given")))
    return findings


def check_partner(baseline: RunResult, candidate: RunResult, where: str) -> list[Finding]:
    """A paired round: what the candidate did while the baseline was timed, and to the baseline."""
    findings: list[Finding] = []
    base, watch = baseline.watch, candidate.watch
    if base is not None and base.interference:
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: while it ran beside the candidate, {'; '.join(base.interference[:MAX_LISTED]).replace('the child', 'the baseline')}: "
            "only the candidate ran beside it")))
    if watch is None or watch.idle_cpu_s is None or not watch.idle_wall_s:
        return findings
    base_idle = (base.idle_cpu_s or 0.0) if base is not None else 0.0
    allowed = base_idle + IDLE_SHARE * watch.idle_wall_s + IDLE_SLACK_S
    if watch.idle_cpu_s > allowed:
        findings.append(Finding(kind=FindingKind.tampered_resources, message=(
            f"{where}: the candidate used {watch.idle_cpu_s * 1e3:.0f} ms of CPU during the {watch.idle_wall_s * 1e3:.0f} ms the baseline "
            f"was being timed (the baseline used {base_idle * 1e3:.0f} ms while the candidate was): work that slows the side it "
            "is compared with")))
        return findings
    if watch.near_idle_cpu_s is not None and watch.near_idle_wall_s:
        base_near = (base.near_idle_cpu_s or 0.0) if base is not None else 0.0
        allowed = base_near + SPIN_PER_STEP_S * watch.near_idle_steps + IDLE_SHARE * watch.near_idle_wall_s + IDLE_SLACK_S
        if watch.near_idle_cpu_s > allowed:
            findings.append(Finding(kind=FindingKind.tampered_resources, message=(
                f"{where}: right after its own steps the candidate used {watch.near_idle_cpu_s * 1e3:.0f} ms of CPU during the "
                f"{watch.near_idle_wall_s * 1e3:.0f} ms the baseline was being timed ({watch.near_idle_steps} steps; the baseline used "
                f"{base_near * 1e3:.0f} ms): more than threads spin-waiting after a step, work that slows the side it is compared with")))
    return findings


def check_protocol(candidate: RunResult, where: str) -> list[Finding]:
    watch = candidate.watch
    if watch is None or not watch.protocol_violations:
        return []
    return [Finding(kind=FindingKind.tampered_harness, message=(
        f"{where}: the candidate interfered with the gate's control channel: {'; '.join(watch.protocol_violations[:MAX_LISTED])}"))]


def snapshot_tree(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `root`, .git excluded, by relative path."""
    found: dict[str, tuple[int, int]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            path = Path(folder) / name
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            found[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return found


def changed_files(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def check_written_files(baseline_written: set[str], candidate_written: list[str], where: str) -> list[Finding]:
    own = [p for p in candidate_written if p not in baseline_written]
    if not own:
        return []
    shown = ", ".join(own[:MAX_LISTED]) + (f" and {len(own) - MAX_LISTED} more" if len(own) > MAX_LISTED else "")
    return [Finding(kind=FindingKind.tampered_harness, message=(
        f"{where}: the candidate wrote into its worktree while judged ({shown}); the baseline writes nothing there. State kept "
        "between runs can tell one run from another or carry results across")) ]
