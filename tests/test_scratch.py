"""Sandbox scratch folders: a killed process's folders are swept, live ones never."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainbridge.sandbox.scratch import OWNER_FILE, scratch_dir, sweep_stale


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(root, name: str, pid: int | None, age_s: float):
    folder = root / name
    folder.mkdir()
    (folder / "result.json").write_text("{}")
    if pid is not None:
        (folder / OWNER_FILE).write_text(str(pid))
        old = time.time() - age_s
        os.utime(folder / OWNER_FILE, (old, old))
    return folder


def test_sweep_removes_only_folders_of_dead_owners(tmp_path):
    dead = _folder(tmp_path, "trainbridge-run-dead", _dead_pid(), 60)
    young = _folder(tmp_path, "trainbridge-gate-baseline-young", _dead_pid(), 0)
    mine = _folder(tmp_path, "trainbridge-run-mine", os.getpid(), 60)
    parent = _folder(tmp_path, "trainbridge-evidence-parent", os.getppid(), 60)
    unowned = _folder(tmp_path, "trainbridge-run-unowned", None, 60)
    other = _folder(tmp_path, "something-else", _dead_pid(), 60)
    demo = _folder(tmp_path, "trainbridge-demo-x", _dead_pid(), 60)  # a demo repository is the user's result: never swept

    assert sweep_stale(tmp_path) == [dead]
    assert not dead.exists() and all(p.exists() for p in (young, mine, parent, unowned, other, demo))


def test_scratch_dir_records_its_owner_and_cleans_up(tmp_path):
    with scratch_dir("trainbridge-run-", tmp_path) as folder:
        assert (folder / OWNER_FILE).read_text() == str(os.getpid()) and folder.parent == tmp_path
        assert sweep_stale(tmp_path, now=time.time() + 3600) == []  # its owner (this process) is alive
    assert not folder.exists()
    with pytest.raises(ValueError, match="must start with one of"):
        with scratch_dir("mine-", tmp_path):
            pass


def test_a_killed_owner_leaves_a_folder_the_next_sweep_removes(tmp_path):
    code = ("import sys, time; from pathlib import Path; from trainbridge.sandbox.scratch import scratch_dir\n"
            f"with scratch_dir('trainbridge-run-', Path({str(tmp_path)!r})) as f:\n"
            "    print(f, flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    folder = tmp_path / os.path.basename(child.stdout.readline().strip())
    child.kill()
    child.wait()
    assert folder.is_dir()  # kill -9: no clean-up ran
    assert sweep_stale(tmp_path, now=time.time() + 60) == [folder] and not folder.exists()
