"""The command line, run as a real subprocess of the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def trainbridge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainbridge", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_and_explains_commands():
    result = trainbridge("--help")
    assert result.returncode == 0
    assert "measure" in result.stdout and "Run a workload's training step" in result.stdout


def test_measure_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "result.json"
    result = trainbridge("measure", str(WORKLOADS / "tiny"), "--steps", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "median step" in result.stdout
    payload = json.loads(out.read_text())
    assert len(payload["step_times_s"]) == 2 and payload["failure"] is None


def test_json_to_stdout_is_all_that_stdout_holds():
    """Issue 27: `--json -` printed the table before the JSON, so stdout did not parse."""
    result = trainbridge("measure", str(WORKLOADS / "tiny"), "--steps", "2", "--json", "-")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)  # nothing else on stdout
    assert len(payload["step_times_s"]) == 2 and "median step" in result.stderr  # the table went to stderr


def test_a_program_that_imports_torch_npu_is_measured_on_the_npu_backend_and_says_where(tmp_path):
    """Issue 25: `measure` of a ported program stopped at `No module named 'torch_npu'` (the CPU backend), with no
    word of the emulation that `run --target npu` uses."""
    from trainbridge.sandbox.backends import npu_emulated

    out = tmp_path / "result.json"
    result = trainbridge("measure", str(WORKLOADS / "tiny_npu"), "--steps", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "imports torch_npu: it runs on the npu backend" in result.stderr
    assert json.loads(out.read_text())["backend"] == "npu"
    if npu_emulated():
        assert "CPU emulation of torch_npu" in result.stderr and "speed unmeasured" in result.stderr
        assert "speed measured on this machine" not in result.stderr
    forced = trainbridge("measure", str(WORKLOADS / "tiny_npu"), "--steps", "1", "--backend", "cpu")
    assert "imports torch_npu" not in forced.stderr  # asked for: no guess


def test_measure_reports_failures_with_exit_code_1_and_bad_input_with_2():
    failed = trainbridge("measure", str(WORKLOADS / "nan"))
    assert failed.returncode == 1 and "nonfinite_loss" in failed.stderr
    bad = trainbridge("measure", str(WORKLOADS / "bad_key"))
    assert bad.returncode == 2 and "unknown key 'setps'" in bad.stderr
    unknown = trainbridge("measure", "no_such_example")
    assert unknown.returncode == 2 and "bundled" in unknown.stderr


def test_demo_uses_a_knowledge_base_of_its_own_unless_told(tmp_path, monkeypatch):
    """The demo's verdicts must not land in the user's knowledge base: by default it gets a fresh one
    beside the demo repository; --kb-dir / --kb-url choose another. (The loop itself is stubbed: a
    demo runs for 13 minutes.)"""
    from typer.testing import CliRunner

    from trainbridge.graph import runs
    from trainbridge.graph.cli.app import build_app

    seen = []

    def fake_start_run(config, **kwargs):
        seen.append(config)
        return runs.RunOutcome(config.run_id, True, None, {"run_branch": f"trainbridge/{config.run_id}", "stop_reason": "stub"})

    monkeypatch.setattr(runs, "start_run", fake_start_run)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    app = build_app()
    assert CliRunner().invoke(app, ["demo", "llama_pretrain"]).exit_code == 0
    own = Path(seen[-1].kb_dir)
    assert own.parent == Path(seen[-1].repo).parent and own.name == "kb" and seen[-1].kb_url is None
    assert own != tmp_path / "home" / "kb"  # not the user's default
    assert CliRunner().invoke(app, ["demo", "llama_pretrain", "--kb-dir", str(tmp_path / "mine")]).exit_code == 0
    assert seen[-1].kb_dir == str((tmp_path / "mine").resolve())
    assert CliRunner().invoke(app, ["demo", "llama_pretrain", "--kb-url", "http://kb-host:8000"]).exit_code == 0
    assert seen[-1].kb_url == "http://kb-host:8000" and seen[-1].kb_dir is None
    for config in seen:  # the demo's temporary repositories
        shutil.rmtree(Path(config.repo).parent, ignore_errors=True)


def test_version_and_bad_run_options_get_one_line_naming_the_option(tmp_path):
    """Issue 27: `--version`; `--target` lists its choices; a bad value names its option in one line, without
    pydantic's field paths or links. Nothing of a run is created for bad input."""
    from importlib.metadata import version

    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    app, runner = build_app(), CliRunner()
    shown = runner.invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output.strip() == f"trainbridge {version('trainbridge')}"
    assert "<cpu|cuda|npu>" in runner.invoke(app, ["run", "--help"], terminal_width=200).output
    bad_target = runner.invoke(app, ["run", str(tmp_path), "--target", "banana"])
    assert bad_target.exit_code == 2 and "'--target'" in bad_target.output and "'cpu', 'cuda', 'npu'" in bad_target.output
    bad_gain = runner.invoke(app, ["run", str(tmp_path), "--min-gain", "5"])
    assert bad_gain.exit_code == 2 and "--min-gain: Input should be less than 1" in bad_gain.output
    assert "pydantic" not in bad_gain.output and "validation error" not in bad_gain.output
    bad_budget = runner.invoke(app, ["run", str(tmp_path), "--budget", "banana"], terminal_width=200)
    assert bad_budget.exit_code == 2 and "Invalid value for --budget: 'banana' is not a duration" in bad_budget.output


def test_noisy_step_times_get_a_word_and_steady_ones_none():
    """Issue 27: `measure` printed p10/p90 of 2854/9375 ms without a word about a busy machine."""
    from trainbridge.graph.cli.workload import busy_note
    from trainbridge.sandbox.results import RunResult

    noisy = RunResult(mode="entry", backend="cpu", device="cpu", seed=0, threads=2, warmup_steps=1, step_times_s=[2.8, 2.9, 9.4, 9.3, 3.0])
    note = busy_note(noisy, load=5.2, cores=2)
    assert note.startswith("the step times varied a lot (p90 is 3.") and "load average 5.2 on 2 cores" in note
    assert "busy" not in busy_note(noisy, load=0.5, cores=2)
    steady = RunResult(mode="entry", backend="cpu", device="cpu", seed=0, threads=2, warmup_steps=1, step_times_s=[1.0, 1.05, 1.1, 0.98])
    assert busy_note(steady, load=5.2, cores=2) is None
