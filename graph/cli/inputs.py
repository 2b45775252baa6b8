"""What the user typed, resolved and checked before anything is created: repositories, bundled
examples, durations."""

from __future__ import annotations

import re
from datetime import datetime
from enum import Enum
from pathlib import Path

import typer
from pydantic import ValidationError

from trainbridge.tools.git.names import check_run_id, valid_run_id  # noqa: F401 - valid_run_id: the CLI's callback


def examples_dir() -> Path:
    """The bundled example workloads (installed with the package)."""
    import trainbridge

    return Path(trainbridge.__file__).resolve().parent / "examples"


def resolve_repo(target: str) -> Path:
    """A path to a repository, or the name of a bundled example (e.g. `llama_pretrain`)."""
    path = Path(target)
    if path.exists():
        return path.resolve()
    bundled = examples_dir() / target
    if bundled.is_dir():
        return bundled
    names = sorted(p.name for p in examples_dir().iterdir() if (p / "trainbridge.toml").is_file()) if examples_dir().is_dir() else []
    raise typer.BadParameter(f"{target!r} is neither a directory nor a bundled example (bundled: {', '.join(names) or 'none'})")


class TargetChoice(str, Enum):
    """The backends a run optimises for (`--target`, listed as choices in --help)."""

    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


def parse_duration(text: str, option: str | None = None) -> float:
    """'8h', '90m', '45s', '1h30m' or plain seconds; a bad one names `option` in its message."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise typer.BadParameter(f"{text!r} is not a duration like 8h, 90m, 1h30m or 3600", param_hint=option)
    return sum(float(value) * {"h": 3600, "m": 60, "s": 1}[unit] for value, unit in parts)


def default_run_id(stem: str, when: datetime | None = None) -> str:
    """`<stem>-<timestamp>`, with whatever the rule does not allow in `stem` (dots, spaces, a leading
    '-') made into '-', and cut so the id stays within 64 characters."""
    stamp = f"{when or datetime.now():%Y%m%d-%H%M%S}"
    clean = re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-_")[: 64 - len(stamp) - 1].rstrip("-_")
    return check_run_id(f"{clean}-{stamp}" if clean else f"run-{stamp}")


def config_errors(exc: ValidationError, options: dict[str, str]) -> str:
    """A settings record's validation errors as one line per option the user typed (`--min-gain: Input should be
    less than 1`), instead of pydantic's field paths and links; `options` maps a field to its option."""
    lines = []
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error.get("loc") else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if not field:  # a rule across options (`--review` with `--devices`): its message names them
            lines.append(message)
            continue
        option = options.get(field) or f"--{field.replace('_', '-')}"
        lines.append(f"{option}: {message.removeprefix(option).lstrip(' :')}")
    return "\n".join(lines)
