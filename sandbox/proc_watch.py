"""The kernel's view of a sandbox child, read by the parent from /proc (nothing the child can rebind).

The gate does not believe what a child says about its own time or resources. This module reads, for
a child and every process descended from it: CPU time (per thread, nanoseconds where the kernel
keeps them), thread counts, scheduling priority (nice value and policy), and which processes are
still alive. A process that escapes the child's process group (`setsid`, a double fork) would be
reparented to init and lost; with `become_subreaper()` the parent receives such orphans instead,
so they are found, counted and killed.

Linux only: on other systems every reader returns None and the callers skip the checks that need
it (and say so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_PROC = Path("/proc")
_PR_SET_CHILD_SUBREAPER = 36
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SCHED_POLICIES = {0: "SCHED_OTHER", 1: "SCHED_FIFO", 2: "SCHED_RR", 3: "SCHED_BATCH", 5: "SCHED_IDLE", 6: "SCHED_DEADLINE"}
_NORMAL_POLICIES = {0, 3, 5}  # other, batch, idle: none of them gains priority over a normal process


def available() -> bool:
    return (_PROC / "self" / "stat").exists()


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4). True when set."""
    if not available():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    cpu_ns: int  # user + system time of all its threads, live and exited (clock-tick resolution)
    nice: int
    threads: int
    policy: int
    start_ticks: int


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has, though not yet reaped)."""
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def read_stat(pid: int) -> ProcStat | None:
    """/proc/<pid>/stat, parsed (None when the process is gone)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field n is rest[n - 3]
    utime, stime = int(rest[11]), int(rest[12])
    return ProcStat(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]), state=rest[0],
                    cpu_ns=(utime + stime) * 1_000_000_000 // _TICKS, nice=int(rest[16]), threads=int(rest[17]),
                    policy=int(rest[38]) if len(rest) > 38 else 0, start_ticks=int(rest[19]))


def thread_cpu_ns(pid: int) -> int | None:
    """CPU time of the live threads of `pid` in nanoseconds (schedstat), or None."""
    total = 0
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
            continue
    return total


def thread_stats(pid: int) -> list[tuple[int, int, int]]:
    """(thread id, nice, policy) of every live thread of `pid` (a thread's priority can differ from its process's)."""
    out = []
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return out
    for task in tasks:
        try:
            text = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        rest = text[text.rindex(")") + 2:].split()
        out.append((int(task.name), int(rest[16]), int(rest[38]) if len(rest) > 38 else 0))
    return out


def all_stats() -> list[ProcStat]:
    stats = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat is not None:
                stats.append(stat)
    return stats


SANDBOX_TOOL = "bwrap"  # bubblewrap's processes stand between a confined child and the gate (sandbox/confinement.py)


def comm(pid: int) -> str | None:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def inner_pid(pid: int) -> int:
    """The process a confined child really is: below bubblewrap's own processes (the outer one, which the gate
    started, and the namespace's init), the first that is not bubblewrap's; `pid` itself when it is not
    bubblewrap's, or when nothing is below it yet."""
    while comm(pid) == SANDBOX_TOOL:
        below = [s.pid for s in all_stats() if s.ppid == pid and s.state != "Z"]
        if len(below) != 1:
            return pid
        pid = below[0]
    return pid


