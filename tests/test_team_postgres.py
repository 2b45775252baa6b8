"""Runs checkpointed in Postgres (issue 17): a real server (Debian's `postgresql`, started in a
temporary folder on a loopback port by tests/team_support.py and stopped afterwards).

- quick: the URL rules (no password in a URL that is saved with the run), the run lock across
  processes through the database;
- slow: the loop workload started with `--checkpoint postgresql://...` in one process, SIGKILLed
  while a gate times the candidate; `trainbridge status` from a second process with another home
  (no run.json there: it reads the run from the database); resumed from a third process with that
  other home: it finishes with one commit per accepted rewrite and each verdict once, as an
  uninterrupted run of this workload decides (tests/loop_fixtures.py), and no SQLite file anywhere.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from trainbridge.graph.checkpoints import CheckpointError, check_checkpoint_url, database_run_lock
from trainbridge.graph.state import RunConfig
from trainbridge.tests.loop_checks import assert_clean_repository, child_env, cli_argv, run_commits, run_outcomes
from trainbridge.tests.loop_fixtures import decided_by_construction, git, loop_config, make_loop_repo
from trainbridge.tests.team_support import LoopProcess, outcome_view, postgres_bin, postgres_server

needs_postgres = pytest.mark.skipif(postgres_bin() is None, reason="Postgres server binaries not installed "
                                    "(apt-get install -y postgresql; .ci/run installs them)")


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as url:
        yield url


def test_checkpoint_urls_are_postgres_without_a_password():
    assert check_checkpoint_url(None) is None and check_checkpoint_url("sqlite") is None
    assert check_checkpoint_url("postgresql://tb@db-host:5432/runs") == "postgresql://tb@db-host:5432/runs"
    with pytest.raises(ValueError, match="PGPASSWORD or ~/.pgpass"):
        check_checkpoint_url("postgresql://tb:secret@db-host/runs")
    with pytest.raises(ValueError, match="Postgres URL"):
        check_checkpoint_url("mysql://db-host/runs")
    with pytest.raises(ValueError, match="PGPASSWORD"):
        RunConfig(repo="/r", run_id="r1", checkpoint="postgres://tb:pw@h/db")


def test_a_run_found_nowhere_says_how_to_reach_its_database(tmp_path, monkeypatch):
    from trainbridge.graph.runs import RunError, load_config

    monkeypatch.delenv("TRAINBRIDGE_CHECKPOINT", raising=False)
    with pytest.raises(RunError, match="--checkpoint postgresql://"):
        load_config("elsewhere", root=tmp_path / "runs")


def test_a_served_run_keeps_the_checkpoints_of_its_server(tmp_path, monkeypatch):
    from trainbridge.graph.server import ServedRunError, served_run

    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    settings = {"repo": str(tmp_path), "run_id": "served", "checkpoint": "postgresql://tb@db-host/runs"}
    with pytest.raises(ServedRunError, match="POSTGRES_URI"):
        served_run({"run_id": "served"}, {"configurable": {"thread_id": "t1"}}, {"run": settings}, None)
    assert not (tmp_path / "home" / "runs" / "served").exists()


@needs_postgres
def test_the_run_lock_in_the_database_holds_across_processes_and_dies_with_its_holder(postgres):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from trainbridge.graph.checkpoints import database_run_lock\n"
                               f"with database_run_lock({postgres!r}, 'locked-run'):\n print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="already running"):
            with database_run_lock(postgres, "locked-run"):
                pass
        with database_run_lock(postgres, "another-run"):  # other runs are not held
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with database_run_lock(postgres, "locked-run"):  # the server dropped the killed holder's session lock
        pass


@needs_postgres
@pytest.mark.slow
def test_killed_run_resumes_from_another_home_through_postgres(postgres, tmp_path):
    repo = make_loop_repo(tmp_path / "repo")
    config = loop_config(repo, "pg-crash", tmp_path, checkpoint=postgres)
    home_a, home_b = tmp_path / "home-a", tmp_path / "home-b"

    refused = []

    def second_process_is_refused():  # the lock in the database, from a home that has no run.json
        done = subprocess.run([*cli_argv(), "resume", "pg-crash", "--checkpoint", postgres], env=child_env(home_b),
                              capture_output=True, text=True, timeout=120)
        refused.append((done.returncode, done.stderr))

    first = LoopProcess({"action": "start", "config": config.model_dump(mode="json")}, home_a, tmp_path / "first.log")
    status = first.watch(kill_at_measure=2, before_kill=second_process_is_refused)  # 1: baseline; 2: the first gate child
    assert status == -signal.SIGKILL, first.tail()
    assert refused and refused[0][0] == 2 and "already running" in refused[0][1], refused

    shown = subprocess.run([*cli_argv(), "status", "pg-crash", "--checkpoint", postgres], env=child_env(home_b),
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "run pg-crash: stopped; next:" in shown.stdout and "baseline step" in shown.stdout, shown.stdout
    assert not (home_b / "runs" / "pg-crash" / "run.json").exists()  # read from the database, not from files

    second = LoopProcess({"action": "resume", "run_id": "pg-crash", "checkpoint": postgres}, home_b, tmp_path / "second.log")
    assert second.watch(timeout_s=900) == 0, second.tail()
    assert "OUTCOME {\"finished\": true}" in second.tail()

    done = subprocess.run([*cli_argv(), "status", "pg-crash", "--checkpoint", postgres], env=child_env(home_b),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "run pg-crash: finished" in done.stdout, done.stdout + done.stderr
    listed = subprocess.run([*cli_argv(), "status", "--checkpoint", postgres], env=child_env(tmp_path / "home-c"),
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "pg-crash: finished" in listed.stdout, listed.stdout + listed.stderr

    from trainbridge.graph.runs import run_status

    state = run_status("pg-crash", root=home_b / "runs", checkpoint=postgres)["state"]
    # what this workload decides by construction, each candidate once (numerics decide the planted recipe; GELU is
    # judged on speed: tests/test_loop.py holds an uninterrupted run to its acceptance)
    view = outcome_view(state["verdicts"])
    assert decided_by_construction(view), [(v["candidate"], v["reason"], v["message"]) for v in state["verdicts"]]
    commits = run_commits(repo, state["base_sha"], "trainbridge/pg-crash")
    assert [c["sha"] for c in commits] == [a["sha"] for a in state["accepted"]] and len(commits) == int(view[0][2])
    moves = git(repo, "reflog", "show", "--format=%gs", "trainbridge/pg-crash").splitlines()
    assert sum("accept candidate" in m for m in moves) == 1, moves
    outcomes = run_outcomes(config.kb_dir, "pg-crash")
    assert sorted(o.id for o in outcomes) == sorted(f"outcome-pg-crash-{v['candidate']}" for v in state["verdicts"] if v["candidate"])
    assert not list(tmp_path.rglob("checkpoints.sqlite")), "a Postgres run wrote a SQLite checkpoint"
    assert_clean_repository(repo, "pg-crash")
