"""Gates as Ray tasks (issue 17): what a task asks for, what reaches the worker, and (slow) a run on
a local Ray cluster started by the test, one of whose workers is killed mid-gate.

- quick: the resources a gate asks for (one device; no CPU of Ray's accounting); the worker checks
  out exactly the two commits the job names from a git bundle of the candidate's branch (a commit
  that is not in the bundle is refused);
- slow: `ray.init` with the custom resource `trainbridge_cpu_slot: 2` standing in for two devices
  (two slots of one pinned core on this 2-core machine); the loop workload with `--devices cpu:2
  --ray auto` judges its candidates as Ray tasks, two at a time; the Ray worker running the first
  gate is SIGKILLed while the gate times; Ray runs that gate again in another worker and the run
  ends with this workload's decisions (the GELU rewrite accepted, the planted RMSNorm one rejected on
  numerics), each verdict and outcome once, one commit per accepted candidate; its checkpoints are in
  a Postgres started by the test (where the server binaries are installed), read back from elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.agents.coder.candidate import make_candidate
from trainbridge.graph.context import RunContext
from trainbridge.graph.team.gate_jobs import GateJob
from trainbridge.graph.team.ray_gates import CPU_SLOT_RESOURCE, candidate_bundle, checkout_from_bundle, task_options
from trainbridge.graph.state import RunPaths
from trainbridge.sandbox.scratch import sweep_stale
from trainbridge.tests.loop_checks import (LLM_ENV, assert_clean_repository, harness_children, kill_harness_groups, run_commits,
                                          run_outcomes)
from trainbridge.tests.loop_fixtures import GOOD_RECIPE, decided_by_construction, git, loop_config, make_loop_repo
from trainbridge.tests.team_support import outcome_view, postgres_bin, postgres_server

ray = pytest.importorskip("ray", reason="Ray is part of '.[dev]' (pip install -e '.[team]')")


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


def test_a_gate_asks_for_one_device():
    assert task_options("npu")["resources"] == {"NPU": 1} and task_options("npu")["num_cpus"] == 0
    assert task_options("cuda")["num_gpus"] == 1 and "resources" not in task_options("cuda")
    assert task_options("cpu")["resources"] == {CPU_SLOT_RESOURCE: 1}
    assert task_options("cpu")["max_retries"] >= 1 and task_options("cpu")["retry_exceptions"] is False


def test_the_worker_checks_out_the_jobs_commits_from_a_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "repo")
    config = loop_config(repo, "bundled", tmp_path)
    context = RunContext(config=config, paths=RunPaths(config.run_id, tmp_path / "home" / "runs"))
    workspace = context.workspace("HEAD")
    gelu = next(i for i in scan_repo_result(repo).intents if str(i.category) == "gelu")
    candidate = make_candidate(workspace, gelu, context.kb.get_recipe(GOOD_RECIPE))
    job = GateJob(index=0, candidate=candidate.model_dump(mode="json"), baseline_root="/elsewhere", baseline_sha=candidate.base_sha,
                  candidate_root="/elsewhere", candidate_sha=candidate.sha, target="cpu", rounds=2, max_rounds=2, min_gain=0.05)
    bundle = candidate_bundle(repo, job)
    (tmp_path / "worker").mkdir()
    local = checkout_from_bundle(job, bundle, tmp_path / "worker")
    assert (Path(local.candidate_root) / "model.py").read_text() == (Path(candidate.worktree) / "model.py").read_text()
    assert (Path(local.baseline_root) / "model.py").read_text() == (repo / "model.py").read_text()
    assert git(Path(local.candidate_root), "rev-parse", "HEAD") == candidate.sha
    stranger = job.model_copy(update={"candidate_sha": "1" * 40})
    (tmp_path / "worker2").mkdir()
    with pytest.raises(Exception, match="1111111111"):
        checkout_from_bundle(stranger, bundle, tmp_path / "worker2")
    context.kb.close()


class GateWatcher(threading.Thread):
    """Sees every gate process (python -m trainbridge.graph.team.gate_worker JOB VERDICT, a child of a Ray
    worker) and which candidate it judges; SIGKILLs the Ray worker of the first gate once that gate's
    timed sandbox children run, and ends the sandbox children it saw when asked."""

    def __init__(self):
        super().__init__(daemon=True)
        self.gates: dict[int, str] = {}  # gate process pid -> candidate name
        self.killed: tuple[int, str] | None = None
        self.harness: set[int] = set()
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            for pid, argv in _processes():
                if "trainbridge.graph.team.gate_worker" not in argv or pid in self.gates:
                    continue
                try:
                    self.gates[pid] = json.loads(Path(argv[-2]).read_text())["candidate"]["name"]
                except (OSError, ValueError, KeyError, IndexError):
                    continue
            for pid, name in list(self.gates.items()):
                timed = [c for c, mode in harness_children(pid).items() if mode == "timed"]
                self.harness.update(harness_children(pid))
                if self.killed is None and timed:
                    parent = _parent(pid)
                    if parent and "ray::" in " ".join(_argv(parent)) or parent and "default_worker" in " ".join(_argv(parent)):
                        os.kill(parent, signal.SIGKILL)
                        self.killed = (parent, name)
            time.sleep(0.2)

    def reap(self):
        self.stop.set()
        self.join(timeout=5)
        kill_harness_groups(self.harness)


def _processes():
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = _argv(int(entry.name))
            if argv:
                yield int(entry.name), argv


def _argv(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@pytest.mark.slow
def test_gates_on_a_local_ray_cluster_survive_a_killed_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a loopback cluster of this test: no token written to ~/.ray
    repo = make_loop_repo(tmp_path / "repo")
    with contextlib.ExitStack() as stack:  # the team's setting: checkpoints in Postgres too, where its server is installed
        checkpoint = stack.enter_context(postgres_server()) if postgres_bin() is not None else None
        _run_on_ray(repo, tmp_path, checkpoint)
        if checkpoint is not None:  # another process reads the same run from the database
            from trainbridge.graph.runs import run_status

            assert run_status("on-ray", root=tmp_path / "elsewhere", checkpoint=checkpoint)["finished"]
            assert not list(tmp_path.rglob("checkpoints.sqlite")), "a Postgres run wrote a SQLite checkpoint"


def _run_on_ray(repo: Path, tmp_path: Path, checkpoint: str | None) -> dict:
    from trainbridge.graph.runs import start_run

    config = loop_config(repo, "on-ray", tmp_path, devices="cpu:2", ray="auto", checkpoint=checkpoint)
    ray_dir = Path("/tmp") / f"tb-ray-{os.getpid()}"  # Ray wants a short path for its sockets
    ray.init(num_cpus=2, resources={CPU_SLOT_RESOURCE: 2}, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_dir))
    watcher = GateWatcher()
    watcher.start()
    try:
        outcome = start_run(config, root=tmp_path / "home" / "runs")
    finally:
        watcher.reap()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        sweep_stale()  # the killed worker's gate folders (their owner is gone), as the next run would
    state = outcome.state
    assert outcome.finished, state.get("node")
    assert watcher.killed is not None, f"no Ray worker was killed mid-gate (gates seen: {watcher.gates})"
    killed_name = watcher.killed[1]
    # the killed worker's gate ran again (a new gate process for the same candidate), its verdict recorded once
    assert list(watcher.gates.values()).count(killed_name) >= 2, watcher.gates
    assert [v["candidate"] for v in state["verdicts"]].count(killed_name) == 1
    view = outcome_view(state["verdicts"])
    assert decided_by_construction(view), [(v["candidate"], v["reason"], v["message"]) for v in state["verdicts"]]
    batches = [t for t in state["phase_times"] if t["node"] == "batch"]
    assert batches and state["candidates_tried"] == 2
    outcomes = run_outcomes(config.kb_dir, "on-ray")
    assert sorted(o.id for o in outcomes) == sorted(f"outcome-on-ray-{v['candidate']}" for v in state["verdicts"] if v["candidate"])
    commits = run_commits(repo, state["base_sha"], "trainbridge/on-ray")
    assert [c["sha"] for c in commits] == [a["sha"] for a in state["accepted"]] and len(commits) == int(view[0][2])
    assert_clean_repository(repo, "on-ray")
    return state
