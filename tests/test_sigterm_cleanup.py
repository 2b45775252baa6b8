"""`kill` (SIGTERM) or Ctrl-C (SIGINT, pressed twice as people do) of a `trainbridge measure` mid-step ends its
sandbox child and everything in the child's session: nothing of the sandbox is left running, reparented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from script_repos import script_repo

LONG = 'launch = "python train.py 1000000"\nwarmup_steps = 1\nsteps = 90000\ntimeout_s = 600\n'


def _stat_rows() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, session id, state) of every process readable in /proc."""
    rows = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            rows.append((int(entry.name), int(fields[1]), int(fields[3]), fields[0]))
    return rows


def _children(pid: int) -> list[int]:
    return [child for child, ppid, _, _ in _stat_rows() if ppid == pid]


def _session(sid: int) -> list[int]:
    return [member for member, _, session, state in _stat_rows() if session == sid and state != "Z"]


def _measure_mid_step(tmp_path: Path, send, expect_status: int, expect_line: str) -> None:
    """`trainbridge measure` of a long script; once its sandbox child steps, `send(pid)`; then nothing of the sandbox
    may be left, and the command ends with `expect_status`, saying `expect_line`."""
    repo = script_repo(tmp_path / "repo", "accumulate.py", LONG)
    err = tmp_path / "measure.err"  # a file, not a pipe: a pipe nobody reads until the end can fill and stall the command
    with err.open("wb") as errors:
        cli = subprocess.Popen([sys.executable, "-m", "trainbridge", "measure", str(repo)], stdout=subprocess.DEVNULL,
                               stderr=errors, start_new_session=True)
    sandbox: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not sandbox and cli.poll() is None:
            sandbox = [pid for pid in _children(cli.pid) if "sandbox.script.launcher" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
            time.sleep(0.2)
        assert sandbox, f"the sandbox child never started: {err.read_text(errors='replace')[-2000:]}"
        time.sleep(4.0)  # into its steps (torch imported, the script stepping)
        assert cli.poll() is None, err.read_text(errors="replace")[-2000:]
        send(cli.pid)
        cli.wait(timeout=120)
        time.sleep(1.0)
        survivors = [pid for child in sandbox for pid in _session(child)]
        assert survivors == [], f"left running: {survivors}"
        stderr = err.read_text(errors="replace")
        assert cli.returncode == expect_status, stderr[-2000:]
        assert expect_line in stderr, stderr[-2000:]
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
        for pid in [*_children(cli.pid), *(p for child in sandbox for p in _session(child))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigterm_of_measure_mid_step_leaves_no_sandbox_process(tmp_path):
    _measure_mid_step(tmp_path, lambda pid: os.kill(pid, signal.SIGTERM), 143, "terminated (SIGTERM)")  # 128 + SIGTERM


def test_two_ctrl_c_half_a_second_apart_leave_no_sandbox_process(tmp_path):
    """Issue 27: the second Ctrl-C used to land in the cleanup and leave the user's script running under init."""
    def twice(pid: int) -> None:
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(pid, signal.SIGINT)

    _measure_mid_step(tmp_path, twice, 130, "interrupted (Ctrl-C); its sandbox processes were ended")


def test_what_is_left_below_the_process_is_found_and_killed_across_sessions():
    from trainbridge.sandbox.termination import kill_descendants, sandbox_processes

    # a child in a session of its own (as the sandbox starts them) that starts a helper in yet another session
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen(['sleep', '60'], start_new_session=True); print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == b"up"
        below = sandbox_processes()
        helpers = [pid for pid in _children(child.pid)]
        assert child.pid in below and helpers and set(helpers) <= set(below)
        killed = kill_descendants()
        assert child.pid in killed and not Path(f"/proc/{child.pid}").exists()  # killed and reaped
        time.sleep(0.3)
        assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                   for pid in helpers)
    finally:
        if child.poll() is None:
            child.kill()
