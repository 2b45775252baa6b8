"""Script mode in the sandbox: unmodified scripts driven step by step over the control channel (each test runs real children)."""

from __future__ import annotations

import math
import re

import pytest

from script_repos import git, nanogpt_repo, script_repo, stdout_lines
from trainbridge.sandbox.results import FailureKind
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.script.seeds import derive_seed
from trainbridge.sandbox.child.step_driver import StepPlan
from trainbridge.sandbox.workload import load_workload

NANO = '''launch = "python train.py --batch_size=2 --block_size=16 --n_layer=1 --n_embd=32 --n_head=2"
data = ["data/"]
warmup_steps = 1
steps = 2
timeout_s = 120
'''


def test_step_boundaries_and_losses_follow_the_optimizer_steps_and_backward_calls(tmp_path):
    repo = script_repo(tmp_path / "repo", "accumulate.py", 'launch = "python train.py 500"\nwarmup_steps = 2\nsteps = 3\nseed = 11\n')
    result = run_workload(load_workload(repo))
    assert result.ok, result.failure
    printed = [float(re.search(r"loss_sum=(\S+)", line).group(1)) for line in stdout_lines(result, "STEP ")]
    timed = [*result.losses, *result.cooldown_losses]
    assert len(timed) == 2 + 3 + 1 and len(result.step_times_s) == 3 and len(result.warmup_times_s) == 2
    # two optimizers and three backward calls make one step; the script was stopped right after the plan
    assert result.extra["script"]["optimizers_per_step"] == 2
    assert len(printed) == len(timed), printed
    assert timed == pytest.approx(printed, rel=1e-6)
    assert result.timing_source == "parent" and all(t > 0 for t in result.step_times_s)


def test_seeding_calls_of_the_script_get_the_gates_seed(tmp_path):
    repo = script_repo(tmp_path / "repo", "accumulate.py", 'launch = "python train.py 500"\nwarmup_steps = 0\nsteps = 1\n')
    seen = {}
    for seed in (3, 3, 4):
        result = run_workload(load_workload(repo).with_overrides(seed=seed))
        assert result.ok, result.failure
        seen.setdefault(seed, []).append((stdout_lines(result, "SEED ")[0], result.losses))
    line, losses = seen[3][0]
    assert f"torch={derive_seed(3, 1234)}" in line  # torch.manual_seed(1234) in the script
    assert seen[3][1] == (line, losses)  # same gate seed: same seeds, same data, same losses
    other_line, other_losses = seen[4][0]
    assert other_line != line and other_losses != losses
    calls = {call[0] for call in result.extra["script"]["seed_calls"]}
    assert {"torch.manual_seed", "random.seed", "numpy.random.seed"} <= calls


def test_nanogpt_style_script_runs_unmodified_with_overrides_and_ignored_data(tmp_path):
    user = nanogpt_repo(tmp_path / "user", NANO + '\n[overrides]\nbatch_size = 3\n"--max_iters" = 777\n'
                        '"GPTConfig.dropout" = 0.0\n"GPTConfig(n_embd)" = 48\n', commit=True)
    worktree = tmp_path / "wt"
    git(user, "worktree", "add", "-q", "-b", "trainbridge/t", str(worktree))
    assert not (worktree / "data").exists()  # git-ignored: only in the user's checkout
    before = sorted(p.relative_to(user).as_posix() for p in user.rglob("*") if ".git" not in p.parts)
    result = run_workload(load_workload(worktree))
    assert result.ok, (result.failure, result.stderr_tail)
    line = stdout_lines(result, "model: ")[0]
    # --n_embd=32 from the launch line, but the call keyword override forces 48; the module constant
    # batch_size is overridden after the script's assignment, and --batch_size=2 (argv) then wins in its own parser
    assert "n_embd=48" in line and "n_layer=1" in line and "batch_size=2" in line and "max_iters=777" in line
    assert all(math.isfinite(x) for x in result.losses) and len(result.step_times_s) == 2
    assert result.extra["script"]["data"] == {"data/": str(user / "data")}
    assert sorted(p.relative_to(user).as_posix() for p in user.rglob("*") if ".git" not in p.parts) == before
    assert git(worktree, "status", "--porcelain") == ""  # nothing written into the worktree


