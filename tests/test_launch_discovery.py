"""Finding a repository's training script and its launch line (tools/launch/discovery.py and its parsers).

The repositories in tests/fixtures/launch_repos/ are small programs written here in the styles of
public training repositories (a nanoGPT-style script with a configurator and config files, an
llm.c-style argparse script with a torchrun shell script, a modded-nanogpt-style torchrun script with
a hyperparameter dataclass, and a repository that only evaluates); no public code is copied.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainbridge.tools.git.ignore_rules import IgnoreRules
from trainbridge.tools.launch.discovery import EvidenceKind, discover_launch
from trainbridge.tools.launch.lines import lines_in_markdown, lines_in_shell, parse_launch
from trainbridge.tools.launch.script_facts import read_script_facts

REPOS = Path(__file__).parent / "fixtures" / "launch_repos"


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


TRAINS = """
    import torch

    def main():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    if __name__ == "__main__":
        main()
"""


# --- the fixture repositories -----------------------------------------------------------------


@pytest.mark.parametrize(("repo", "launch", "where", "kind", "torchrun", "nproc"), [
    ("nanogpt_style", "python train.py config/train_tiny_poems.py", ["README.md:22"], EvidenceKind.markdown_block,
     False, None),
    ("llmc_style", "python train_gpt2.py", ["README.md:8"], EvidenceKind.markdown_block, False, None),
    ("modded_style", "torchrun --standalone --nproc_per_node=8 train_gpt.py", ["README.md:4", "run.sh:1"],
     EvidenceKind.markdown_inline, True, 8),
])
def test_the_exact_launch_line_of_each_repository(repo, launch, where, kind, torchrun, nproc):
    best = discover_launch(REPOS / repo).best
    assert best is not None
    assert best.launch == launch and best.argv == launch.split()
    assert [e.where for e in best.evidence] == where and best.evidence[0].kind == kind
    assert (best.torchrun, best.nproc) == (torchrun, nproc)
    assert best.script == best.argv[best.argv.index(best.script)]  # repo-relative, as the line names it


def test_every_candidate_in_rank_order_with_its_reasons():
    nano = discover_launch(REPOS / "nanogpt_style")
    assert [c.launch for c in nano.candidates] == ["python train.py config/train_tiny_poems.py",
                                                   "python train.py config/train_tiny_poems.py --batch_size=8"]
    assert nano.candidates[0].config_files == ["config/train_tiny_poems.py"]
    assert nano.candidates[1].evidence[0].kind == EvidenceKind.markdown_inline  # weaker than a code block
    assert nano.candidates[0].score > nano.candidates[1].score
    llmc = discover_launch(REPOS / "llmc_style")
    second = llmc.candidates[1]
    assert second.launch == ("torchrun --standalone --nproc_per_node=4 train_gpt2.py --input_bin "
                             "dev/data/tinyshakespeare/tiny_shakespeare_train.bin --batch_size 8 --sequence_length 256")
    assert (second.torchrun, second.nproc, second.evidence[0].where) == (True, 4, "scripts/run_gpt2_ddp.sh:5")
    modded = discover_launch(REPOS / "modded_style").best
    assert "also in run.sh:1 (+0.5)" in modded.reasons  # the same line in two places is one stronger candidate
    assert any("builds an optimizer and calls .backward()" in r for r in modded.reasons)


def test_near_misses_and_lines_not_taken_say_why():
    nano = discover_launch(REPOS / "nanogpt_style")
    misses = {m.script: m.reason for m in nano.near_misses}
    assert "it only evaluates" in misses["sample.py"] and "data/tiny_poems/prepare.py" in misses
    assert "configurator.py" not in misses  # exec'd by train.py for its settings, no program of its own
    assert any(s.startswith("README.md:16 `python data/tiny_poems/prepare.py`") and "builds no optimizer" in s
               for s in nano.skipped)
    assert not any(c.script in ("sample.py", "data/tiny_poems/prepare.py") for c in nano.candidates)
    llmc = discover_launch(REPOS / "llmc_style")
    assert {m.script: m.reason for m in llmc.near_misses}["evaluate.py"] == (
        "runs as a script but builds no optimizer and never calls .backward() (it only evaluates)")


def test_a_repository_without_a_training_script_gets_a_clear_message():
    found = discover_launch(REPOS / "no_training")
    assert found.candidates == [] and found.best is None
    message = found.nothing_found()
    assert message.startswith(f"no training script found in {(REPOS / 'no_training').resolve()}")
    assert "near miss: tag.py: runs as a script but builds no optimizer" in message
    assert "not taken: README.md:6 `python tag.py photos/`" in message and "entry mode" in message
    assert "utils.py" not in message  # a plain module is no near miss


def test_settings_of_the_best_script_sizes_first_config_files_winning():
    nano = {s.name: s for s in discover_launch(REPOS / "nanogpt_style").settings}
    assert (nano["batch_size"].value, nano["batch_size"].where) == ("32", "config/train_tiny_poems.py:4")
    assert (nano["gradient_accumulation_steps"].value, nano["gradient_accumulation_steps"].where) == ("2", "train.py:14")
    assert "iter_num" not in nano and "ddp" not in nano  # set after configurator.py ran: not a setting
    modded = discover_launch(REPOS / "modded_style")
    assert [s.name for s in modded.settings][:4] == ["batch_size", "device_batch_size", "sequence_length",
                                                     "num_iterations"]
    assert modded.settings[0].value == "8 * 64" and modded.settings[0].kind == "dataclass field"
    assert modded.configurable_by == ["a hyperparameter dataclass (overrides of its defaults)"] and modded.distributed
    llmc = {s.name: s for s in discover_launch(REPOS / "llmc_style").settings}
    assert (llmc["batch_size"].kind, llmc["batch_size"].value, llmc["batch_size"].where) == \
        ("argparse option", "4", "train_gpt2.py:29")


@pytest.mark.parametrize(("repo", "data"), [
    ("nanogpt_style", ["data/"]),  # os.path.join('data', dataset) under `data/**/*.bin`
    ("llmc_style", ["dev/data/tinyshakespeare/"]),  # `dev/data/*/`
    ("modded_style", ["data/fineweb10B/"]),  # `data/fineweb10B/`
])
def test_git_ignored_data_paths_the_script_reads(repo, data):
    assert discover_launch(REPOS / repo).data_paths == data


# --- edges on repositories written here --------------------------------------------------------


def test_a_training_script_with_no_launch_line_written_anywhere(tmp_path):
    write(tmp_path, {"trainer/run_training.py": TRAINS, "trainer/__init__.py": ""})
    best = discover_launch(tmp_path).best
    assert best.launch == "python trainer/run_training.py" and best.evidence[0].kind == EvidenceKind.script_only
    assert best.evidence[0].where == "trainer/run_training.py:13"  # its __main__ guard


def test_a_script_that_reads_rank_without_a_default_is_launched_with_torchrun(tmp_path):
    """Issue 25: `init` picked `python train_gpt.py` for a speedrun that reads os.environ["RANK"] (it stopped at
    `environment variable RANK expected`); one that reads it with a default (nanoGPT's .get) still runs as python."""
    needs = TRAINS.replace("    import torch\n", "    import os\n    import torch\n    rank = int(os.environ[\"RANK\"])\n", 1)
    assert needs != TRAINS
    write(tmp_path / "a", {"train_gpt.py": needs})
    best = discover_launch(tmp_path / "a").best
    assert best.launch == "torchrun --standalone --nproc_per_node=1 train_gpt.py" and best.torchrun and best.nproc == 1
    assert any("torchrun sets them" in r for r in best.reasons)
    optional = TRAINS.replace("    import torch\n", "    import os\n    import torch\n    rank = int(os.environ.get(\"RANK\", -1))\n", 1)
    write(tmp_path / "b", {"train_gpt.py": optional})
    assert discover_launch(tmp_path / "b").best.launch == "python train_gpt.py"
    guarded = TRAINS.replace("    import torch\n", "    import os\n    import torch\n    ddp = int(os.environ.get('RANK', -1)) != -1\n"
                             "    rank = int(os.environ['RANK']) if ddp else 0\n", 1)  # nanoGPT's
    write(tmp_path / "c", {"train_gpt.py": guarded})
    assert discover_launch(tmp_path / "c").best.launch == "python train_gpt.py"


def test_a_launch_line_naming_a_missing_script_is_not_taken(tmp_path):
    write(tmp_path, {"README.md": "```bash\npython old_train.py --epochs 3\n```\n", "train.py": TRAINS})
    found = discover_launch(tmp_path)
    assert [c.launch for c in found.candidates] == ["python train.py"]
    assert found.skipped == ["README.md:2 `python old_train.py --epochs 3`: old_train.py is not in the repository"]


def test_python_dash_m_and_a_script_named_from_its_shell_scripts_folder(tmp_path):
    write(tmp_path, {"pkg/__init__.py": "", "pkg/train.py": TRAINS,
                     "scripts/go.sh": "cd .. && OMP_NUM_THREADS=2 python -m pkg.train --lr 0.1\n",
                     "scripts/local.sh": "python helper_train.py\n", "scripts/helper_train.py": TRAINS})
    found = {c.script: c for c in discover_launch(tmp_path).candidates}
    assert found["pkg/train.py"].argv == ["python", "-m", "pkg.train", "--lr", "0.1"]
    assert found["pkg/train.py"].env == {"OMP_NUM_THREADS": "2"}
    assert found["scripts/helper_train.py"].evidence[0].where == "scripts/local.sh:1"


def test_backward_in_an_imported_engine_module_counts(tmp_path):
    """A main.py that builds the optimizer and calls an engine's train_one_epoch (where backward() is)."""
    write(tmp_path, {
        "main.py": """
            import argparse
            import torch
            from engine import train_one_epoch
            from vision import models

            if __name__ == "__main__":
                parser = argparse.ArgumentParser()
                parser.add_argument("--epochs", type=int, default=300)
                args = parser.parse_args()
                model = models.tiny()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(args.epochs):
                    train_one_epoch(model, optimizer)
        """,
        "engine.py": "def train_one_epoch(model, optimizer):\n    loss = model().sum()\n    loss.backward()\n    optimizer.step()\n",
        "vision/__init__.py": "", "vision/models.py": "import torch\n\ndef tiny():\n    return torch.nn.Linear(2, 2)\n",
        "README.md": "```bash\npython main.py --epochs 3\n```\n",
        "predict.py": "from engine import train_one_epoch\nif __name__ == '__main__':\n    print('no optimizer here')\n",
    })
    found = discover_launch(tmp_path)
    assert [c.launch for c in found.candidates] == ["python main.py --epochs 3"]
    assert "main.py builds an optimizer; .backward() is called in engine.py:3 (+3)" in found.best.reasons
    assert {m.script for m in found.near_misses} == {"predict.py"}  # imports the engine but builds no optimizer


def test_discovery_runs_nothing_of_the_repository(tmp_path):
    marker = tmp_path / "EXECUTED"
    write(tmp_path, {"train.py": f"open({str(marker)!r}, 'w').write('ran')\n" + textwrap.dedent(TRAINS),
                     "README.md": "```sh\npython train.py\n```\n"})
    assert discover_launch(tmp_path).best.launch == "python train.py"
    assert not marker.exists()


def test_a_file_that_does_not_parse_is_reported_not_fatal(tmp_path):
    write(tmp_path, {"README.md": "```sh\npython train.py\n```\n", "train.py": "print 'python 2'\n"})
    found = discover_launch(tmp_path)
    assert found.candidates == [] and "train.py:1" in found.skipped[0]


# --- the parsers ---------------------------------------------------------------------------------


def test_parse_launch_reads_python_torchrun_and_refuses_the_rest():
    run = parse_launch("torchrun --nnodes 1 --nproc-per-node 2 --master_port=29500 train.py --compile=False")
    assert (run.script, run.script_args, run.torchrun, run.nproc) == ("train.py", ["--compile=False"], True, 2)
    module = parse_launch("python3 -u -m torch.distributed.run --standalone --nproc_per_node=8 train_gpt.py")
    assert (module.script, module.torchrun, module.nproc) == ("train_gpt.py", True, 8)
    assert parse_launch("CUDA_VISIBLE_DEVICES=0 python train.py").env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert parse_launch("torchrun --nproc_per_node=$NGPU train.py").notes == [
        "nproc_per_node is '$NGPU', not a number of processes"]
    for not_a_launch in ("pip install torch", "python -m venv .venv", "python -c 'import torch'", "make train",
                         "python train.py | tee log.txt", "python train.py > log.txt", "python", "ls *.py"):
        assert parse_launch(not_a_launch) is None, not_a_launch


def test_markdown_and_shell_lines_join_continuations_and_drop_prompts():
    text = ("Run `torchrun --nproc_per_node=2 a.py` or:\n\n```console\n$ python train.py \\\n    --batch_size=4\n"
            "# a comment\n```\n\n```python\nimport train  # not shell\n```\n")
    assert lines_in_markdown(text) == [(1, "torchrun --nproc_per_node=2 a.py", "markdown inline code"),
                                       (4, "python train.py --batch_size=4", "markdown code block")]
    assert lines_in_shell("#!/bin/sh\nset -e\ncd src && python train.py\n") == [
        (2, "set -e", "shell script"), (3, "cd src", "shell script"), (3, "python train.py", "shell script")]


def test_gitignore_rules():
    rules = IgnoreRules(["*.bin", "!keep.bin", "/out/", "data/**/*.pkl", "logs", "# comment", ""])
    assert rules.ignored("a/b/x.bin") and not rules.ignored("keep.bin")
    assert rules.ignored("out", is_dir=True) and not rules.ignored("out") and not rules.ignored("src/out", is_dir=True)
    assert rules.ignored("out/ckpt.pt") and rules.ignored("x/logs/run1.txt")
    assert rules.ignored("data/a/b/meta.pkl") and not rules.ignored("data/meta.txt")
    assert rules.ignores_inside("data") and not rules.ignores_inside("src")
    assert IgnoreRules.of(Path("/nonexistent")).rules == []


def test_script_facts_of_a_training_script_and_an_evaluation(tmp_path):
    write(tmp_path, {"t.py": TRAINS, "e.py": "import torch\nif __name__ == '__main__':\n    torch.load('m.pt').eval()\n"})
    trains, evaluates = read_script_facts(tmp_path, "t.py"), read_script_facts(tmp_path, "e.py")
    assert trains.trains and trains.main_guard == 13 and trains.optimizer_lines == [6] and trains.backward_lines == [10]
    assert not evaluates.trains and evaluates.runs_as_script and evaluates.why_not_training() == (
        "builds no optimizer and never calls .backward() (it only evaluates)")
