"""The loop in a child process (`DRIVER`), and one run with review of the loop workload driven from the command line, as
a user does it (`reviewed_cli_run`): process 1 starts it and stops at the first patch, `trainbridge review` in process 2
rejects that patch with a reason, in process 3 approves the next one. tests/test_loop.py checks that review across
processes; tests/test_server.py's served run must end with the same branch, verdicts and knowledge-base entries. A
pytest plugin (tests/conftest.py loads it), so that a session runs the workload's review run once for both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
REVIEWED = "reviewed"  # the run id of the reviewed run, here and on the server

# The loop in a child process. Optionally it SIGKILLs itself right after a given git command
# succeeded (the moment a crash hurts most: the commit or ref move exists, the checkpoint does not).
DRIVER = r"""
import json, os, signal, sys
args = json.loads(sys.argv[1])
if args.get("kill_after"):
    from trainbridge.tools.git import runner as git_runner
    kind, ref = args["kill_after"]
    original = git_runner._git_status
    def _git_status(cwd, *argv, **kwargs):
        result = original(cwd, *argv, **kwargs)
        moved_run_branch = "update-ref" in argv and ref in argv and argv[-1] != ""  # not its creation
        if result[0] == 0 and ((kind == "commit" and "commit" in argv) or (kind == "move" and moved_run_branch)):
            print(f"KILLING MYSELF after git {' '.join(a for a in argv if not a.startswith('-c'))[:200]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    git_runner._git_status = _git_status
from trainbridge.graph.runs import resume_run, start_run
from trainbridge.graph.state import RunConfig
say = lambda message: print(message, flush=True)
if args["action"] == "start":
    outcome = start_run(RunConfig.model_validate(args["config"]), say=say)
else:
    outcome = resume_run(args["run_id"], say=say)
print("OUTCOME " + json.dumps({"finished": outcome.finished, "waiting": outcome.waiting_for_review}), flush=True)
"""


@pytest.fixture(scope="session")
def reviewed_cli_run(tmp_path_factory):
    """The review run of the loop workload (review on, two gate rounds), its three processes run to their ends, and the
    run's status after each: `paused` (process 1: waiting for the first patch), `again` (after the rejection: waiting
    for the next), `final` (after the approval), with each process's exit status and output."""
    from trainbridge.graph.runs import RunError, run_status
    from trainbridge.tests.loop_checks import REJECT_REASON, child_env, cli_argv
    from trainbridge.tests.loop_fixtures import loop_config, make_loop_repo

    tmp = tmp_path_factory.mktemp("reviewed-cli")
    repo = make_loop_repo(tmp / "repo")
    home = tmp / "home"
    runs = home / "runs"
    config = loop_config(repo, REVIEWED, tmp, review=True, gate_rounds=2)
    done = SimpleNamespace(tmp=tmp, repo=repo, home=home, runs=runs, config=config, first=None, paused=None, second=None,
                           again=None, third=None, final=None)

    def status() -> dict | None:
        try:
            return run_status(REVIEWED, root=runs)
        except RunError:
            return None

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli_argv(), *args], cwd=tmp, env=child_env(home), capture_output=True, text=True, timeout=600)

    start = {"action": "start", "config": config.model_dump(mode="json"), "kill_after": None}
    done.first = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(start)], cwd=ROOT, env=child_env(home),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    done.paused = status()
    if done.first.returncode != 0 or done.paused is None:
        return done  # the tests that read it fail on what they find, with the process's output
    done.second = cli("review", REVIEWED, "--action", "reject", "--reason", REJECT_REASON)
    done.again = status()
    if done.second.returncode != 0:
        return done
    done.third = cli("review", REVIEWED, "--action", "approve")
    done.final = status()
    return done
