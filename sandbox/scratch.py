"""Scratch folders of sandbox runs that a killed TrainBridge process cannot leave behind for long.

Each folder records the pid of the process that made it (`owner.pid`). A process killed with -9
never runs its clean-up, so the next `run`/`resume` sweeps folders whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PREFIXES = ("trainbridge-run-", "trainbridge-gate-", "trainbridge-evidence-", "trainbridge-calibrate-")
OWNER_FILE = "owner.pid"
MIN_AGE_S = 5.0  # a folder younger than this may still be getting its owner file


@contextlib.contextmanager
def scratch_dir(prefix: str, dir: Path | None = None) -> Iterator[Path]:
    """Like tempfile.TemporaryDirectory, plus the owner's pid for `sweep_stale`."""
    if not prefix.startswith(PREFIXES):
        raise ValueError(f"scratch prefix {prefix!r} must start with one of {PREFIXES} (so a sweep can find it)")
    with tempfile.TemporaryDirectory(prefix=prefix, dir=dir) as tmp:
        (Path(tmp) / OWNER_FILE).write_text(str(os.getpid()), encoding="utf-8")
        yield Path(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_stale(root: Path | None = None, *, now: float | None = None) -> list[Path]:
    """Remove scratch folders under `root` (default: the temp dir) whose owner process is gone.
    Folders without an owner file are left alone (not ours to judge); returns what was removed."""
    base = Path(root or tempfile.gettempdir())
    now = time.time() if now is None else now
    removed = []
    for folder in base.glob("trainbridge-*"):
        if not folder.is_dir() or not folder.name.startswith(PREFIXES):
            continue
        owner = folder / OWNER_FILE
        try:
            pid = int(owner.read_text(encoding="utf-8").strip())
            age = now - owner.stat().st_mtime
        except (OSError, ValueError):
            continue
        if age >= MIN_AGE_S and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
