"""`review` and `verify` speak as `run` does (issue 27): `--json FILE|-` with nothing else on stdout, `-v`/`-q`.
The run and the replay themselves are stubbed here: tests/test_loop.py and tests/test_verify.py run them for real."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from trainbridge.graph import runs, verify
from trainbridge.graph.cli.app import build_app


def _report() -> verify.VerifyReport:
    outcome = verify.ReplayOutcome(pending_sha="a" * 40, candidate="c1", replay="c1-verify", decision="accepted", reason="accepted",
                                   message="1.12x faster", ratio=0.89, run_sha="b" * 40)
    return verify.VerifyReport(run_id="r1", backend="npu", availability_reason="torch_npu 2.14", pending_branch="trainbridge/r1.pending-npu",
                               run_head_before="1" * 40, run_head_after="2" * 40, outcomes=[outcome], record_path="/x/verify.json")


def test_verify_json_to_stdout_is_the_whole_record_and_nothing_else(monkeypatch, tmp_path):
    said = []
    monkeypatch.setattr(verify, "verify_run", lambda run_id, say: (said.append(say), _report())[1])
    app = build_app()
    out = CliRunner().invoke(app, ["verify", "r1", "--json", "-"])
    assert out.exit_code == 0, out.output
    record = json.loads(out.stdout)  # the JSON alone: no decision lines beside it
    assert record["run_head_after"] == "2" * 40 and record["outcomes"][0]["decision"] == "accepted"
    plain = CliRunner().invoke(app, ["verify", "r1", "--json", str(tmp_path / "v.json"), "-q"])
    assert plain.exit_code == 0 and plain.stdout == "" and json.loads((tmp_path / "v.json").read_text())["run_id"] == "r1"
    lines = CliRunner().invoke(app, ["verify", "r1"])  # without --json: one JSON line per decision, as before
    assert [json.loads(line)["replay"] for line in lines.stdout.splitlines() if line.startswith("{")] == ["c1-verify"]
    both = CliRunner().invoke(app, ["verify", "r1", "-v", "-q"])
    assert both.exit_code == 2 and "not both" in both.output


def test_review_json_to_stdout_carries_the_runs_record_and_sends_the_patch_to_stderr(monkeypatch):
    payload = {"candidate": "c1", "recipe_id": "r", "intent": {"category": "gelu", "spans": []}, "diff": "--- a\n+++ b\n"}
    monkeypatch.setattr(runs, "run_status", lambda run_id, checkpoint=None: {"waiting_for_review": payload})
    answered = []

    def answer(run_id, decision, say, checkpoint=None):
        answered.append(decision)
        return runs.RunOutcome(run_id, True, None, {"run_branch": "trainbridge/r1", "stop_reason": "no intents left", "node": "report"})

    monkeypatch.setattr(runs, "answer_review", answer)
    app = build_app()
    out = CliRunner().invoke(app, ["review", "r1", "--action", "approve", "--json", "-"])
    assert out.exit_code == 0, out.output
    record = json.loads(out.stdout)
    assert record["run_id"] == "r1" and record["run_branch"] == "trainbridge/r1" and record["condition"] == "finished"
    assert answered[0]["action"] == "approve" and "+++ b" in out.stderr  # the patch went to stderr
    served = CliRunner().invoke(app, ["review", "r1", "--server", "http://127.0.0.1:9", "--action", "approve", "--json", "-"])
    assert served.exit_code == 2 and "not with --server" not in served.stdout and "local run's review" in served.output
