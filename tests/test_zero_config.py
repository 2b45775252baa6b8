"""Zero config (issue 30, item 1): a run in a worktree of the user's checkout sees the checkout's files outside git that
the script reads (git-ignored token data, an untracked input.txt), read-only, without a `data = [...]` line; outputs,
caches and environments stay out, and the run says what it showed. Tiny repositories of tests/zero_config_repos.py in
temporary git repositories; real sandbox children."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainbridge.graph.preflight import shown_files_notes
from trainbridge.sandbox.results import FailureKind
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.script.files import make_run_dir
from trainbridge.sandbox.script.ignored import ignored_inputs, not_an_input
from trainbridge.sandbox.workload import workload_for_launch
from trainbridge.tests.zero_config_repos import git, mingpt_style, nanogpt_style, write

CPU_LINE = "python train.py config/train_shakespeare_char.py --device=cpu"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


no_cuda_here = pytest.mark.skipif(_cuda(), reason="a GPU line runs on this host: the fallback from it is for hosts without CUDA")


def worktree(user: Path, tmp_path: Path, name: str = "wt") -> Path:
    """A worktree of the user's checkout on a branch of its own, as `trainbridge run` makes one."""
    path = tmp_path / name
    git(user, "worktree", "add", "-q", "-b", f"trainbridge/{name}", str(path))
    return path


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(root).parts}


@pytest.mark.parametrize(("entry", "left_out"), [
    ("data/shakespeare_char/train.bin", False), ("data/", False), ("meta.pkl", False), ("input.txt", False),
    ("tokenizer/vocab.json", False), ("build_data/x.bin", False),
    (".venv/", True), (".env", True), ("data/.cache/x", True), ("out/", True), ("out-shakespeare-char/", True),
    ("out_ddp/ckpt.pt", True), ("checkpoints/", True), ("runs/exp1/", True), ("wandb/", True), ("lib/__pycache__/", True),
    ("mypkg.egg-info/", True), ("train.log", True), ("model.pyc", True), ("lightning_logs/", True),
])
def test_what_counts_as_an_input_by_its_name(entry, left_out):
    assert (not_an_input(entry) is not None) == left_out, not_an_input(entry)


def test_the_checkouts_ignored_and_untracked_inputs_are_listed_and_code_is_not(tmp_path):
    user = nanogpt_style(tmp_path / "user")
    write(user, {"notes/input.txt": "hello", "scratch.py": "print('uncommitted code')\n", "tools/helper.py": "x = 1\n"})
    found = ignored_inputs(user)
    assert found.shown == ["data/shakespeare_char/meta.pkl", "data/shakespeare_char/train.bin", "data/shakespeare_char/val.bin",
                           "notes/"], found
    assert set(found.skipped) == {".venv/", "out-shakespeare-char/", "scratch.py", "tools/"}
    assert "untracked code (helper.py)" in found.skipped["tools/"] and "named like an output" in found.skipped["out-shakespeare-char/"]
    assert found.skipped_reason("out-shakespeare-char/ckpt.pt") == ("out-shakespeare-char/", found.skipped["out-shakespeare-char/"])
    note, = found.notes(data=["data/"])
    assert note.startswith("the script sees these files of your checkout outside git, read-only: notes/ (left out: ")
    assert found.notes(data=["data/", "notes"]) == []


def test_the_mirror_of_a_worktree_shows_them_without_hiding_the_worktree_and_new_files_land_in_scratch(tmp_path):
    user = nanogpt_style(tmp_path / "user")
    (user / "data" / "shakespeare_char" / "prepare.py").write_text("changed in the checkout, not committed\n")
    wt = worktree(user, tmp_path)
    run_dir = make_run_dir(wt, [], tmp_path / "cwd")
    mirror = run_dir.cwd / "data" / "shakespeare_char"
    assert (mirror / "train.bin").resolve() == (user / "data" / "shakespeare_char" / "train.bin").resolve()
    assert (mirror / "prepare.py").read_text() == (wt / "data" / "shakespeare_char" / "prepare.py").read_text()  # tracked: the worktree's
    assert not (run_dir.cwd / "out-shakespeare-char").exists() and not (run_dir.cwd / ".venv").exists()
    assert not mirror.is_symlink()  # a real folder: a file the script writes beside its data lands in scratch
    (mirror / "cache.npy").write_bytes(b"x")
    assert not (user / "data" / "shakespeare_char" / "cache.npy").exists()
    assert list(run_dir.shown) == ["data/shakespeare_char/meta.pkl", "data/shakespeare_char/train.bin", "data/shakespeare_char/val.bin"]
    assert make_run_dir(wt, [], tmp_path / "cwd-off", show_ignored=False).shown == {}
    assert not (tmp_path / "cwd-off" / "data" / "shakespeare_char" / "train.bin").exists()


