"""What the tests share with the benchmarks lives in benchmarks/ (a folder of scripts, not a package: the recipe
lab, the script-mode fixture repositories), imported by name the way the benchmarks import one another."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)

pytest_plugins = ["trainbridge.tests.suite_clock"]
