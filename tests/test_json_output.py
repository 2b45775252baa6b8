"""Issue 27, machine-readable output and -v/-q: `--json FILE` writes the command's record to FILE, `--json -` writes
it to stdout and nothing else goes there, in every command that prints results (run, resume, report, status, kb
list/show/stats); `run`/`resume -q` show only the verdict lines and the final line, `-v` adds a failed child's
stderr tail. The loop itself is replaced by a scripted one here (tests/test_loop.py runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainbridge.graph.cli.app import build_app
from trainbridge.graph.lines import Detail, VerdictLine
from trainbridge.graph.runs import RunOutcome

SHA = "c" * 40


def _state(report: Path) -> dict:
    accepted = {"candidate": "c1", "intent_id": "silu-1", "category": "silu", "recipe_id": "silu-functional", "accepted": True,
                "reason": "accepted", "message": "faster", "ratio": 0.9, "ratio_ci": [0.85, 0.95], "sha": SHA,
                "gate": {"rounds": 6}}
    return {"node": "report", "run_branch": "trainbridge/r", "base_sha": "b" * 40, "baseline_step_s": 0.1,
            "accepted": [accepted], "verdicts": [accepted], "candidates_tried": 1, "stop_reason": "no intents left",
            "report_paths": [str(report)], "intents": [], "done_intents": ["silu-1"]}


@pytest.fixture
def scripted_run(tmp_path, monkeypatch):
    """`run` and `resume` over a scripted loop that says one line of each kind and finishes."""
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRAINBRIDGE_CHECKPOINT", raising=False)
    report = tmp_path / "report.md"
    report.write_text("# TrainBridge run `r`\n", encoding="utf-8")

    def loop(run_id: str, say) -> RunOutcome:
        say("measuring the baseline step")
        say("  gate: round 3 of 6 planned (1.0 s a round; about 3 s to the next look)")
        say(VerdictLine("verdict c1: accepted (ratio 0.900)"))
        say(Detail("  child's stderr tail:\n    RuntimeError: boom"))
        return RunOutcome(run_id=run_id, finished=True, waiting_for_review=None, state=_state(report))

    monkeypatch.setattr("trainbridge.graph.preflight.check_run_input", lambda config: [])
    monkeypatch.setattr("trainbridge.graph.runs.start_run", lambda config, say: loop(config.run_id, say))
    monkeypatch.setattr("trainbridge.graph.runs.resume_run", lambda run_id, say, checkpoint, budget_s: loop(run_id, say))
    repo = tmp_path / "repo"
    repo.mkdir()
    return repo


def _invoke(*args: str):
    return CliRunner().invoke(build_app(), list(args), terminal_width=200)


def test_run_json_dash_puts_the_run_record_and_nothing_else_on_stdout(scripted_run):
    done = _invoke("run", str(scripted_run), "--run-id", "r", "--json", "-")
    assert done.exit_code == 0, done.output
    record = json.loads(done.stdout)  # the whole of stdout parses: nothing else is there (the report's markdown is not)
    assert record["run_id"] == "r" and record["condition"] == "finished" and record["stop_reason"] == "no intents left"
    assert record["accepted"][0]["sha"] == SHA and record["accepted"][0]["ratio_ci"] == [0.85, 0.95]
    assert record["verdicts"][0]["reason"] == "accepted" and record["report_paths"][0].endswith("report.md")
    assert "run r finished" in done.stderr
    plain = _invoke("run", str(scripted_run), "--run-id", "r")
    assert plain.stdout.startswith("# TrainBridge run `r`")  # without --json the report is printed as before


def test_run_and_resume_json_file_write_the_record_and_keep_the_usual_output(scripted_run, tmp_path):
    out = tmp_path / "run.json"
    done = _invoke("run", str(scripted_run), "--run-id", "r", "--json", str(out))
    assert done.exit_code == 0 and "# TrainBridge run" in done.stdout and f"wrote {out}" in done.stderr
    assert json.loads(out.read_text())["condition"] == "finished"
    resumed = _invoke("resume", "r", "--json", "-")
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["run_id"] == "r"


def test_a_run_that_stops_with_an_error_still_writes_its_record(scripted_run, monkeypatch):
    from trainbridge.graph.stops import RunStopped

    def stopped(config, say):
        raise RunStopped("the unmodified program fails in the sandbox (exception): boom")

    monkeypatch.setattr("trainbridge.graph.runs.start_run", stopped)
    done = _invoke("run", str(scripted_run), "--run-id", "r", "--json", "-")
    assert done.exit_code == 1
    record = json.loads(done.stdout)
    assert record["condition"] == "failed" and "boom" in record["error"] and "trainbridge rm r" in done.stderr


def test_quiet_shows_verdicts_and_the_final_line_verbose_adds_the_childs_stderr_tail(scripted_run):
    default = _invoke("run", str(scripted_run), "--run-id", "r").stderr
    assert "measuring the baseline step" in default and "gate: round 3 of 6" in default and "verdict c1" in default
    assert "stderr tail" not in default
    quiet = _invoke("run", str(scripted_run), "--run-id", "r", "-q")
    lines = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and "verdict c1: accepted" in lines[0], quiet.stderr
    assert lines[1].startswith("run r finished: no intents left;") and "report " in lines[1]
    assert quiet.stdout == ""  # not the report's markdown either
    verbose = _invoke("resume", "r", "-v").stderr
    assert "gate: round 3 of 6" in verbose and "child's stderr tail:" in verbose and "RuntimeError: boom" in verbose
    both = _invoke("run", str(scripted_run), "--run-id", "r", "-q", "-v")
    assert both.exit_code == 2 and "not both" in both.output


def test_the_run_log_keeps_every_line_whatever_the_terminal_shows(tmp_path, capsys):
    from trainbridge.graph.cli.display import QUIET, say_at
    from trainbridge.graph.runs import logged

    log = tmp_path / "run.log"
    say = logged(say_at(QUIET), log)  # as graph/runs.py wraps the CLI's say
    for line in ("analysing the run branch head", VerdictLine("verdict c1: slower (ratio 1.2)"), Detail("  child's stderr tail")):
        say(line)
    shown = capsys.readouterr().err
    assert "verdict c1" in shown and "analysing" not in shown and "stderr tail" not in shown
    kept = log.read_text(encoding="utf-8")
    assert "analysing the run branch head" in kept and "verdict c1" in kept and "child's stderr tail" in kept


def test_report_json(tmp_path, monkeypatch):
    report = tmp_path / "report.md"
    report.write_text("# TrainBridge run `r`\n", encoding="utf-8")
    info = {"state": _state(report), "finished": True, "waiting_for_review": None, "next": [], "failure": None}
    monkeypatch.setattr("trainbridge.graph.cli.loop.served_run_status", lambda run_id, checkpoint: info)
    done = _invoke("report", "r", "--json", "-")
    record = json.loads(done.stdout)
    assert done.exit_code == 0 and record["condition"] == "finished" and record["accepted"][0]["sha"] == SHA
    out = tmp_path / "r.json"
    both = _invoke("report", "r", "--json", str(out))
    assert both.stdout.startswith("# TrainBridge run") and json.loads(out.read_text())["run_id"] == "r"


def test_status_json_takes_a_file_or_dash(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("TRAINBRIDGE_CHECKPOINT", raising=False)
    listed = _invoke("status", "--json", "-")
    assert listed.exit_code == 0 and json.loads(listed.stdout) == []
    out = tmp_path / "status.json"
    to_file = _invoke("status", "--json", str(out))
    assert "no runs under" in to_file.stdout and json.loads(out.read_text()) == []


def test_kb_list_show_and_stats_take_the_same_json_option(tmp_path):
    kb = str(tmp_path / "kb")
    listed = _invoke("kb", "list", "--kb-dir", kb, "--category", "rmsnorm", "--json", "-")
    recipes = json.loads(listed.stdout)
    assert listed.exit_code == 0 and recipes and {r["category"] for r in recipes} == {"rmsnorm"}
    assert all("replacement" in r and "stats" in r for r in recipes)  # every field, as kb show --json gives one
    out = tmp_path / "list.json"
    table = _invoke("kb", "list", "--kb-dir", kb, "--category", "rmsnorm", "--json", str(out))
    assert "recipe(s) in" in table.stdout and len(json.loads(out.read_text())) == len(recipes)
    shown = _invoke("kb", "show", recipes[0]["id"], "--kb-dir", kb, "--json", "-")
    assert json.loads(shown.stdout)["id"] == recipes[0]["id"]
    stats = _invoke("kb", "stats", "--kb-dir", kb, "--json", "-")
    assert json.loads(stats.stdout)["recipes"] >= len(recipes)
