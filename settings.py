"""Every TRAINBRIDGE_* variable the tool reads, in one typed class that documents it (issue 27).

    from trainbridge.settings import settings
    settings().home                 # $TRAINBRIDGE_HOME, read now (never at import)
    settings().data_dir("runs")     # $TRAINBRIDGE_HOME/runs, else $XDG_DATA_HOME/trainbridge/runs, else ~/.local/...

`settings()` reads the environment each time it is called, so a command sees the variables of the moment it
runs and a test's monkeypatched environment. A value that does not parse is a `SettingsError` whose one line
names the variable and what it accepts. Options on the command line win over these (each command's --help
says which variable is its default).

Variables that are not settings but messages between TrainBridge's own processes (the emulated NPU's device
mode in a sandbox child, the probe's output markers) are listed in `INTERNAL`: a user never sets them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

PREFIX = "TRAINBRIDGE_"
# set by TrainBridge for its own sandbox children, or printed by them: not user settings
INTERNAL = {
    "TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP": "0 in in-process op tests of the emulation: no device at all",
    "TRAINBRIDGE_NPU_PROBE": "the marker of a probe child's line that says whether a real torch_npu is usable",
    "TRAINBRIDGE_NPU_VERSIONS": "the marker of a child's line that reports torch_npu / CANN versions",
    "TRAINBRIDGE_FORK_PREWARM": "set by the gate for a fork server whose programs compile: ready Inductor once",
}


class SettingsError(ValueError):
    """A TRAINBRIDGE_* variable holds a value that does not parse; the message names it."""


class Settings(BaseSettings):
    """TrainBridge's settings from the environment (prefix TRAINBRIDGE_, e.g. TRAINBRIDGE_HOME)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", case_sensitive=True, frozen=True, env_ignore_empty=True)

    # --- where things live
    HOME: Path | None = Field(default=None, description="home of runs/, kb/ and ports/ (default: $XDG_DATA_HOME/trainbridge, "
                              "else ~/.local/share/trainbridge)")
    KB_DIR: Path | None = Field(default=None, description="the local knowledge base's folder (default: <home>/kb)")
    KB_URL: str | None = Field(default=None, description="a shared Chroma server's URL (http://host:8000) used instead of "
                               "the local folder when --kb-dir is not given")
    CHECKPOINT: str | None = Field(default=None, description="Postgres URL for run checkpoints (postgresql://user@host:5432/db), "
                                   "the default of --checkpoint (default: each run's SQLite file)")
    # --- the sandbox and the gate
    UNCONFINED: bool = Field(default=False, description="1: judge candidates even where this machine cannot confine them "
                             "(no bubblewrap or user namespaces); every verdict and the report say so (as --unconfined)")
    CONFINE: bool = Field(default=True, description="0: run sandbox children without bubblewrap's confinement (debugging "
                          "only; results say 'not confined')")
    GATE_SPAWN: Literal["fork-server", "exec"] | None = Field(default=None, description="how gate children start: forked "
                                                               "from a warm server (default on the CPU) or exec'd")
    GATE_PAIRING: Literal["paired", "sequential"] | None = Field(default=None, description="how a gate round runs its sides: "
                                                                  "side by side (default on the CPU) or one after the other")
    REGION_LAB: bool = Field(default=True, description="off: no region lab before a gate (a rewrite that makes its own "
                             "region clearly slower is then gated anyway)")
    # --- the optional LLM coder (agents/coder/llm/config.py validates them together)
    LLM_BASE_URL: str | None = Field(default=None, description="an OpenAI-compatible API root (http://host:8000/v1)")
    LLM_MODEL: str | None = Field(default=None, description="the model name; naming a model or an endpoint turns the LLM on")
    LLM_API_KEY: SecretStr | None = Field(default=None, description="the endpoint's key (else OPENAI_API_KEY)")
    LLM_TIMEOUT: float | None = Field(default=None, gt=0, description="seconds per request (default 120)")
    LLM_MAX_ATTEMPTS: int | None = Field(default=None, ge=1, description="model replies tried per intent (default 3)")
    LLM_RETRIES: int | None = Field(default=None, ge=0, description="retries of a failed request")
    # --- the emulated NPU (no Ascend hardware here)
    EMULATED_NPU_SOC: Literal["Ascend910B", "Ascend910_93", "Ascend950"] | None = Field(
        default=None, description="the Ascend chip the emulation behaves as (default Ascend910B): chip-dependent API "
        "behaviour (npu_fusion_attention_v2's dropout seed/offset) follows it")
    EMULATED_TORCH_NPU_RELEASE: str | None = Field(default=None, description="the Ascend release emulated (default 26.1.0)")
    NPU_EMULATION_DEVICE: Literal["backend", "map"] | None = Field(default=None, description="backend: tensors on a real "
                                                                    "`npu` device type; map: npu mapped onto the CPU "
                                                                    "(default backend; the compile reference uses map)")
    EMULATED_NPU_COUNT: int | None = Field(default=None, ge=1, description="torch.npu.device_count() in the emulation "
                                           "(default 1)")

    def data_dir(self, name: str) -> Path:
        """<home>/<name>: $TRAINBRIDGE_HOME/<name>, else $XDG_DATA_HOME/trainbridge/<name>, else
        ~/.local/share/trainbridge/<name>."""
        if self.HOME is not None:
            return self.HOME.expanduser() / name
        xdg = os.environ.get("XDG_DATA_HOME")
        return (Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share") / "trainbridge" / name


def settings() -> Settings:
    """The settings as the environment holds them now; a `SettingsError` naming the variable when one does not parse."""
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        name = PREFIX + str(first["loc"][0]) if first.get("loc") else PREFIX + "*"
        raise SettingsError(f"{name}={os.environ.get(name, '')!r}: {first['msg']}") from None


def variables() -> list[tuple[str, str]]:
    """(variable, what it does) for every setting, in the class's order: the README's table."""
    return [(PREFIX + name, field.description or "") for name, field in Settings.model_fields.items()]
