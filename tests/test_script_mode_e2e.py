"""Zero config, end to end, as a new user does it: `trainbridge init` on an unmodified nanoGPT-style
repository, commit the toml it wrote, `trainbridge run`: a rewrite lands, its numerics checked on the
gate's fresh seeds, and the user's checkout is untouched. (Real subprocesses, the installed CLI.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.tests.script_mode_support import commit_all, git, nanogpt_repo

# a whole run (init, baseline, repeatability check, paired gate): minutes on 2 cores, more when the machine is shared
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def trainbridge(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)


def test_init_then_run_lands_a_verified_rewrite_on_an_unmodified_script(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", "")
    (repo / "trainbridge.toml").unlink()  # the user has written nothing for TrainBridge
    (repo / ".gitignore").write_text("data/\nout/\n", encoding="utf-8")
    commit_all(repo)
    env = {**os.environ, "TRAINBRIDGE_HOME": str(tmp_path / "home")}
    init = trainbridge("init", ".", "--yes", cwd=repo, env=env)
    assert init.returncode == 0, init.stderr
    toml = (repo / "trainbridge.toml").read_text(encoding="utf-8")
    assert 'launch = "python train.py"' in toml and 'data = ["data/"]' in toml and "it runs: median step" in init.stdout + init.stderr
    git(repo, "add", "trainbridge.toml")
    git(repo, "commit", "-q", "-m", "trainbridge.toml from trainbridge init")
    head, status = git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")

    done = trainbridge("run", ".", "--no-reference", "--rounds", "6", "--final-rounds", "0", "--category", "gelu",
                       "--budget", "20m", "--run-id", "zero-config", cwd=repo, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "home" / "runs" / "zero-config" / "report" / "report.md").read_text(encoding="utf-8")
    assert "| gelu | gelu-tanh-functional | accepted |" in report, report[:3000]
    verdict, = json.loads((tmp_path / "home" / "runs" / "zero-config" / "report" / "run.json").read_text())["state"]["verdicts"]
    assert verdict["accepted"] and "numerics match (seed" in verdict["message"], verdict["message"]
    assert git(repo, "log", "--format=%s", "-1", "trainbridge/zero-config") != git(repo, "log", "--format=%s", "-1", "main")
    # the user's repository: same head, same (clean) working tree, data untouched
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "status", "--porcelain") == status
