"""Where a script-mode step's loss comes from (sandbox/script/loss.py): backward's scalars, GradScaler's scaling undone,
or the loss the program prints (loss_pattern), and the measurement saying which (each test runs real children)."""

from __future__ import annotations

import re

import pytest

from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.script.loss import LoggedLoss, OutputWatch
from trainbridge.sandbox.workload import load_workload
from script_repos import script_repo, stdout_lines

TOML = 'launch = "python train.py {mode}"\nwarmup_steps = 1\nsteps = 2\ntimeout_s = 120\n'


def _printed(result, prefix: str, group: str) -> list[float]:
    return [float(re.search(group, line).group(1)) for line in stdout_lines(result, prefix)]


def _run(tmp_path, mode: str, extra: str = ""):
    repo = script_repo(tmp_path / "repo", "logged_loss.py", TOML.format(mode=mode) + extra)
    result = run_workload(load_workload(repo))
    assert result.ok, (result.failure, result.stderr_tail[-2000:])
    return result, [*result.losses, *result.cooldown_losses]


def test_the_default_pattern_reads_the_usual_forms_and_the_last_match_of_a_step_wins():
    logged = LoggedLoss(r"loss[=: ]+(?P<loss>[-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)", preferred=False)
    for line, value in (("iter 3: loss 1.234, time 5ms", 1.234), ("loss: 0.5", 0.5), ("train loss=2e-3", 0.002)):
        logged.read_line(line)
        assert logged.take() == value
    assert logged.take() is None  # nothing printed since
    stream = OutputWatch(_Sink(), logged)
    stream.write("step 1 loss: 3.0\nstep 1 lo")
    stream.write("ss: 4.5\n")
    assert logged.take() == 4.5 and stream.sink.text == "step 1 loss: 3.0\nstep 1 loss: 4.5\n"


class _Sink:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text
        return len(text)

    @property
    def sink(self):
        return self


def test_a_loss_scaled_by_gradscaler_is_measured_unscaled(tmp_path):
    result, losses = _run(tmp_path, "scaler")
    printed = _printed(result, "step ", r"loss: (\S+)")
    assert len(printed) == len(losses) == 4
    assert losses == pytest.approx(printed, abs=2e-6)  # not 1024 times the loss
    assert result.extra["script"]["loss_sources"] == {"backward-unscaled": 4}


def test_without_a_scalar_backward_the_printed_loss_is_the_fallback(tmp_path):
    result, losses = _run(tmp_path, "weighted")
    assert losses == pytest.approx(_printed(result, "step ", r"loss: (\S+)"), abs=2e-6)
    assert result.extra["script"]["loss_sources"] == {"pattern": 4}


def test_a_pattern_of_the_tomls_own_is_the_source_of_every_step(tmp_path):
    result, losses = _run(tmp_path, "scaler", "loss_pattern = 'ema (?P<loss>\\S+)'\n")
    assert losses == pytest.approx(_printed(result, "ema ", r"ema (\S+)"), abs=2e-6)
    assert result.extra["script"]["loss_sources"] == {"pattern": 4}


def test_a_pattern_without_its_loss_group_is_refused_before_the_run(tmp_path):
    repo = script_repo(tmp_path / "repo", "logged_loss.py", TOML.format(mode="scaler") + "loss_pattern = 'ema (\\S+)'\n")
    result = run_workload(load_workload(repo))
    assert result.failure is not None and result.failure.kind == "bad_workload"
    assert "(?P<loss>...)" in result.failure.message and "loss_pattern" in result.failure.message


def test_measure_says_where_the_losses_came_from(tmp_path):
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    repo = script_repo(tmp_path / "repo", "logged_loss.py", TOML.format(mode="weighted"))
    result = CliRunner().invoke(build_app(), ["measure", str(repo)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert re.search(r"loss from\s+│?\s*pattern \(4 steps\)", result.output), result.output


class _Channel:
    """The parent's side of the control channel, in process: every command is `step`."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return {"op": "step", "index": len(self.sent)}


class _Backend:
    def sync(self):
        return None


def test_a_backward_on_a_bare_leaf_is_no_step_and_no_loss():
    """The Modded-NanoGPT records run `torch.empty(1, device="cuda", requires_grad=True).backward()` at import ("prevents a
    bug on some systems"): a backward on a leaf, uninitialised memory. Counted as the first step's loss it added
    garbage to it (22400 measured as 9.3e14 at one thread, 22400 at two: the late records' first losses were not
    repeatable), and it started the first step before the model was built."""
    import torch

    from trainbridge.sandbox.script.hooks import StepController

    channel = _Channel()
    controller = StepController(channel, _Backend(), check_ready=lambda: [], close=lambda failure: None)
    leaf = torch.full((1,), 3.0e30, requires_grad=True)  # what an uninitialised torch.empty may hold
    controller.on_backward(leaf)
    controller.on_backward([leaf])  # torch.autograd.backward's form
    assert not controller.started and channel.sent == [] and controller.loss_parts == []

    weight = torch.nn.Parameter(torch.tensor([2.0]))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for value in (5.0, 7.0):
        loss = (weight * value).sum()
        controller.on_backward(loss)
        controller.on_optimizer_pre(optimizer, (), {})
    assert [m["op"] for m in channel.sent] == ["ready", "step"]
    assert channel.sent[1]["loss"] == pytest.approx(10.0)  # the first step's loss: 2 * 5, no leaf in it
    assert controller._take_loss() == pytest.approx(14.0)
