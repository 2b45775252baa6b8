"""`kill` (SIGTERM) of a `trainbridge measure` mid-step ends its sandbox child and everything in the child's session:
nothing of the sandbox is left running, reparented to init."""

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


def test_sigterm_of_measure_mid_step_leaves_no_sandbox_process(tmp_path):
    repo = script_repo(tmp_path / "repo", "accumulate.py", LONG)
    cli = subprocess.Popen([sys.executable, "-m", "trainbridge", "measure", str(repo)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    sandbox: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not sandbox and cli.poll() is None:
            sandbox = [pid for pid in _children(cli.pid) if "sandbox.script.launcher" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
            time.sleep(0.2)
        assert sandbox, f"the sandbox child never started: {cli.stderr.read().decode()[-2000:] if cli.poll() is not None else ''}"
        time.sleep(4.0)  # into its steps (torch imported, the script stepping)
        assert cli.poll() is None, cli.stderr.read().decode()[-2000:]
        os.kill(cli.pid, signal.SIGTERM)
        cli.wait(timeout=60)
        time.sleep(1.0)
        survivors = [pid for child in sandbox for pid in _session(child)]
        assert survivors == [], f"left running after SIGTERM: {survivors}"
        assert cli.returncode == 143, cli.stderr.read().decode()[-2000:]  # 128 + SIGTERM: a terminated measurement
        assert "terminated (SIGTERM)" in cli.stderr.read().decode()
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
        for pid in [*_children(cli.pid), *(p for child in sandbox for p in _session(child))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


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