def test_a_module_constant_override_reaches_the_script(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", NANO.replace("--batch_size=2 ", "") + '\n[overrides]\nbatch_size = 3\n')
    result = run_workload(load_workload(repo).with_overrides(steps=1, warmup_steps=0))
    assert result.ok, result.failure
    assert "batch_size=3" in stdout_lines(result, "model: ")[0]


def test_an_override_that_matches_nothing_stops_the_run_naming_the_nearest(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", NANO + '\n[overrides]\n"GPTConfig.n_layers" = 2\nbatch_sise = 1\n', data=True)
    result = run_workload(load_workload(repo))
    assert result.failure is not None and result.failure.kind == FailureKind.bad_workload
    assert "'GPTConfig.n_layers' matched nothing" in result.failure.message and "GPTConfig.n_layer" in result.failure.message
    assert "'batch_sise' matched nothing" in result.failure.message and "batch_size" in result.failure.message


def test_writes_land_in_scratch_and_the_data_stays_read_only(tmp_path):
    toml = 'launch = "python train.py {mode}"\ndata = ["data/"]\nwarmup_steps = 0\nsteps = 4\n'
    repo = script_repo(tmp_path / "repo", "writes_outside.py", toml.format(mode="checkpoint"), {"data/values.txt": "1.0\n2.0\n"})
    result = run_workload(load_workload(repo))
    assert result.ok, result.failure
    assert not (repo / "out").exists()  # the checkpoint went to the run's scratch mirror, gone with it
    (repo / "trainbridge.toml").write_text(toml.format(mode="tamper"), encoding="utf-8")
    result = run_workload(load_workload(repo))
    assert result.failure is not None and "PermissionError" in result.failure.message
    assert "read-only" in result.failure.message and "values.txt" in result.failure.message
    assert (repo / "data" / "values.txt").read_text(encoding="utf-8") == "1.0\n2.0\n"


def test_epoch_loop_with_two_optimizers_and_a_scheduler(tmp_path):
    repo = script_repo(tmp_path / "repo", "epoch_two_optimizers.py", 'launch = "python train.py --epochs 50"\nwarmup_steps = 1\nsteps = 3\n')
    result = run_workload(load_workload(repo))
    assert result.ok, result.failure
    assert result.extra["script"]["optimizers_per_step"] == 2 and len(result.losses) == 4
    assert not stdout_lines(result, "epoch ")  # stopped within the first epoch (32 steps), after the plan


@pytest.mark.parametrize("script, toml, kind, says", [
    ("never_steps.py", 'launch = "python train.py"\n', FailureKind.bad_workload, "before its first optimizer step"),
    ("never_steps.py", 'launch = "python missing.py"\n', FailureKind.bad_workload, "'missing.py' of launch line"),
    ("never_steps.py", 'launch = "torchrun --nnodes=2 --nproc_per_node=2 train.py"\n', FailureKind.bad_workload,
     "several nodes (--nnodes=2) are not supported"),  # 2 ranks of one node run (tests/test_script_ranks.py)
    ("hangs_before_step.py", 'launch = "python train.py"\ntimeout_s = 12\n', FailureKind.timeout, "no optimizer step within the 12 s"),
    # told at once, not after the whole timeout_s (it waited 60 s and blamed its set-up)
    ("backward_only.py", 'launch = "python train.py"\ntimeout_s = 300\n', FailureKind.bad_workload,
     "it called backward() but never optimizer.step()"),
])
def test_bad_inputs_fail_with_a_message_saying_what_to_do(tmp_path, script, toml, kind, says):
    repo = script_repo(tmp_path / "repo", script, toml)
    result = run_workload(load_workload(repo))
    assert result.failure is not None and result.failure.kind == kind, result.failure
    assert says in result.failure.message
    if script == "never_steps.py" and "missing" not in toml and "torchrun" not in toml:
        assert "eval loss" in result.failure.message  # the script's output tail
    if script == "backward_only.py":
        assert result.wall_s < 60, result.wall_s
    if script == "hangs_before_step.py":
        assert "waiting for the data server" in (result.failure.traceback_tail or "")


def test_a_missing_data_file_is_named(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", NANO.replace('data = ["data/"]\n', ""), data=False)
    result = run_workload(load_workload(repo))
    assert result.failure is not None and result.failure.kind == FailureKind.bad_workload
    assert "missing: 'data/tokens/meta.pkl'" in result.failure.message and "data = [...]" in result.failure.message


def test_a_script_that_ends_before_the_plan_says_how_to_run_longer(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", NANO.replace("--n_head=2", "--n_head=2 --max_iters=2"))
    result = run_workload(load_workload(repo), plan=StepPlan.sequential(1, 3))
    assert result.failure is not None and "finished after 2 optimizer step(s)" in result.failure.message
    assert "--max_iters" in result.failure.message


def test_unseeded_data_order_is_reported_nondeterministic_naming_the_cause(tmp_path):
    from trainbridge.sandbox.script.determinism import check_repeatable

    unseeded = script_repo(tmp_path / "unseeded", "unseeded_order.py", 'launch = "python train.py"\nwarmup_steps = 1\nsteps = 2\n')
    report = check_repeatable(load_workload(unseeded))
    assert not report.repeatable and report.first_difference_step == 0
    assert any("random.Random()" in cause for cause in report.likely_causes) and "random.Random()" in report.message
    seeded = script_repo(tmp_path / "seeded", "accumulate.py", 'launch = "python train.py 500"\nwarmup_steps = 1\nsteps = 2\n')
    assert check_repeatable(load_workload(seeded)).repeatable


def test_what_the_script_rebinds_is_reported_by_the_guard(tmp_path):
    repo = script_repo(tmp_path / "repo", "rebinds_hooks.py", 'launch = "python train.py"\nwarmup_steps = 1\nsteps = 2\n')
    result = run_workload(load_workload(repo))
    assert result.ok, result.failure
    assert "torch.Tensor.backward" in result.watch.replaced
    assert "trainbridge.sandbox.script.hooks.StepController._boundary" in result.watch.replaced
    assert "trainbridge.sandbox.script.hooks.StepController._serve" not in result.watch.replaced


def test_the_compile_arm_compiles_the_modules_the_optimizers_train(tmp_path):
    repo = script_repo(tmp_path / "repo", "epoch_two_optimizers.py", 'launch = "python train.py"\nwarmup_steps = 2\nsteps = 2\n')
    result = run_workload(load_workload(repo), extra_request={"compile": True})
    assert result.ok, (result.failure, result.stderr_tail[-2000:])
    assert sorted(result.extra["script"]["compiled"]) == ["Linear", "Sequential"]  # the body and the head
    eager = run_workload(load_workload(repo))
    assert eager.extra["script"]["compiled"] == []
    assert result.losses == pytest.approx(eager.losses, rel=1e-4)  # same steps, compiled or not


def test_profile_mode_records_the_eager_ops_of_a_script_step_by_source_line(tmp_path):
    from trainbridge.tools.eager_profile import EagerOpTable

    repo = nanogpt_repo(tmp_path / "repo", NANO)
    result = run_workload(load_workload(repo).with_overrides(steps=1, warmup_steps=1), mode="profile")
    assert result.ok, result.failure
    table = EagerOpTable.model_validate(result.extra["eager_ops"])
    assert result.extra["optimizer_class"] == "AdamW" and table.steps == 1 and len(table.step_times_us) == 3
    lines = {(op.span.file, op.phase.value) for op in table.ops}
    assert {("model.py", "forward"), ("model.py", "backward"), ("train.py", "optimizer")} <= lines
    source = (repo / "train.py").read_text(encoding="utf-8").splitlines()
    step_line = next(n for n, text in enumerate(source, start=1) if text.strip() == "optimizer.step()")
    assert any(op.span.file == "train.py" and op.span.line_start == step_line and op.phase.value == "optimizer" for op in table.ops)


def test_a_helper_process_that_would_outlive_the_script_is_named_and_killed(tmp_path):
    import os

    repo = script_repo(tmp_path / "repo", "spawns_helper.py", 'launch = "python train.py"\nwarmup_steps = 1\nsteps = 2\n')
    result = run_workload(load_workload(repo))
    pid = int(stdout_lines(result, "HELPER ")[0].split()[1])
    if result.confined:  # its own PID namespace: the pid it printed is the namespace's, and the helper died with it
        helpers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == HELPER_CMDLINE]
        assert helpers == [], helpers
        return
    assert any(f"pid {pid}" in survivor for survivor in result.watch.survivors), result.watch
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


HELPER_CMDLINE = "import time; time.sleep(600)"  # tests/fixtures/scripts/spawns_helper.py's helper


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().split(b"\0")[-2].decode(errors="replace") if handle else ""
    except (OSError, IndexError):
        return ""


def test_a_config_file_on_the_launch_line_is_read_from_the_worktree(tmp_path):
    repo = nanogpt_repo(tmp_path / "repo", 'launch = "python train.py config/small.py --n_layer=2"\ndata = ["data/"]\n'
                        'warmup_steps = 0\nsteps = 1\n')
    result = run_workload(load_workload(repo))
    assert result.ok, result.failure
    line = stdout_lines(result, "model: ")[0]
    assert "n_layer=2" in line and "n_embd=32" in line and "batch_size=2" in line
