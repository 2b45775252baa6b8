"""Script mode's torchrun groups: `torchrun --nproc_per_node 2 train.py` runs as 2 gloo ranks on the CPU
(sandbox/child/rank_supervisor.py inside the sandbox, sandbox/child/rank_group.py driving them as one timed child)."""

from __future__ import annotations

import os
import re
import statistics
import time
import tomllib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trainbridge.graph.cli.app import build_app
from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child.driven import ChildSpec, StepPlan
from trainbridge.sandbox.child.rank_group import RankGroupChild, child_for
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.script.launch import parse_launch, rank_threads, torchrun_env
from trainbridge.sandbox.script.run import launch_problem
from trainbridge.sandbox.workload import load_workload, workload_for_launch
from script_repos import ddp_repo, script_repo

# --- the launch line (no processes) ---


@pytest.mark.parametrize("line", ["torchrun --nproc_per_node 2 train.py --x=1", "torchrun --nproc_per_node=2 train.py --x=1",
                                  "torchrun --standalone --nproc-per-node 2 train.py --x=1",
                                  "torchrun --standalone --nproc-per-node=2 train.py --x=1",
                                  "torchrun --nnodes=1 --standalone --nproc_per_node 2 train.py --x=1"])
def test_every_spelling_of_two_processes_is_a_group_of_two_ranks(line):
    spec = parse_launch(line)
    assert (spec.launcher, spec.nproc, spec.script, spec.args, spec.launch_problem()) == ("torchrun", 2, "train.py", ["--x=1"], None)
    assert spec.multi_process


def test_python_lines_and_torchruns_default_are_one_rank():
    assert parse_launch("python train.py --x=1").nproc == 1
    assert parse_launch("torchrun train.py").nproc == 1
    assert parse_launch("torchrun --standalone --nproc_per_node=1 train.py").nproc == 1


@pytest.mark.parametrize("line, says", [
    ("torchrun --nnodes=2 --nproc_per_node=2 train.py", "several nodes (--nnodes=2) are not supported"),
    ("torchrun --nproc_per_node=auto train.py", "--nproc_per_node='auto' is not a number of processes"),
    ("torchrun --nproc_per_node 64 train.py", "64 processes per node; script mode runs at most 8"),
])
def test_groups_that_cannot_run_here_say_what_to_write(tmp_path, line, says):
    (tmp_path / "train.py").write_text("print('hi')\n", encoding="utf-8")
    problem = launch_problem(workload_for_launch(tmp_path, line)) or ""
    assert says in problem and ("launch = \"torchrun --standalone --nproc_per_node=2 train.py" in problem or "Lower --nproc_per_node" in problem)


