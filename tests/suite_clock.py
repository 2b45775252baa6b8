"""The suite's clock (a pytest plugin, loaded by tests/conftest.py): a run of the whole suite prints its wall time
and says loudly when it went past its target, so a wave that slows the suite sees it before CI's 90 minutes do.

CI runs the README's test command on 2 cores; the suite is to stay within 45 minutes there (`TARGET_S`). A run past
the target prints a warning in red; a run past its limit, 60 minutes (`LIMIT_S`; `TRAINBRIDGE_SUITE_LIMIT_S` seconds
sets another, 0 or less none), fails even when every test passed: CI's own run of stop 31 took 43.6 minutes, so a
suite past 60 has grown by a third, and fails here before it fails CI's 90 minutes. Only a run of the whole suite is judged: a run given files, folders,
test ids, -k or -m prints its time and nothing more. A whole-suite run also lists its slowest files, so a CI log
says where the time went (with `--durations`, addopts in pyproject.toml, for the slowest tests). `TRAINBRIDGE_SUITE_TARGET_S` plants another target (this file's
own test does).
"""

from __future__ import annotations

import os
import time

import pytest

TARGET_S = 45 * 60
LIMIT_S = 60 * 60
LIMIT_ENV = "TRAINBRIDGE_SUITE_LIMIT_S"
TARGET_ENV = "TRAINBRIDGE_SUITE_TARGET_S"
_STARTED = pytest.StashKey[float]()
SLOWEST_FILES = 15
_by_file: dict[str, float] = {}  # test file -> seconds of its tests' setup, call and teardown (this process's run)


def target_s() -> float:
    return float(os.environ.get(TARGET_ENV) or TARGET_S)


def limit_s() -> float | None:
    value = os.environ.get(LIMIT_ENV)
    limit = float(value) if value else LIMIT_S
    return limit if limit > 0 else None


def whole_suite(config: pytest.Config) -> bool:
    """No file, folder or test id on the command line and no -k/-m selection: pytest ran its `testpaths`."""
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword")
            and not config.getoption("markexpr"))


def _wall(config: pytest.Config) -> float:
    return time.monotonic() - config.stash.get(_STARTED, time.monotonic())


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()
    _by_file.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _by_file[path] = _by_file.get(path, 0.0) + report.duration


def slowest_files(count: int = SLOWEST_FILES) -> list[str]:
    """The files that took longest, one line each: minutes, share of the tests' time, path."""
    total = sum(_by_file.values()) or 1.0
    ranked = sorted(_by_file.items(), key=lambda item: -item[1])[:count]
    return [f"{seconds / 60:6.1f} min {100 * seconds / total:5.1f}%  {path}" for path, seconds in ranked]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    limit = limit_s()
    if whole_suite(session.config) and limit is not None and _wall(session.config) > limit and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    wall = _wall(config)
    line = f"suite wall time: {wall / 60:.1f} min"
    if not whole_suite(config):
        terminalreporter.write_line(line + " (a part of the suite)")
        return
    limit = limit_s()
    terminalreporter.write_line(f"the {min(SLOWEST_FILES, len(_by_file))} slowest test files (setup + call + teardown):")
    for row in slowest_files():
        terminalreporter.write_line("  " + row)
    terminalreporter.write_line(f"{line} for the whole suite (target: within {target_s() / 60:g} min on CI's 2 cores"
                                + (f"; a run past {limit / 60:g} min fails)" if limit is not None else ")"))
    if limit is not None and wall > limit:
        terminalreporter.write_line(
            f"THE SUITE TOOK {wall / 60:.1f} MIN, PAST ITS {limit / 60:g}-MINUTE LIMIT: it fails although its tests "
            "passed. Find the slowest tests with `pytest --durations=40` and make them cheaper before CI's 90 minutes "
            "run out.", red=True, bold=True)
    elif wall > target_s():
        terminalreporter.write_line(
            f"THE SUITE TOOK {wall / 60:.1f} MIN, PAST ITS {target_s() / 60:g}-MINUTE TARGET: find the slowest tests with "
            "`pytest --durations=40` and make them cheaper before CI's 90 minutes run out.", red=True, bold=True)
