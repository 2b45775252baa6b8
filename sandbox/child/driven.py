"""One sandbox child under the parent's control, from its start to its cleanup (parent side).

`sandbox/child/step_driver.py` runs a plan through one child or through two at once; this module holds
what concerns a single child: starting it with the control channel's two pipes, each exchange of
the protocol (request, probe, mark, step, final, exit: see sandbox/child/step_server.py), reading its
process tree from the kernel (sandbox/proc_watch.py) between steps, and killing and reaping it and
anything it left behind. A child's own fault (it died, timed out, broke the protocol) is recorded
in its `DriveOutcome` and ends its plan with `ChildStopped`; it never raises further.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child.channel import Channel, ChannelClosed, ChannelProtocolError, ChannelTimeout
from trainbridge.sandbox.results import ChildWatch, Failure, FailureKind

EXIT_GRACE_S = 5.0  # for a child whose channel closed without its closing message
CHANNEL_FD = 1000  # where a child finds its channel: the same numbers in every child


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

    def evidence_dirs(self) -> list[Path]:
        """The folders the child is asked to leave its evidence in (the probe's gradients, the parameter changes):
        a confined child may write there (sandbox/confinement.py)."""
        paths = [(self.probe or {}).get("grads_path"), self.deltas_path]
        return list(dict.fromkeys(Path(p).parent for p in paths if p))

    def timed(self) -> list[tuple[str, int]]:
        """(phase, batch index) of every timed step, in order."""
        return [("warmup", i) for i in self.warmup] + [("measured", i) for i in self.measured] + [("cooldown", i) for i in self.cooldown]


@dataclass(frozen=True)
class ChildSpec:
    """How to start one timed child: `argv` gets ``--channel R,W`` appended."""

    argv: list[str]
    request: dict[str, Any]
    plan: StepPlan
    cwd: Path
    env: dict[str, str]
    preexec_fn: Any
    timeout_s: float
    stdout_path: Path
    stderr_path: Path
    fork_pool: Any = None  # a sandbox/child/fork_server.py ForkPool: fork the child from a warm server (None: exec `argv`)
    memory_limit_mb: int | None = None  # the cap `preexec_fn` applies, for a forked child
    writable: tuple[str, ...] | None = None  # a forked child's only writable folders (sandbox/child/self_confinement.py)
    ranks: int = 1  # > 1: a torchrun group of ranks (sandbox/child/rank_group.py), argv starts its supervisor


@dataclass
class DriveOutcome:
    failure: Failure | None = None
    warmup_times_s: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    cooldown_times_s: list[float] = field(default_factory=list)
    inner_times_s: list[float] = field(default_factory=list)  # the child's own clock, every timed step in order
    kernels: list[int] = field(default_factory=list)  # NPU kernels per timed step, where the emulated device counts them
    clock_pairs: list[tuple[float, float]] = field(default_factory=list)  # per timed step: (reply read, parent clock; child clock at reply)
    losses: list[float] = field(default_factory=list)  # warm-up and measured steps
    cooldown_losses: list[float] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    result: dict[str, Any] | None = None  # the child's closing message (versions, peak memory)
    watch: ChildWatch = field(default_factory=ChildWatch)
    returncode: int | None = None
    timed_out: bool = False
    interrupted: str | None = None  # ran beside another child whose fault ended both plans: why
    forked: bool = False  # forked from a warm server (under its system-call filter, sandbox/child/signal_filter.py)
    fork_confined: bool = False  # forked, and confined itself (sandbox/child/self_confinement.py)


def record_step(out: DriveOutcome, phase: str, elapsed: float, loss: float) -> None:
    """A timed step's wall time and loss into the outcome's list for its phase (warmup, measured, cooldown)."""
    if phase == "cooldown":
        out.cooldown_times_s.append(elapsed)
        out.cooldown_losses.append(loss)
    else:
        (out.warmup_times_s if phase == "warmup" else out.step_times_s).append(elapsed)
        out.losses.append(loss)


def record_kernels(out: DriveOutcome, reply: dict[str, Any]) -> None:
    """A step reply's device kernel count (sandbox/device_kernels.py), when it has a whole one."""
    kernels = reply.get("kernels")
    if isinstance(kernels, int) and not isinstance(kernels, bool) and kernels >= 0:
        out.kernels.append(kernels)


class ChildStopped(Exception):
    """The child's own fault ended its plan; its outcome says what happened."""

    def __init__(self, child: "DrivenChild"):
        super().__init__(f"child {child.spec.argv[-1]!r} stopped")
        self.child = child


class _ChildFailed(Exception):
    def __init__(self, failure: Failure | None = None):
        self.failure = failure


class DrivenChild:
    """A started child and everything the parent learns about it. `siblings` are the other children
    running at the same time (never counted as this one's descendants); `claims_orphans`: processes
    that escaped their process group and were handed to this process as subreaper are counted
    against this child (with two children alive at once, nothing tells whose they were)."""

    def __init__(self, spec: ChildSpec, *, reaper: bool, claims_orphans: bool = True):
        self.spec, self.out = spec, DriveOutcome()
        self.reaper, self.claims_orphans = reaper, claims_orphans
        self.base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.siblings: set[int] = set()
        self.popen: subprocess.Popen | Any = None  # or a fork_server.ForkedChild
        self._watched: int | None = None  # `watched_pid`, once resolved
        self.channel: Channel | None = None
        self.since: int | None = None
        self._files: list[Any] = []
        self.cores = frozenset(os.sched_getaffinity(0))  # what the child inherits from the gate

    # ---- lifecycle ----
    def start(self) -> bool:
        """Start the child; False (and a `crashed` failure) when it cannot be started."""
        spec = self.spec
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        # the child's ends always get the same numbers (its argv and open files would otherwise tell a child
        # started first from one started second, and so the round it is in): copies at fixed numbers, made
        # just for this start (children are started one at a time) and closed here once it has them
        child_r, child_w = _fixed_fds()
        os.dup2(cmd_r, child_r)
        os.dup2(reply_w, child_w)
        os.close(cmd_r)
        os.close(reply_w)
        stdout, stderr = spec.stdout_path.open("wb"), spec.stderr_path.open("wb")
        self._files = [stdout, stderr]
        try:
            forked = None if spec.fork_pool is None else spec.fork_pool.fork(
                cwd=spec.cwd, env=spec.env, channel=(child_r, child_w), memory_limit_mb=spec.memory_limit_mb,
                fds={"command": child_r, "reply": child_w, "stdout": stdout.fileno(), "stderr": stderr.fileno()},
                writable=spec.writable)
            self.popen = forked or subprocess.Popen([*spec.argv, "--channel", f"{child_r},{child_w}"], cwd=spec.cwd, env=spec.env,
                                                    stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                                    pass_fds=(child_r, child_w), start_new_session=True, preexec_fn=spec.preexec_fn)
        except OSError as exc:
            for fd in (child_r, child_w, cmd_w, reply_r):
                os.close(fd)
            self._close_files()
            self.out.failure = Failure(kind=FailureKind.crashed, message=f"could not start {spec.argv[0]}: {exc}")
            return False
        self.out.forked = forked is not None
        self.out.fork_confined = bool(forked is not None and forked.confined)
        os.close(child_r)
        os.close(child_w)
        self.channel = Channel(reply_r, cmd_w)
        started = proc_watch.read_stat(self.popen.pid)
        self.since = started.start_ticks if started else None
        return True

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def watched_pid(self) -> int:
        """The process the kernel's view is read from: the child itself, below bubblewrap's processes when it is
        confined (sandbox/confinement.py); the gate still waits for, and kills the group of, `pid`."""
        if self._watched is None or self._watched == self.pid:
            self._watched = proc_watch.inner_pid(self.pid)
        return self._watched

    def guarded(self, action, *args):
        """Run one exchange with the child; its faults land in the outcome and raise ChildStopped."""
        try:
            return action(*args)
        except ChannelTimeout:
            self.out.timed_out = True
        except ChannelClosed:
            pass  # died: classified from its exit status at cleanup
        except ChannelProtocolError as exc:
            self.out.watch.protocol_violations.append(f"the child wrote something that is not the harness's reply: {exc}")
        except _ChildFailed as failed:
            if failed.failure is not None:
                self.out.failure = failed.failure
        raise ChildStopped(self)

    def send(self, message: dict[str, Any]) -> None:
        assert self.channel is not None
        try:
            self.channel.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def expect(self, op: str, deadline: float) -> dict[str, Any]:
        assert self.channel is not None
        reply = self.channel.recv(deadline)
        if reply.get("op") == "result":  # the child failed while serving: its closing message says how
            raise _ChildFailed(Failure.model_validate(reply["failure"]) if reply.get("failure") else None)
        if reply.get("op") != op:
            raise ChannelProtocolError(f"expected the reply to {op!r}, got {str(reply)[:200]}")
        return reply

    def step(self, phase: str, index: int, deadline: float) -> float:
        """One timed step on batch `index`: the parent's clock from writing the command to reading the reply."""
        started = time.perf_counter_ns()
        self.send({"op": "step", "index": index})
        reply = self.expect("step", deadline)
        elapsed = (time.perf_counter_ns() - started) / 1e9
        if reply.get("index") != index:
            raise ChannelProtocolError(f"asked for the step on batch {index}, the reply is for {reply.get('index')!r}")
        out = self.out
        loss, inner = float(reply["loss"]), float(reply.get("inner_s", math.nan))
        out.inner_times_s.append(inner)
        record_kernels(out, reply)
        out.clock_pairs.append((started / 1e9 + elapsed, float(reply.get("clock", math.nan))))
        record_step(out, phase, elapsed, loss)
        if not math.isfinite(loss):
            done = len(out.inner_times_s)
            raise _ChildFailed(Failure(kind=FailureKind.nonfinite_loss, message=f"step {done - 1} returned a non-finite loss ({loss})",
                                       step=done - 1))
        return elapsed

    def request_final(self, deadline: float) -> None:
        """`final` (each parameter's change since `mark`), when the plan asks for it."""
        if self.spec.plan.deltas_path is not None:
            self.send({"op": "final", "deltas_path": str(self.spec.plan.deltas_path)})
            self.out.final = self.expect("final", deadline)

    def finish(self, deadline: float) -> None:
        """`final` (when planned), `exit`, and the closing message."""
        out, watch = self.out, self.out.watch
        self.request_final(deadline)
        self.send({"op": "exit"})
        assert self.channel is not None
        closing = self.channel.recv(deadline)
        if closing.get("op") != "result":
            raise ChannelProtocolError(f"expected the closing result, got {str(closing)[:200]}")
        out.result = closing
        watch.replaced = [str(name) for name in closing.get("replaced", [])]
        if isinstance(closing.get("threads_in_use"), int):
            watch.threads_in_use = closing["threads_in_use"]
        if closing.get("failure"):
            out.failure = Failure.model_validate(closing["failure"])
        if self.channel.pending():
            try:
                extra = self.channel.recv(time.monotonic() + 0.5)
                watch.protocol_violations.append(f"the child sent more than the harness's replies: {str(extra)[:200]}")
            except ChannelClosed:
                pass
            except (ChannelTimeout, ChannelProtocolError) as exc:
                watch.protocol_violations.append(f"the child wrote into the control channel: {exc}")

    # ---- the kernel's view ----
    def sample(self) -> proc_watch.TreeSample | None:
        return proc_watch.sample_tree(self.watched_pid, base_nice=self.base_nice, reaper_pid=self._reaper_pid(), since_ticks=self.since,
                                      exclude=self.siblings)

    def note_interference(self) -> None:
        """What another process did *to* this child since the last look: stopped or continued it
        (the parent is told by the kernel), lowered its threads' priority or narrowed their cores
        below what the gate started it with."""
        watch = self.out.watch
        try:
            while True:
                event = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WCONTINUED | os.WNOHANG)
                if event is None:
                    break
                what = "continued" if event.si_code == os.CLD_CONTINUED else f"stopped by signal {_signal_name(event.si_status)}"
                _add(watch.interference, f"the child was {what} by another process")
        except ChildProcessError:
            pass
        for tid, nice, _ in proc_watch.thread_stats(self.watched_pid):
            if nice > self.base_nice:
                _add(watch.interference, f"a thread of the child was moved to nice {nice} (the gate starts it at {self.base_nice})")
            try:
                cores = frozenset(os.sched_getaffinity(tid))
            except OSError:
                continue
            if not cores >= self.cores:  # (a program that pins its own threads reads the same: none of the examples does)
                _add(watch.interference, f"a thread of the child was confined to {len(cores)} of the {len(self.cores)} core(s) the gate gives")

    def _reaper_pid(self) -> int | None:
        return os.getpid() if self.reaper and self.claims_orphans else None

    # ---- cleanup ----
    def survivors(self) -> list[proc_watch.ProcStat]:
        if self.popen is None:
            return []
        return proc_watch.descendants(self.watched_pid, reaper_pid=self._reaper_pid(), since_ticks=self.since,
                                      exclude=self.siblings)

    def close(self, survivors: list[proc_watch.ProcStat]) -> None:
        """Wait briefly, kill the process group, kill and reap what escaped it, close the pipes."""
        out, watch = self.out, self.out.watch
        if self.popen is None:
            return
        try:
            # the closing message is the last thing the harness sends: the interpreter's own shutdown (a second or
            # more with torch loaded) is not waited for; a child that failed to send it gets a short grace
            self.popen.wait(timeout=0 if out.result is not None or out.timed_out or watch.protocol_violations or out.interrupted
                            else EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        known = {s.pid for s in survivors}
        survivors = survivors + [s for s in self.survivors() if s.pid not in known]
        alive = [s for s in survivors if proc_watch.read_stat(s.pid) is not None and s.pgid != self.pid]
        if alive:
            watch.survivors = [f"pid {s.pid} (session {s.sid}, process group {s.pgid})" for s in alive]
            proc_watch.kill_all(alive)
        for stat in alive:  # orphans handed to us as subreaper are our children now: reap them
            if stat.ppid == os.getpid():
                try:
                    os.waitpid(stat.pid, 0)
                except ChildProcessError:
                    pass
        assert self.channel is not None
        self.channel.close()
        self._close_files()
        out.returncode = self.popen.returncode

    def _close_files(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []


def _fixed_fds() -> tuple[int, int]:
    """The two descriptor numbers every child's channel ends get: high, below the open-files limit,
    and free in this process (else the next free pair above them, and a child could tell)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    first = max(16, min(CHANNEL_FD, soft - 2) if soft != resource.RLIM_INFINITY else CHANNEL_FD)
    while _is_open(first) or _is_open(first + 1):
        first += 2
    return first, first + 1


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _add(items: list[str], text: str) -> None:
    if text not in items:
        items.append(text)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
