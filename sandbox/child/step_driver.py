"""The parent side of parent-timed steps: drive sandbox children command by command and time them.

Step times come from this process's clock (`time.perf_counter_ns`, out of the child's reach): a
step starts when the command is written and ends when its reply is read, so whatever the child does
between the two is in the time, and nothing can be done ahead (the next batch index is unknown to
the child until it has answered). Around the timed steps the kernel's accounting of the child and
its descendants (sandbox/proc_watch.py) gives the cores it used, raised priorities and processes
that outlive it. The child's own step clock (`inner_s`) is kept for the gate's cross-check.

Two ways to run a plan:

- `drive`: one child, its steps back to back (measurements, the gate's sequential pairing);
- `drive_pair`: two children alive at once, their timed steps alternated one by one (A, B, B, A,
  A, B, ...: who goes first swaps every step), so that the two sides of a comparison are timed
  milliseconds apart instead of seconds: the machine's slow drifts (frequency, a neighbour's load)
  fall on both alike. Both start and import at the same time; they compute (probe, steps) in
  turns. Between steps the parent reads both process trees: the CPU a child used
  while the *other* was being timed (`idle_cpu_s`, over the partner's second step in a row, when the
  child's own spin-waits are over: work done to slow its partner shows there), and
  what another process did to it (stopped it, lowered its priority, narrowed its cores:
  `interference`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child.driven import ChildSpec, ChildStopped, DrivenChild, DriveOutcome, StepPlan
from trainbridge.sandbox.child.rank_group import child_for

__all__ = ["ChildSpec", "DriveOutcome", "StepPlan", "drive", "drive_pair"]


def drive(spec: ChildSpec, *, on_progress: Callable[[int], None] | None = None) -> DriveOutcome:
    """Run one child through `spec.plan`; never raises for the child's faults."""
    reaper = proc_watch.become_subreaper()
    child = child_for(spec, reaper=reaper)
    if not child.start():
        return child.out
    deadline = time.monotonic() + spec.timeout_s
    try:
        _setup([child], deadline)
        before = child.sample()
        phase_start = time.perf_counter_ns()
        for done, (phase, index) in enumerate(spec.plan.timed(), start=1):
            child.guarded(child.step, phase, index, deadline)
            if on_progress is not None:
                on_progress(done)
        wall_ns = time.perf_counter_ns() - phase_start
        after = child.sample()
        _record_phase(child, before, after, own_cpu_ns=None, own_wall_ns=wall_ns)
        child.guarded(child.finish, deadline)
    except ChildStopped:
        pass
    finally:
        _close([child])
    return child.out


