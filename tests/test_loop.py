"""The loop end to end: a real repository, real sandbox runs, real git, a real knowledge base
(the graph's units without sandbox runs: tests/test_loop_graph.py).

- end to end (slow): one uninterrupted run accepts the GELU rewrite with a measured gain and rejects
  the planted wrong RMSNorm rewrite with numerics_mismatch, on a repository with every git hook and
  hostile git settings, none of which runs or changes anything;
- crash/resume (slow): the same run in subprocesses killed with SIGKILL at many points (during the
  baseline measurement, right after a candidate commit, during a gate timing child, right after the
  run branch moved, at seeded random moments), resumed each time: same commits and verdicts as the
  uninterrupted run, no duplicates, nothing lost, the repository intact;
- review across processes (slow): process 1 stops at the first patch, `trainbridge review` in
  process 2 rejects it with a reason, process 3 approves the next one (the session's one such run:
  tests/review_run_support.py; tests/test_server.py's served run must end as it does).

Decisions are deterministic by construction (see tests/loop_fixtures.py): numerics decide the
planted candidate, and the GELU rewrite halves the step against a 5% minimum gain.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainbridge.graph.runs import RunError, resume_run, run_status, start_run
from trainbridge.graph.state import RunConfig
from trainbridge.tests.loop_checks import (
    LLM_ENV,
    REJECT_REASON,
    assert_clean_repository,
    child_env,
    cli_argv,
    decision_view,
    harness_children,
    kill_harness_groups,
    run_commits,
    run_outcomes,
    user_view,
)
from trainbridge.tests.loop_fixtures import (
    GOOD_RECIPE,
    WRONG_RECIPE,
    add_user_changes,
    git,
    loop_config,
    make_loop_repo,
)
from trainbridge.tests.review_run_support import DRIVER  # the loop in a child process, killable after a git command


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


class Driver:
    """One loop process (start or resume) with its log; killable at chosen moments."""

    def __init__(self, args: dict, home: Path, log: Path):
        self.log = log
        self.handle = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT, env=child_env(home),
                                     stdout=self.handle, stderr=subprocess.STDOUT)
        self.sandbox_children: dict[int, str] = {}

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]

    def watch(self, *, kill_at_measure: int | None = None, kill_after_s: float | None = None, timeout_s: float = 600,
              before_kill=None) -> int:
        """Wait for the process; SIGKILL it when its `kill_at_measure`-th timed child is running
        (calling `before_kill()` first), or after `kill_after_s`. Returns the exit status (-9 when killed)."""
        started = time.monotonic()
        while self.proc.poll() is None:
            self.sandbox_children.update(harness_children(self.proc.pid))
            measuring = [pid for pid, mode in self.sandbox_children.items() if mode == "timed"]
            if (kill_at_measure is not None and len(measuring) >= kill_at_measure) or \
                    (kill_after_s is not None and time.monotonic() - started >= kill_after_s):
                if before_kill is not None and kill_at_measure is not None:
                    before_kill()
                self.kill()
                break
            if time.monotonic() - started > timeout_s:
                self.kill()
                pytest.fail(f"loop process ran past {timeout_s} s:\n{self.tail()}")
            time.sleep(0.1)
        status = self.proc.wait()
        self.reap_orphans()
        self.handle.close()
        return status

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def reap_orphans(self) -> None:
        """The sandbox children run in their own sessions and outlive a killed parent: end the ones we saw."""
        kill_harness_groups(self.sandbox_children)


def start_args(config: RunConfig, kill_after: tuple[str, str] | None = None) -> dict:
    return {"action": "start", "config": config.model_dump(mode="json"), "kill_after": kill_after}


def resume_args(run_id: str, kill_after: tuple[str, str] | None = None) -> dict:
    return {"action": "resume", "run_id": run_id, "kill_after": kill_after}


# --------------------------------------------------------------------------------------- end to end


# Every client-side hook git knows; each leaves a marker (outside the repository) when it runs.
HOOKS = ("applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit", "prepare-commit-msg",
         "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge", "pre-push", "pre-auto-gc",
         "post-rewrite", "post-index-change", "reference-transaction", "push-to-checkout", "fsmonitor-watchman")


def install_hostile_config(repo: Path, markers: Path) -> None:
    """A user's repository as git allows it to be: every hook installed (a failing post-checkout among
    them), a core.hooksPath with the same hooks, prefix-less and coloured diffs, mandatory signing
    without a key."""
    markers.mkdir(parents=True, exist_ok=True)
    hooks_path = repo.parent / "user-hooks"
    for folder in (repo / ".git" / "hooks", hooks_path):
        folder.mkdir(parents=True, exist_ok=True)
        for name in HOOKS:
            hook = folder / name
            status = 1 if name == "post-checkout" else 0
            hook.write_text(f"#!/bin/sh\necho \"$0 $*\" >> '{markers}/{name}'\nexit {status}\n", encoding="utf-8")
            hook.chmod(0o755)
    for key, value in {"core.hooksPath": str(hooks_path), "diff.noprefix": "true", "diff.mnemonicPrefix": "true",
                       "color.ui": "always", "color.diff": "always", "commit.gpgsign": "true", "tag.gpgSign": "true",
                       "user.signingkey": "0xDEADBEEFNOSUCHKEY", "gpg.program": str(markers / "no-such-gpg")}.items():
        git(repo, "config", key, value)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted run of the loop workload (in this process), shared by the slow tests. Its
    repository is as hostile as git allows (every hook, core.hooksPath, prefix-less coloured diffs,
    signing without a key: `install_hostile_config`), so the same run shows that none of it changes what
    the loop does: the crash/resume test's plain repository must end with this run's branch and verdicts."""
    tmp = tmp_path_factory.mktemp("loop-reference")
    repo = make_loop_repo(tmp / "repo")
    markers = tmp / "markers"
    install_hostile_config(repo, markers)
    changes = add_user_changes(repo)
    before = user_view(repo)
    config = loop_config(repo, "reference", tmp)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBRIDGE_HOME", str(tmp / "home"))
        for name in LLM_ENV:
            patch.delenv(name, raising=False)
        started = time.monotonic()
        outcome = start_run(config, root=tmp / "home" / "runs")
        wall_s = time.monotonic() - started
    print(f"\nuninterrupted loop run: {wall_s:.1f} s")
    return SimpleNamespace(tmp=tmp, repo=repo, config=config, outcome=outcome, before=before, changes=changes, wall_s=wall_s,
                           markers=markers)


