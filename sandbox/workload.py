"""The workload contract: `trainbridge.toml` at a repository's root says how to run one training step.

Two modes:

- ``entry = "module:function"`` (precise). ``function(device: str, seed: int)`` returns a dict with
  ``model`` (nn.Module on the device), ``optimizer``, ``batch`` (``batch(step) -> batch``, a
  deterministic function of seed and step), ``loss_fn`` (``loss_fn(model, batch) -> loss``: forward
  and loss only) and ``train_step`` (``train_step(model, optimizer, batch) -> loss``: the whole step
  as the user wrote it). The sandbox controls seeds, warm-up, synchronisation, timing, profiling and
  torch.compile.
- ``command = "python train.py --steps 30"`` (coarse). Step times and losses are read from the
  program's output with ``step_time_pattern`` and ``loss_pattern``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIG_FILE = "trainbridge.toml"

DEFAULT_STEP_TIME_PATTERN = r"time_ms[=: ]+(?P<ms>[0-9]+(?:\.[0-9]*)?)"
DEFAULT_LOSS_PATTERN = r"loss[=: ]+(?P<loss>[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan|inf))"


class WorkloadConfigError(ValueError):
    """`trainbridge.toml` is missing or malformed; the message says where and how to fix it."""


class WorkloadConfig(BaseModel):
    """The keys of `trainbridge.toml`. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")

    entry: str | None = Field(default=None, description='"module:function" returning the parts of a step')
    command: str | None = Field(default=None, description="shell-free command line that trains and prints per-step lines")
    step_time_pattern: str = Field(default=DEFAULT_STEP_TIME_PATTERN, description="regex with group 'ms' or 's'")
    loss_pattern: str = Field(default=DEFAULT_LOSS_PATTERN, description="regex with group 'loss'")
    warmup_steps: int = Field(default=2, ge=0, le=10_000)
    steps: int = Field(default=8, ge=1, le=100_000)
    timeout_s: float = Field(default=900.0, gt=0)
    memory_limit_mb: int | None = Field(default=None, ge=256, description="address-space cap; default: 3/4 of RAM, at most 16 GiB")
    threads: int = Field(default=2, ge=1, le=1024)
    seed: int = Field(default=0, ge=0)
    pythonpath: list[str] = Field(default_factory=list, description="extra import dirs, relative to the repo root")

    @field_validator("entry")
    @classmethod
    def _entry_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError('must look like "module:function", e.g. "train:trainbridge_entry"')
        return value

    @field_validator("step_time_pattern", "loss_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _one_mode(self) -> "WorkloadConfig":
        if (self.entry is None) == (self.command is None):
            raise ValueError('set exactly one of "entry" (precise mode) or "command" (coarse mode)')
        if self.command is not None:
            if "ms" not in re.compile(self.step_time_pattern).groupindex and "s" not in re.compile(self.step_time_pattern).groupindex:
                raise ValueError("step_time_pattern needs a named group (?P<ms>...) or (?P<s>...)")
            if "loss" not in re.compile(self.loss_pattern).groupindex:
                raise ValueError("loss_pattern needs a named group (?P<loss>...)")
        return self

    @property
    def mode(self) -> str:
        return "entry" if self.entry else "command"


class Workload(BaseModel):
    """A validated workload: its repository root and its configuration."""

    model_config = ConfigDict(extra="forbid")

    root: Path
    config: WorkloadConfig

    def with_overrides(self, **overrides: Any) -> "Workload":
        """The same workload with some config keys replaced (None values are ignored)."""
        data = self.config.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return Workload(root=self.root, config=_validate(data, self.root / CONFIG_FILE, text=""))


def load_workload(repo: Path) -> Workload:
    """Read and validate `<repo>/trainbridge.toml`."""
    repo = Path(repo).resolve()
    path = repo / CONFIG_FILE
    if not repo.is_dir():
        raise WorkloadConfigError(f"{repo}: not a directory. Pass the root of a training repository.")
    if not path.is_file():
        raise WorkloadConfigError(
            f"{path}: not found. Add a {CONFIG_FILE} with entry = \"module:function\" (see README, "
            "'The workload contract') or command = \"python train.py ...\"."
        )
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadConfigError(f"{path}: not valid TOML: {exc}") from exc
    config = _validate(data, path, text)
    for extra in config.pythonpath:
        if Path(extra).is_absolute() or ".." in Path(extra).parts:
            raise WorkloadConfigError(f"{path}: pythonpath entry {extra!r} must be a path inside the repository")
    return Workload(root=repo, config=config)


def _validate(data: dict[str, Any], path: Path, text: str) -> WorkloadConfig:
    try:
        return WorkloadConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(file)"
            line = _line_of(text, str(err["loc"][0])) if err["loc"] else None
            where = f"{path}:{line}" if line else str(path)
            if err["type"] == "extra_forbidden":
                known = ", ".join(WorkloadConfig.model_fields)
                problems.append(f"{where}: unknown key {key!r} (known keys: {known})")
            else:
                problems.append(f"{where}: {key}: {err['msg']}")
        raise WorkloadConfigError("\n".join(problems)) from None


def _line_of(text: str, key: str) -> int | None:
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line):
            return number
    return None
