"""The distribution ships every subpackage and data file the code needs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGES = ("tests/fixtures", "examples", "sandbox/npu_emulation/torch_npu", ".venv", "build", "benchmarks")


def test_every_code_folder_is_a_listed_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"trainbridge"}
    for init in ROOT.rglob("__init__.py"):
        relative = init.parent.relative_to(ROOT).as_posix()
        if relative == "." or relative.startswith(NOT_PACKAGES) or "/." in f"/{relative}":
            continue
        found.add("trainbridge." + relative.replace("/", "."))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_console_script_and_no_generic_top_level_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["trainbridge"] == "trainbridge.graph.cli.app:main"
    assert all(name == "trainbridge" or name.startswith("trainbridge.") for name in project["tool"]["setuptools"]["packages"])
