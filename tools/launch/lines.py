"""Launch lines written down in a repository: shell commands that start a Python training script,
found in markdown code blocks (fenced, and inline `...` spans), and in shell scripts.

    lines_in_markdown(text)     -> [(line number, command text, "markdown code block" | "markdown inline code")]
    lines_in_shell(text)        -> [(line number, command text, "shell script")]
    parse_launch("torchrun --standalone --nproc_per_node=8 train_gpt.py")
        -> ParsedLaunch(argv=[...], script="train_gpt.py", torchrun=True, nproc=8, ...)

Nothing here reads files or runs anything: texts in, typed records out.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh", "shell-session", "text"}
_INLINE = re.compile(r"`([^`\n]+)`")
_PROMPT = re.compile(r"^\s*(?:\$|>|#\s*\$)\s+")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
_TORCHRUN_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
# launcher options that take a value as the next word (torchrun's and python's own)
_TORCHRUN_VALUED = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
                    "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend",
                    "--rdzv_endpoint", "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--max_restarts",
                    "--max-restarts", "--monitor_interval", "--log_dir", "--log-dir", "--redirects", "--tee",
                    "--role", "--local_addr", "--start_method", "--start-method"}
_PYTHON_VALUED = {"-W", "-X", "-c"}
_SHELL_SYNTAX = ("|", ";", ">", "<", "$(", "`")


@dataclass(frozen=True)
class ParsedLaunch:
    """One command line that starts a Python script, split into argv (no shell involved).

    `script` is the path as written (``train.py``, ``./train.py``) or, for ``python -m pkg.train``,
    the module's file path (``pkg/train.py``); `env` holds leading ``KEY=value`` assignments."""

    argv: list[str]
    script: str
    script_args: list[str]
    torchrun: bool = False
    nproc: int | None = None
    module: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def lines_in_markdown(text: str) -> list[tuple[int, str, str]]:
    """Commands in shell-like fenced code blocks (continuations joined, prompts dropped), then in
    inline code spans of the prose; each with the 1-based line it starts on."""
    found: list[tuple[int, str, str]] = []
    fence: str | None = None
    shell_block = False
    block: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence, shell_block, block = opening.group(1)[0] * 3, opening.group(2).lower() in _SHELL_LANGS, []
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                if shell_block:
                    found += [(n, cmd, "markdown code block") for n, cmd in _commands(block)]
                fence = None
            else:
                block.append((number, line))
            continue
        for span in _INLINE.findall(line):
            found += [(number, cmd, "markdown inline code") for _, cmd in _commands([(number, span)])]
    return found


def lines_in_shell(text: str) -> list[tuple[int, str, str]]:
    """Commands of a shell script (comments and continuations handled), each with its line."""
    return [(n, cmd, "shell script") for n, cmd in _commands(list(enumerate(text.splitlines(), 1)))]


def _commands(numbered: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Logical command lines: backslash continuations joined, prompts and comments dropped, `a && b`
    split into its parts."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in numbered:
        line = _PROMPT.sub("", raw.rstrip())
        if not pending:
            start = number
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line.strip())
        joined = " ".join(part for part in pending if part)
        pending = []
        for part in re.split(r"\s*(?:&&|\|\|)\s*", joined):
            if part:
                commands.append((start, part))
    return commands


def parse_launch(command: str) -> ParsedLaunch | None:
    """The launch of a Python script in `command`, or None when it starts no ``.py`` script with
    python or torchrun (``pip install ...``, ``make``, ``python -m venv``)."""
    if any(mark in command for mark in _SHELL_SYNTAX):
        return None  # pipes, redirections, substitutions: not a plain argv
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    env: dict[str, str] = {}
    while words and _ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words and words[0] in ("exec", "nohup", "time"):
        words = words[1:]
    if not words:
        return None
    launcher = words[0].rsplit("/", 1)[-1]
    if launcher == "torchrun":
        return _after_torchrun(words, 1, env)
    if not _PYTHON.match(words[0]):
        return None
    i = 1
    while i < len(words) and words[i].startswith("-") and words[i] != "-m":
        i += 2 if words[i] in _PYTHON_VALUED else 1
    if i < len(words) and words[i] == "-m":
        if i + 1 >= len(words):
            return None
        module = words[i + 1]
        if module in _TORCHRUN_MODULES:
            return _after_torchrun(words, i + 2, env)
        if module.startswith(("pip", "venv", "pytest", "http.server", "ensurepip")):
            return None
        return ParsedLaunch(argv=words, script=module.replace(".", "/") + ".py", script_args=words[i + 2:],
                            module=module, env=env)
    if i >= len(words) or not words[i].endswith(".py"):
        return None
    return ParsedLaunch(argv=words, script=words[i], script_args=words[i + 1:], env=env)


def _after_torchrun(words: list[str], i: int, env: dict[str, str]) -> ParsedLaunch | None:
    nproc: int | None = None
    notes: list[str] = []
    while i < len(words) and words[i].startswith("-"):
        name, has_value, value = words[i].partition("=")
        if name in _TORCHRUN_VALUED and not has_value:
            value = words[i + 1] if i + 1 < len(words) else ""
            i += 1
        if name in ("--nproc_per_node", "--nproc-per-node"):
            if value.isdigit():
                nproc = int(value)
            else:
                notes.append(f"nproc_per_node is {value!r}, not a number of processes")
        i += 1
    if i < len(words) and words[i] == "-m" and i + 1 < len(words):
        module = words[i + 1]
        return ParsedLaunch(argv=words, script=module.replace(".", "/") + ".py", script_args=words[i + 2:],
                            torchrun=True, nproc=nproc, module=module, env=env, notes=notes)
    if i >= len(words) or not words[i].endswith(".py"):
        return None
    return ParsedLaunch(argv=words, script=words[i], script_args=words[i + 1:], torchrun=True, nproc=nproc, env=env,
                        notes=notes)
