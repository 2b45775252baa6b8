"""Script mode on the shapes the manual trials on public repositories met (issue 12).

Each program here is written for this test, in the style that broke a trial; no public code.
"""

from __future__ import annotations

import sys
import textwrap
import tomllib
from pathlib import Path

from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.script.launch import parse_launch, single_torchrun_env, torchrun_options
from trainbridge.sandbox.script.overrides import OverridePlan, compile_source, install
from trainbridge.sandbox.script.run import launch_problem
from trainbridge.sandbox.workload import Workload, WorkloadConfig
from trainbridge.tools.launch.init_toml import render_toml
from trainbridge.tools.launch.discovery import discover_launch

# A script that names its data by bare file names joined to a folder at run time
# (`os.path.join(data_dir, "train.bin")`), and a checkpoint it writes itself; `.gitignore` ignores
# the extensions only, so no folder of the path is ignored as such.
JOINED_NAMES = {
    ".gitignore": "*.bin\n*.pkl\n*.pt\n",
    "README.md": "```sh\npython train.py\n```\n",
    "train.py": """
        import os
        import pickle
        import numpy as np
        import torch

        dataset = "tiny"
        out_dir = "out"
        data_dir = os.path.join("data", dataset)
        with open(os.path.join(data_dir, "meta.pkl"), "rb") as f:
            vocab_size = pickle.load(f)["vocab_size"]
        tokens = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
        model = torch.nn.Embedding(vocab_size, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        while True:
            x = torch.from_numpy(tokens[:8].astype(np.int64))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.save(model.state_dict(), os.path.join(out_dir, "ckpt.pt"))
        """,
    "data/tiny/prepare.py": "print('would download')\n",
}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_bare_data_names_joined_to_a_folder_are_found_where_they_lie(tmp_path):
    repo = write(tmp_path, JOINED_NAMES)
    (repo / "data/tiny/train.bin").write_bytes(b"\0" * 32)
    (repo / "data/tiny/meta.pkl").write_bytes(b"x")
    found = discover_launch(repo)
    # the prepared files by their paths (bare names would be missing from every run's mirror)
    assert sorted(found.data_paths) == ["data/tiny/meta.pkl", "data/tiny/train.bin"]
    assert found.data_missing == ["ckpt.pt"]  # written by the script: nowhere yet, left out
    config = tomllib.loads(render_toml(found, found.best))
    assert config["data"] == found.data_paths


def test_bare_data_names_prepared_nowhere_are_left_out_and_named(tmp_path):
    repo = write(tmp_path, JOINED_NAMES)
    found = discover_launch(repo)
    assert found.data_paths == []
    assert sorted(found.data_missing) == ["ckpt.pt", "meta.pkl", "train.bin"]
    text = render_toml(found, found.best)
    assert "data" not in tomllib.loads(text)  # a data entry that does not exist would stop every run
    assert "nowhere in the repository yet" in text and ", ".join(found.data_missing) in text


def test_a_bare_name_at_the_root_stays_as_it_is(tmp_path):
    files = dict(JOINED_NAMES)
    files["train.py"] = files["train.py"].replace('os.path.join(data_dir, "train.bin")', '"train.bin"')
    repo = write(tmp_path, files)
    (repo / "train.bin").write_bytes(b"\0" * 32)
    (repo / "data/tiny/train.bin").write_bytes(b"\0" * 32)  # same name elsewhere: the root's copy is the one read
    found = discover_launch(repo)
    assert "train.bin" in found.data_paths
    assert "data/tiny/train.bin" not in found.data_paths


# --- a configurator that runs a config file into the script's globals (nanoGPT's idiom) ----------

CONFIGURED = """
    batch_size = 12
    n_layer = 12
    device = "cuda"
    exec(open(CONFIGURATOR).read())
    derived = batch_size * 2
    """

CONFIGURATOR = """
    import sys
    for arg in sys.argv[1:]:
        if "=" not in arg:
            exec(open(arg).read())  # a config file, e.g. config/train_shakespeare_char.py
        else:
            key, val = arg.removeprefix("--").split("=")
            globals()[key] = type(globals()[key])(val)
    """


