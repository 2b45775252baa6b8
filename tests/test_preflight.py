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


def test_a_machine_that_cannot_confine_refuses_the_run_unless_it_is_asked_to_run_unconfined(tmp_path, monkeypatch):
    """Issue 24, item 2: candidates are untrusted; where bubblewrap cannot confine them (here: TRAINBRIDGE_CONFINE=0,
    the same answer as a host without it) the run is refused with what to install, before anything of it exists;
    --unconfined (or TRAINBRIDGE_UNCONFINED=1) runs it and says so."""
    from trainbridge.sandbox import confinement

    repo = _repo(tmp_path)
    monkeypatch.setenv(confinement.CONFINE_ENV, "0")
    confinement.bubblewrap.cache_clear()
    try:
        with pytest.raises(RunInputError, match=r"cannot confine the code the gate runs: .*apt-get install bubblewrap.*--unconfined"):
            check_run_input(RunConfig(repo=str(repo), run_id="refused"))
        notes = check_run_input(RunConfig(repo=str(repo), run_id="allowed", unconfined=True))
        assert notes and notes[0].startswith("UNCONFINED: candidates run without the sandbox's confinement")
        from trainbridge.agents.coder.candidate import Candidate
        from trainbridge.graph.nodes import verdict_record

        candidate = Candidate(intent_id="i", category="gelu", recipe_id="r", name="c", files=["m.py"], diff="", branch="b",
                              sha="1" * 40, base_sha="0" * 40, worktree=str(repo))
        assert verdict_record(candidate, accepted=False, reason="slower", message="m")["unconfined"] is True
    finally:
        monkeypatch.delenv(confinement.CONFINE_ENV)
        confinement.bubblewrap.cache_clear()
    if confinement.bubblewrap().usable:
        assert check_run_input(RunConfig(repo=str(repo), run_id="confined")) == []
        assert verdict_record(candidate, accepted=False, reason="slower", message="m")["unconfined"] is False

    # a run started with confinement and resumed where there is none is refused the same way
    (tmp_path / "tb" / "runs" / "started").mkdir(parents=True)
    (tmp_path / "tb" / "runs" / "started" / "run.json").write_text(RunConfig(repo=str(repo), run_id="started").model_dump_json())
    env = {"TRAINBRIDGE_CONFINE": "0"}
    resumed = _cli_env(tmp_path, env, "resume", "started")
    assert resumed.returncode == 2 and "cannot confine the code the gate runs" in resumed.stderr, resumed.stderr
    shutil.rmtree(tmp_path / "tb")
    refused = _cli_env(tmp_path, env, "run", str(repo), "--run-id", "refused")
    assert refused.returncode == 2 and "cannot confine the code the gate runs" in refused.stderr, refused.stderr
    assert not (tmp_path / "tb" / "runs").exists()
    assert "--unconfined" in _cli_env(tmp_path, env, "run", "--help").stdout


def _cli_env(home: Path, extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TRAINBRIDGE_HOME": str(home / "tb"), "COLUMNS": "250", **extra}
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], capture_output=True, text=True, env=env, timeout=300)


def test_too_few_rounds_to_accept_anything_are_said_before_the_run(tmp_path):
    """Issue 27: `--rounds 2` was accepted without a word, though such a run can never accept a candidate."""
    repo = _repo(tmp_path)
    notes = check_run_input(RunConfig(repo=str(repo), run_id="short", gate_rounds=2, unconfined=True))
    assert any(n.startswith("--rounds 2 lets the gate look at 4 rounds at most") and "never accept one" in n for n in notes), notes
    assert not any("--rounds" in n for n in check_run_input(RunConfig(repo=str(repo), run_id="ok", gate_rounds=3, unconfined=True)))
