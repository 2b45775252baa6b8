"""`trainbridge init` on repositories laid out the way two public ones are (issue 30: init on public repositories). The
small programs here are written for these tests in the style of those repositories, not copied from them:

- a minGPT-style repository: projects/charlm/charlm.py runs from its own folder (it opens `input.txt` beside it), imports
  its package from the root, leaves the optimizer and backward() to a Trainer of that package, and takes its settings as
  `--trainer.max_iters=...` arguments merged into a config tree whose sub-trees the package's classes build;
- a pytorch/examples-style folder of examples: wordlm/README.md says `python main.py ...` (run from wordlm/), the data is
  under wordlm/data/, and the script updates its parameters by hand unless `--use-optimizer` is given.

Two sandbox runs (init's own check on the minGPT-style repository, then its launch line typed with no workdir); the rest
reads files only.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from trainbridge.tests.zero_config_repos import write

CONFIG_TREE = '''"""A tiny config tree: attributes, sub-trees, and --a.b=value arguments merged in."""
from ast import literal_eval


class Node:
    def __init__(self, **values):
        self.__dict__.update(values)

    def merge_from_args(self, args):
        for arg in args:
            key, _, text = arg.partition("=")
            *path, leaf = key.removeprefix("--").split(".")
            node = self
            for part in path:
                node = getattr(node, part)
            try:
                value = literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            setattr(node, leaf, value)
'''

PACKAGE_MODEL = '''import torch
import torch.nn as nn
from torch.nn import functional as F

from charpkg.config import Node


class TinyLM(nn.Module):
    @staticmethod
    def get_default_config():
        C = Node()
        C.n_embd = 16
        C.vocab_size = None
        return C

    def __init__(self, config):
        super().__init__()
        self.emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, x, y):
        logits = self.head(self.emb(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
'''

PACKAGE_TRAINER = '''import torch

from charpkg.config import Node


class Trainer:
    @staticmethod
    def get_default_config():
        C = Node()
        C.batch_size = 16
        C.learning_rate = 1e-2
        C.max_iters = None
        return C

    def __init__(self, config, model, data):
        self.config, self.model, self.data = config, model, data

    def run(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)
        generator = torch.Generator().manual_seed(0)
        step = 0
        while self.config.max_iters is None or step < self.config.max_iters:
            ix = torch.randint(len(self.data) - 9, (self.config.batch_size,), generator=generator)
            x = torch.stack([self.data[i:i + 8] for i in ix])
            y = torch.stack([self.data[i + 1:i + 9] for i in ix])
            _, loss = self.model(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"iter {step}: loss {loss.item():.4f}")
            step += 1
'''

CHAR_SCRIPT = '''"""Trains a character model on input.txt (put it beside this script)."""
import os
import sys

import torch

from charpkg.config import Node
from charpkg.model import TinyLM
from charpkg.trainer import Trainer


def get_config():
    C = Node()
    C.system = Node()
    C.system.work_dir = "./out/charlm"
    C.model = TinyLM.get_default_config()
    C.trainer = Trainer.get_default_config()
    C.trainer.batch_size = 4
    return C


if __name__ == "__main__":
    config = get_config()
    config.merge_from_args(sys.argv[1:])
    os.makedirs(config.system.work_dir, exist_ok=True)
    with open(os.path.join(config.system.work_dir, "args.txt"), "w") as f:
        f.write(" ".join(sys.argv))
    text = open("input.txt").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    config.model.vocab_size = len(chars)
    print(f"batch_size={config.trainer.batch_size} argv0={sys.argv[0]} cwd={os.path.basename(os.getcwd())}")
    Trainer(config.trainer, TinyLM(config.model), data).run()
'''

WORDLM_MAIN = '''import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--data", type=str, default="./data/corpus")
parser.add_argument("--epochs", type=int, default=40)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--use-optimizer", action="store_true")
args = parser.parse_args()

words = open(args.data + "/train.txt").read().split()
model = torch.nn.Embedding(len(set(words)), 8)
if args.use_optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
for epoch in range(args.epochs):
    loss = model(torch.arange(4)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    if args.use_optimizer:
        optimizer.step()
    else:
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-args.lr)
'''

WORDLM_README = '''# Word-level language model

```bash
python main.py --epochs 6           # by hand
python main.py --epochs 6 --use-optimizer --lr 0.001
python main.py -h
python main.py --use-optimizer --data [PATH_TO_CORPUS] --dist-url tcp://IP_OF_NODE0:FREEPORT
```
'''


def mingpt_like(path: Path) -> Path:
    from script_repos import commit_all

    write(path, {"charpkg/__init__.py": "", "charpkg/config.py": CONFIG_TREE, "charpkg/model.py": PACKAGE_MODEL,
                 "charpkg/trainer.py": PACKAGE_TRAINER, "projects/charlm/charlm.py": CHAR_SCRIPT,
                 "README.md": "# charpkg\n\nSee projects/.\n", ".gitignore": "__pycache__/\n"})
    commit_all(path)
    (path / "projects" / "charlm" / "input.txt").write_text("hello world, a tiny text! " * 40, encoding="utf-8")  # untracked
    return path


def examples_like(path: Path) -> Path:
    from script_repos import commit_all

    write(path, {"wordlm/main.py": WORDLM_MAIN, "wordlm/README.md": WORDLM_README,
                 "wordlm/data/corpus/train.txt": "the cat sat on the mat\n" * 20, ".gitignore": "data\n*.pt\n",
                 "README.md": "# examples\n\nOne folder per example.\n"})
    commit_all(path)
    return path


@pytest.fixture(scope="module")
def mingpt_repo(tmp_path_factory) -> Path:
    return mingpt_like(tmp_path_factory.mktemp("init_public") / "charpkg")


def test_a_script_that_opens_a_file_beside_it_runs_from_its_folder_with_its_config_tree_as_settings(mingpt_repo):
    from trainbridge.tools.launch.discovery import discover_launch
    from trainbridge.tools.launch.init_toml import render_toml

    found = discover_launch(mingpt_repo, cuda=False)
    best = found.best
    assert best.launch == "python projects/charlm/charlm.py" and best.workdir == "projects/charlm"
    assert ("it opens 'input.txt' (projects/charlm/charlm.py:28), which is beside it (projects/charlm/input.txt) and not at "
            "the root: it runs from projects/charlm/ (workdir)") in best.reasons
    assert found.pythonpath == ["."]
    settings = {s.key: (s.value, s.where) for s in found.settings}
    # the script's own assignment replaces the trainer's default; the trainer's and the model's defaults come from the package
    assert settings["--trainer.batch_size"] == ("4", "projects/charlm/charlm.py:18")
    assert settings["--trainer.max_iters"] == ("None", "charpkg/trainer.py:12")
    assert settings["--model.n_embd"] == ("16", "charpkg/model.py:12")
    assert settings["--system.work_dir"] == ("'./out/charlm'", "projects/charlm/charlm.py:15")
    assert "--system" not in settings and "--model" not in settings  # sub-trees are no settings
    assert found.configurable_by[0].startswith("--section.key=value arguments into its config tree "
                                               "(projects/charlm/charlm.py:24")
    config = tomllib.loads(render_toml(found, best))
    assert config == {"launch": "python projects/charlm/charlm.py", "workdir": "projects/charlm", "pythonpath": ["."]}


def test_init_writes_the_working_folder_its_check_runs_there_and_a_typed_line_finds_it_alone(mingpt_repo):
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app
    from trainbridge.sandbox.runner import run_workload
    from trainbridge.sandbox.workload import workload_for_launch

    result = CliRunner().invoke(build_app(), ["init", str(mingpt_repo), "--yes", "--force", "--script",
                                              "projects/charlm/charlm.py"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "projects/charlm/charlm.py runs from its folder: workdir = 'projects/charlm'" in result.output
    assert "it runs: median step" in result.output, result.output
    assert '"--trainer.batch_size" = 4' in result.output  # the shrink hint names the config argument
    assert tomllib.loads((mingpt_repo / "trainbridge.toml").read_text())["workdir"] == "projects/charlm"
    # zero config (the launch line typed, no workdir): the run finds the folder itself; the shrink reaches the config
    # tree through the script's own arguments
    text = (mingpt_repo / "trainbridge.toml").read_text().replace('workdir = "projects/charlm"', "")
    (mingpt_repo / "trainbridge.toml").write_text(text.replace("# [overrides]", '[overrides]\n"--trainer.batch_size" = 3'))
    workload = workload_for_launch(mingpt_repo, "python projects/charlm/charlm.py")
    assert workload.config.workdir is None
    run = run_workload(workload.with_overrides(steps=1, warmup_steps=0))
    assert run.ok, run.failure
    assert "batch_size=3 argv0=charlm.py cwd=charlm" in run.stdout_tail
    assert ("projects/charlm/charlm.py runs from its folder: it opens 'input.txt' (projects/charlm/charlm.py:28), which is "
            "beside it") in run.extra["script"]["notes"][-1]
    assert not (mingpt_repo / "projects" / "charlm" / "out").exists()  # what it wrote stayed in the run's scratch


def test_a_line_written_in_an_examples_readme_runs_from_that_folder_and_the_optimizer_switch_ranks_first(tmp_path):
    from trainbridge.tools.launch.discovery import discover_launch

    found = discover_launch(examples_like(tmp_path / "examples"), cuda=False)
    assert [(c.launch, c.workdir) for c in found.candidates] == [
        ("python wordlm/main.py --epochs 6 --use-optimizer --lr 0.001", "wordlm"),
        ("python wordlm/main.py --epochs 6", "wordlm"),
        ("python wordlm/main.py --use-optimizer --data '[PATH_TO_CORPUS]' --dist-url tcp://IP_OF_NODE0:FREEPORT", "wordlm"),
        ("python wordlm/main.py -h", "wordlm")]
    best, by_hand, placeholders, helps = found.candidates
    assert "it has values to fill in ([PATH_TO_CORPUS], tcp://IP_OF_NODE0:FREEPORT) (-2)" in placeholders.reasons
    assert "it asks for the help text (-h) and exits before training (-3)" in helps.reasons
    assert "written in wordlm/README.md as `python main.py --epochs 6 --use-optimizer --lr 0.001`: it runs from wordlm/ " \
           "(workdir)" in best.reasons
    assert "it passes --use-optimizer, which turns on the optimizer (wordlm/main.py:15) (+0.5)" in best.reasons
    assert by_hand.score == best.score - 1.5 and "without --use-optimizer it builds no optimizer" in by_hand.reasons[-1]
    assert found.data_paths == ["wordlm/data/"]  # './data/corpus' read from wordlm/, git-ignored as `data`


def test_a_script_with_no_launch_line_gets_its_optimizer_switch(tmp_path):
    from script_repos import commit_all

    from trainbridge.tools.launch.discovery import discover_launch

    write(tmp_path / "repo", {"main.py": WORDLM_MAIN, "data/corpus/train.txt": "a b c\n"})
    commit_all(tmp_path / "repo")
    best = discover_launch(tmp_path / "repo", cuda=False).best
    assert best.launch == "python main.py --use-optimizer" and best.workdir is None
    assert "--use-optimizer turns its optimizer on" in best.reasons


def test_a_check_that_misses_a_file_beside_its_script_is_tried_again_from_that_folder(tmp_path):
    from trainbridge.graph.cli.init import own_folder_retry
    from trainbridge.sandbox.results import Failure, FailureKind
    from trainbridge.tools.launch.discovery import EvidenceKind, LaunchCandidate, LaunchEvidence

    (tmp_path / "projects" / "x").mkdir(parents=True)
    (tmp_path / "projects" / "x" / "input.txt").write_text("text")
    candidate = LaunchCandidate(launch="python projects/x/x.py", argv=["python", "projects/x/x.py"], script="projects/x/x.py",
                                evidence=[LaunchEvidence(kind=EvidenceKind.script_only, file="projects/x/x.py", line=1,
                                                         text="python projects/x/x.py")], score=4, reasons=[])
    missing = Failure(kind=FailureKind.bad_workload, message="the script needs a file that is missing: 'input.txt': your "
                      "checkout has projects/x/input.txt, but ...")
    again = own_folder_retry(tmp_path, candidate, missing)
    assert again.workdir == "projects/x" and again.launch == candidate.launch
    assert again.reasons == ["it opens input.txt relative to its working directory and that file is beside it "
                             "(projects/x/input.txt): it runs from projects/x/ (workdir)"]
    assert own_folder_retry(tmp_path, again, missing) is None  # already there
    other = Failure(kind=FailureKind.bad_workload, message="the script needs a file that is missing: 'meta.pkl'")
    assert own_folder_retry(tmp_path, candidate, other) is None


def test_the_missing_file_message_names_the_workdir_that_would_find_it(tmp_path):
    from trainbridge.sandbox.script.files import RunDir
    from trainbridge.sandbox.script.run import missing_file_hint

    (tmp_path / "projects" / "x").mkdir(parents=True)
    (tmp_path / "projects" / "x" / "input.txt").write_text("text")
    run_dir = RunDir(cwd=tmp_path / "scratch", protected=[], checkout=tmp_path)
    message = missing_file_hint("the script needs a file that is missing: 'input.txt' (working directory: ...)", run_dir)
    assert "your checkout has projects/x/input.txt, but the script looks for it relative to its working directory, the " \
           "repository's root unless trainbridge.toml sets workdir" in message
    assert 'add workdir = "projects/x" to trainbridge.toml' in message
    (tmp_path / "projects" / "x" / "input.txt").unlink()  # nowhere: put it beside the script
    run_dir.script = "projects/x/x.py"
    message = missing_file_hint("the script needs a file that is missing: 'input.txt' (working directory: ...)", run_dir)
    assert message.endswith("A script in a subfolder often opens it from its own folder: put it at projects/x/input.txt in "
                            "your checkout and runs start the script in projects/x/ by themselves (workdir).")
    (tmp_path / "projects" / "x" / "input.txt").write_text("text")
    run_dir.workdir = "projects/x"  # found there: nothing to say about other folders
    assert "it is in your checkout" in missing_file_hint("the script needs a file that is missing: 'input.txt'", run_dir)


def test_workdir_is_a_folder_inside_the_repository(tmp_path):
    from trainbridge.sandbox.script.run import launch_problem
    from trainbridge.sandbox.workload import Workload, WorkloadConfig

    with pytest.raises(ValueError, match="must be a folder inside the repository"):
        WorkloadConfig(launch="python x.py", workdir="../elsewhere")
    with pytest.raises(ValueError, match='"workdir" apply to script mode only'):
        WorkloadConfig(entry="m:f", workdir="sub")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.py").write_text("")
    assert "workdir 'nowhere' of trainbridge.toml is not a folder" in launch_problem(
        Workload(root=tmp_path, config=WorkloadConfig(launch="python sub/x.py", workdir="nowhere")))
    assert "it is in workdir 'sub': the launch line names the script from the repository's root, launch = \"python sub/x.py" \
        in launch_problem(Workload(root=tmp_path, config=WorkloadConfig(launch="python x.py", workdir="sub")))
    assert launch_problem(Workload(root=tmp_path, config=WorkloadConfig(launch="python sub/x.py", workdir="sub"))) is None


def test_in_a_worktree_the_folder_is_found_from_the_checkouts_untracked_input(mingpt_repo, tmp_path):
    from script_repos import git

    from trainbridge.sandbox.script.files import make_run_dir, use_workdir
    from trainbridge.tools.launch.workdir import own_folder
    from trainbridge.tools.launch.script_facts import read_script_facts

    worktree = tmp_path / "wt"
    git(mingpt_repo, "worktree", "add", "-q", "-b", "trainbridge/wt", str(worktree))
    script = "projects/charlm/charlm.py"
    facts = read_script_facts(worktree, script)
    assert own_folder(worktree, script, facts) is None  # the worktree holds what git tracks: no input.txt
    run_dir = make_run_dir(worktree, [], tmp_path / "cwd")  # the mirror shows the checkout's untracked input.txt
    assert own_folder(run_dir.cwd, script, facts)[0] == "projects/charlm"
    folder = use_workdir(run_dir, "projects/charlm")
    assert folder.is_dir() and not folder.is_symlink() and (folder / "input.txt").is_file()