def host_pids(root_pid: int, inner: list[int]) -> list[int]:
    """The host's pids of processes below `root_pid` that a PID namespace knows as `inner` (its own pids: a
    confined child reports those), in the same order; a pid not found is kept as given."""
    by_inner = {}
    for stat in descendants(root_pid):
        try:
            line = next(x for x in (_PROC / str(stat.pid) / "status").read_text().splitlines() if x.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        levels = line.split()[1:]
        if len(levels) > 1:
            by_inner[int(levels[-1])] = stat.pid
    return [by_inner.get(pid, pid) for pid in inner]


def descendants(root_pid: int, *, reaper_pid: int | None = None, since_ticks: int | None = None,
                exclude: set[int] | frozenset[int] = frozenset()) -> list[ProcStat]:
    """Processes descended from `root_pid` (not itself): by parent links, by its session and process
    group, and (with `reaper_pid`, the subreaper) orphans reparented to the reaper that started after
    `since_ticks` (the child's start) and are not the root. `exclude`: other children of the reaper
    running at the same time (sandbox siblings): neither they nor their own descendants count."""
    stats = all_stats()
    if exclude:
        stats = [s for s in stats if s.pid not in exclude and s.sid not in exclude and s.pgid not in exclude]
    by_parent: dict[int, list[ProcStat]] = {}
    for stat in stats:
        by_parent.setdefault(stat.ppid, []).append(stat)
    found: dict[int, ProcStat] = {}
    frontier = [root_pid]
    if reaper_pid is not None:
        for stat in by_parent.get(reaper_pid, []):
            if stat.pid != root_pid and (since_ticks is None or stat.start_ticks >= since_ticks):
                found[stat.pid] = stat
                frontier.append(stat.pid)
    for stat in stats:
        if stat.pid != root_pid and (stat.sid == root_pid or stat.pgid == root_pid):
            found[stat.pid] = stat
            frontier.append(stat.pid)
    while frontier:
        pid = frontier.pop()
        for stat in by_parent.get(pid, []):
            if stat.pid not in found and stat.pid != root_pid:
                found[stat.pid] = stat
                frontier.append(stat.pid)
    return [s for s in found.values() if s.state != "Z"]


def kill_all(stats: list[ProcStat]) -> None:
    for stat in stats:
        try:
            os.kill(stat.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def reap_orphans(since_ticks: int | None, exclude: int | set[int]) -> int:
    """Collect the exited orphans handed to this process as subreaper that started after `since_ticks`
    (a sandbox child's start: its descendants), never `exclude` (the child itself, which its Popen
    waits for). A Popen of another thread started after the child could match too and lose its
    status; TrainBridge runs sandbox children from one thread at a time. Returns how many."""
    reaped = 0
    me = os.getpid()
    excluded = {exclude} if isinstance(exclude, int) else set(exclude)
    for stat in all_stats():
        if stat.ppid != me or stat.state != "Z" or stat.pid in excluded:
            continue
        if since_ticks is not None and stat.start_ticks < since_ticks:
            continue
        try:
            os.waitpid(stat.pid, os.WNOHANG)
            reaped += 1
        except ChildProcessError:
            pass
    return reaped


def run_reaping(argv: list[str], *, timeout: float, settle_s: float = 1.0) -> subprocess.CompletedProcess:
    """`subprocess.run(argv)` (output captured as text) for a short command that leaves orphans behind (bubblewrap
    with a PID namespace: its inner process outlives the outer one), which a subreaper receives: reap those that
    started after it, waiting up to `settle_s` for them to exit, so that none stays a zombie of this process."""
    me = os.getpid()
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        stat = read_stat(proc.pid)
        since = stat.start_ticks if stat is not None else None
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    if since is not None:
        deadline = time.monotonic() + settle_s
        while True:
            reap_orphans(since, exclude=proc.pid)
            left = [s for s in all_stats() if s.ppid == me and s.pid != proc.pid and s.start_ticks >= since and s.state != "Z"]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@dataclass
class TreeSample:
    """One reading of a child's process tree."""

    cpu_ns: int  # the child (live and exited threads) plus its live descendants
    child_threads: int
    helper_cpu_ns: int = 0  # the live descendants alone
    descendants: list[int] = field(default_factory=list)
    raised_priority: list[str] = field(default_factory=list)


def sample_tree(pid: int, *, base_nice: int, reaper_pid: int | None, since_ticks: int | None,
                exclude: set[int] | frozenset[int] = frozenset()) -> TreeSample | None:
    stat = read_stat(pid)
    if stat is None:
        return None
    live = thread_cpu_ns(pid)
    # schedstat keeps nanoseconds (live threads only); stat keeps clock ticks (10 ms), exited threads included
    cpu = live if live is not None else stat.cpu_ns
    kids = descendants(pid, reaper_pid=reaper_pid, since_ticks=since_ticks, exclude=exclude)
    helpers = sum(k.cpu_ns for k in kids)
    cpu += helpers
    raised = []
    for _, nice, policy in thread_stats(pid):
        if nice < base_nice:
            raised.append(f"a thread of the child runs at nice {nice} (the gate starts it at {base_nice})")
        if policy not in _NORMAL_POLICIES:
            raised.append(f"a thread of the child runs under {SCHED_POLICIES.get(policy, policy)}")
    for kid in kids:
        if kid.nice < base_nice:
            raised.append(f"process {kid.pid} runs at nice {kid.nice}")
        if kid.policy not in _NORMAL_POLICIES:
            raised.append(f"process {kid.pid} runs under {SCHED_POLICIES.get(kid.policy, kid.policy)}")
    return TreeSample(cpu_ns=cpu, child_threads=stat.threads, helper_cpu_ns=helpers, descendants=[k.pid for k in kids], raised_priority=sorted(set(raised)))
