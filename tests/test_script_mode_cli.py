"""`trainbridge measure <repo> -- LAUNCH` and `trainbridge run <repo> -- LAUNCH`, as a user types them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

from script_repos import commit_all, nanogpt_repo, script_repo


def trainbridge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], capture_output=True, text=True, timeout=300)


def test_measure_runs_a_launch_line_given_after_two_dashes(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", 'data = ["data/"]\ntimeout_s = 120\n')  # no launch in the toml: the command line gives it
    out = tmp_path / "result.json"
    done = trainbridge("measure", str(repo), "--steps", "2", "--warmup", "1", "--json", str(out), "--",
                       "python", "train.py", "--batch_size=2", "--block_size=16", "--n_layer=1", "--n_embd=32", "--n_head=2")
    assert done.returncode == 0, done.stderr
    payload = json.loads(out.read_text())
    assert payload["mode"] == "script" and len(payload["step_times_s"]) == 2
    assert payload["extra"]["script"]["argv"][:2] == ["train.py", "--batch_size=2"]


def test_measure_with_a_bad_launch_line_exits_2_with_the_reason(tmp_path):
    repo = script_repo(tmp_path / "repo", "never_steps.py", "")
    done = trainbridge("measure", str(repo), "--", "bash", "run.sh")
    assert done.returncode == 2 and "not 'bash'" in done.stderr
    # words after `--` are already the shell's argv: a literal '$' (quoted in the user's shell) is passed as is
    literal = trainbridge("measure", str(repo), "--", "python", "train.py", "--out=$HOME")
    assert literal.returncode == 1 and "before its first optimizer step" in literal.stderr


def test_run_with_a_launch_line_checks_it_before_anything_of_the_run_exists(tmp_path):
    repo = script_repo(tmp_path / "repo", "never_steps.py", "timeout_s = 60\n")
    commit_all(repo)
    done = trainbridge("run", str(repo), "--", "bash", "run.sh")
    assert done.returncode == 2 and "not 'bash'" in done.stderr
    done = trainbridge("run", str(repo), "--", "python", "missing.py")
    assert done.returncode == 2 and "missing.py" in done.stderr, done.stderr


def test_analyze_and_collect_evidence_take_the_launch_line_too(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", 'data = ["data/"]\ntimeout_s = 120\nsteps = 2\nwarmup_steps = 1\n')
    out = tmp_path / "analysis.json"
    done = trainbridge("analyze", str(repo), "--no-reference", "--json", str(out), "--",
                       "python", "train.py", "--batch_size=2", "--block_size=16", "--n_layer=1", "--n_embd=32", "--n_head=2")
    assert done.returncode == 0, done.stderr
    analysis = json.loads(out.read_text())
    profiled = [i for i in analysis["intents"] if "eager_profile" in i["evidence"]["detectors"]]  # the script ran
    assert profiled and any(span["file"] == "model.py" for i in profiled for span in i["spans"]), analysis["intents"][:3]
    for command in (("analyze", str(repo)), ("collect-evidence", str(repo), "--out", str(tmp_path / "pack.tar.gz"))):
        refused = trainbridge(*command, "--", "bash", "run.sh")
        assert refused.returncode == 2 and "not 'bash'" in refused.stderr, (command, refused.stderr)
