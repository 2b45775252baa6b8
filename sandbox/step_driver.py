"""The parent side of parent-timed steps: drive a sandbox child command by command and time it.

Step times come from this process's clock (`time.perf_counter_ns`, out of the child's reach): a
step starts when the command is written and ends when its reply is read, so whatever the child does
between the two is in the time, and nothing can be done ahead (the next batch index is unknown to
the child until it has answered). Around the timed steps the kernel's accounting of the child and
its descendants (sandbox/proc_watch.py) gives the cores it used, raised priorities and processes
that outlive it. The child's own step clock (`inner_s`) is kept for the gate's cross-check.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.channel import Channel, ChannelClosed, ChannelProtocolError, ChannelTimeout
from trainbridge.sandbox.results import ChildWatch, Failure, FailureKind

EXIT_GRACE_S = 5.0  # for a child whose channel closed without its closing message


@dataclass(frozen=True)
class StepPlan:
    """What the parent asks of a timed child. Indices are batch indices (`batch(index)`)."""

    warmup: list[int]
    measured: list[int]
    cooldown: list[int] = field(default_factory=list)  # run and timed after the measured steps, not samples
    probe: dict[str, Any] | None = None  # {"seed", "batch_indices", "grads_path"}: the numerics probe first
    deltas_path: Path | None = None  # mark before the warm-up, report parameter changes after the cool-down

    @classmethod
    def sequential(cls, warmup: int, steps: int, cooldown: int = 1) -> "StepPlan":
        return cls(warmup=list(range(warmup)), measured=list(range(warmup, warmup + steps)),
                   cooldown=list(range(warmup + steps, warmup + steps + cooldown)))


@dataclass
class DriveOutcome:
    failure: Failure | None = None
    warmup_times_s: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    cooldown_times_s: list[float] = field(default_factory=list)
    inner_times_s: list[float] = field(default_factory=list)  # the child's own clock, every timed step in order
    clock_pairs: list[tuple[float, float]] = field(default_factory=list)  # per timed step: (reply read, parent clock; child clock at reply)
    losses: list[float] = field(default_factory=list)  # warm-up and measured steps
    cooldown_losses: list[float] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    result: dict[str, Any] | None = None  # the child's closing message (versions, peak memory)
    watch: ChildWatch = field(default_factory=ChildWatch)
    returncode: int | None = None
    timed_out: bool = False


class _ChildFailed(Exception):
    def __init__(self, failure: Failure | None = None):
        self.failure = failure


def drive(
    argv: list[str],
    *,
    request: dict[str, Any],
    plan: StepPlan,
    cwd: Path,
    env: dict[str, str],
    preexec_fn,
    timeout_s: float,
    stdout_path: Path,
    stderr_path: Path,
    on_progress: Callable[[int], None] | None = None,
) -> DriveOutcome:
    """Run the child `argv + ["--channel", "R,W"]` through `plan`; never raises for the child's faults."""
    out = DriveOutcome()
    cmd_r, cmd_w = os.pipe()
    reply_r, reply_w = os.pipe()
    reaper = proc_watch.become_subreaper()
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
        try:
            child = subprocess.Popen([*argv, "--channel", f"{cmd_r},{reply_w}"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=stdout, stderr=stderr, pass_fds=(cmd_r, reply_w), start_new_session=True,
                                     preexec_fn=preexec_fn)
        except OSError as exc:
            for fd in (cmd_r, cmd_w, reply_r, reply_w):
                os.close(fd)
            out.failure = Failure(kind=FailureKind.crashed, message=f"could not start {argv[0]}: {exc}")
            return out
        os.close(cmd_r)
        os.close(reply_w)
        channel = Channel(reply_r, cmd_w)
        started = proc_watch.read_stat(child.pid)
        since = started.start_ticks if started else None
        deadline = time.monotonic() + timeout_s
        watch = out.watch
        try:
            _run_plan(channel, child.pid, plan, request, out, deadline, on_progress, base_nice,
                      os.getpid() if reaper else None, since)
        except ChannelTimeout:
            out.timed_out = True
        except ChannelClosed:
            pass  # died: classified from its exit status below
        except ChannelProtocolError as exc:
            watch.protocol_violations.append(f"the child wrote something that is not the harness's reply: {exc}")
        except _ChildFailed as failed:
            if failed.failure is not None:
                out.failure = failed.failure
        finally:
            survivors = proc_watch.descendants(child.pid, reaper_pid=os.getpid() if reaper else None, since_ticks=since)
            # the closing message is the last thing the harness sends: the interpreter's own shutdown (a second or
            # more with torch loaded) is not waited for; a child that failed to send it gets a short grace
            try:
                child.wait(timeout=0 if out.result is not None or out.timed_out or watch.protocol_violations else EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(child)
            survivors += [s for s in proc_watch.descendants(child.pid, reaper_pid=os.getpid() if reaper else None, since_ticks=since)
                          if s.pid not in {t.pid for t in survivors}]
            alive = [s for s in survivors if proc_watch.read_stat(s.pid) is not None and s.pgid != child.pid]
            if alive:
                watch.survivors = [f"pid {s.pid} (session {s.sid}, process group {s.pgid})" for s in alive]
                proc_watch.kill_all(alive)
            for stat in alive:  # orphans handed to us as subreaper are our children now: reap them
                if stat.ppid == os.getpid():
                    try:
                        os.waitpid(stat.pid, 0)
                    except ChildProcessError:
                        pass
            if reaper:
                proc_watch.reap_orphans(since, exclude=child.pid)
            channel.close()
        out.returncode = child.returncode
    return out


def _kill_group(child: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _expect(channel: Channel, op: str, deadline: float) -> dict[str, Any]:
    reply = channel.recv(deadline)
    if reply.get("op") == "result":  # the child failed while serving: its closing message says how
        raise _ChildFailed(Failure.model_validate(reply["failure"]) if reply.get("failure") else None)
    if reply.get("op") != op:
        raise ChannelProtocolError(f"expected the reply to {op!r}, got {str(reply)[:200]}")
    return reply


def _run_plan(channel: Channel, pid: int, plan: StepPlan, request: dict[str, Any], out: DriveOutcome, deadline: float,
              on_progress, base_nice: int, reaper_pid: int | None, since: int | None) -> None:
    watch = out.watch
    channel.send(request)
    _expect(channel, "ready", deadline)
    if plan.probe is not None:
        channel.send({"op": "probe", **plan.probe})
        out.probe = _expect(channel, "probe", deadline)["report"]
    if plan.deltas_path is not None:
        channel.send({"op": "mark"})
        _expect(channel, "mark", deadline)
    sample_before = proc_watch.sample_tree(pid, base_nice=base_nice, reaper_pid=reaper_pid, since_ticks=since)
    phase_start = time.perf_counter_ns()
    done = 0
    phases = (("warmup", plan.warmup), ("measured", plan.measured), ("cooldown", plan.cooldown))
    for phase, indices in phases:
        for index in indices:
            started = time.perf_counter_ns()
            channel.send({"op": "step", "index": index})
            reply = _expect(channel, "step", deadline)
            elapsed = (time.perf_counter_ns() - started) / 1e9
            if reply.get("index") != index:
                raise ChannelProtocolError(f"asked for the step on batch {index}, the reply is for {reply.get('index')!r}")
            loss, inner = float(reply["loss"]), float(reply.get("inner_s", math.nan))
            out.inner_times_s.append(inner)
            out.clock_pairs.append((started / 1e9 + elapsed, float(reply.get("clock", math.nan))))
            if phase == "cooldown":
                out.cooldown_times_s.append(elapsed)
                out.cooldown_losses.append(loss)
            else:
                (out.warmup_times_s if phase == "warmup" else out.step_times_s).append(elapsed)
                out.losses.append(loss)
            done += 1
            if on_progress is not None:
                on_progress(done)
            if not math.isfinite(loss):
                raise _ChildFailed(Failure(kind=FailureKind.nonfinite_loss, message=f"step {done - 1} returned a non-finite loss ({loss})",
                                           step=done - 1))
    wall_ns = time.perf_counter_ns() - phase_start
    sample_after = proc_watch.sample_tree(pid, base_nice=base_nice, reaper_pid=reaper_pid, since_ticks=since)
    if sample_before is not None and sample_after is not None and wall_ns > 0:
        watch.cpu_s = (sample_after.cpu_ns - sample_before.cpu_ns) / 1e9
        watch.wall_s = wall_ns / 1e9
        watch.cores_used = watch.cpu_s / watch.wall_s
        watch.max_threads = max(sample_before.child_threads, sample_after.child_threads)
        watch.raised_priority = sample_after.raised_priority
        watch.extra_processes = sorted(set(sample_before.descendants) | set(sample_after.descendants))
        watch.helper_cpu_s = max(0.0, (sample_after.helper_cpu_ns - sample_before.helper_cpu_ns) / 1e9)
    if plan.deltas_path is not None:
        channel.send({"op": "final", "deltas_path": str(plan.deltas_path)})
        out.final = _expect(channel, "final", deadline)
    channel.send({"op": "exit"})
    closing = channel.recv(deadline)
    if closing.get("op") != "result":
        raise ChannelProtocolError(f"expected the closing result, got {str(closing)[:200]}")
    out.result = closing
    watch.replaced = [str(name) for name in closing.get("replaced", [])]
    if isinstance(closing.get("threads_in_use"), int):
        watch.threads_in_use = closing["threads_in_use"]
    if closing.get("failure"):
        out.failure = Failure.model_validate(closing["failure"])
    if channel.pending():
        try:
            extra = channel.recv(time.monotonic() + 0.5)
            watch.protocol_violations.append(f"the child sent more than the harness's replies: {str(extra)[:200]}")
        except ChannelClosed:
            pass
        except (ChannelTimeout, ChannelProtocolError) as exc:
            watch.protocol_violations.append(f"the child wrote into the control channel: {exc}")