def _run_configured(tmp_path, monkeypatch, overrides: dict, argv: list[str]) -> dict:
    (tmp_path / "configurator.py").write_text(textwrap.dedent(CONFIGURATOR))
    (tmp_path / "big.py").write_text("batch_size = 64\nn_layer = 6\n")
    monkeypatch.setattr(sys, "argv", ["train.py", *[str(tmp_path / a) if a.endswith(".py") else a for a in argv]])
    plan = OverridePlan.from_overrides(overrides)
    install(Path("/nonexistent-root"), OverridePlan())  # the call helper only
    namespace = {"__name__": "__main__", "CONFIGURATOR": str(tmp_path / "configurator.py")}
    exec(compile_source(textwrap.dedent(CONFIGURED), "train.py", plan, is_script=True), namespace)
    assert plan.unmatched() == []
    return namespace


def test_a_constant_override_survives_a_config_file_run_by_exec(tmp_path, monkeypatch):
    # the config file sets batch_size = 64 after the script's own 12: the override must still win
    namespace = _run_configured(tmp_path, monkeypatch, {"batch_size": 4, "device": "cpu"}, ["big.py"])
    assert (namespace["batch_size"], namespace["device"], namespace["derived"]) == (4, "cpu", 8)
    assert namespace["n_layer"] == 6  # not overridden: the config file's value, as without TrainBridge


def test_a_constant_override_wins_over_a_key_value_argument_too(tmp_path, monkeypatch):
    namespace = _run_configured(tmp_path, monkeypatch, {"n_layer": 2}, ["big.py", "--n_layer=3", "--batch_size=5"])
    assert (namespace["n_layer"], namespace["batch_size"]) == (2, 5)


def test_without_overrides_the_config_file_decides(tmp_path, monkeypatch):
    namespace = _run_configured(tmp_path, monkeypatch, {}, ["big.py"])
    assert (namespace["batch_size"], namespace["n_layer"], namespace["device"]) == (64, 6, "cuda")


# --- a record launched only by torchrun, reading RANK / LOCAL_RANK / WORLD_SIZE (Modded-NanoGPT's shape) ---


def test_torchrun_with_one_process_is_one_process_and_more_are_refused():
    one = parse_launch("torchrun --standalone --nproc_per_node=1 train_gpt.py --x=1")
    assert (one.launcher, one.script, one.args, one.multi_process) == ("torchrun", "train_gpt.py", ["--x=1"], False)
    assert not parse_launch("torchrun --nproc-per-node 1 train_gpt.py").multi_process
    assert not parse_launch("torchrun train_gpt.py").multi_process  # torchrun's default: one process per node
    assert parse_launch("torchrun --standalone --nproc_per_node=8 train_gpt.py").multi_process
    assert parse_launch("torchrun --nproc_per_node 2 train_gpt.py").multi_process
    assert parse_launch("torchrun --nnodes=2 --nproc_per_node=1 train_gpt.py").multi_process
    assert torchrun_options(["--standalone", "--nproc-per-node", "4", "--master_port=29500"]) == \
        {"standalone": "", "nproc_per_node": "4", "master_port": "29500"}


def test_the_environment_of_one_torchrun_worker_lets_a_process_group_form():
    env = single_torchrun_env(29517)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}


TORCHRUN_ONLY = """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # env:// : needs torchrun's variables
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert (rank, world, dist.get_world_size()) == (0, 1, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        loss = model(torch.ones(8, 4) * (step % 3)).pow(2).mean()
        dist.all_reduce(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    """


def test_a_script_that_needs_torchrun_runs_as_one_torchrun_process(tmp_path):
    repo = write(tmp_path / "repo", {"train_gpt.py": TORCHRUN_ONLY})
    workload = Workload(root=repo, config=WorkloadConfig(launch="torchrun --standalone --nproc_per_node=1 train_gpt.py",
                                                         warmup_steps=1, steps=3, timeout_s=60))
    assert launch_problem(workload) is None
    result = run_workload(workload, backend="cpu")
    assert result.failure is None, result.failure
    assert len(result.inner_step_times_s) >= 3  # warm-up, measured and cool-down steps all stepped