@pytest.mark.slow
def test_end_to_end_accepts_a_measured_gain_and_rejects_wrong_numerics(reference_run):
    run, state = reference_run, reference_run.outcome.state
    assert reference_run.outcome.finished and reference_run.outcome.waiting_for_review is None, state.get("node")
    verdicts = state["verdicts"]
    accepted = [v for v in verdicts if v["accepted"]]
    assert [v["recipe_id"] for v in accepted] == [GOOD_RECIPE], verdicts
    gain = accepted[0]
    assert gain["reason"] == "accepted" and gain["ratio"] <= 1 - run.config.min_gain and gain["ratio_ci"][1] < 1.0, gain
    wrong = [v for v in verdicts if v["recipe_id"] == WRONG_RECIPE]
    assert len(wrong) == 1 and wrong[0]["reason"] == "numerics_mismatch" and not wrong[0]["accepted"], wrong
    assert "gradient" in wrong[0]["message"] and wrong[0]["category"] == "rmsnorm"
    assert state["stop_reason"] == "no intents left" and state["candidates_tried"] == 2

    # the loop's own cost: one entry per node run, in order, with the sub-phases the nodes measured
    times = state["phase_times"]
    assert [t["node"] for t in times][:3] == ["prepare", "analyst", "retrieval"] and times[-1]["node"] == "report"
    assert [t["node"] for t in times].count("profiler") == 2 and all(t["wall_s"] >= 0 for t in times)
    by_node = {t["node"]: t for t in times}
    assert 0 < by_node["prepare"]["parts"]["baseline"] <= by_node["prepare"]["wall_s"]
    assert {"static", "profile"} <= set(by_node["analyst"]["parts"])
    gated = [t for t in times if t["node"] == "profiler"]
    assert all(0 < t["parts"]["numerics"] <= t["wall_s"] for t in gated)
    assert any(t["parts"].get("timing", 0) > 0 for t in gated)  # the accepted candidate was timed
    assert sum(t["wall_s"] for t in times) <= run.wall_s

    # the knowledge base knows both outcomes, with the rejection's reason
    outcomes = {o.recipe_id: o for o in run_outcomes(run.config.kb_dir, "reference")}
    assert set(outcomes) == {GOOD_RECIPE, WRONG_RECIPE}
    assert outcomes[GOOD_RECIPE].verdict == "accepted" and outcomes[GOOD_RECIPE].ratio == gain["ratio"]
    assert outcomes[WRONG_RECIPE].verdict.startswith("numerics_mismatch: numerics mismatch")
    assert wrong[0]["message"][:80] in outcomes[WRONG_RECIPE].verdict

    # exactly one commit per accepted candidate on the run branch, on top of the base
    commits = run_commits(run.repo, state["base_sha"], "trainbridge/reference")
    assert [c["sha"] for c in commits] == [gain["sha"]]
    assert commits[0]["parents"] == [state["base_sha"]] and commits[0]["candidate"] == gain["candidate"]
    assert git(run.repo, "diff", "--name-only", state["base_sha"], gain["sha"]) == "model.py"
    assert 'return torch.nn.functional.gelu(x, approximate="tanh")' in git(run.repo, "show", f"{gain['sha']}:model.py")
    assert_clean_repository(run.repo, "reference")

    # the user's branch, HEAD, index, working tree and uncommitted changes are untouched
    assert user_view(run.repo) == run.before
    for name, text in run.changes.items():
        assert (run.repo / name).read_text(encoding="utf-8") == text

    # the report states the baseline and both decisions
    paths = [Path(p) for p in state["report_paths"]]
    names = {p.name for p in paths}
    assert {"report.md", "report.html", "step_time.png"} <= names and all(p.is_file() for p in paths)
    baseline = f"baseline step: {state['baseline_step_s'] * 1000:.1f} ms"
    markdown = (paths[0].parent / "report.md").read_text(encoding="utf-8")
    html = (paths[0].parent / "report.html").read_text(encoding="utf-8")
    assert baseline in markdown and baseline in html
    assert f"| {GOOD_RECIPE} | accepted |" in markdown and f"| {WRONG_RECIPE} | numerics_mismatch |" in markdown
    assert "<img" in html
    assert "&#x27;" not in markdown and "&amp;" not in html  # verdict messages quote names: escaped once, not twice


