"""Script mode's pure parts: the launch line, the config keys, argv and code overrides, seeds, the run's file mirror."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from script_repos import commit_all, git
from trainbridge.sandbox.script.files import DataPathError, make_run_dir, user_checkout
from trainbridge.sandbox.script.seeds import derive_seed
from trainbridge.sandbox.script.launch import LaunchError, parse_launch
from trainbridge.sandbox.script.overrides import OverridePlan, apply_argv, compile_source, install
from trainbridge.sandbox.workload import WorkloadConfig, WorkloadConfigError, load_workload, workload_for_launch


def test_launch_line_reads_script_module_and_arguments():
    spec = parse_launch("python train.py --batch_size=4 'name with | bar'")
    assert (spec.script, spec.module, spec.args, spec.multi_process) == ("train.py", None, ["--batch_size=4", "name with | bar"], False)
    spec = parse_launch("python3 -u -m pkg.train --steps 3")
    assert (spec.script, spec.module, spec.args, spec.interpreter_flags) == (None, "pkg.train", ["--steps", "3"], ["-u"])
    spec = parse_launch("torchrun --nproc_per_node 2 train_gpt.py --x=1")
    assert spec.multi_process and spec.script == "train_gpt.py" and spec.launcher_args == ["--nproc_per_node", "2"]


@pytest.mark.parametrize("line, says", [
    ("python train.py && echo done", "'&&'"),
    ("python train.py | tee log", "'|'"),
    ("python train.py > log.txt", "'>'"),
    ("python train.py --out=$HOME/x", "'$'"),
    ('python train.py --tag="$(date)"', "'$'"),
    ("python train.py `pwd`", "'`'"),
    ("CUDA_VISIBLE_DEVICES=0 python train.py", "environment variable"),
    ("bash run.sh", "not 'bash'"),
    ("python", "no script"),
    ("python 'train.py", "unclosed"),
])
def test_launch_line_with_shell_syntax_is_refused_with_what_to_write(line, says):
    with pytest.raises(LaunchError) as caught:
        parse_launch(line)
    assert says in str(caught.value)


def test_config_has_a_third_mode_and_rejects_mixtures(tmp_path):
    config = WorkloadConfig(launch="python train.py", data=["data/"], overrides={"batch_size": 2, "--max_iters": 9,
                                                                                 "GPTConfig.n_layer": 1, "GPTConfig(n_embd)": 32})
    assert config.mode == "script"
    with pytest.raises(ValueError, match="exactly one"):
        WorkloadConfig(launch="python train.py", entry="train:entry")
    with pytest.raises(ValueError, match="script mode only"):
        WorkloadConfig(entry="train:entry", overrides={"x": 1})
    with pytest.raises(ValueError, match="not understood"):
        WorkloadConfig(launch="python train.py", overrides={"GPTConfig(n_layer": 1})
    with pytest.raises(ValueError, match="inside the repository"):
        WorkloadConfig(launch="python train.py", data=["../elsewhere"])
    (tmp_path / "trainbridge.toml").write_text('launch = "python train.py | tee log"\n', encoding="utf-8")
    with pytest.raises(WorkloadConfigError, match=r"trainbridge.toml:1: launch: .*'\|' at column"):
        load_workload(tmp_path)


def test_launch_from_the_command_line_replaces_the_tomls_mode(tmp_path):
    (tmp_path / "trainbridge.toml").write_text('entry = "train:entry"\nsteps = 3\ndata = []\n', encoding="utf-8")
    workload = workload_for_launch(tmp_path, "python train.py --x=1")
    assert (workload.config.mode, workload.config.launch, workload.config.entry, workload.config.steps) == (
        "script", "python train.py --x=1", None, 3)
    assert workload_for_launch(tmp_path / "..", "python t.py").config.steps == 8  # no toml: defaults


def test_argument_overrides_replace_or_append():
    args = ["--batch_size=12", "--device", "cuda", "--compile", "--keep=1"]
    out = apply_argv(args, {"--batch_size": 4, "--device": "cpu", "--compile": False, "--new": True, "plain": 3})
    assert out == ["--keep=1", "--batch_size=4", "--device=cpu", "--new"]


SOURCE = '''
from dataclasses import dataclass
batch_size = 12
if True:
    n_layer = 6
@dataclass
class Config:
    n_layer: int = 12
    width: int = 64
def build(**kwargs):
    return Config(**kwargs)
made = Config(n_layer=n_layer, width=128)
via_kwargs = build()
spread = Config(**{"width": 8})
'''


def _run(source: str, overrides: dict, *, is_script: bool = True) -> tuple[dict, OverridePlan]:
    plan = OverridePlan.from_overrides(overrides)
    install(Path("/nonexistent-root"), OverridePlan())  # the call helper only
    namespace: dict = {"__name__": "fixture"}
    exec(compile_source(source, "fixture.py", plan, is_script=is_script), namespace)
    return namespace, plan


def test_code_overrides_reach_constants_dataclass_defaults_and_call_keywords():
    ns, plan = _run(SOURCE, {"batch_size": 4, "n_layer": 2, "Config.width": 16, "Config(width)": 32})
    assert ns["batch_size"] == 4 and ns["n_layer"] == 2
    assert ns["Config"]().width == 16  # the dataclass default
    assert (ns["made"].n_layer, ns["made"].width) == (2, 32)  # the call keyword, forced
    assert ns["spread"].width == 32  # also through **kwargs
    assert ns["via_kwargs"].width == 32  # every call in the code, inside functions too
    assert plan.unmatched() == []


def test_an_array_replacing_a_tuple_default_stays_a_tuple():
    """A TOML array over a dataclass field whose default is a tuple (Modded-NanoGPT's train_bs_schedule): a list
    default would make @dataclass raise 'mutable default <class 'list'> ... use default_factory'."""
    source = "from dataclasses import dataclass\n@dataclass\nclass Args:\n    schedule: tuple = (8, 16, 24)\n    sizes = [1, 2]\n"
    ns, plan = _run(source, {"Args.schedule": [2, 2, 2], "Args.sizes": [3]})
    assert ns["Args"]().schedule == (2, 2, 2) and ns["Args"].sizes == [3]  # a list stays a list
    assert plan.unmatched() == []


def test_an_override_that_matches_nothing_names_the_nearest_names():
    _, plan = _run(SOURCE, {"batch_sise": 4, "Config.n_layers": 2, "Confg(width)": 3})
    problems = plan.unmatched()
    assert len(problems) == 3
    assert "'batch_sise' matched nothing" in problems[0] and "batch_size" in problems[0]
    assert "Config.n_layer" in problems[1]
    assert "Config(width)" in problems[2]


def test_constants_are_overridden_only_in_the_script_itself():
    ns, plan = _run("batch_size = 12\n", {"batch_size": 4}, is_script=False)
    assert ns["batch_size"] == 12 and plan.unmatched()


def test_derived_seeds_depend_on_the_gate_seed_and_keep_the_scripts_seeds_apart():
    assert derive_seed(5, 1337) == derive_seed(5, 1337)
    assert derive_seed(5, 1337) != derive_seed(6, 1337)
    assert derive_seed(5, 1337) != derive_seed(5, 1338)
    assert 0 <= derive_seed(5, 1, 2**32) < 2**32


def _worktree_with_ignored_data(tmp_path: Path) -> tuple[Path, Path]:
    user = tmp_path / "user"
    (user / "data" / "shards").mkdir(parents=True)
    (user / "data" / "prepare.py").write_text("# tracked\n", encoding="utf-8")
    (user / "train.py").write_text("print('hi')\n", encoding="utf-8")
    (user / ".gitignore").write_text("data/shards/\nmeta.pkl\n", encoding="utf-8")
    commit_all(user)
    (user / "data" / "shards" / "train.bin").write_bytes(b"\x00" * 64)
    (user / "meta.pkl").write_bytes(b"meta")
    worktree = tmp_path / "wt"
    git(user, "worktree", "add", "-q", "-b", "trainbridge/x", str(worktree))
    return user, worktree


def test_run_dir_mirrors_the_worktree_and_shows_the_checkouts_ignored_data(tmp_path):
    user, worktree = _worktree_with_ignored_data(tmp_path)
    assert user_checkout(worktree) == user.resolve() and user_checkout(user) == user.resolve()
    assert not (worktree / "meta.pkl").exists() and not (worktree / "data" / "shards").exists()
    run_dir = make_run_dir(worktree, ["data/", "meta.pkl"], tmp_path / "run" / "cwd")
    cwd = run_dir.cwd
    assert (cwd / "data" / "shards" / "train.bin").read_bytes() == b"\x00" * 64
    assert os.path.realpath(cwd / "data" / "prepare.py") == str(worktree.resolve() / "data" / "prepare.py")  # tracked: the worktree's
    assert os.path.realpath(cwd / "meta.pkl") == str(user.resolve() / "meta.pkl")
    assert os.path.realpath(cwd / "train.py") == str(worktree.resolve() / "train.py")
    assert not (cwd / ".git").exists()
    assert set(run_dir.protected) == {worktree.resolve(), user.resolve()}
    (cwd / "out").mkdir()  # what the script creates lands in the scratch folder
    (cwd / "data" / "log.txt").write_text("x", encoding="utf-8")  # in a tracked folder too
    assert not (worktree / "out").exists() and not (user / "out").exists()
    assert not (worktree / "data" / "log.txt").exists() and not (user / "data" / "log.txt").exists()
    with pytest.raises(DataPathError, match="'tokenizer.json' is in neither"):
        make_run_dir(worktree, ["tokenizer.json"], tmp_path / "run2" / "cwd")


def test_likely_causes_come_from_the_source_and_from_seeds_that_differ_between_runs():
    from trainbridge.sandbox.results import RunResult
    from trainbridge.sandbox.script.determinism import likely_causes

    def run(seed_value: str) -> RunResult:
        return RunResult(mode="script", backend="cpu", device="cpu", seed=0, threads=2, warmup_steps=0,
                         extra={"script": {"seed_calls": [["torch.manual_seed", seed_value, 1]]}})

    causes = likely_causes("loader = DataLoader(ds, num_workers=4)\n", run("1700000000"), run("1700000001"))
    assert any("worker" in c for c in causes) and any("torch.manual_seed was called with 1700000000" in c for c in causes)
    assert likely_causes("torch.manual_seed(0)\n", run("0"), run("0")) == []


def test_a_bare_name_meant_for_an_argparse_option_or_a_field_is_pointed_to_the_right_key():
    source = "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--batch-size', type=int)\n" + SOURCE
    _, plan = _run(source, {"batch_sise_": 4, "width": 2})
    problems = plan.unmatched()
    assert "--batch-size" in problems[0] and "Config.width" in problems[1]
