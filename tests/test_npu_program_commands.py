"""`init` and `analyze` on a program that imports torch_npu (a ported one) on a host without an NPU (issue 25,
item 3): both run it on the npu backend, the torch_npu emulation here, and say so, as `measure` does
(tests/test_cli.py). init's check ran every script on the CPU backend and stopped at `No module named 'torch_npu'`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainbridge.graph.cli.app import build_app
from trainbridge.sandbox.backends import npu_emulated

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"

_SCRIPT = textwrap.dedent('''
    """A ported training script: it imports torch_npu and trains on the npu device."""
    import torch
    import torch_npu  # noqa: F401
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).npu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8).npu(), torch.randn(32, 1).npu()
    for step in range(20):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
''')


def test_init_checks_a_torch_npu_program_on_the_npu_backend_and_says_so(tmp_path):
    repo = tmp_path / "ported"
    repo.mkdir()
    (repo / "train.py").write_text(_SCRIPT)
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "port"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    result = CliRunner().invoke(build_app(), ["init", str(repo), "--yes"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert tomllib.loads((repo / "trainbridge.toml").read_text())["launch"] == "python train.py"
    assert "imports torch_npu: it runs on the npu backend" in result.output
    assert "on the npu backend" in result.output and "it runs: median step" in result.output, result.output
    assert "No module named 'torch_npu'" not in result.output
    if npu_emulated():
        assert "CPU emulation of torch_npu" in result.output and "speed unmeasured" in result.output


def test_analyze_profiles_a_torch_npu_program_on_the_npu_backend_and_says_so():
    if not npu_emulated():
        pytest.skip("an NPU is here: no emulation to speak of")
    # --static: the backend is chosen and said before anything runs (the eager profile on the emulated npu is the
    # NPU run's own, tested with `run --target npu`)
    done = subprocess.run([sys.executable, "-m", "trainbridge", "analyze", str(WORKLOADS / "tiny_npu"), "--static"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imports torch_npu: it runs on the npu backend" in done.stderr
    assert "CPU emulation of torch_npu" in done.stderr and "speed unmeasured" in done.stderr