@pytest.mark.slow
def test_hooks_and_the_users_git_config_change_nothing(reference_run):
    """The reference run's repository has every hook, core.hooksPath, diff.noprefix, color.ui=always and
    commit.gpgsign=true without a key: no hook ran, its run branch holds exactly the accepted rewrite
    (checked in full by test_end_to_end...), and the user's checkout (tree, index, refs, config) is
    byte-identical."""
    run = reference_run
    assert sorted(p.name for p in run.markers.iterdir()) == [], "hooks ran: " + ", ".join(p.name for p in run.markers.iterdir())
    assert (run.repo / ".git" / "hooks" / "pre-commit").is_file() and git(run.repo, "config", "commit.gpgsign") == "true"
    state = run.outcome.state
    assert [c["sha"] for c in run_commits(run.repo, state["base_sha"], "trainbridge/reference")] == \
        [a["sha"] for a in state["accepted"]] and len(state["accepted"]) == 1
    assert user_view(run.repo) == run.before
    assert_clean_repository(run.repo, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [20240611])
def test_killed_at_many_points_resumes_to_the_same_branch_and_verdicts(reference_run, tmp_path, seed):
    rng = random.Random(seed)
    repo = make_loop_repo(tmp_path / "repo")
    add_user_changes(repo)
    before = user_view(repo)
    config = loop_config(repo, "crash", tmp_path)
    home = tmp_path / "home"
    run_ref = "refs/heads/trainbridge/crash"
    refused = []

    def second_process_is_refused():
        with pytest.raises(RunError, match="already running"):
            resume_run("crash", root=home / "runs")
        refused.append(True)

    plan = [
        ("killed while the baseline is measured (no node finished yet)", start_args(config),
         {"kill_at_measure": 1, "before_kill": second_process_is_refused}, True),
        ("killed right after the candidate commit (coder not checkpointed)", resume_args("crash", ("commit", "")), {}, True),
        ("killed while a gate timing child runs", resume_args("crash"), {"kill_at_measure": 2}, True),
        ("killed right after the run branch moved (decide not checkpointed)", resume_args("crash", ("move", run_ref)), {}, True),
        (f"killed at a random moment (seed {seed})", resume_args("crash"), {"kill_after_s": rng.uniform(4, 25)}, False),
        (f"killed at a random moment (seed {seed})", resume_args("crash"), {"kill_after_s": rng.uniform(4, 25)}, False),
    ]
    timeline = []
    for number, (what, args, how, must_be_killed) in enumerate(plan):
        driver = Driver(args, home, tmp_path / f"process-{number}.log")
        started = time.monotonic()
        status = driver.watch(**how)
        timeline.append(f"{what}: exit {status} after {time.monotonic() - started:.1f} s")
        if must_be_killed:
            assert status == -signal.SIGKILL, f"{what}: the process was not killed (exit {status}):\n{driver.tail()}"
        else:
            assert status in (0, -signal.SIGKILL), f"{what}: exit {status}:\n{driver.tail()}"
        if status == -signal.SIGKILL:
            assert "Traceback" not in driver.tail(20000), driver.tail()
    print("\n" + "\n".join(timeline))
    assert refused == [True]  # a second process could not run the same run while the first was alive
    assert "KILLING MYSELF after git commit" in (tmp_path / "process-1.log").read_text()
    assert "KILLING MYSELF after git update-ref" in (tmp_path / "process-3.log").read_text()

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBRIDGE_HOME", str(home))
        outcome = resume_run("crash", root=home / "runs")
        status = run_status("crash", root=home / "runs")
    assert outcome.finished and status["finished"], status["next"]
    state, reference = outcome.state, reference_run.outcome.state

    # same decisions, each exactly once (no verdict lost or duplicated by a re-run node)
    assert decision_view(state["verdicts"]) == decision_view(reference["verdicts"])
    assert [a["candidate"] for a in state["accepted"]] == [a["candidate"] for a in reference["accepted"]]
    assert state["candidates_tried"] == reference["candidates_tried"]
    outcomes = run_outcomes(config.kb_dir, "crash")
    assert sorted(o.id for o in outcomes) == sorted(f"outcome-crash-{v['candidate']}" for v in state["verdicts"])

    # the same branch: same trees and subjects, one commit per accepted candidate, moved once
    commits = run_commits(repo, state["base_sha"], "trainbridge/crash")
    expected = run_commits(reference_run.repo, reference["base_sha"], "trainbridge/reference")
    assert [(c["tree"], c["subject"], c["candidate"]) for c in commits] == \
           [(c["tree"], c["subject"], c["candidate"]) for c in expected]
    assert [c["sha"] for c in commits] == [a["sha"] for a in state["accepted"]]
    moves = git(repo, "reflog", "show", "--format=%gs", "trainbridge/crash").splitlines()
    assert sum("accept candidate" in m for m in moves) == len(state["accepted"]), moves
    assert_clean_repository(repo, "crash")
    assert user_view(repo) == before
    assert Path(state["report_paths"][0]).is_file()


