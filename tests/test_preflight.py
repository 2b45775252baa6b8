"""Bad input is refused before a run exists: no run record, checkpoint or branch, exit code 2, and a
message naming the user's own path (never the copy in a run's worktree) and what to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.graph.runs import RunError, start_run
from trainbridge.graph.preflight import RunInputError, check_run_input
from trainbridge.graph.state import RunConfig

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True)


def _repo(tmp_path: Path, workload: str = "tiny") -> Path:
    repo = tmp_path / "user-repo"
    shutil.copytree(WORKLOADS / workload, repo, ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    return repo


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TRAINBRIDGE_HOME": str(home / "tb"), "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_refuses_bad_input_before_any_run_record(tmp_path):
    plain = tmp_path / "not-a-checkout"
    plain.mkdir()
    for repo, words in ((tmp_path / "missing", f"{tmp_path / 'missing'} does not exist"),
                        (plain, f"{plain} is not inside a git repository")):
        done = _cli(tmp_path, "run", str(repo), "--run-id", "bad-input")
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and "trainbridge resume" not in done.stderr, done.stderr
        assert not (tmp_path / "tb" / "runs").exists()  # nothing of the run was created
    bad_id = _cli(tmp_path, "run", str(plain), "--run-id", "-dash-first")
    assert bad_id.returncode == 2 and "starting with a letter or digit" in bad_id.stderr


def test_a_malformed_trainbridge_toml_is_reported_at_the_users_file(tmp_path):
    repo = _repo(tmp_path, "bad_key")
    with pytest.raises(RunInputError, match="unknown key 'setps'") as raised:
        check_run_input(RunConfig(repo=str(repo), run_id="r"))
    assert f"{repo / 'trainbridge.toml'}:3:" in str(raised.value) and "/workspace/" not in str(raised.value)
    with pytest.raises(RunError, match="unknown key 'setps'"):
        start_run(RunConfig(repo=str(repo), run_id="r"), root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_the_committed_trainbridge_toml_is_what_the_run_uses(tmp_path):
    repo = _repo(tmp_path)
    assert check_run_input(RunConfig(repo=str(repo), run_id="r"), env={}) == []
    toml = repo / "trainbridge.toml"
    toml.write_text(toml.read_text() + "\n# tuned, not committed\n")
    with pytest.raises(RunInputError, match="has uncommitted changes"):
        check_run_input(RunConfig(repo=str(repo), run_id="r"))
    _git(repo, "rm", "-q", "--cached", "trainbridge.toml")
    _git(repo, "commit", "-qm", "untrack")
    with pytest.raises(RunInputError, match="is not committed"):
        check_run_input(RunConfig(repo=str(repo), run_id="r"))
    with pytest.raises(RunInputError, match=f"evidence pack {tmp_path / 'none.tar.gz'} does not exist"):
        check_run_input(RunConfig(repo=str(_repo(tmp_path / "b")), run_id="r", reference_pack=str(tmp_path / "none.tar.gz")))


def test_half_set_llm_settings_are_refused_before_the_run(tmp_path):
    repo = _repo(tmp_path)
    with pytest.raises(RunInputError, match="TRAINBRIDGE_LLM_MODEL"):
        check_run_input(RunConfig(repo=str(repo), run_id="r"), env={"TRAINBRIDGE_LLM_BASE_URL": "http://127.0.0.1:9/v1"})
    assert check_run_input(RunConfig(repo=str(repo), run_id="r"), env={}) == []
