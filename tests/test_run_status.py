"""`trainbridge status` tells a run's condition apart (issue 27): running (the pid holding its lock, read without
taking it), waiting for review, finished, failed (what stopped it, and where) or stopped (where it goes on)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.graph.runs import RunPaths, lock_holder, run_lock, run_status, start_run
from trainbridge.graph.state import RunConfig
from trainbridge.tests.loop_checks import LLM_ENV

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def _repo(tmp_path: Path, workload: str) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(WORKLOADS / workload, repo, ignore=shutil.ignore_patterns("__pycache__"))
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-qm", "base")):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True)
    return repo


def test_a_run_whose_baseline_fails_reads_failed_with_its_cause_and_a_held_lock_reads_running(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(home))
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)
    repo = _repo(tmp_path, "raises")
    config = RunConfig(repo=str(repo), run_id="broken", compile_reference=False, kb_dir=str(tmp_path / "kb"))
    with pytest.raises(Exception) as stopped:
        start_run(config, root=home / "runs")
    info = run_status("broken", root=home / "runs")
    assert info["running_pid"] is None and not info["finished"]
    log = (home / "runs" / "broken" / "run.log").read_text()  # what the run said, kept in its folder
    assert "baseline" in log and log.splitlines()[0][:4].isdigit(), log
    assert info["failure"]["type"] == type(stopped.value).__name__ and info["failure"]["error"][:60] in str(stopped.value)

    from trainbridge.graph.cli.loop import run_condition

    assert run_condition(info, "broken").startswith("failed at ") and "fix the cause, then `trainbridge resume broken`" in \
        run_condition(info, "broken")
    paths = RunPaths("broken", home / "runs")
    with run_lock(paths):
        assert lock_holder(paths) == os.getpid()
        held = run_status("broken", root=home / "runs")
        assert run_condition(held, "broken").startswith(f"running (pid {os.getpid()})")
    assert lock_holder(paths) is None

    shown = subprocess.run([sys.executable, "-m", "trainbridge", "status"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "TRAINBRIDGE_HOME": str(home)})
    assert shown.returncode == 0 and shown.stdout.startswith("broken: failed at "), shown.stdout + shown.stderr
    listed = subprocess.run([sys.executable, "-m", "trainbridge", "status", "--json", "-"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRAINBRIDGE_HOME": str(home)})
    (record,) = json.loads(listed.stdout)  # JSON and nothing else on stdout
    assert record["run_id"] == "broken" and record["condition"].startswith("failed at ") and record["finished"] is False
    one = subprocess.run([sys.executable, "-m", "trainbridge", "status", "broken", "--json", "-"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TRAINBRIDGE_HOME": str(home)})
    assert json.loads(one.stdout)["failure"]["type"] == type(stopped.value).__name__


def test_the_status_line_multiplies_ratios_and_says_the_speedup_apart():
    from trainbridge.graph.cli.loop import status_record

    info = {"state": {"accepted": [{"ratio": 0.8}, {"ratio": 1.11}], "baseline_step_s": 0.01}, "finished": True,
            "waiting_for_review": None, "next": [], "failure": None}
    assert abs(status_record(info, "r")["accepted_ratio_product"] - 0.888) < 1e-9  # not 1/0.888 as the product
