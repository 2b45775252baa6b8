"""The suite's clock (a pytest plugin, loaded by tests/conftest.py): a run of the whole suite prints its wall
time, and fails loudly past `LIMIT_S`, so a wave that slows the suite sees it before CI's 90 minutes do.

CI runs the README's test command on 2 cores; the suite is kept within 45 minutes there (`TARGET_S`), and a run
past 60 minutes (`LIMIT_S`) fails even when every test passed. Only a run of the whole suite is judged: a run
given files, folders or test ids (`pytest tests/test_cli.py`) prints its time and nothing more.
`TRAINBRIDGE_SUITE_LIMIT_S` sets another limit (this file's own test plants a tiny one).
"""

from __future__ import annotations

import os
import time

import pytest

TARGET_S = 45 * 60
LIMIT_S = 60 * 60
LIMIT_ENV = "TRAINBRIDGE_SUITE_LIMIT_S"
_STARTED = pytest.StashKey[float]()


def limit_s() -> float:
    return float(os.environ.get(LIMIT_ENV) or LIMIT_S)


def whole_suite(config: pytest.Config) -> bool:
    """No file, folder or test id on the command line and no -k/-m selection: pytest ran its `testpaths`."""
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword")
            and not config.getoption("markexpr"))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    wall = time.monotonic() - session.config.stash.get(_STARTED, time.monotonic())
    if whole_suite(session.config) and wall > limit_s() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    wall = time.monotonic() - config.stash.get(_STARTED, time.monotonic())
    line = f"suite wall time: {wall / 60:.1f} min"
    if not whole_suite(config):
        terminalreporter.write_line(line + " (a part of the suite)")
        return
    terminalreporter.write_line(f"{line} for the whole suite (kept within {TARGET_S // 60} min on CI's 2 cores; "
                                f"a run past {limit_s() / 60:g} min fails)")
    if wall > limit_s():
        terminalreporter.write_line(
            f"THE SUITE TOOK {wall / 60:.1f} MIN, PAST ITS {limit_s() / 60:g}-MINUTE LIMIT: it fails although its tests "
            "passed. Find the slowest tests with `pytest --durations=40` and make them cheaper before CI's 90 minutes "
            "run out.", red=True, bold=True)
