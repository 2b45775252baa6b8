"""`kill` (SIGTERM) or Ctrl-C of a TrainBridge command ends its sandbox children too.

Every sandbox child runs in a session of its own (so a timeout kills its whole tree), which also
puts it out of reach of a signal sent to TrainBridge's own process group. By default SIGTERM ends
the Python process at once: no `finally` runs, and a child blocked on its control channel, or a
script that catches the channel's end in its own `except Exception`, went on running, reparented
to init. `run_terminable(app)`:

1. turns SIGTERM into `Terminated` (a BaseException, like Ctrl-C's KeyboardInterrupt) in the main
   thread, so the code that holds a child unwinds through its `finally` (the child's process group
   killed and reaped, its scratch folder removed);
2. then kills whatever is left below this process: every descendant, and every process in a session
   that a child of this process leads (orphans handed to it as subreaper included);
3. and ends the process with status 143 (128 + SIGTERM) without waiting for other threads, which
   could otherwise record a verdict on a child that step 2 killed. The run's state is what its last
   checkpoint holds, as after `kill -9`: `trainbridge resume` continues it.

Ctrl-C (SIGINT) is the same with KeyboardInterrupt, status 130, and a line saying so at once: the first one
unwinds the command (which prints its resume line), every later SIGINT or SIGTERM is ignored until the cleanup
is done (a second Ctrl-C half a second later used to cut the cleanup short and orphan the user's script).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM reached the process (BaseException: `except Exception` in user-facing code must not swallow it)."""


EXIT_INTERRUPTED = 128 + signal.SIGINT
_interrupted: list[int] = []  # the SIGINT that reached the process, once it has


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Terminated()


def _raise_interrupted(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt as Python's own handler raises it, once. People press Ctrl-C twice: the second
    used to land in the cleanup's `finally` and leave the user's script running under init."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _interrupted.append(signum)
    print("trainbridge: interrupted (Ctrl-C): ending its sandbox processes; further Ctrl-C are ignored until that is done",
          file=sys.stderr, flush=True)
    raise KeyboardInterrupt()


def run_terminable(app: Callable[[], object]) -> None:
    """Run the command line `app` with SIGTERM and SIGINT handled as the module doc says."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when the caller ignores Ctrl-C
        signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        app()
    except Terminated:
        _end("terminated (SIGTERM); its sandbox processes were ended", EXIT_TERMINATED)
    except (KeyboardInterrupt, SystemExit) as exc:
        if not _interrupted:
            raise
        if isinstance(exc, SystemExit) and exc.code in (0, None):  # the command handled its Ctrl-C (serve stops so)
            kill_descendants()
            raise
        _end("interrupted (Ctrl-C); its sandbox processes were ended", EXIT_INTERRUPTED)


def _end(what: str, status: int) -> None:
    kill_descendants()
    print(f"trainbridge: {what}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _stats() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, state) of every process readable in /proc."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry.name)] = (int(fields[1]), int(fields[3]), fields[0])
    return stats


def sandbox_processes(root: int | None = None) -> list[int]:
    """Every live process below `root` (default: this process): its descendants, and the members of the sessions
    its descendants lead."""
    root = os.getpid() if root is None else root
    stats = _stats()
    below: set[int] = set()
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in stats.items():
            if ppid == parent and pid not in below:
                below.add(pid)
                frontier.append(pid)
    sessions = {pid for pid in below if stats[pid][1] == pid}
    below |= {pid for pid, (_, sid, _) in stats.items() if sid in sessions and pid != root}
    return sorted(pid for pid in below if stats.get(pid, (0, 0, "Z"))[2] != "Z")


def kill_descendants(root: int | None = None) -> list[int]:
    """SIGKILL `sandbox_processes(root)` and reap the ones that are this process's children; returns their pids."""
    pids = sandbox_processes(root)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not ours to reap (a grandchild, or one its own parent reaps)
    return pids
