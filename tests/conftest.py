"""What the tests share with the benchmarks lives in benchmarks/ (a folder of scripts, not a package: the recipe
lab, the script-mode fixture repositories), imported by name the way the benchmarks import one another.

On a machine that cannot confine sandbox children (no bubblewrap: CI installs it, .ci/run), runs are refused unless
asked to run unconfined: the suite asks (TRAINBRIDGE_UNCONFINED=1, read by `trainbridge run`; loop_fixtures.loop_config
sets `unconfined`) so that it still runs everything else there."""

import os
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)

pytest_plugins = ["trainbridge.tests.suite_clock", "trainbridge.tests.leak_watch", "trainbridge.tests.review_run_support"]


def pytest_configure(config):
    from trainbridge.sandbox.confinement import bubblewrap

    if not bubblewrap().usable:
        os.environ.setdefault("TRAINBRIDGE_UNCONFINED", "1")
