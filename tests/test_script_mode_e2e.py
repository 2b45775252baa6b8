"""Zero config, end to end, as a new user does it: `trainbridge init` on an unmodified nanoGPT-style
repository, commit the toml it wrote, `trainbridge run`: a rewrite lands, its numerics checked on the
gate's fresh seeds, and the user's checkout is untouched. The run is killed with SIGKILL twice (while the
baseline is measured, and while a gate's two children run) and resumed each time: the same result, one
verdict, one commit. (Real subprocesses, the installed CLI.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from script_repos import commit_all, git, nanogpt_repo

# a whole run (init, baseline, repeatability check, paired gate): minutes on 2 cores, more when the machine is shared
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def trainbridge(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)


def launchers_below(pid: int) -> set[int]:
    """The script-mode sandbox children below `pid` (they run `trainbridge.sandbox.script.launcher`)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                todo.append(child)
                try:  # bubblewrap's own processes (a confined child's outer one and its namespace's init) carry the
                    # same command line: the launcher is the process below them
                    if b"trainbridge.sandbox.script.launcher" in Path(f"/proc/{child}/cmdline").read_bytes() \
                            and Path(f"/proc/{child}/comm").read_text().strip() != "bwrap":
                        found.add(child)
                except OSError:
                    pass
    return found


def kill_when(args: list[str], cwd: Path, env: dict[str, str], log: Path, ready) -> int:
    """Run `trainbridge ARGS`; SIGKILL it once `ready(alive launchers, launchers seen)` holds; end the sandbox
    children it left (they run in their own sessions, as after a real kill -9). Returns the exit status."""
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trainbridge", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        seen: set[int] = set()
        deadline = time.monotonic() + 1200
        while proc.poll() is None and time.monotonic() < deadline:
            alive = launchers_below(proc.pid)
            seen |= alive
            if ready(alive, seen):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        status = proc.wait()
    for pid in seen:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # its group: led by bubblewrap's outer process when confined
        except OSError:
            pass
    return status


def test_init_then_run_killed_twice_and_resumed_lands_a_verified_rewrite_on_an_unmodified_script(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", "")
    (repo / "trainbridge.toml").unlink()  # the user has written nothing for TrainBridge
    (repo / ".gitignore").write_text("data/\nout/\n", encoding="utf-8")
    commit_all(repo)
    env = {**os.environ, "TRAINBRIDGE_HOME": str(tmp_path / "home")}
    init = trainbridge("init", ".", "--yes", cwd=repo, env=env)
    assert init.returncode == 0, init.stderr
    toml = (repo / "trainbridge.toml").read_text(encoding="utf-8")
    assert 'launch = "python train.py"' in toml and 'data = ["data/"]' in toml and "it runs: median step" in init.stdout + init.stderr
    git(repo, "add", "trainbridge.toml")
    git(repo, "commit", "-q", "-m", "trainbridge.toml from trainbridge init")
    head, status = git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")

    run = ["run", ".", "--no-reference", "--rounds", "6", "--final-rounds", "0", "--category", "gelu", "--budget", "20m",
           "--run-id", "zero-config"]
    # killed while the first child (the baseline's measurement) runs: no node has finished yet
    first = kill_when(run, repo, env, tmp_path / "run-1.log", lambda alive, seen: bool(alive))
    assert first == -signal.SIGKILL, (tmp_path / "run-1.log").read_text()[-3000:]
    # killed while a gate's two children (baseline and candidate, paired rounds) run at once
    second = kill_when(["resume", "zero-config"], repo, env, tmp_path / "run-2.log", lambda alive, seen: len(alive) >= 2)
    assert second == -signal.SIGKILL, (tmp_path / "run-2.log").read_text()[-3000:]
    done = trainbridge("resume", "zero-config", cwd=repo, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "home" / "runs" / "zero-config" / "report" / "report.md").read_text(encoding="utf-8")
    assert "| gelu | gelu-tanh-functional | accepted |" in report, report[:3000]
    verdict, = json.loads((tmp_path / "home" / "runs" / "zero-config" / "report" / "run.json").read_text())["state"]["verdicts"]
    assert verdict["accepted"] and "numerics match (seed" in verdict["message"], verdict["message"]
    # one commit on the run branch above the user's head: the killed gate was judged again, not stacked or lost
    assert git(repo, "rev-list", "--count", f"{head}..trainbridge/zero-config") == "1"
    # the user's repository: same head, same (clean) working tree, data untouched
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "status", "--porcelain") == status
