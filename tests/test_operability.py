"""Issue 27's operability symptoms that no other test file held: `serve` stopped by a signal sent to it alone, help
text that keeps its brackets, bad input named in one line, and a dirty tree. (The audit:
benchmarks/results/2026-12-04-operability-audit.md.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainbridge.sandbox import proc_watch

FAKE_SERVER = r"""
import os, signal, sys, time
from pathlib import Path
marks = Path(os.environ["FAKE_SERVER_MARKS"])
def stop(signum, frame):
    (marks / "stopped").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
(marks / "pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])  # SIGTERM takes the same path
def test_serve_stops_its_server_on_a_signal_sent_to_it_alone(tmp_path, signum):
    """Issue 27: `serve` sent SIGINT left `langgraph dev` serving. The server here is a stand-in `langgraph_cli` (a real
    process that records the signal it got) first on PYTHONPATH; the signal goes to serve's pid only, as `kill` sends it."""
    fake = tmp_path / "fake" / "langgraph_cli"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_SERVER)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "FAKE_SERVER_MARKS": str(marks), "TRAINBRIDGE_HOME": str(tmp_path / "home")}
    port = _free_port()
    log = tmp_path / "serve.log"  # a file, not a pipe: a server left running would hold a pipe open and hang the read
    with log.open("wb") as out:
        serve = subprocess.Popen([sys.executable, "-m", "trainbridge", "serve", "--port", str(port)], env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        deadline = time.monotonic() + 60
        while not (marks / "pid").is_file() and time.monotonic() < deadline and serve.poll() is None:
            time.sleep(0.1)
        assert (marks / "pid").is_file(), log.read_text()[-2000:]
        server = int((marks / "pid").read_text())
        os.kill(serve.pid, signum)  # to serve alone, not its group
        code = serve.wait(timeout=30)
        output = log.read_text()
        assert (marks / "stopped").read_text() == "SIGINT", output  # asked to shut down as Ctrl-C does
        assert not proc_watch.alive(server), output
        assert code == (0 if signum == signal.SIGINT else 128 + signum), output
        assert f"stopping the LangGraph server (pid {server})" in output
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        if server and proc_watch.alive(server):
            os.kill(server, signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _commands(app):
    """(name, click command) of every command and sub-command of the app."""
    import typer.main

    root = typer.main.get_command(app)
    found = []
    for name, command in root.commands.items():
        found.append((name, command))
        for sub_name, sub in getattr(command, "commands", {}).items():
            found.append((f"{name} {sub_name}", sub))
    return found


def test_help_text_keeps_every_bracketed_word():
    """Issue 27: rich markup ate `[team]` and `[overrides]` in --help. Every bracketed word of a help text (an option's,
    an argument's, a command's own) must show in that command's --help as written."""
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    app, runner = build_app(), CliRunner()
    checked = 0
    for name, command in _commands(app):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        words = {w for text in texts for w in re.findall(r"\[[A-Za-z_][A-Za-z0-9_.-]*\]", text.replace("\\[", "["))}
        if not words:
            continue
        shown = re.sub(r"\s*│\s*", " ", runner.invoke(app, [*name.split(), "--help"], terminal_width=400).output)
        for word in words:
            assert word in shown, f"`trainbridge {name} --help` lost {word}"
            checked += 1
    assert checked >= 2  # trainbridge[team] (run --ray), [overrides] (init)


def test_bad_devices_and_a_reviewed_run_on_devices_are_one_line_naming_the_option(tmp_path):
    """Issue 27: `--devices gpu:9` and `--review --devices cpu:2` printed pydantic's internals."""
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    app, runner = build_app(), CliRunner()
    env = {"TRAINBRIDGE_HOME": str(tmp_path / "home")}
    bad = runner.invoke(app, ["run", str(tmp_path), "--devices", "gpu:9"], env=env)
    assert bad.exit_code == 2 and bad.output.count("\n") == 1, bad.output
    assert bad.output.startswith("--devices: 'gpu:9': expected cpu:N") and "--devices: --devices" not in bad.output
    reviewed = runner.invoke(app, ["run", str(tmp_path), "--review", "--devices", "cpu:2"], env=env)
    assert reviewed.exit_code == 2 and reviewed.output.startswith("--review pauses at every patch"), reviewed.output
    for output in (bad.output, reviewed.output):
        assert "pydantic" not in output and "validation error" not in output and "the settings:" not in output
    assert not (tmp_path / "home" / "runs").exists()  # nothing of a run for bad input
    unknown = runner.invoke(app, ["verify", "no-such-run"], env=env)  # bad input is 2 in every command (verify said 1)
    assert unknown.exit_code == 2 and unknown.output.count("\n") == 1, unknown.output


def test_a_dirty_tree_is_said_before_the_run(tmp_path):
    """Issue 27: a dirty working tree was ignored without a word (the run uses HEAD): the preflight's notes say so."""
    from trainbridge.graph.preflight import check_run_input
    from trainbridge.graph.state import RunConfig
    from trainbridge.tests.loop_fixtures import add_user_changes, make_loop_repo

    repo = make_loop_repo(tmp_path / "repo")
    assert not any("not part of the run" in n for n in check_run_input(RunConfig(repo=str(repo), run_id="a", unconfined=True)))
    add_user_changes(repo)
    notes = check_run_input(RunConfig(repo=str(repo), run_id="b", unconfined=True))
    assert any("1 changed, 1 untracked" in n and "not part of the run" in n for n in notes), notes


SMALL_TOML = 'entry = "train:trainbridge_entry"\nwarmup_steps = 1\nsteps = 2\nthreads = 1\ntimeout_s = 120\n'


HOLD = """

import os as _os
import time as _time

_HOLD, _entry = {hold!r}, trainbridge_entry


def trainbridge_entry(device, seed):
    started = _time.monotonic()
    while _os.path.exists(_HOLD) and _time.monotonic() - started < 100:  # the test interrupts the baseline here
        _time.sleep(0.2)
    return _entry(device, seed)
"""


def _small_loop_repo(path: Path, hold: Path | None = None) -> Path:
    """The loop workload (a hand-written GELU and RMSNorm: intents with recipes) at a tenth of its width, two steps;
    with `hold`, each child waits at its entry while that file exists (the baseline is still being measured when a
    test interrupts it, however fast this host is)."""
    from trainbridge.tests.loop_fixtures import REPO_FIXTURE, git

    import shutil

    shutil.copytree(REPO_FIXTURE, path, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (path / "trainbridge.toml").write_text(SMALL_TOML, encoding="utf-8")
    train = path / "train.py"
    train.write_text(train.read_text(encoding="utf-8").replace("HIDDEN = 4096", "HIDDEN = 256")
                     + (HOLD.format(hold=str(hold)) if hold is not None else ""), encoding="utf-8")
    (path / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    git(path, "init", "-q", "--initial-branch=main")
    git(path, "-c", "user.name=t", "-c", "user.email=t@example.com", "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "small loop workload")
    return path


def _descendants(root: int) -> list[int]:
    """Every live process below `root`, and the members of the sessions they lead (sandbox children lead their own)."""
    from trainbridge.sandbox.termination import sandbox_processes

    return sandbox_processes(root)


def test_a_run_interrupted_twice_ends_every_process_says_how_to_resume_and_resumes_within_its_budget(tmp_path, monkeypatch):
    """Issue 27, with real processes: `status` of a run in flight reads running with its pid; two Ctrl-C 0.5 s apart
    during the baseline end every process below the run (they left the user's script running under init), print the
    resume line at once, and exit 130; `resume` does not count the time the run was down and holds the budget before
    the first candidate (nothing asked the budget before a candidate: `--budget 6m` took 13 min)."""
    import json

    from trainbridge.graph.cli.loop import run_condition
    from trainbridge.graph.runs import run_status
    from trainbridge.sandbox.confinement import bubblewrap

    hold = tmp_path / "hold"  # the baseline's child waits while it exists: the interrupt lands in the baseline
    hold.touch()
    repo = _small_loop_repo(tmp_path / "repo", hold)
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    env = {**os.environ, "TRAINBRIDGE_HOME": str(tmp_path / "home")}
    if not bubblewrap().usable:
        env["TRAINBRIDGE_UNCONFINED"] = "1"
    tb = [sys.executable, "-m", "trainbridge"]
    log = tmp_path / "home" / "runs" / "op" / "run.log"
    err = tmp_path / "run.err"  # files, not pipes: a process left running would hold a pipe open and hang the read
    with err.open("wb") as errors:
        cli = subprocess.Popen([*tb, "run", str(repo), "--run-id", "op", "--no-reference", "--budget", "2s", "--final-rounds",
                                "0", "--kb-dir", str(tmp_path / "kb")], env=env, stdout=subprocess.DEVNULL, stderr=errors,
                               start_new_session=True)
    below: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while cli.poll() is None and time.monotonic() < deadline and not (
                log.is_file() and "measuring the baseline step" in log.read_text() and _descendants(cli.pid)):
            time.sleep(0.2)
        assert cli.poll() is None, err.read_text()[-3000:]
        condition = run_condition(run_status("op"), "op")  # as `status` reads it, in this process
        assert condition.startswith(f"running (pid {cli.pid})"), condition
        below = _descendants(cli.pid)
        assert below, "no sandbox process below the run"
        cli.send_signal(signal.SIGINT)
        time.sleep(0.5)
        cli.send_signal(signal.SIGINT)
        code = cli.wait(timeout=60)
        stderr = err.read_text()
        assert code == 130, stderr[-3000:]
        assert "interrupted (Ctrl-C): ending its sandbox processes" in stderr
        assert "continue it with `trainbridge resume op`" in stderr
        time.sleep(0.5)
        assert [pid for pid in below if proc_watch.alive(pid)] == [], stderr[-3000:]
    finally:
        hold.unlink(missing_ok=True)
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
        for pid in below:
            if proc_watch.alive(pid):
                os.kill(pid, signal.SIGKILL)
    resumed = subprocess.run([*tb, "resume", "op", "--json", "-"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads(resumed.stdout)
    assert record["condition"] == "finished" and record["candidates_tried"] == 0 and record["intents_left"] > 0, record
    assert record["stop_reason"] == "time budget spent" and "not starting a candidate" in resumed.stderr
    assert "min used before the stop (the time it was down is not counted" in resumed.stderr


def test_a_run_ended_by_sigterm_prints_its_resume_line_too(tmp_path, monkeypatch):
    """Ctrl-C printed the resume line, SIGTERM (a scheduler's stop, `kill`) did not."""
    from typer.testing import CliRunner

    from trainbridge.graph import runs
    from trainbridge.graph.cli import loop
    from trainbridge.graph.cli.app import build_app
    from trainbridge.sandbox.termination import Terminated
    from trainbridge.tests.loop_fixtures import make_loop_repo

    def terminated(config, **kwargs):
        raise Terminated()

    said: list[str] = []
    monkeypatch.setattr(runs, "start_run", terminated)
    monkeypatch.setattr(loop, "_error", said.append)
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "repo")
    with pytest.raises(Terminated):  # on to sandbox/termination.py, which ends the processes and exits 143
        CliRunner().invoke(build_app(), ["run", str(repo), "--run-id", "termed", "--unconfined"], catch_exceptions=False)
    assert said == ["run termed interrupted; its last checkpoint is kept: continue it with `trainbridge resume termed`"]


def test_the_readme_commands_table_gives_every_commands_exit_codes_and_json():
    """Issue 27's done-when: the README's commands table documents exit codes and --json. Every row says its exit codes
    (or whose it shares), and every command that takes --json names it as `--json FILE|-` in its row."""
    from trainbridge.graph.cli.app import build_app

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in readme[readme.index("## Commands"):].splitlines():
        found = re.match(r"\| `trainbridge ([a-z-]+)", line)
        if found:
            rows[found.group(1)] = line
        elif rows and not line.startswith("|") and line.strip():
            break
    assert {"run", "resume", "status", "rm", "report", "measure", "kb"} <= set(rows)
    no_codes = [name for name, row in rows.items() if "Exit code" not in row and "exit codes as" not in row.lower()]
    assert not no_codes, f"rows without their exit codes: {no_codes}"
    for name, command in _commands(build_app()):
        if any("--json" in getattr(p, "opts", []) for p in command.params):
            row = rows.get(name.split()[0], "")
            assert "--json FILE\\|-" in row, f"the row of `{name}` does not name --json FILE|-"


def test_a_run_on_a_damaged_knowledge_base_stops_before_it_starts_naming_it(tmp_path):
    """Issue 27: a corrupt knowledge-base folder gave a 130-line traceback. `kb` commands name it since; `run` still
    measured the baseline, analysed, and then stopped at its first retrieval with chromadb's traceback."""
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app
    from trainbridge.tests.loop_fixtures import make_loop_repo

    repo = make_loop_repo(tmp_path / "repo")
    kb = tmp_path / "kb"
    kb.mkdir()
    (kb / "chroma.sqlite3").write_text("not a database\n")
    home = tmp_path / "home"
    result = CliRunner().invoke(build_app(), ["run", str(repo), "--run-id", "damaged", "--unconfined", "--kb-dir", str(kb)],
                                env={"TRAINBRIDGE_HOME": str(home)})
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"the knowledge base at {kb} cannot be opened") and "Move the folder aside" in result.output
    assert not (home / "runs" / "damaged").exists()


def test_a_question_nobody_can_answer_says_which_options_answer_it(tmp_path):
    """A silent exit 1: `rm` (or `review`) with standard input closed, as under cron, printed only click's 'Aborted!'."""
    from typer.testing import CliRunner

    from trainbridge.graph.cli.app import build_app

    home = tmp_path / "home"
    (home / "runs" / "kept").mkdir(parents=True)
    (home / "runs" / "kept" / "run.json").write_text("{}")
    result = CliRunner().invoke(build_app(), ["rm", "kept"], input="", env={"TRAINBRIDGE_HOME": str(home)})
    assert result.exit_code == 1 and "no answer (standard input is closed)" in result.output, result.output
    assert "trainbridge rm kept --yes" in result.output and (home / "runs" / "kept" / "run.json").is_file()


def test_the_closing_comparison_says_each_round_with_the_time_left(monkeypatch):
    """Issue 27: the closing comparison ran 4 min 31 s without a line (`compare_final` takes a round callback, the report
    node passed none)."""
    from types import SimpleNamespace

    from trainbridge.agents.profiler import final
    from trainbridge.graph import nodes

    def compare(original, head, *, backend, rounds, with_compile, on_round=None, round_fits=None):
        for done in range(1, rounds + 1):
            on_round(done, rounds)
        return SimpleNamespace(rounds=rounds, model_dump=lambda mode: {"rounds": rounds})

    monkeypatch.setattr(final, "compare_final", compare)
    monkeypatch.setattr(nodes, "detached_view", lambda workspace, name, sha: "original")
    monkeypatch.setattr(nodes, "remove_view", lambda workspace, name: None)
    said: list[str] = []
    ctx = SimpleNamespace(config=SimpleNamespace(compile_reference=True, target="cpu", workload=lambda where: where), say=said.append)
    assert nodes._final_comparison(ctx, SimpleNamespace(worktree="head"), "abc", 3) == {"rounds": 3}
    assert said[0] == "final comparison: original, final head, torch.compile of the original, 3 interleaved rounds"
    assert [line.split(" (")[0] for line in said[1:]] == [f"  final comparison: round {k} of 3" for k in (1, 2, 3)]
    assert said[-1].endswith("about 0 s left)")


def test_the_closing_comparison_stops_between_rounds_when_the_next_would_overrun_the_budget(monkeypatch):
    """Seen in a real gpt2_pretrain run: `--budget 30m` took 36.6 min, its closing comparison estimated to fit 3 rounds
    in the 8.6 min left and taking 15.2 min. The report node now asks before each round after the first whether one more,
    as long as the rounds so far, ends within the budget."""
    import contextlib

    from trainbridge.agents.profiler import final
    from trainbridge.graph.state import RunConfig
    from trainbridge.graph.stops import closing_round_fits
    from trainbridge.sandbox.results import RunResult
    from trainbridge.sandbox.workload import load_workload

    ran: list[str] = []

    def run_workload(workload, *, backend, mode, extra_request):
        ran.append(str(workload.root))
        return RunResult(mode="entry", backend="cpu", device="cpu", seed=0, threads=1, warmup_steps=1, step_times_s=[0.1, 0.11])

    monkeypatch.setattr(final, "run_workload", run_workload)
    monkeypatch.setattr(final.fork_server, "serving", lambda *args, **kwargs: contextlib.nullcontext())
    tiny = load_workload(Path(__file__).parent / "fixtures" / "workloads" / "tiny")
    asked: list[float] = []
    result = final.compare_final(tiny, tiny, rounds=6, with_compile=False,
                                 round_fits=lambda round_s: asked.append(round_s) or len(asked) < 2)
    assert result.rounds == 2 and len(ran) == 4 and len(result.samples["original"]) == 2 and len(asked) == 2
    assert result.final_vs_original is not None  # the figures of the rounds that ran
    config = RunConfig(repo="/nonexistent", run_id="r", budget_s=1800)
    started = {"started_at": time.time() - 1700}
    assert closing_round_fits(started, config, 90.0) and not closing_round_fits(started, config, 110.0)
