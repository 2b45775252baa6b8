"""The suite's clock (tests/suite_clock.py): a whole-suite run prints its wall time, warns past its target, and
fails past its limit (60 minutes unless set)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _suite(tmp_path: Path, *args: str, limit_s: float | None = None, target_s: float | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = checks\n", encoding="utf-8")
    (tmp_path / "checks").mkdir(exist_ok=True)
    (tmp_path / "checks" / "test_quick.py").write_text("def test_passes():\n    assert True\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINBRIDGE_SUITE_LIMIT_S", "TRAINBRIDGE_SUITE_TARGET_S")}
    if limit_s is not None:
        env["TRAINBRIDGE_SUITE_LIMIT_S"] = str(limit_s)
    if target_s is not None:
        env["TRAINBRIDGE_SUITE_TARGET_S"] = str(target_s)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "trainbridge.tests.suite_clock", "-p", "no:cacheprovider",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_whole_suite_past_a_set_limit_fails_loudly_although_its_tests_pass(tmp_path):
    done = _suite(tmp_path, limit_s=0.006)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout
    assert "1 passed" in done.stdout
    assert "PAST ITS 0.0001-MINUTE LIMIT: it fails although its tests passed" in done.stdout


def test_a_limit_of_zero_is_no_limit(tmp_path):
    done = _suite(tmp_path, limit_s=0)
    assert done.returncode == 0 and "LIMIT" not in done.stdout and "a run past" not in done.stdout, done.stdout


def test_a_whole_suite_past_its_target_warns_and_passes(tmp_path):
    done = _suite(tmp_path, target_s=0)
    assert done.returncode == 0, done.stdout
    assert "PAST ITS 0-MINUTE TARGET" in done.stdout


def test_a_whole_suite_within_its_target_prints_its_wall_time(tmp_path):
    done = _suite(tmp_path)
    assert done.returncode == 0, done.stdout
    assert ("suite wall time: 0.0 min for the whole suite (target: within 45 min on CI's 2 cores; a run past 60 min fails)"
            in done.stdout)
    assert "the 1 slowest test files (setup + call + teardown):" in done.stdout and "100.0%  checks/test_quick.py" in done.stdout
    assert "PAST" not in done.stdout


@pytest.mark.parametrize("args", [("checks/test_quick.py",), ("-k", "passes"), ("-m", "not slow")])
def test_a_part_of_the_suite_is_not_judged(tmp_path, args):
    done = _suite(tmp_path, *args, limit_s=0.006)
    assert done.returncode == 0, done.stdout
    assert "(a part of the suite)" in done.stdout and "PAST" not in done.stdout
