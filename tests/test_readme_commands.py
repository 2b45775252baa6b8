"""Every `trainbridge ...` command the README prints works as printed.

The commands of the README's shell blocks are run for real where a test can afford it (`port`,
with the README's placeholder path replaced by a copy of a CUDA program) and otherwise parsed by the
real command line with `--help` appended: click parses every argument and option before it answers
`--help`, so an option the README prints but the command lacks fails here (exit 2, "No such
option"). The Commands table is checked the same way: each command exists and takes the options the
table names. Long runs (`run`, `demo`, `serve`, `verify` on an NPU host) are what this parses
instead of runs; tests/test_loop.py and friends run them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CUDA_PROGRAM = Path(__file__).parent / "fixtures" / "gpu_program"
RUN_FOR_REAL = {"port"}  # cheap enough to run in a test; the others are parsed (see the module doc)


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """(README line, argv after `trainbridge`) of every trainbridge command in bash/sh blocks."""
    found = []
    lines = text.splitlines()
    in_block = False
    held = ""  # a command continued on the next line (a trailing backslash), as the shell reads it
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            in_block = not in_block and line[3:].strip() in ("bash", "sh", "shell", "console")
            held = ""
            continue
        if not in_block:
            continue
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        line, held = held + line, ""
        for part in re.split(r"&&|;|\|", line.split(" #")[0]):
            words = shlex.split(part)
            if words and words[0].rsplit("/", 1)[-1] == "trainbridge":
                found.append((number, words[1:]))
    return found


def table_commands(text: str) -> list[tuple[str, list[str]]]:
    """(subcommand, options) of every row of the Commands table."""
    rows = []
    for line in text.splitlines():
        match = re.match(r"\| `trainbridge ([a-z-]+)([^`]*)` \|", line)
        if match:
            rows.append((match.group(1), re.findall(r"--[a-z][a-z-]*", match.group(2))))
    return rows


def trainbridge(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as the README calls it (`python -m trainbridge` where it is not installed)."""
    script = Path(sys.executable).parent / "trainbridge"
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", "trainbridge"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


COMMANDS = shell_commands(README.read_text(encoding="utf-8"))
TABLE = table_commands(README.read_text(encoding="utf-8"))


def test_the_readme_has_the_commands_this_test_checks():
    names = {argv[0] for _, argv in COMMANDS if argv}
    assert {"demo", "serve", "run", "review", "port", "verify"} <= names, names
    assert {"measure", "analyze", "run", "resume", "status", "review", "report", "demo", "port", "verify", "kb"} <= \
        {name for name, _ in TABLE}


@pytest.mark.parametrize("line, argv", [c for c in COMMANDS if c[1] and c[1][0] not in RUN_FOR_REAL],
                         ids=lambda c: str(c) if isinstance(c, int) else " ".join(c)[:60])
def test_each_printed_command_parses(line, argv):
    head = argv[: argv.index("--")] if "--" in argv else argv  # after `--` comes the user's launch line, not options
    done = trainbridge(*head, "--help")
    assert done.returncode == 0, f"README.md:{line}: `trainbridge {' '.join(argv)}` does not parse:\n{done.stderr}"
    assert f"trainbridge {argv[0]}" in done.stdout  # its own help, not the root's


@pytest.mark.parametrize("name, options", TABLE, ids=lambda c: c if isinstance(c, str) else ",".join(c))
def test_each_command_of_the_table_exists_with_its_options(name, options):
    done = trainbridge(name, "--help", env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    missing = [option for option in options if option not in done.stdout]
    assert not missing, f"`trainbridge {name}` has no {missing} (README's Commands table)"


def test_port_runs_as_printed(tmp_path):
    printed = [argv for _, argv in COMMANDS if argv and argv[0] == "port"]
    assert printed, "the README prints no `trainbridge port` line"
    for argv in printed:
        placeholder = argv[1]
        repo = tmp_path / Path(placeholder).name
        shutil.copytree(CUDA_PROGRAM, repo)
        before = {p.relative_to(repo): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()}
        done = trainbridge(*[str(repo) if a == placeholder else a for a in argv], env={"COLUMNS": "250", "PATH": "/usr/bin:/bin",
                                                                                       "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr
        ported = tmp_path / f"{repo.name}-npu"
        assert f"into {ported}" in " ".join(done.stdout.split()), done.stdout
        assert any("torch_npu" in p.read_text(encoding="utf-8") for p in ported.rglob("*.py"))
        assert (tmp_path / f"{ported.name}.port-report" / "port-report.md").is_file()
        assert {p.relative_to(repo): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()} == before
        again = trainbridge(*[str(repo) if a == placeholder else a for a in argv], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert again.returncode == 2 and "already holds files" in again.stderr and "--out" in again.stderr