def test_a_two_rank_line_is_not_refused_before_it_starts(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n", encoding="utf-8")
    assert launch_problem(workload_for_launch(tmp_path, "torchrun --standalone --nproc_per_node 2 train.py")) is None


def test_each_rank_gets_torchruns_environment_and_its_share_of_the_threads():
    env = torchrun_env(1, 2, 29555)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    assert env["TORCHELASTIC_RUN_ID"] and env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert [rank_threads(2, 2), rank_threads(1, 2), rank_threads(4, 2), rank_threads(2, 1)] == [1, 1, 2, 2]


def test_each_rank_writes_its_own_probe_and_delta_files_and_rank_0_keeps_the_gates(tmp_path):
    spec = ChildSpec(argv=["x"], request={"threads": 2}, plan=StepPlan.sequential(1, 1), cwd=tmp_path, env={}, preexec_fn=None,
                     timeout_s=1, stdout_path=tmp_path / "stdout.txt", stderr_path=tmp_path / "stderr.txt", ranks=2)
    group = child_for(spec, reaper=False)
    assert isinstance(group, RankGroupChild)
    probe = {"op": "probe", "seed": 3, "batch_indices": [1], "grads_path": "/g/grads.pt"}
    assert group._for_rank(0, probe) == probe
    assert group._for_rank(1, probe) == {**probe, "grads_path": "/g/grads.pt.rank1"}
    assert group._for_rank(1, {"op": "final", "deltas_path": "/g/d.pt"})["deltas_path"] == "/g/d.pt.rank1"
    assert group._for_rank(1, {"mode": "gate", "threads": 2}) == {"mode": "gate", "threads": 1, "rank": 1}
    one = ChildSpec(**{**spec.__dict__, "ranks": 1})
    assert not isinstance(child_for(one, reaper=False), RankGroupChild)


def test_init_on_a_torchrun_ddp_repository_keeps_its_two_ranks(tmp_path):
    repo = ddp_repo(tmp_path / "repo", None, commit=True)
    done = CliRunner().invoke(build_app(), ["init", str(repo), "--yes", "--no-measure"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    config = tomllib.loads((repo / "trainbridge.toml").read_text(encoding="utf-8"))
    assert config["launch"] == "torchrun --standalone --nproc_per_node 2 train.py --batch_size=16" and config["data"] == ["data/"]
    assert parse_launch(config["launch"]).nproc == 2 and "torchrun, 2 processes" in done.output


# --- real groups (2 ranks of the fixture, each a sandboxed launcher) ---

def ranks_repo(path: Path, args: str, *, timeout_s: int = 120, steps: int = 4) -> Path:
    toml = (f'launch = "torchrun --standalone --nproc_per_node 2 train.py {args}"\n'
            f"warmup_steps = 1\nsteps = {steps}\ntimeout_s = {timeout_s}\n")
    return script_repo(path, "ranks_misbehave.py", toml)


def _left_behind() -> list[int]:
    return [s.pid for s in proc_watch.descendants(os.getpid()) if s.state != "Z"]


def test_two_ranks_step_together_the_slowest_rank_times_the_step_and_numerics_come_from_rank_0(tmp_path):
    repo = ranks_repo(tmp_path / "repo", "--slow_rank=1 --slow_ms=80")
    plan = StepPlan(warmup=[0], measured=[1, 2, 3, 4], cooldown=[5],
                    probe={"seed": 11, "batch_indices": [7, 8], "grads_path": str(tmp_path / "grads.pt")}, deltas_path=tmp_path / "d.pt")
    result = run_workload(load_workload(repo), mode="gate", plan=plan)
    assert result.failure is None, result.failure
    ranks = result.extra["script"]["ranks"]
    assert ranks["world_size"] == 2 and ranks["threads_per_rank"] == 1 and ranks["steps_done"][0] == ranks["steps_done"][1]
    # torchrun's environment, in the sandbox's network namespace (gloo formed over its loopback)
    env = re.search(r"env (.*)", result.stdout_tail).group(1)
    assert re.fullmatch(r"RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=\d+ OMP_NUM_THREADS=1 "
                        r"TORCHELASTIC_RUN_ID=trainbridge torch_threads=1", env), env
    # the group's step is the slowest rank's (rank 1 sleeps 80 ms after each collective; rank 0 does not)
    times = ranks["step_times_s"]
    timed = [*result.warmup_times_s, *result.step_times_s, *result.cooldown_times_s]
    assert timed == [max(a, b) for a, b in zip(*times)]
    assert min(result.step_times_s) >= 0.08 and statistics.median(times[0]) < statistics.median(times[1]) - 0.04
    assert ranks["slowest_rank"].count(1) >= len(timed) - 1
    # the loss of a step is the ranks' mean (their losses differ by 1 by construction)
    losses = [*result.losses, *result.cooldown_losses]
    assert losses == pytest.approx([(a + b) / 2 for a, b in zip(*ranks["losses"])], abs=1e-6)
    assert all(b - a > 0.5 for a, b in zip(*ranks["losses"]))  # what backward saw, not the in-place all-reduced log value
    # the probe: rank 0's gradients (averaged over the ranks by the script: rank 1's are the same), the ranks' mean loss
    report = result.extra["numerics"]
    assert report["grads_path"] == str(tmp_path / "grads.pt")
    assert report["losses"] == pytest.approx([(a + b) / 2 for a, b in zip(*ranks["probe_losses"])], abs=1e-6)
    grads0, grads1 = torch.load(tmp_path / "grads.pt"), torch.load(tmp_path / "grads.pt.rank1")
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    assert result.extra["final"]["steps"] >= 6 and result.watch.helper_cpu_s == 0.0 and not _left_behind()


def test_a_rank_that_raises_ends_the_group_named_with_its_traceback(tmp_path):
    result = run_workload(load_workload(ranks_repo(tmp_path / "repo", "--crash_rank=1 --at=2")))
    failure = result.failure
    assert failure is not None and failure.kind == "exception", failure
    assert failure.message.startswith("rank 1 of 2: RuntimeError: rank 1 fails on purpose at iteration 2")
    assert "raise RuntimeError" in (failure.traceback_tail or "") and not _left_behind()


@pytest.mark.parametrize("where", ["--die_rank=1", "--die_in_collective_rank=1"])  # waiting for its command; in backward's wake
def test_a_rank_killed_by_a_signal_ends_the_group_at_once_and_is_named_not_its_peer(tmp_path, where):
    started = time.monotonic()
    result = run_workload(load_workload(ranks_repo(tmp_path / "repo", f"{where} --at=2", timeout_s=240)))
    failure = result.failure
    assert failure is not None and "rank 1 of 2 died (signal SIGKILL)" in failure.message, failure
    assert "rank 1 iter 1 loss" in (failure.traceback_tail or "")  # rank 1's own output, not rank 0's
    assert time.monotonic() - started < 200  # its peer waiting in all_reduce was killed, not left to the timeout
    assert not _left_behind()


def test_a_rank_that_hangs_is_named_and_the_whole_group_killed_at_the_timeout(tmp_path):
    result = run_workload(load_workload(ranks_repo(tmp_path / "repo", "--hang_rank=1 --at=2", timeout_s=40)))
    failure = result.failure
    assert failure is not None and failure.kind == "timeout", failure
    assert "no reply from rank(s) 1 of 2 within the 40 s limit" in failure.message
    assert "rank 1 waits for ever at iteration 2" in (failure.traceback_tail or "")
    assert not _left_behind()
