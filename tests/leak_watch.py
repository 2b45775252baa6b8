"""Processes a test file left behind (a pytest plugin, loaded by tests/conftest.py): after each file's tests and
teardown, what the file started and is still alive is listed, then killed, so that a leak (a training script orphaned
by an interrupt, a fork server or Ray worker whose owner died) neither burns one of CI's two cores through the timing
tests after it nor goes unseen. The end of the run prints every leak with its file; the run does not fail on them.

A process is the file's when it started after the file's first test began and it is a descendant of this pytest, or
its command line or working folder lies in this run's temporary folder, or it is an orphan (adopted by init, or by a
subreaper above this pytest) started from this suite's virtual environment (`sys.prefix`: nothing else ties an orphan to us; another checkout's
suite has another). Linux only (/proc); elsewhere the plugin does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

GRACE_S = 5.0  # a process that is on its way out (Ray's workers, a server told to stop) gets this long
_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Leak:
    file: str
    pid: int
    command: str


_leaks: list[Leak] = []
_file_started: dict[str, float] = {}  # test file -> boot-relative seconds when its first test began


def _uptime() -> float:
    return float((_PROC / "uptime").read_text().split()[0])


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, start time in seconds since boot) of `pid`, or None when it is gone or a zombie."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19]) / _TICKS


def _command(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _link(pid: int, name: str) -> str:
    try:
        return os.readlink(_PROC / str(pid) / name)
    except OSError:
        return ""


def _ours(pid: int, table: dict[int, tuple[int, float]], basetemp: str, prefix: str, ancestors: set[int]) -> bool:
    seen, cursor = set(), pid
    while cursor in table and cursor not in seen:
        if cursor == os.getpid():
            return True
        seen.add(cursor)
        cursor = table[cursor][0]
    command = _command(pid)
    if basetemp and (basetemp in command or _link(pid, "cwd").startswith(basetemp)):
        return True
    # an orphan (adopted by init, or by a subreaper above this pytest: a suite that runs this one as a test) of this
    # suite's own interpreter (its virtual environment's path, not the interpreter it links to, which another
    # checkout's suite or any other program shares)
    parent = table[pid][0]
    return (parent in (0, 1) or parent in ancestors) and command.startswith(prefix + os.sep)


def _ancestors() -> set[int]:
    found, cursor = set(), os.getpid()
    while cursor > 1 and cursor not in found:
        found.add(cursor)
        parent = _stat(cursor)
        cursor = parent[0] if parent else 0
    return found


def alive_since(started: float, basetemp: str, prefix: str) -> list[int]:
    """Processes of this suite, other than pytest and its ancestors, that started at or after `started`."""
    table = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (info := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = info
    skip = _ancestors()
    above = skip - {os.getpid()}
    return sorted(pid for pid, (_, start) in table.items()
                  if pid not in skip and start >= started and _ours(pid, table, basetemp, prefix, above))


def _basetemp(config: pytest.Config) -> str:
    factory = getattr(config, "_tmp_path_factory", None)
    try:
        return str(factory.getbasetemp()) if factory is not None else ""
    except Exception:  # no temporary folder made yet
        return ""


def _sweep(config: pytest.Config, file: str) -> None:
    started = _file_started.pop(file, None)
    if started is None:
        return
    prefix = sys.prefix
    deadline = time.monotonic() + GRACE_S
    pids = alive_since(started, _basetemp(config), prefix)
    while pids and time.monotonic() < deadline:
        time.sleep(0.25)
        pids = alive_since(started, _basetemp(config), prefix)
    for pid in pids:
        _leaks.append(Leak(file, pid, _command(pid)[:200]))
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _PROC.is_dir():
        yield
        return
    file = item.nodeid.split("::", 1)[0]
    _file_started.setdefault(file, _uptime() - 1.0)  # start times are in clock ticks: a tick's slack
    yield
    if nextitem is None or nextitem.nodeid.split("::", 1)[0] != file:  # the file's module fixtures are torn down
        _sweep(item.config, file)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _leaks:
        return
    terminalreporter.write_sep("=", f"processes left behind by test files: {len(_leaks)} (killed)", red=True)
    for leak in _leaks:
        terminalreporter.write_line(f"{leak.file}: pid {leak.pid}: {leak.command}")