@pytest.mark.slow
def test_review_across_processes_reject_then_approve(reviewed_cli_run):
    """Process 1 stops at the first patch, `trainbridge review` in process 2 rejects it with a reason, process 3
    approves the next one (the run is tests/review_run_support.py's, which tests/test_server.py's served run matches)."""
    run = reviewed_cli_run
    first = run.first.stdout[-3000:]
    assert run.first.returncode == 0, first
    assert "OUTCOME" in first and '"waiting": {' in first
    paused = run.paused
    payload = paused["waiting_for_review"]
    assert payload is not None and paused["next"] == ["review"] and payload["schema"] == 1
    first_candidate = payload["candidate"]

    second = run.second
    assert second.returncode == 0, second.stdout + second.stderr
    assert "paused for review" in second.stderr, second.stderr
    again = run.again
    assert again["waiting_for_review"] is not None and again["waiting_for_review"]["candidate"] != first_candidate
    rejected = [v for v in again["state"]["verdicts"] if v["candidate"] == first_candidate]
    assert [(v["reason"], v["message"]) for v in rejected] == [("rejected_in_review", REJECT_REASON)]

    third = run.third
    assert third.returncode == 0, third.stdout + third.stderr
    assert "run reviewed finished" in third.stderr, third.stderr
    final = run.final
    assert final["finished"] and final["waiting_for_review"] is None
    verdicts = final["state"]["verdicts"]
    assert len(verdicts) == 2 and verdicts[0]["candidate"] == first_candidate
    assert verdicts[1]["reason"] != "rejected_in_review"  # approved: the gate judged it
    outcomes = {o.id: o for o in run_outcomes(run.config.kb_dir, "reviewed")}
    assert outcomes[f"outcome-reviewed-{first_candidate}"].verdict == f"rejected_in_review: {REJECT_REASON}"
    assert len(outcomes) == 2
    assert subprocess.run([*cli_argv(), "review", "reviewed", "--action", "approve"], cwd=run.tmp, env=child_env(run.home),
                          capture_output=True, text=True, timeout=120).returncode == 2  # nothing waits any more
