"""Which of a checkout's files outside git are no input of a training script, by name (sandbox/script/ignored.py
shows the others to a run; tools/launch/discovery.py leaves them out of a `data` list): hidden entries, folders
named like outputs, caches or environments, bytecode and logs."""

from __future__ import annotations

import fnmatch

_OUTPUT_DIRS = ("out", "out-*", "out_*", "output", "outputs", "output_*", "checkpoint", "checkpoints", "ckpt", "ckpts",
                "saved_models", "save", "saves", "results", "logs", "log", "runs", "wandb", "mlruns", "lightning_logs",
                "tb_logs", "tensorboard", "__pycache__", "venv", "env", "virtualenv", "site-packages", "node_modules",
                "build", "dist", "*.egg-info", "htmlcov")
_NOT_INPUT_FILES = ("*.pyc", "*.pyo", "*.log", "*.swp", "*~", "nohup.out", "trainbridge.toml")


def not_an_input(rel: str) -> str | None:
    """Why the git-ignored entry `rel` is left out (see the module doc), or None when it is shown."""
    parts = [p for p in rel.split("/") if p]
    for index, part in enumerate(parts):
        folder = index < len(parts) - 1 or rel.endswith("/")
        if part.startswith("."):
            return "hidden (environments, secrets and caches are not inputs)"
        if folder and any(fnmatch.fnmatch(part, pattern) for pattern in _OUTPUT_DIRS):
            return f"{part}/ is named like an output, cache or environment folder"
    if not rel.endswith("/") and parts and any(fnmatch.fnmatch(parts[-1], pattern) for pattern in _NOT_INPUT_FILES):
        return "bytecode, a log or an editor's file"
    return None
