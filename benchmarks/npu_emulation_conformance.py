"""Conformance of the NPU emulation with Ascend's own op tests: runs tests/test_npu_emu_conformance_*.py
and prints one table row per (API, upstream test file): the upstream cases mirrored, how many test
instances ran and how many passed.

Each conformance test names what it mirrors with @upstream(api, "<repo> <path>", "<case>"). By
default the tests run on the emulated `npu` device (this process registers it, as `import torch_npu`
would in a training program: TRAINBRIDGE_NPU_EMULATION_DEVICE=backend); --host runs them on host
tensors instead, the way the normal test suite does.

    .venv/bin/python benchmarks/npu_emulation_conformance.py            # table on stdout
    .venv/bin/python benchmarks/npu_emulation_conformance.py --host --out table.md -k rotary
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = sorted(str(p) for p in (ROOT / "tests").glob("test_npu_emu_conformance_*.py"))


class Collector:
    """pytest plugin: outcome per test, keyed by the @upstream tag of its function."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"cases": [], "tests": 0, "passed": 0,
                                                                     "failed": [], "skipped": 0})
        self._tags: dict[str, tuple[str, str, str]] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            tag = getattr(getattr(item, "function", None), "upstream", None)
            if tag is not None:
                self._tags[item.nodeid] = tag

    def pytest_runtest_logreport(self, report):
        tag = self._tags.get(report.nodeid)
        if tag is None or (report.when != "call" and not (report.failed or report.skipped)):
            return
        if report.when == "teardown" and report.passed:
            return
        api, source, case = tag
        row = self.rows[(api, source)]
        if case not in row["cases"]:
            row["cases"].append(case)
        if report.when == "call" or report.failed or report.skipped:
            row["tests"] += 1
            if report.passed:
                row["passed"] += 1
            elif report.skipped:
                row["skipped"] += 1
            else:
                row["failed"].append(report.nodeid.split("::", 1)[-1])


def table(rows: dict, *, where: str, command: str, seconds: float, versions: dict[str, str]) -> str:
    lines = [f"NPU emulation conformance ({where}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"command: {command}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
             "| API | upstream test file | cases | pass |", "|---|---|---|---|"]
    total = passed = 0
    for (api, source), row in sorted(rows.items()):
        total += row["tests"]
        passed += row["passed"]
        status = f"{row['passed']}/{row['tests']}"
        if row["skipped"]:
            status += f" ({row['skipped']} skipped)"
        if row["failed"]:
            status += " FAILED: " + ", ".join(row["failed"][:4])
        lines.append(f"| {api} | {source} | {'; '.join(row['cases'])} | {status} |")
    lines += ["", f"{passed}/{total} test instances passed in {seconds:.0f} s"]
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    import torch

    found = {"torch": torch.__version__}
    npu = sys.modules.get("torch_npu")
    if npu is not None:
        from torch_npu._device_mode import device_description  # type: ignore[import-not-found]
        from torch_npu._version import release_string  # type: ignore[import-not-found]

        found["torch_npu (emulated)"] = f"{npu.__version__}, release {release_string()}"
        found["emulated device:"] = device_description()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="store_true", help="run on host tensors (no npu device registered)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a subset of the cases)")
    args = parser.parse_args(argv)

    os.environ.pop("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", None)
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    if args.host:
        os.environ.pop("TRAINBRIDGE_NPU_CONFORMANCE_ON_DEVICE", None)
    else:
        os.environ["TRAINBRIDGE_NPU_CONFORMANCE_ON_DEVICE"] = "1"
        os.environ["TRAINBRIDGE_NPU_EMULATION_DEVICE"] = "backend"
    import pytest

    collector = Collector()
    pytest_args = [*TESTS, "-q", "-p", "no:cacheprovider", "-o", "addopts=--import-mode=importlib"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    start = time.monotonic()
    code = pytest.main(pytest_args, plugins=[collector])
    seconds = time.monotonic() - start
    command = "python benchmarks/npu_emulation_conformance.py" + (" --host" if args.host else "") + (
        f" -k {args.keyword!r}" if args.keyword else "")
    text = table(collector.rows, where="host tensors" if args.host else "emulated npu device", command=command,
                 seconds=seconds, versions=_versions())
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
