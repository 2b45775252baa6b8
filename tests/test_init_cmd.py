"""`trainbridge init <repo>`: the toml it writes for each test repository (tests/fixtures/launch_repos/),
what it prints, what it refuses, and the measurement it tries (guarded until script mode runs a
`launch` line). Every repository is a fresh copy in tmp_path; the fixtures are never written.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainbridge.graph.cli import init as init_cmd
from trainbridge.graph.cli.app import build_app

REPOS = Path(__file__).parent / "fixtures" / "launch_repos"


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(REPOS / name, tmp_path / name))


def init(*args: str, input: str | None = None):
    return CliRunner().invoke(build_app(), ["init", *map(str, args)], input=input, env={"COLUMNS": "200"})


def uncommented_overrides(text: str) -> dict:
    """The toml with its `# [overrides]` block uncommented, as a user would do it."""
    head, _, block = text.partition("# [overrides]\n")
    lines = ["[overrides]"] + [re.sub(r"^# ", "", line) for line in block.splitlines() if " = " in line]
    return tomllib.loads(head + "\n".join(lines) + "\n")


@pytest.fixture(autouse=True)
def no_script_mode(monkeypatch):
    """Until script mode lands the loader cannot run `launch`; the tests that measure say so themselves."""
    monkeypatch.setattr(init_cmd, "script_mode_available", lambda: False)


@pytest.mark.parametrize(("repo", "launch", "data", "overrides"), [
    ("nanogpt_style", "python train.py config/train_tiny_poems.py", ["data/"],
     {"batch_size": 32, "block_size": 128, "n_layer": 4, "compile": False, "out_dir": "out-tiny-poems"}),
    ("llmc_style", "python train_gpt2.py", ["dev/data/tinyshakespeare/"],
     {"--batch_size": 4, "--sequence_length": 64, "--learning_rate": 0.0001}),
    ("modded_style", "torchrun --standalone --nproc_per_node=8 train_gpt.py", ["data/fineweb10B/"],
     {"Hyperparameters.batch_size": 512, "Hyperparameters.sequence_length": 1024,
      "Hyperparameters.input_bin": "data/fineweb10B/fineweb_train_*.bin"}),
])
def test_init_writes_a_commented_toml_with_the_launch_line(tmp_path, repo, launch, data, overrides):
    root = copy(repo, tmp_path)
    result = init(root, "--yes")
    assert result.exit_code == 0, result.output
    text = (root / "trainbridge.toml").read_text()
    parsed = tomllib.loads(text)
    assert parsed == {"launch": launch, "data": data}  # the [overrides] table is left commented
    assert "# [overrides]" in text and "ranked first because:" in text
    assert uncommented_overrides(text)["overrides"].items() >= overrides.items()
    assert f"wrote {root / 'trainbridge.toml'}" in result.output
    assert f"written; run `trainbridge measure {root}` to check it" in result.output
    assert "shrink it under [overrides]" in result.output
    size_key = next(key for key in overrides if key.endswith("batch_size"))
    shown = size_key if size_key.isidentifier() else f'"{size_key}"'
    assert f"{shown} = {overrides[size_key]}" in result.output  # the key to write, as written in the toml
    assert f"1. {launch}" in result.output and "why: " in result.output


def test_torchrun_lines_get_a_hint_for_smaller_machines(tmp_path):
    root = copy("modded_style", tmp_path)
    init(root, "--yes")
    assert "# torchrun with 8 processes per node: on a smaller machine lower --nproc_per_node" in \
        (root / "trainbridge.toml").read_text()


def test_init_refuses_to_overwrite_without_force(tmp_path):
    root = copy("llmc_style", tmp_path)
    (root / "trainbridge.toml").write_text('entry = "train:entry"\n')
    refused = init(root, "--yes")
    assert refused.exit_code == 2 and "already exists" in refused.output and "--force" in refused.output
    assert (root / "trainbridge.toml").read_text() == 'entry = "train:entry"\n'
    forced = init(root, "--yes", "--force")
    assert forced.exit_code == 0 and tomllib.loads((root / "trainbridge.toml").read_text())["launch"] == "python train_gpt2.py"


def test_no_training_script_exits_1_and_writes_nothing(tmp_path):
    root = copy("no_training", tmp_path)
    result = init(root, "--yes")
    assert result.exit_code == 1
    assert "no training script found" in result.output and "near miss: tag.py" in result.output
    assert not (root / "trainbridge.toml").exists()


def test_a_path_that_is_not_a_folder_is_bad_input(tmp_path):
    result = init(tmp_path / "missing", "--yes")
    assert result.exit_code == 2 and "is not a folder" in result.output


def test_asked_which_line_and_whether_to_write(tmp_path):
    root = copy("llmc_style", tmp_path)
    declined = init(root, input="2\nn\n")
    assert declined.exit_code == 0 and "nothing written" in declined.output and not (root / "trainbridge.toml").exists()
    chosen = init(root, input="2\ny\n")
    assert chosen.exit_code == 0, chosen.output
    launch = tomllib.loads((root / "trainbridge.toml").read_text())["launch"]
    assert launch.startswith("torchrun --standalone --nproc_per_node=4 train_gpt2.py")
    assert 'launch = "python train_gpt2.py"   # README.md:8' in (root / "trainbridge.toml").read_text()


def test_no_measure_skips_the_check(tmp_path):
    root = copy("nanogpt_style", tmp_path)
    result = init(root, "--yes", "--no-measure")
    assert result.exit_code == 0 and "trainbridge measure" not in result.output


def test_with_script_mode_the_check_goes_through_the_measure_path(tmp_path, monkeypatch):
    """Where the loader cannot read the written file, init says so and exits 0 (the file is written).
    Today's loader rejects `launch` itself; once script mode lands, tests of script mode measure."""
    from trainbridge.sandbox.workload import WorkloadConfig

    if "launch" in WorkloadConfig.model_fields:
        pytest.skip("script mode has landed: its own tests run `launch`; this checks the loader's refusal path")
    monkeypatch.setattr(init_cmd, "script_mode_available", lambda: True)
    root = copy("nanogpt_style", tmp_path)
    result = init(root, "--yes")
    assert result.exit_code == 0, result.output
    assert "written, but it does not load yet" in result.output and "launch" in result.output
    assert (root / "trainbridge.toml").exists()


