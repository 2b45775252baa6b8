"""The command line, run as a real subprocess of the installed console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def trainbridge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_and_explains_commands():
    result = trainbridge("--help")
    assert result.returncode == 0
    assert "measure" in result.stdout and "Run a workload's training step" in result.stdout


def test_measure_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "result.json"
    result = trainbridge("measure", str(WORKLOADS / "tiny"), "--steps", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "median step" in result.stdout
    payload = json.loads(out.read_text())
    assert len(payload["step_times_s"]) == 2 and payload["failure"] is None


def test_measure_reports_failures_with_exit_code_1_and_bad_input_with_2():
    failed = trainbridge("measure", str(WORKLOADS / "nan"))
    assert failed.returncode == 1 and "nonfinite_loss" in failed.stderr
    bad = trainbridge("measure", str(WORKLOADS / "bad_key"))
    assert bad.returncode == 2 and "unknown key 'setps'" in bad.stderr
    unknown = trainbridge("measure", "no_such_example")
    assert unknown.returncode == 2 and "bundled" in unknown.stderr