def test_a_program_the_script_runs_that_is_not_installed_is_named_as_a_program():
    import subprocess

    from trainbridge.sandbox.script.launcher import missing_file_message

    try:
        subprocess.run(["trainbridge-no-such-program-smi"], stdout=subprocess.PIPE)
    except FileNotFoundError as exc:
        message = missing_file_message(exc)
    assert "a program that is not installed here: 'trainbridge-no-such-program-smi'" in message
    assert '"run(executable)" = "/bin/true"' in message
    try:
        open("/nonexistent-trainbridge/meta.pkl")
    except FileNotFoundError as exc:
        assert "data = [...]" in missing_file_message(exc)  # a data file keeps the data advice


def test_live_object_scans_skip_weak_proxies_whose_object_is_gone():
    # torch.compile's and DDP's caches keep weakref proxies alive; isinstance on a dead one raises ReferenceError,
    # which lost the eager profile of a torch.compile'd record ("returned no eager_ops")
    import weakref

    import torch

    from trainbridge.sandbox.script.hooks import _instances

    class Holder:
        pass

    held = Holder()
    dead = weakref.proxy(held)
    del held
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _instances([dead, model, optimizer], torch.optim.Optimizer) == [optimizer]
    assert _instances([dead, model, optimizer], torch.nn.Module) == [model]


# --- the [overrides] keys init suggests: what the launcher matches, not only the bare name -----------

RECORD_STYLE = {
    "train_gpt.py": """
        from dataclasses import dataclass
        import torch

        @dataclass
        class Hyperparameters:
            batch_size : int = 8*64
            sequence_length : int = 1024

        @dataclass
        class GPTConfig:
            n_layer : int = 12
            n_embd : int = 768

        args = Hyperparameters()
        config = GPTConfig(n_layer=12, n_embd=768)
        model = torch.nn.Linear(config.n_embd, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        while True:
            loss = model(torch.randn(args.batch_size, config.n_embd)).mean()
            loss.backward()
            opt.step()
        """,
}


def test_suggested_override_keys_name_the_dataclass_and_the_call_that_passes_a_field(tmp_path):
    found = discover_launch(write(tmp_path, RECORD_STYLE))
    keys = {s.name: s.key for s in found.settings}
    assert keys["batch_size"] == "Hyperparameters.batch_size"
    assert keys["n_layer"] == "GPTConfig(n_layer)"  # passed explicitly: a class-attribute override would change nothing
    text = render_toml(found, found.best)
    hints = [line[2:] for line in text.splitlines() if line.startswith('# "')]
    assert any(h.startswith('"Hyperparameters.batch_size"') and "# batch_size: dataclass field" in h for h in hints), hints
    assert any(h.startswith('"GPTConfig(n_layer)"') for h in hints), hints  # each hint line starts with the key to write
    # the suggested keys are what the launcher matches
    plan = OverridePlan.from_overrides({"Hyperparameters.batch_size": 4, "GPTConfig(n_layer)": 2})
    install(Path("/nonexistent-root"), OverridePlan())
    namespace: dict = {"__name__": "not_main"}
    source = textwrap.dedent(RECORD_STYLE["train_gpt.py"]).split("while True:")[0]
    exec(compile_source(source, "train_gpt.py", plan, is_script=True), namespace)
    assert plan.unmatched() == []
    assert (namespace["args"].batch_size, namespace["config"].n_layer) == (4, 2)


def test_a_download_at_start_is_explained_as_the_sandbox_having_no_network():
    # llm.c's train_gpt2.py calls tiktoken.get_encoding("gpt2") first: a chained requests/urllib3 error
    from trainbridge.sandbox.script.launcher import network_message

    class NameResolutionError(OSError):
        pass

    class ConnectionError(OSError):  # noqa: A001 - the name the HTTP library gives it is what is matched
        pass

    try:
        try:
            raise NameResolutionError("Failed to resolve 'example.invalid'")
        except NameResolutionError as inner:
            raise ConnectionError("Max retries exceeded with url: /gpt-2/encodings/main/vocab.bpe") from inner
    except ConnectionError as exc:
        message = network_message(exc)
    assert message is not None and "the sandbox has none" in message and "vocab.bpe" in message
    assert "data = [...]" in message
    assert network_message(ValueError("bad shape")) is None