def drive_pair(first: ChildSpec, second: ChildSpec, *, orphans_to: int = 1,
               on_progress: Callable[[int], None] | None = None) -> tuple[DriveOutcome, DriveOutcome]:
    """Run two children at once, their timed steps alternated (`first` leads the first step). Both
    plans must have the same phases and lengths. A fault of one child ends both plans: the other's
    outcome is marked `interrupted`. `orphans_to`: which child (0 or 1) escaped processes are
    counted against (the gate: the candidate)."""
    timed = first.plan.timed(), second.plan.timed()
    if [p for p, _ in timed[0]] != [p for p, _ in timed[1]]:
        raise ValueError("drive_pair needs two plans with the same warm-up, measured and cool-down lengths")
    reaper = proc_watch.become_subreaper()
    children = [child_for(spec, reaper=reaper, claims_orphans=(i == orphans_to)) for i, spec in enumerate((first, second))]
    # started in a random order: which one starts first (visible to both in /proc) says nothing about the round
    launch = children if random.SystemRandom().random() < 0.5 else children[::-1]
    started = [c for c in launch if c.start()]
    if len(started) < 2:
        for child in children:
            if child in started:
                child.out.interrupted = "the other side of the pair could not be started"
        _close(started)
        return children[0].out, children[1].out
    a, b = children
    a.siblings, b.siblings = {b.pid}, {a.pid}
    deadline = time.monotonic() + max(first.timeout_s, second.timeout_s)
    own_cpu, idle_cpu, own_wall, idle_wall = [0, 0], [0, 0], [0, 0], [0, 0]
    near_cpu, near_wall, near_steps = [0, 0], [0, 0], [0, 0]
    previous: int | None = None  # who stepped last
    try:
        _setup(children, deadline)
        samples = [c.sample() for c in children]
        starts = [samples[0], samples[1]]
        for c in children:
            c.note_interference()
        for k in range(len(timed[0])):
            order = (0, 1) if k % 2 == 0 else (1, 0)
            for who in order:
                current = children[who]
                phase, index = timed[who][k]
                t0 = time.perf_counter_ns()
                current.guarded(current.step, phase, index, deadline)
                wall = time.perf_counter_ns() - t0
                now = [c.sample() for c in children]
                # the idle side's CPU counts only over the partner's second step in a row (A B *B* A A *B* ...):
                # right after its own step a side's threads may still spin-wait for a few milliseconds (OpenMP,
                # more in compiled code), which is not work against the partner; one step later it must be idle
                far = previous == who
                for i in (0, 1):
                    delta = now[i].cpu_ns - samples[i].cpu_ns if now[i] is not None and samples[i] is not None else None
                    if i == who:
                        own_cpu[i] += delta or 0
                        own_wall[i] += wall
                    elif far:
                        idle_cpu[i] += delta or 0
                        idle_wall[i] += wall
                    else:  # judged with an allowance for spin-waits per step (agents/profiler/conduct.py)
                        near_cpu[i] += delta or 0
                        near_wall[i] += wall
                        near_steps[i] += 1
                    children[i].note_interference()
                samples, previous = now, who
            if on_progress is not None:
                on_progress(k + 1)
        for i, child in enumerate(children):
            _record_phase(child, starts[i], samples[i], own_cpu_ns=own_cpu[i], own_wall_ns=own_wall[i])
            child.out.watch.idle_cpu_s = idle_cpu[i] / 1e9 if samples[i] is not None else None
            child.out.watch.idle_wall_s = idle_wall[i] / 1e9
            child.out.watch.near_idle_cpu_s = near_cpu[i] / 1e9 if samples[i] is not None else None
            child.out.watch.near_idle_wall_s = near_wall[i] / 1e9
            child.out.watch.near_idle_steps = near_steps[i]
        for child in children:
            child.guarded(child.finish, deadline)
    except ChildStopped as stopped:
        for child in children:
            if child is not stopped.child:
                child.out.interrupted = "the other side of the pair failed, which ended this one's run"
    finally:
        _close(children)
    return a.out, b.out


def _setup(children: list[DrivenChild], deadline: float) -> None:
    """The request to every child at once (interpreter start and imports overlap), then, one child
    at a time, the probe and the mark (when planned). Two children computing at once would each run
    their threads on cores the other holds: OpenMP's spin-waits make that many times slower than
    taking turns (a paired llama round's set-up: 11-28 s at once)."""
    for child in children:
        child.guarded(child.send, child.spec.request)
    for child in children:
        child.guarded(child.expect, "ready", deadline)
    for child in children:
        if child.spec.plan.probe is not None:
            child.guarded(child.send, {"op": "probe", **child.spec.plan.probe})
            child.out.probe = child.guarded(child.expect, "probe", deadline)["report"]
        if child.spec.plan.deltas_path is not None:
            child.guarded(child.send, {"op": "mark"})
            child.guarded(child.expect, "mark", deadline)


def _record_phase(child: DrivenChild, before, after, *, own_cpu_ns: int | None, own_wall_ns: int) -> None:
    """The timed phase's figures: CPU over the child's own steps (`own_cpu_ns`; None: the whole phase)."""
    watch = child.out.watch
    if before is None or after is None or own_wall_ns <= 0:
        return
    cpu_ns = after.cpu_ns - before.cpu_ns if own_cpu_ns is None else own_cpu_ns
    watch.cpu_s = cpu_ns / 1e9
    watch.wall_s = own_wall_ns / 1e9
    watch.cores_used = watch.cpu_s / watch.wall_s
    watch.max_threads = max(before.child_threads, after.child_threads)
    watch.raised_priority = after.raised_priority
    watch.extra_processes = sorted(set(before.descendants) | set(after.descendants))
    watch.helper_cpu_s = max(0.0, (after.helper_cpu_ns - before.helper_cpu_ns) / 1e9)


def _close(children: list[DrivenChild]) -> None:
    """Survivors are listed for every child before any is killed (a sibling's death must not hide
    them); then each is closed, and the orphans handed to this process are reaped."""
    survivors = [c.survivors() for c in children]
    for child, found in zip(children, survivors):
        child.close(found)
    if any(c.reaper for c in children):
        starts = [c.since for c in children if c.since is not None]
        proc_watch.reap_orphans(min(starts) if starts else None, exclude={c.pid for c in children if c.popen is not None})
