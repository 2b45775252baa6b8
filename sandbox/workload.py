"""The workload contract: `trainbridge.toml` at a repository's root says how to run one training step.

Three modes:

- ``launch = "python train.py --max_iters=100"`` (script mode, the normal way). The script runs
  unmodified in the sandbox from a launcher outside the repository (sandbox/script/launcher.py):
  optimizer-step hooks mark the steps, ``backward()`` gives the loss, every seeding call the
  script makes gets the gate's seed (or one derived from it and the script's own value), and the
  program is stopped after the planned steps. The seed controls the script's data order; the batch
  index the gate sends does not choose its data. Extra keys:

  - ``data = ["data/", "meta.pkl"]``: paths (relative to the repository root) that the script
    reads but git ignores; each run sees the user's checkout's copies through symlinks,
    read-only (sandbox/script/files.py). The run's working directory is a scratch folder that
    mirrors the worktree, so files the script writes (checkpoints, logs) land there.
  - ``workdir = "projects/chargpt"``: the folder of the repository the script runs in (its working
    directory in the run's mirror; default the root), for a script written to run from its own folder
    (``open("input.txt")`` beside it). The launch line's script path stays relative to the root.
  - ``[overrides]``: shrink a run without editing the repository. Key syntax:

    ========================== ================================================================
    ``batch_size = 4``          a module-level constant of the script (assigned after the
                                script's own assignment)
    ``"--max_iters" = 20``      a command-line argument: ``--max_iters=20`` replaces the one in
                                the launch line or is appended; ``true`` adds a bare flag,
                                ``false`` removes it
    ``"GPTConfig.n_layer" = 2`` a class attribute / dataclass field default, in the script or
                                any module of the repository
    ``"GPTConfig(n_layer)" = 2`` a keyword argument of every call of ``GPTConfig`` (or
                                ``x.GPTConfig``) in the repository's code, forced at call time
    ========================== ================================================================

    An override that matches nothing stops the run with the nearest names.
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

from trainbridge.sandbox.script.launch import LaunchError, parse_launch

CONFIG_FILE = "trainbridge.toml"

DEFAULT_STEP_TIME_PATTERN = r"time_ms[=: ]+(?P<ms>[0-9]+(?:\.[0-9]*)?)"
OVERRIDE_KEY = re.compile(r"^(?:(?P<arg>--?[A-Za-z0-9][\w.-]*)|(?P<constant>[A-Za-z_]\w*)|(?P<field>[A-Za-z_]\w*\.[A-Za-z_]\w*)"
                          r"|(?P<call>[A-Za-z_]\w*)\((?P<keyword>[A-Za-z_]\w*)\))$")
OverrideValue = bool | int | float | str | list
DEFAULT_LOSS_PATTERN = r"loss[=: ]+(?P<loss>[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan|inf))"


class WorkloadConfigError(ValueError):
    """`trainbridge.toml` is missing or malformed; the message says where and how to fix it."""


class WorkloadConfig(BaseModel):
    """The keys of `trainbridge.toml`. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")

    entry: str | None = Field(default=None, description='"module:function" returning the parts of a step')
    command: str | None = Field(default=None, description="shell-free command line that trains and prints per-step lines")
    launch: str | None = Field(default=None, description='script mode: the command the repo trains with, e.g. "python train.py"')
    data: list[str] = Field(default_factory=list, description="script mode: git-ignored paths the script reads, shown read-only")
    overrides: dict[str, OverrideValue] = Field(default_factory=dict, description="script mode: constants, arguments, "
                                                 "dataclass defaults and call keywords to replace (see the module doc)")
    step_time_pattern: str = Field(default=DEFAULT_STEP_TIME_PATTERN, description="regex with group 'ms' or 's'")
    loss_pattern: str = Field(default=DEFAULT_LOSS_PATTERN, description="regex with group 'loss'")
    warmup_steps: int = Field(default=2, ge=0, le=10_000)
    steps: int = Field(default=8, ge=1, le=100_000)
    timeout_s: float = Field(default=900.0, gt=0)
    memory_limit_mb: int | None = Field(default=None, ge=256, description="address-space cap; default: 3/4 of RAM, at most 16 GiB")
    threads: int = Field(default=2, ge=1, le=1024)
    seed: int = Field(default=0, ge=0)
    pythonpath: list[str] = Field(default_factory=list, description="extra import dirs, relative to the repo root")
    workdir: str | None = Field(default=None, description="script mode: the folder the script runs in, relative to the repo root")

    @field_validator("entry")
    @classmethod
    def _entry_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            raise ValueError('must look like "module:function", e.g. "train:trainbridge_entry"')
        return value

    @field_validator("launch")
    @classmethod
    def _launch_shape(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_launch(value)
            except LaunchError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("overrides")
    @classmethod
    def _override_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [key for key in value if not OVERRIDE_KEY.match(key)]
        if bad:
            raise ValueError(f"override key(s) {', '.join(map(repr, bad))} not understood: write a constant (batch_size), an "
                             'argument ("--max_iters"), a class field ("GPTConfig.n_layer") or a call keyword ("GPTConfig(n_layer)")')
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir_inside(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError(f"workdir {value!r} must be a folder inside the repository (relative, no '..')")
        return value

    @field_validator("data")
    @classmethod
    def _data_inside(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not entry.strip() or Path(entry).is_absolute() or ".." in Path(entry).parts:
                raise ValueError(f"data entry {entry!r} must be a path inside the repository (relative, no '..')")
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
        if sum(value is not None for value in (self.entry, self.command, self.launch)) != 1:
            raise ValueError('set exactly one of "launch" (script mode: launch = "python train.py"), "entry" (precise mode) '
                             'or "command" (coarse mode)')
        if self.launch is None and (self.data or self.overrides or self.workdir):
            raise ValueError('"data", "overrides" and "workdir" apply to script mode only (launch = "python train.py ...")')
        if self.command is not None:
            if "ms" not in re.compile(self.step_time_pattern).groupindex and "s" not in re.compile(self.step_time_pattern).groupindex:
                raise ValueError("step_time_pattern needs a named group (?P<ms>...) or (?P<s>...)")
            if "loss" not in re.compile(self.loss_pattern).groupindex:
                raise ValueError("loss_pattern needs a named group (?P<loss>...)")
        return self

    @property
    def mode(self) -> str:
        return "entry" if self.entry else "script" if self.launch else "command"


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
            f"{path}: not found. Add a {CONFIG_FILE} with launch = \"python train.py ...\" (script mode), "
            "entry = \"module:function\" (see README, 'The workload contract') or command = \"python train.py ...\"; "
            "or pass the launch line: trainbridge measure <repo> -- python train.py ..."
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


def workload_for_launch(repo: Path, launch: str) -> Workload:
    """Script mode from a launch line typed on the command line (`trainbridge measure <repo> -- python train.py ...`):
    the repository's trainbridge.toml, when it has one, gives the other keys (steps, data, overrides); its
    entry/command, if any, is replaced by the launch line."""
    repo = Path(repo).resolve()
    path = repo / CONFIG_FILE
    if not repo.is_dir():
        raise WorkloadConfigError(f"{repo}: not a directory. Pass the root of a training repository.")
    data: dict[str, Any] = {}
    text = ""
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise WorkloadConfigError(f"{path}: not valid TOML: {exc}") from exc
        for key in ("entry", "command", "step_time_pattern", "loss_pattern"):
            data.pop(key, None)
    data["launch"] = launch
    return Workload(root=repo, config=_validate(data, path, text))