def test_a_nanogpt_style_run_in_a_worktree_reads_the_ignored_data_without_a_toml_and_leaves_the_checkout_alone(tmp_path):
    user = nanogpt_style(tmp_path / "user")
    before = files_of(user)
    wt = worktree(user, tmp_path)
    assert not (wt / "trainbridge.toml").exists() and not (wt / "data" / "shakespeare_char" / "train.bin").exists()
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    out = tmp_path / "measure.json"
    shown = CliRunner().invoke(build_app(), ["measure", str(wt), "--steps", "2", "--warmup", "1", "--json", str(out), "--",
                                             *CPU_LINE.split()], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert re.search(r"shown read-only +│ +data/shakespeare_char/meta.pkl, data/shakespeare_char/train.bin, "
                     r"data/shakespeare_char/val.bin │", shown.output), shown.output
    import json

    script = json.loads(out.read_text())["extra"]["script"]
    assert script["data"] == {} and script["data_shown"] == [f"data/shakespeare_char/{n}" for n in ("meta.pkl", "train.bin", "val.bin")]
    assert set(script["data_skipped"]) == {".venv/", "out-shakespeare-char/"} and script["data_changed"] == []
    assert files_of(user) == before and git(wt, "status", "--porcelain") == ""
    notes = shown_files_notes(workload_for_launch(user, CPU_LINE), user)  # what `trainbridge run` says before it starts
    assert notes == ["the script sees these files of your checkout outside git, read-only: data/shakespeare_char/meta.pkl, "
                     "data/shakespeare_char/train.bin, data/shakespeare_char/val.bin (left out: .venv/, out-shakespeare-char/: "
                     "outputs, caches, environments; data = [...] in trainbridge.toml shows one)"]


def test_a_file_left_out_by_its_name_is_named_with_the_data_entry_that_shows_it(tmp_path):
    user = nanogpt_style(tmp_path / "user")
    tokens_dir = user / "out-shakespeare-char"  # the data lives where an output would (prepared into an out-* folder)
    for name in ("train.bin", "val.bin", "meta.pkl"):
        (tokens_dir / name).write_bytes((user / "data" / "shakespeare_char" / name).read_bytes())
    wt = worktree(user, tmp_path)
    line = CPU_LINE + " --dataset=../out-shakespeare-char"
    result = run_workload(workload_for_launch(wt, line).with_overrides(steps=1, warmup_steps=0))
    assert result.failure is not None and result.failure.kind == FailureKind.bad_workload
    message = result.failure.message
    assert "needs a file that is missing: 'data/../out-shakespeare-char/meta.pkl'" in message, message
    assert f"it is in your checkout ({user}/" in message and 'data = ["out-shakespeare-char/"]' in message, message


def test_an_untracked_input_beside_a_script_of_a_subfolder_is_shown(tmp_path):
    user = mingpt_style(tmp_path / "user")
    wt = worktree(user, tmp_path)
    run_dir = make_run_dir(wt, [], tmp_path / "cwd")
    assert list(run_dir.shown) == ["projects/chargpt/input.txt"]
    assert (run_dir.cwd / "projects" / "chargpt" / "input.txt").read_text() == (user / "projects/chargpt/input.txt").read_text()


# --- init: proves its launch line here, falls back to the next, says the cause and the fix (issue 30, item 1) ---

def init(*args: str):
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    return CliRunner().invoke(build_app(), ["init", *map(str, args)], env={"COLUMNS": "200"})


def test_without_cuda_a_readmes_cpu_line_goes_before_its_gpu_line_of_the_same_score(tmp_path):
    from trainbridge.tools.launch.discovery import discover_launch, line_device

    user = nanogpt_style(tmp_path / "user")
    gpu_first = discover_launch(user, cuda=True)
    assert [c.device for c in gpu_first.candidates] == [None, "cpu"]  # file order: the GPU line comes first
    cpu_first = discover_launch(user, cuda=False)
    assert cpu_first.best.launch == "python train.py config/train_shakespeare_char.py --device=cpu --max_iters=300"
    assert cpu_first.best.score == cpu_first.candidates[1].score and "this host has no CUDA" in cpu_first.best.reasons[-1]
    assert cpu_first.data_paths == ["data/shakespeare_char/meta.pkl"]  # the stale out-*/ckpt.pt is an output, not data
    assert [line_device(a.split()) for a in ("--device cpu", "--device=cuda:1", "--accelerator=gpu", "--no-cuda", "--lr=1")] \
        == ["cpu", "cuda", "cuda", "cpu", None]


@no_cuda_here
def test_init_falls_back_from_a_gpu_line_that_fails_here_saying_why_and_the_override(tmp_path, monkeypatch):
    from trainbridge.graph.cli import init as init_cmd

    monkeypatch.setattr(init_cmd, "cuda_here", lambda: True)  # ranked as on a CUDA host: the GPU line first
    user = nanogpt_style(tmp_path / "user")
    result = init(user, "--yes")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "the check failed (exception): AssertionError: Torch not compiled with CUDA enabled" in out
    assert ('cause: it asked for a CUDA device and this host has none (Torch not compiled with CUDA enabled); fix: under '
            '[overrides] in trainbridge.toml: device = "cpu" (constant, train.py:19') in out
    assert "trying the next launch line: python train.py config/train_shakespeare_char.py --device=cpu --max_iters=300" in out
    assert "it runs: median step" in out and "did not" in out
    import tomllib

    assert tomllib.loads((user / "trainbridge.toml").read_text())["launch"].endswith("--device=cpu --max_iters=300")


@no_cuda_here
def test_with_only_a_gpu_line_init_writes_the_device_override_that_makes_it_run(tmp_path):
    import tomllib

    from trainbridge.tests.zero_config_repos import NANO_README

    user = nanogpt_style(tmp_path / "user", readme=NANO_README.split("No GPU?")[0])
    result = init(user, "--yes")
    assert result.exit_code == 0, result.output
    assert "trying it with device = 'cpu': python train.py config/train_shakespeare_char.py" in result.output, result.output
    assert "and that override: it runs here" in result.output
    text = (user / "trainbridge.toml").read_text()
    assert tomllib.loads(text)["overrides"] == {"device": "cpu"} and "# batch_size" in text  # the hints stay commented
    assert 'device = "cpu"   # init: it asked for a CUDA device and this host has none' in text


def test_a_check_that_misses_its_data_names_the_file_and_the_preparation_and_tries_no_other_line(tmp_path):
    user = nanogpt_style(tmp_path / "user", data=False)
    result = init(user, "--yes")
    assert result.exit_code == 1, result.output  # written, but its check did not pass
    assert "cause: a file it reads is missing: data/shakespeare_char/meta.pkl; fix: run the repository's data preparation " \
           "first (python data/shakespeare_char/prepare.py, in your checkout)" in result.output
    assert "trying the next launch line" not in result.output and "shrink it under" not in result.output
    assert f"it is not in your checkout ({user}) either" in result.output and "Create it there first" in result.output


def test_a_check_that_downloads_says_it_needs_the_network(tmp_path):
    script = ('import urllib.request\nimport torch\n\ntext = urllib.request.urlopen("http://example.invalid/input.txt").read()\n'
              'model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor _ in range(100):\n'
              '    loss = model(torch.ones(2)).sum()\n    loss.backward()\n    opt.step()\n')
    user = write(tmp_path / "user", {"train.py": script, "README.md": "```\npython train.py\n```\n"})
    from script_repos import commit_all

    commit_all(user)
    result = init(user, "--yes")
    assert "cause: it downloads something when it starts" in result.output, result.output
    assert "the sandbox has no network" in result.output


def test_init_follows_a_trainer_object_into_the_repositorys_package_and_the_check_runs(tmp_path):
    user = mingpt_style(tmp_path / "user")
    result = init(user, "--yes")
    assert result.exit_code == 0, result.output
    assert "1. python projects/chargpt/chargpt.py" in result.output
    assert ("projects/chargpt/chargpt.py calls Trainer of mingpt/trainer.py, which builds an optimizer (mingpt/trainer.py:15) "
            "and calls .backward() (mingpt/trainer.py:21)") in result.output
    assert "no training script" not in result.output and "it runs: median step" in result.output, result.output
    import tomllib

    assert tomllib.loads((user / "trainbridge.toml").read_text()) == {"launch": "python projects/chargpt/chargpt.py",
                                                                       "pythonpath": ["."]}


def test_a_shown_file_the_script_writes_is_copied_on_write_and_the_checkouts_copy_stays(tmp_path):
    script = ('import torch\n\nwith open("notes.txt", "a") as f:\n    f.write("appended\\n")\nprint("NOTES", open("notes.txt").read().split())\n'
              'model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor step in range(100):\n'
              '    loss = model(torch.ones(2)).sum()\n    loss.backward()\n    opt.step()\n'
              '    if step == 1:\n        torch.save(model.state_dict(), "ckpt.pt")\n')
    user = write(tmp_path / "user", {"train.py": script, ".gitignore": "*.pt\n"})
    from script_repos import commit_all

    commit_all(user)
    write(user, {"notes.txt": "kept\n"})  # untracked
    (user / "ckpt.pt").write_bytes(b"stale checkpoint of an earlier run")  # git-ignored, at the root: shown
    before = files_of(user)
    wt = worktree(user, tmp_path)
    result = run_workload(workload_for_launch(wt, "python train.py").with_overrides(steps=3, warmup_steps=0))
    assert result.ok, (result.failure, result.stderr_tail[-2000:])
    assert sorted(result.extra["script"]["data_shown"]) == ["ckpt.pt", "notes.txt"]
    assert "NOTES ['kept', 'appended']" in result.stdout_tail  # its own copy, with the old content it appended to
    assert files_of(user) == before and result.extra["script"]["data_changed"] == []


@pytest.mark.parametrize(("message", "tail", "cause", "fix", "line_specific"), [
    ("the script needs a file that is missing: 'input.txt': your checkout has projects/chargpt/input.txt, but the script "
     "looks for it relative to its working directory", None,
     "it opens input.txt relative to its working directory, the repository's root here; your checkout has it at "
     "projects/chargpt/input.txt", "put a copy or a link of projects/chargpt/input.txt at input.txt in your checkout", True),
    ("RuntimeError: Found no NVIDIA driver on your system.", None, "it asked for a CUDA device and this host has none",
     '"--device" = "cpu" (argparse option', True),
    ("ValueError: bad shape", "Traceback ...\nValueError: bad shape", "exception: ValueError: bad shape", "", True),
])
def test_advice_names_the_cause_and_the_fix(message, tail, cause, fix, line_specific):
    from trainbridge.sandbox.results import Failure
    from trainbridge.graph.cli.check_advice import advise
    from trainbridge.tools.launch.discovery import Discovery, Setting

    found = Discovery(repo="/r", candidates=[], settings=[Setting(name="device", value="'cuda'", kind="argparse option",
                                                                  where="train.py:12", key="--device")])
    advice = advise(Failure(kind="exception", message=message, traceback_tail=tail), found)
    assert advice.cause.startswith(cause) and fix in advice.fix and advice.line_specific == line_specific, advice
    assert (advice.override == {"--device": "cpu"}) == ("NVIDIA" in message)


def test_an_entry_that_cannot_be_placed_beside_the_worktrees_files_is_skipped_with_the_reason(tmp_path, monkeypatch):
    from trainbridge.sandbox.script import ignored

    user = nanogpt_style(tmp_path / "user")
    wt = worktree(user, tmp_path)
    (user / "configurator.py").unlink()  # in the checkout a folder now stands where the commit has a file
    write(user, {"configurator.py/extra.txt": "x"})
    listed = ignored.IgnoredInputs(shown=["configurator.py/extra.txt", "data/shakespeare_char/train.bin"])
    monkeypatch.setattr(ignored, "ignored_inputs", lambda checkout: listed)  # as git might list it mid-change
    run_dir = make_run_dir(wt, [], tmp_path / "cwd")
    assert list(run_dir.shown) == ["data/shakespeare_char/train.bin"]
    assert "could not be shown beside the worktree's files" in run_dir.skipped["configurator.py/extra.txt"]
    assert (run_dir.cwd / "configurator.py").read_text() == (wt / "configurator.py").read_text()