def test_a_check_that_fails_exits_1_with_its_cause_and_keeps_the_file(tmp_path, monkeypatch):
    """The toml is written, but its own check did not pass: exit 1 (as `measure` does for a failed run), with the
    one-line cause. A tiny script that stops before its first step; one real check (a sandbox child, a few seconds)."""
    from trainbridge.sandbox.workload import WorkloadConfig

    if "launch" not in WorkloadConfig.model_fields:
        pytest.skip("no script mode: init cannot check a launch line")
    monkeypatch.setattr(init_cmd, "script_mode_available", lambda: True)
    root = tmp_path / "broken"
    root.mkdir()
    (root / "README.md").write_text("```\npython train.py\n```\n")
    (root / "train.py").write_text(
        "import torch\n\nif __name__ == \"__main__\":\n    model = torch.nn.Linear(2, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    raise ValueError(\"the shards are not prepared\")\n"
        "    for _ in range(10):\n        model(torch.ones(2)).sum().backward()\n        opt.step()\n")
    result = init(root, "--yes")
    assert result.exit_code == 1, result.output
    assert "the check failed" in result.output
    cause = [line for line in result.output.splitlines() if line.startswith("cause: ")]
    assert len(cause) == 1 and "ValueError: the shards are not prepared" in cause[0], result.output
    assert tomllib.loads((root / "trainbridge.toml").read_text())["launch"] == "python train.py"  # written all the same


def test_init_is_listed_by_help():
    result = CliRunner().invoke(build_app(), ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and re.search(r"init\s+Find the training script", result.output)
