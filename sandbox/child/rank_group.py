"""A group of ranks under the parent's control, as one timed child (parent side): `torchrun --nproc_per_node N`.

sandbox/child/step_driver.py drives a `RankGroupChild` exactly as it drives one child (`child_for` picks
it when `ChildSpec.ranks` > 1), in `drive` and in `drive_pair` alike. The group is one sandbox
process, sandbox/child/rank_supervisor.py, which starts the ranks inside the same confinement (network
namespace, memory cap, process group, scrubbed environment); the parent holds one control channel
per rank and speaks the usual protocol (sandbox/child/step_server.py) to every rank at once:

- a command goes to every rank (the probe's and the parameter deltas' files get a per-rank name;
  rank 0 keeps the gate's), and its reply is the group's when *every* rank has answered;
- a `step` is timed on the parent's clock from writing the commands to reading the slowest rank's
  reply: that is the group's step time, the one the gate judges. Each rank's own time (to its
  reply) is kept too, and goes to the result's `extra["script"]["ranks"]`;
- the loss of a step is the mean of the ranks' losses (what an all-reduce of the loss gives); the
  numerics probe's gradients are rank 0's (after DDP's all-reduce), its losses the ranks' mean;
- the kernel's view (CPU, threads, priorities) sums the ranks: a rank is the child, not a helper;
  only what a rank starts itself counts as a helper process;
- a rank's failure ends the group: its closing message, its death (the supervisor kills the
  others at once, so no peer waits in a collective) or its silence until the deadline become one
  typed failure naming the rank, with that rank's output tail.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child.channel import Channel, ChannelClosed, ChannelProtocolError, ChannelTimeout
from trainbridge.sandbox.child.driven import CHANNEL_FD, ChildSpec, ChildStopped, DrivenChild, record_kernels, record_step
from trainbridge.sandbox.child.rank_supervisor import RANKS_LOG, rank_output
from trainbridge.sandbox.results import Failure, FailureKind
from trainbridge.sandbox.script.launch import rank_threads

TAIL_CHARS = 2000
REAP_WAIT_S = 5.0  # for killed ranks to finish exiting
SETTLE_S = 1.0  # after one rank failed: how long its peers' own closing messages are waited for (to name the first cause)
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo", "Gloo", "ProcessGroup")


def child_for(spec: ChildSpec, *, reaper: bool, claims_orphans: bool = True) -> DrivenChild:
    """The driven child for `spec`: one process, or a group of `spec.ranks` ranks."""
    if spec.ranks > 1:
        return RankGroupChild(spec, reaper=reaper, claims_orphans=claims_orphans)
    return DrivenChild(spec, reaper=reaper, claims_orphans=claims_orphans)


class RankFailed(Exception):
    """A rank's own failure ended the group's plan (its closing message, a non-finite loss); `failure` says which rank."""

    def __init__(self, failure: Failure | None):
        super().__init__(failure.message if failure is not None else "a rank failed")
        self.failure = failure


class RankGroupChild(DrivenChild):
    """The rank supervisor's process and one channel per rank (see the module doc)."""

    def __init__(self, spec: ChildSpec, *, reaper: bool, claims_orphans: bool = True):
        super().__init__(spec, reaper=reaper, claims_orphans=claims_orphans)
        self.ranks = spec.ranks
        self.channels: list[Channel] = []
        self.output_dir = spec.stdout_path.parent
        self.rank_step_times_s: list[list[float]] = [[] for _ in range(self.ranks)]
        self.rank_losses: list[list[float]] = [[] for _ in range(self.ranks)]
        self.rank_inner_s: list[list[float]] = [[] for _ in range(self.ranks)]
        self.probe_rank_losses: list[list[float]] = []
        self.failed_rank: int | None = None
        self.silent_ranks: list[int] = []
        self._rank_pids: list[int] = []

    # ---- lifecycle ----
    def start(self) -> bool:
        spec = self.spec
        pipes = [(os.pipe(), os.pipe()) for _ in range(self.ranks)]  # per rank: (command r, w), (reply r, w)
        fixed = _fixed_block(2 * self.ranks)  # the ranks' ends, at the same numbers in every group
        for rank, ((cmd_r, _), (_, reply_w)) in enumerate(pipes):
            os.dup2(cmd_r, fixed[2 * rank])
            os.dup2(reply_w, fixed[2 * rank + 1])
            os.close(cmd_r)
            os.close(reply_w)
        stdout, stderr = spec.stdout_path.open("wb"), spec.stderr_path.open("wb")
        self._files = [stdout, stderr]
        argv = [*spec.argv, "--ranks", str(self.ranks), "--output-dir", str(self.output_dir), "--channels", ",".join(map(str, fixed))]
        try:
            self.popen = subprocess.Popen(argv, cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                          pass_fds=tuple(fixed), start_new_session=True, preexec_fn=spec.preexec_fn)
        except OSError as exc:
            for fd in fixed:
                os.close(fd)
            for (_, cmd_w), (reply_r, _) in pipes:
                os.close(cmd_w)
                os.close(reply_r)
            self._close_files()
            self.out.failure = Failure(kind=FailureKind.crashed, message=f"could not start the rank group ({spec.argv[0]}): {exc}")
            return False
        for fd in fixed:
            os.close(fd)
        self.channels = [Channel(reply_r, cmd_w) for (_, cmd_w), (reply_r, _) in pipes]
        self.channel = self.channels[0]
        started = proc_watch.read_stat(self.popen.pid)
        self.since = started.start_ticks if started else None
        return True

    def close(self, survivors: list[proc_watch.ProcStat]) -> None:
        if self.popen is not None and self.out.failure is not None and self.popen.poll() is None:
            try:  # a rank reported its failure: its peers may wait in a collective, nothing is left to wait for
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        super().close(survivors)
        for channel in self.channels[1:]:
            channel.close()
        self._reap_ranks()
        if self.popen is not None and self.out.failure is None and self.out.result is None:
            self.out.failure = self._group_failure()

    def _reap_ranks(self) -> None:
        """The ranks died with the group's process group; wait (at most REAP_WAIT_S) until each is gone, reaping those
        handed to this process as subreaper (a rank still exiting when the group was reaped would stay a zombie)."""
        deadline = time.monotonic() + REAP_WAIT_S
        me = os.getpid()
        for pid in self.rank_pids():
            while True:
                stat = proc_watch.read_stat(pid)
                if stat is None or (self.since is not None and stat.start_ticks < self.since):
                    break  # gone (or the number is another process's now)
                if stat.state == "Z" and stat.ppid == me:
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)

    # ---- the protocol, to every rank ----
    def guarded(self, action, *args):
        """As for one child; a rank's failure lands in the outcome too."""
        try:
            return super().guarded(action, *args)
        except RankFailed as failed:
            if failed.failure is not None:
                self.out.failure = failed.failure
            raise ChildStopped(self) from None

    def send(self, message: dict[str, Any]) -> None:
        for rank, channel in enumerate(self.channels):
            try:
                channel.send(self._for_rank(rank, message))
            except (BrokenPipeError, OSError) as exc:
                self.failed_rank = rank if self.failed_rank is None else self.failed_rank
                raise ChannelClosed(f"rank {rank}: {exc}") from exc

    def _for_rank(self, rank: int, message: dict[str, Any]) -> dict[str, Any]:
        if "op" not in message:  # the request
            return {**message, "threads": rank_threads(int(message["threads"]), self.ranks), "rank": rank}
        if rank == 0:
            return message
        renamed = {key: f"{value}.rank{rank}" for key, value in message.items() if key in ("grads_path", "deltas_path")}
        return {**message, **renamed}

    def expect(self, op: str, deadline: float) -> dict[str, Any]:
        replies, _ = self._gather(op, deadline)
        if op != "probe":
            return replies[0]
        reports = [replies[rank]["report"] for rank in range(self.ranks)]
        self.probe_rank_losses = [list(map(float, report["losses"])) for report in reports]
        losses = [_mean(values) for values in zip(*self.probe_rank_losses)]
        return {**replies[0], "report": {**reports[0], "losses": losses, "grad_loss": losses[0] if losses else reports[0]["grad_loss"]}}

    def step(self, phase: str, index: int, deadline: float) -> float:
        """One step of every rank: the parent's clock until the slowest rank's reply."""
        started = time.perf_counter_ns()
        self.send({"op": "step", "index": index})
        replies, arrived = self._gather("step", deadline)
        per_rank = [(arrived[rank] - started) / 1e9 for rank in range(self.ranks)]
        elapsed = max(per_rank)
        for rank in range(self.ranks):
            if replies[rank].get("index") != index:
                raise ChannelProtocolError(f"rank {rank}: asked for the step on batch {index}, the reply is for "
                                           f"{replies[rank].get('index')!r}")
        losses = [float(replies[rank]["loss"]) for rank in range(self.ranks)]
        inner = [float(replies[rank].get("inner_s", math.nan)) for rank in range(self.ranks)]
        for rank in range(self.ranks):
            self.rank_step_times_s[rank].append(per_rank[rank])
            self.rank_losses[rank].append(losses[rank])
            self.rank_inner_s[rank].append(inner[rank])
        out, loss = self.out, _mean(losses)
        out.inner_times_s.append(max((t for t in inner if t == t), default=math.nan))
        record_kernels(out, replies[0])  # rank 0's device: every rank runs the same program
        out.clock_pairs.append((started / 1e9 + per_rank[0], float(replies[0].get("clock", math.nan))))
        record_step(out, phase, elapsed, loss)
        bad = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            done = len(out.inner_times_s)
            raise RankFailed(Failure(kind=FailureKind.nonfinite_loss, step=done - 1, message=(
                f"step {done - 1} returned a non-finite loss on rank {bad[0]} of {self.ranks} ({losses[bad[0]]})")))
        return elapsed

    def finish(self, deadline: float) -> None:
        out, watch = self.out, self.out.watch
        self.request_final(deadline)
        self.send({"op": "exit"})
        closings, _ = self._gather("result", deadline, closing=True)
        first = closings[0]
        watch.replaced = sorted({str(name) for c in closings.values() for name in c.get("replaced", [])})
        counts = [c["threads_in_use"] for c in closings.values() if isinstance(c.get("threads_in_use"), int)]
        watch.threads_in_use = sum(counts) if counts else None  # the group's: the gate's threads are shared among the ranks
        failed = [rank for rank in range(self.ranks) if closings[rank].get("failure")]
        if failed:
            out.failure = self._rank_failure(failed[0], closings[failed[0]])
        peaks = [c["peak_memory_bytes"] for c in closings.values() if isinstance(c.get("peak_memory_bytes"), int)]
        script = dict(first.get("script") or {})
        script["ranks"] = self.rank_record(closings)
        out.result = {**first, "peak_memory_bytes": max(peaks) if peaks else first.get("peak_memory_bytes"), "script": script}
        for rank, channel in enumerate(self.channels):
            if channel.pending():
                try:
                    extra = channel.recv(time.monotonic() + 0.5)
                    watch.protocol_violations.append(f"rank {rank} sent more than the harness's replies: {str(extra)[:200]}")
                except ChannelClosed:
                    pass
                except (ChannelTimeout, ChannelProtocolError) as exc:
                    watch.protocol_violations.append(f"rank {rank} wrote into the control channel: {exc}")

    def rank_record(self, closings: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """What each rank did, for the result's extra["script"]["ranks"]: its step times on the parent's clock
        (every timed step, in order), its losses and own clock, which rank was slowest at each step."""
        times = self.rank_step_times_s
        slowest = [max(range(self.ranks), key=lambda rank: times[rank][k]) for k in range(len(times[0]))]
        return {"world_size": self.ranks, "threads_per_rank": rank_threads(int(self.spec.request.get("threads", 1)), self.ranks),
                "step_times_s": times, "losses": self.rank_losses, "inner_s": self.rank_inner_s, "slowest_rank": slowest,
                "probe_losses": self.probe_rank_losses,
                "steps_done": [int((closings[rank].get("script") or {}).get("steps_done", 0)) for rank in range(self.ranks)],
                "peak_memory_bytes": [closings[rank].get("peak_memory_bytes") for rank in range(self.ranks)]}

    def _gather(self, op: str, deadline: float, *, closing: bool = False) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
        """Every rank's reply to `op` (and when each was read, on the parent's clock). A rank's closing message in
        its place (it failed) raises RankFailed naming the rank; `closing`: closing messages are the replies."""
        replies: dict[int, dict[str, Any]] = {}
        arrived: dict[int, int] = {}
        waiting = set(range(self.ranks))
        while waiting:
            ready = [rank for rank in sorted(waiting) if self.channels[rank].pending()]
            if not ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.silent_ranks = sorted(waiting)
                    raise ChannelTimeout(f"no reply to {op!r} from rank(s) {', '.join(map(str, sorted(waiting)))}")
                select.select([self.channels[rank].read_fd for rank in waiting], [], [], left)
                continue
            for rank in ready:
                try:
                    reply = self.channels[rank].recv(deadline)
                except ChannelClosed:
                    self.failed_rank = rank if self.failed_rank is None else self.failed_rank
                    raise
                except ChannelTimeout:
                    self.silent_ranks = sorted(waiting)
                    raise
                except ChannelProtocolError as exc:
                    raise ChannelProtocolError(f"rank {rank}: {exc}") from exc
                arrived[rank] = time.perf_counter_ns()
                if reply.get("op") == "result" and not closing:
                    raise RankFailed(self._first_cause(rank, reply, waiting - {rank}))
                if reply.get("op") != op:
                    raise ChannelProtocolError(f"rank {rank}: expected the reply to {op!r}, got {str(reply)[:200]}")
                replies[rank] = reply
                waiting.discard(rank)
        return replies, arrived

    def _first_cause(self, rank: int, reply: dict[str, Any], others: set[int]) -> Failure | None:
        """The failure that ended the group: `rank`'s, unless it only reports a peer that went away (a collective
        whose peer failed) and a peer's own closing message, read within SETTLE_S, gives the cause."""
        found = {rank: reply}
        closed = False  # a peer's channel closed: it died, and the supervisor's log says how
        settle = time.monotonic() + SETTLE_S
        while others and _looks_like_peer_error(reply) and time.monotonic() < settle:
            readable, _, _ = select.select([self.channels[r].read_fd for r in others], [], [], max(0.0, settle - time.monotonic()))
            for fd in readable:
                other = next(r for r in others if self.channels[r].read_fd == fd)
                others = others - {other}
                try:
                    message = self.channels[other].recv(settle)
                except ChannelClosed:
                    closed = True
                    continue
                except (ChannelTimeout, ChannelProtocolError):
                    continue
                if message.get("op") == "result" and message.get("failure"):
                    found[other] = message
            causes = [r for r, m in found.items() if not _looks_like_peer_error(m)]
            if causes:
                rank, reply = causes[0], found[causes[0]]
                break
        if _looks_like_peer_error(reply) and closed:
            while time.monotonic() < settle + SETTLE_S:
                death = self._death()
                if death is not None:
                    return death
                time.sleep(0.05)
        if not reply.get("failure"):
            return None
        return self._rank_failure(rank, reply)

    def _rank_failure(self, rank: int, closing: dict[str, Any]) -> Failure:
        self.failed_rank = rank
        failure = Failure.model_validate(closing["failure"])
        failure.message = f"rank {rank} of {self.ranks}: {failure.message}"
        if not failure.traceback_tail and rank > 0:
            failure.traceback_tail = self.rank_tail(rank) or None
        return failure

    def _group_failure(self) -> Failure | None:
        """A death or a silence of the group, classified (out.failure was not set by a rank's own message)."""
        done = len(self.out.inner_times_s)
        if self.out.timed_out:
            silent = self.silent_ranks or list(range(self.ranks))
            who = ", ".join(map(str, silent))
            tails = "\n".join(f"[rank {rank}] {self.rank_tail(rank)[-600:]}" for rank in silent)
            return Failure(kind=FailureKind.timeout, step=done, traceback_tail=tails or None, message=(
                f"no reply from rank(s) {who} of {self.ranks} within the {self.spec.timeout_s:g} s limit: a rank hung (a peer that "
                f"waits in a collective shows as silent too); the whole group was killed after {done} step(s)"))
        death = self._death()
        if death is not None:
            return death
        if self.failed_rank is not None:
            return Failure(kind=FailureKind.crashed, step=done, traceback_tail=self.rank_tail(self.failed_rank) or None,
                           message=f"rank {self.failed_rank} of {self.ranks} closed its control channel after {done} step(s) "
                                   "without a result; the whole group was killed")
        return None  # the supervisor itself: classified from its exit status by the runner

    def _death(self) -> Failure | None:
        """The first rank the supervisor saw die (a signal or a non-zero status), as a failure; None: none died."""
        exits = [event for event in self._events() if event.get("event") == "exited" and event.get("failed")]
        if not exits:
            return None
        done = len(self.out.inner_times_s)
        rank, status = int(exits[0]["rank"]), str(exits[0]["status"])
        kind = FailureKind.oom if status == "signal SIGKILL" else FailureKind.crashed
        cause = "; most likely the kernel's out-of-memory killer" if kind == FailureKind.oom else ""
        self.failed_rank = rank
        return Failure(kind=kind, step=done, traceback_tail=self.rank_tail(rank) or None, message=(
            f"rank {rank} of {self.ranks} died ({status}) after {done} step(s) without a result{cause}; the other ranks "
            "were killed with it"))

    # ---- what the ranks wrote ----
    def rank_tail(self, rank: int) -> str:
        paths = (self.spec.stdout_path, self.spec.stderr_path) if rank == 0 else rank_output(self.output_dir, rank)
        text = "".join(_read(path) for path in paths)
        return text[-TAIL_CHARS:].strip()

    def _events(self) -> list[dict[str, Any]]:
        events = []
        for line in _read(self.output_dir / RANKS_LOG).splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return events

    def rank_pids(self) -> list[int]:
        """The ranks' pids on this host (a confined supervisor logs its own namespace's: mapped to the host's)."""
        if len(self._rank_pids) < self.ranks:
            logged = [int(e["pid"]) for e in self._events() if e.get("event") == "started"]
            self._rank_pids = proc_watch.host_pids(self.pid, logged) if self.watched_pid != self.pid else logged
        return self._rank_pids

    # ---- the kernel's view: the ranks are the child ----
    def sample(self) -> proc_watch.TreeSample | None:
        supervisor = self.watched_pid  # below bubblewrap's processes when confined
        top = proc_watch.read_stat(supervisor)
        if top is None:
            return None
        ranks = set(self.rank_pids())
        tree = proc_watch.descendants(supervisor, reaper_pid=self._reaper_pid(), since_ticks=self.since, exclude=self.siblings)
        helpers = [stat for stat in tree if stat.pid not in ranks]
        own = proc_watch.thread_cpu_ns(supervisor)
        cpu = own if own is not None else top.cpu_ns
        threads, raised = 0, []
        for stat in tree:
            if stat.pid not in ranks:
                continue
            live = proc_watch.thread_cpu_ns(stat.pid)
            cpu += live if live is not None else stat.cpu_ns
            threads += stat.threads
            for _, nice, policy in proc_watch.thread_stats(stat.pid):
                if nice < self.base_nice:
                    raised.append(f"a thread of a rank runs at nice {nice} (the gate starts it at {self.base_nice})")
                if policy not in (0, 3, 5):
                    raised.append(f"a thread of a rank runs under {proc_watch.SCHED_POLICIES.get(policy, policy)}")
        for stat in helpers:
            if stat.nice < self.base_nice:
                raised.append(f"process {stat.pid} runs at nice {stat.nice}")
            if stat.policy not in (0, 3, 5):
                raised.append(f"process {stat.pid} runs under {proc_watch.SCHED_POLICIES.get(stat.policy, stat.policy)}")
        helper_ns = sum(stat.cpu_ns for stat in helpers)
        return proc_watch.TreeSample(cpu_ns=cpu + helper_ns, child_threads=threads, helper_cpu_ns=helper_ns,
                                     descendants=[stat.pid for stat in helpers], raised_priority=sorted(set(raised)))

    def note_interference(self) -> None:
        super().note_interference()
        watch = self.out.watch
        for pid in self.rank_pids():
            stat = proc_watch.read_stat(pid)
            if stat is not None and stat.state in ("T", "t"):  # not this process's child: the kernel tells its parent, not us
                _add(watch.interference, "a rank was stopped by another process")
            for tid, nice, _ in proc_watch.thread_stats(pid):
                if nice > self.base_nice:
                    _add(watch.interference, f"a thread of a rank was moved to nice {nice} (the gate starts it at {self.base_nice})")
                try:
                    cores = frozenset(os.sched_getaffinity(tid))
                except OSError:
                    continue
                if not cores >= self.cores:
                    _add(watch.interference, f"a thread of a rank was confined to {len(cores)} of the {len(self.cores)} core(s) the gate gives")


def _fixed_block(count: int) -> list[int]:
    """`count` consecutive descriptor numbers free in this process, from CHANNEL_FD (below the open-files limit)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    first = max(16, min(CHANNEL_FD, soft - count) if soft != resource.RLIM_INFINITY else CHANNEL_FD)
    while any(_is_open(fd) for fd in range(first, first + count)):
        first += count
    return list(range(first, first + count))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _looks_like_peer_error(closing: dict[str, Any]) -> bool:
    failure = closing.get("failure") or {}
    text = f"{failure.get('message', '')} {failure.get('traceback_tail') or ''}"
    return any(marker in text for marker in _PEER_ERRORS)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _add(items: list[str], text: str) -> None:
    if text not in items:
        items.append(text)
