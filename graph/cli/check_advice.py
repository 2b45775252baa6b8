"""What `trainbridge init`'s check saw when a launch line failed, and the override that fixes it.

    advice = advise(result.failure, found)
    advice.cause   # "it asked for a CUDA device and this host has none (AssertionError: Torch not compiled with CUDA enabled)"
    advice.fix     # 'under [overrides] in trainbridge.toml: device = "cpu" (constant, train.py:18)'
    advice.line_specific   # whether another launch line may run where this one did not

Three causes are told apart (a device, a missing file, a download), each with what fixes it; anything else is the
failure's own message. Pure: a Failure and a Discovery in, words out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainbridge.sandbox.results import Failure
from trainbridge.tools.launch.discovery import Discovery, Setting
from trainbridge.tools.launch.init_toml import toml_key

_NO_CUDA = re.compile(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|no CUDA GPUs are available|"
                      r"CUDA driver version is insufficient|torch\.cuda\.is_available\(\) is False|"
                      r"Attempting to deserialize object on a CUDA device|ProcessGroupNCCL is only supported with GPUs|"
                      r"NCCL (?:is )?not (?:available|built)|Cannot access accelerator device when none is available")
_MISSING = re.compile(r"needs a file that is missing: '([^']+)'")
_PREPARE = re.compile(r"prepare|download|fetch|preprocess|tokeni[sz]e|build_data|make_data", re.IGNORECASE)
_DEVICE_NAMES = ("device", "device_type", "accelerator")


@dataclass(frozen=True)
class Advice:
    cause: str
    fix: str
    line_specific: bool  # another launch line may run where this one did not (a device); not for missing data
    override: dict[str, str] | None = None  # the [overrides] entry that fixes it, when one does (device -> "cpu")


def advise(failure: Failure, found: Discovery) -> Advice:
    """The cause the check saw in `failure` and what fixes it, from the script's own settings (`found`)."""
    text = "\n".join(filter(None, (failure.message, failure.traceback_tail)))
    device = _NO_CUDA.search(text)
    if device:
        setting = _device_setting(found)
        return Advice(cause=f"it asked for a CUDA device and this host has none ({device.group(0)})",
                      fix=_device_fix(setting), line_specific=True,
                      override={setting.key or setting.name: "cpu"} if setting is not None else None)
    missing = _MISSING.search(failure.message)
    elsewhere = re.search(r"your checkout has ([^,]+?)(?:,| but)", failure.message) if missing else None
    if missing and elsewhere:  # chargpt's open("input.txt"), written to run from its own folder
        return Advice(cause=f"it opens {missing.group(1)} relative to its working directory, the repository's root here; "
                            f"your checkout has it at {elsewhere.group(1)}",
                      fix=f"put a copy or a link of {elsewhere.group(1)} at {missing.group(1)} in your checkout (runs show it "
                          "read-only), or make the path a setting of the script and set it under [overrides]",
                      line_specific=True)
    if missing:
        prepare = _preparation(found)
        how = (f"run the repository's data preparation first ({prepare}, in your checkout), "
               if prepare else "create it in your checkout first (the repository's README says how), ")
        return Advice(cause=f"a file it reads is missing: {missing.group(1)}",
                      fix=how + "then `trainbridge init --force`; runs show your checkout's git-ignored files read-only",
                      line_specific=False)
    if "tried to reach the network" in failure.message:
        return Advice(cause="it downloads something when it starts (a dataset, a tokenizer, pretrained weights), and the "
                            "sandbox has no network",
                      fix="fetch it once outside TrainBridge into a git-ignored path of the repository (runs show it "
                          "read-only), or override the setting that asks for the download",
                      line_specific=False)
    return Advice(cause=f"{failure.kind}: {failure.message}", fix=_shrink_fix(found) if failure.kind in ("timeout", "oom") else "",
                  line_specific=True)


def _preparation(found: Discovery) -> str | None:
    """The command that prepares the data: a line the README gives for a script named like it (`python
    data/shakespeare_char/prepare.py`), else such a script that runs on its own."""
    for skipped in found.skipped:  # "README.md:7 `python data/x/prepare.py`: data/x/prepare.py builds no optimizer ..."
        command = re.search(r"`([^`]+)`", skipped)
        if command and _PREPARE.search(command.group(1)):
            return command.group(1)
    script = next((m.script for m in found.near_misses if _PREPARE.search(m.script)), None)
    return f"python {script}" if script else None


def _device_setting(found: Discovery) -> Setting | None:
    """The script's device setting (`device = 'cuda'`, `--device`), if it has one."""
    return next((s for s in found.settings if s.name in _DEVICE_NAMES), None)


def _device_fix(setting: Setting | None) -> str:
    """The override that puts the script on the CPU: its device setting set to "cpu"."""
    if setting is None:
        return ("the script picks CUDA without a setting to change it (a hard-coded .cuda() or 'cuda'): run it where "
                "CUDA is, or give trainbridge its CPU line (`trainbridge measure <repo> -- python <script> ...`)")
    return f'under [overrides] in trainbridge.toml: {toml_key(setting)} = "cpu" ({_where(setting)})'


def _shrink_fix(found: Discovery) -> str:
    from trainbridge.tools.launch.script_facts import SIZE_NAMES

    sizes = [s for s in found.settings if s.name in SIZE_NAMES][:4]
    return ("shrink it under [overrides] in trainbridge.toml: " + ", ".join(f"{toml_key(s)} ({_where(s)})" for s in sizes)) if sizes else ""


def _where(setting: Setting) -> str:
    return f"{setting.kind}, {setting.where}, now {setting.value}"
