"""The loop's graph without sandbox runs (fast): the review interrupt against an in-memory checkpointer
(invoke -> see ``__interrupt__`` -> ``Command(resume=...)``), the review decision's schema, and the
routers and the retrieval fallback as plain functions. The loop end to end: tests/test_loop.py.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.agents.coder.candidate import make_candidate
from trainbridge.graph import nodes
from trainbridge.graph.builder import build_graph
from trainbridge.graph.context import RunContext
from trainbridge.graph.review import ReviewDecision
from trainbridge.graph.state import RunConfig, RunPaths
from trainbridge.knowledge.store import KnowledgeBase
from trainbridge.tools.git.ops import CandidateConflict
from trainbridge.tests.loop_checks import LLM_ENV, REJECT_REASON, decision_view, run_commits, run_outcomes
from trainbridge.tests.loop_fixtures import GOOD_RECIPE, git, loop_config, make_loop_repo


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------------------- graph unit tests


@pytest.fixture
def review_setup(tmp_path, monkeypatch):
    """A run (review on) standing right after retrieval chose the GELU intent: no sandbox runs needed."""
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "repo")
    config = loop_config(repo, "unit", tmp_path, review=True)
    context = RunContext(config=config, paths=RunPaths(config.run_id, tmp_path / "home" / "runs"))
    gelu = next(i for i in scan_repo_result(repo).intents if str(i.category) == "gelu")
    workspace = context.workspace("HEAD")
    values = {"run_id": config.run_id, "node": "retrieval", "base_sha": workspace.info.base_sha,
              "run_branch": workspace.branch, "started_at": time.time(), "baseline_step_s": 0.02, "analyses": 1,
              "intents": [gelu.model_dump(mode="json")], "current_intent": gelu.model_dump(mode="json"),
              "recipe_queue": [GOOD_RECIPE], "candidate": None}
    return SimpleNamespace(repo=repo, config=config, context=context, intent=gelu, values=values,
                           thread={"configurable": {"thread_id": config.run_id}})


def _paused_at_review(setup, **compile_options):
    graph = build_graph().compile(checkpointer=InMemorySaver(), **compile_options)
    graph.update_state(setup.thread, setup.values, as_node="retrieval")
    result = graph.invoke(None, setup.thread, context=setup.context)
    return graph, result


def test_review_interrupt_payload_then_reject_goes_back_with_the_reason(review_setup):
    setup = review_setup
    graph, result = _paused_at_review(setup)
    assert "__interrupt__" in result
    payload = result["__interrupt__"][0].value
    snapshot = graph.get_state(setup.thread)
    assert snapshot.next == ("review",)
    assert payload["schema"] == 1 and payload["kind"] == "trainbridge.review" and payload["run_id"] == "unit"
    assert payload["recipe_id"] == GOOD_RECIPE and payload["files"] == ["model.py"]
    assert '+    return torch.nn.functional.gelu(x, approximate="tanh")' in payload["diff"]
    assert payload["intent"]["id"] == setup.intent.id and payload["intent"]["category"] == "gelu"
    candidate = snapshot.values["candidate"]
    branch = f"refs/heads/trainbridge/unit.cand/{candidate['name']}"
    assert git(setup.repo, "rev-parse", branch) == candidate["sha"]

    graph.invoke(Command(resume={"schema": 1, "action": "reject", "reason": REJECT_REASON}), setup.thread, context=setup.context)
    final = graph.get_state(setup.thread)
    assert final.next == ()  # nothing left: retrieval found no intent, the report was written
    state = final.values
    assert state["review_feedback"] == REJECT_REASON
    assert decision_view(state["verdicts"]) == [(setup.intent.id, "gelu", GOOD_RECIPE, candidate["name"], False, "rejected_in_review")]
    assert state["verdicts"][0]["message"] == REJECT_REASON and state["accepted"] == []
    assert state["done_intents"] == [setup.intent.id] and state["stop_reason"] == "no intents left"
    assert subprocess.run(["git", "rev-parse", "--verify", "-q", branch], cwd=setup.repo).returncode != 0
    assert git(setup.repo, "rev-parse", "trainbridge/unit") == state["base_sha"]
    outcomes = run_outcomes(setup.config.kb_dir, "unit")
    assert [(o.recipe_id, o.verdict) for o in outcomes] == [(GOOD_RECIPE, f"rejected_in_review: {REJECT_REASON}")]
    report = Path(state["report_paths"][0]).read_text(encoding="utf-8")
    assert "rejected_in_review" in report and "baseline step: 20.0 ms" in report


def test_review_edit_replaces_the_patch_and_approve_goes_to_the_gate(review_setup):
    setup = review_setup
    graph, result = _paused_at_review(setup, interrupt_before=["profiler"])
    diff = result["__interrupt__"][0].value["diff"]
    edited = diff.replace('approximate="tanh")', 'approximate="tanh")  # reviewed')
    assert edited != diff
    graph.invoke(Command(resume={"schema": 1, "action": "edit", "patch": edited}), setup.thread, context=setup.context)
    snapshot = graph.get_state(setup.thread)
    assert snapshot.next == ("profiler",)  # an edited patch is approved by its editor: on to the gate
    candidate = snapshot.values["candidate"]
    assert "# reviewed" in candidate["diff"] and snapshot.values["review_decision"]["action"] == "approve"
    assert "# reviewed" in git(setup.repo, "show", f"{candidate['sha']}:model.py")
    assert "edited in review" in git(setup.repo, "log", "-1", "--format=%B", candidate["sha"])
    assert len(run_commits(setup.repo, snapshot.values["base_sha"], candidate["sha"])) == 1  # replaced, not stacked

    fresh = SimpleNamespace(**{**vars(setup), "thread": {"configurable": {"thread_id": "approve"}}})
    fresh.values = {**setup.values, "recipe_queue": [GOOD_RECIPE]}
    graph2, _ = _paused_at_review(fresh, interrupt_before=["profiler"])
    graph2.invoke(Command(resume={"schema": 1, "action": "approve"}), fresh.thread, context=setup.context)
    approved = graph2.get_state(fresh.thread)
    assert approved.next == ("profiler",) and approved.values["candidate"]["recipe_id"] == GOOD_RECIPE
    assert approved.values["verdicts"] == []


def test_a_numerics_only_candidate_closes_its_intent(review_setup):
    """NPU emulation: a candidate whose numerics hold waits on the pending branch; the next recipe for the
    same span must not be tried, its commit could not go on top of the first there."""
    setup = review_setup
    workspace = setup.context.workspace("HEAD")
    recipe = setup.context.kb.get_recipe(GOOD_RECIPE)
    first = make_candidate(workspace, setup.intent, recipe)
    state = {**setup.values, "recipe_queue": ["another-gelu-recipe"], "candidate": first.model_dump(mode="json"),
             "verdict": {"accepted": False, "reason": "speed_unmeasured_numerics_ok", "message": "numerics match; speed unmeasured",
                         "ratio": None, "ratio_ci": None}}
    update = nodes.decide(state, SimpleNamespace(context=setup.context))
    assert update["recipe_queue"] == [] and update["done_intents"] == [setup.intent.id] and "accepted" not in update
    assert update["verdicts"][0]["pending_branch"] == "trainbridge/unit.pending-npu"
    pending = run_commits(setup.repo, setup.values["base_sha"], "trainbridge/unit.pending-npu")
    assert [c["candidate"] for c in pending] == [first.name]
    after = {**state, **update, "verdicts": update["verdicts"], "done_intents": update["done_intents"]}
    # the pending branch moved (lines may have shifted): re-analyse its head before the next intent
    assert nodes.route_after_decide(after, SimpleNamespace(context=setup.context)) == "analyst"
    # why: a second rewrite of the same line does not apply on the pending branch
    other = recipe.model_copy(update={"id": "gelu-tanh-functional-variant",
                                      "replacement": 'torch.nn.functional.gelu(input=$x, approximate="tanh")'})
    second = make_candidate(workspace, setup.intent, other, attempt=1)
    with pytest.raises(CandidateConflict):
        workspace.push_to_branch(second.name, "pending-npu")


def test_review_decision_schema_rejects_what_the_loop_cannot_use():
    assert ReviewDecision.model_validate({"action": "approve"}).schema_ == 1
    for bad, words in [({"action": "reject"}, "needs a reason"), ({"action": "reject", "reason": "  "}, "needs a reason"),
                       ({"action": "edit"}, "needs the patch"), ({"schema": 2, "action": "approve"}, "schema 2"),
                       ({"action": "merge"}, "action"), ({"action": "approve", "comment": "x"}, "comment")]:
        with pytest.raises(ValueError, match=words):
            ReviewDecision.model_validate(bad)


LAST_RESORT = "compile-regional"


def _runtime(**config):
    base = {"repo": "/nonexistent", "run_id": "r"}
    return SimpleNamespace(context=SimpleNamespace(config=RunConfig(**{**base, **config})))


def test_route_after_decide():
    intent = {"id": "gelu-1"}
    accepted = {"intent_id": "gelu-1", "accepted": True}
    now = time.time()
    runtime = _runtime()
    after_accept = {"started_at": now, "current_intent": intent, "done_intents": ["gelu-1"], "verdicts": [accepted],
                    "candidate": None, "candidates_tried": 1}
    assert nodes.route_after_decide(after_accept, runtime) == "analyst"  # re-profile the new head
    # the next intent had no recipe: the accept before it is no reason to re-analyse again
    no_recipe = {**after_accept, "current_intent": {"id": "optimizer-2"}, "done_intents": ["gelu-1", "optimizer-2"]}
    assert nodes.route_after_decide(no_recipe, runtime) == "retrieval"
    rejected = {**after_accept, "verdicts": [{"intent_id": "gelu-1", "accepted": False}], "done_intents": [],
                "recipe_queue": ["another-recipe"]}
    assert nodes.route_after_decide(rejected, runtime) == "coder"
    assert nodes.route_after_decide({**rejected, "recipe_queue": []}, runtime) == "retrieval"
    assert nodes.route_after_decide({**rejected, "candidates_tried": 3}, _runtime(max_candidates=3)) == "report"
    assert nodes.route_after_decide({**rejected, "started_at": now - 100}, _runtime(budget_s=10)) == "report"
    # 60 s left, but the typical gate so far took 90 s: stop now rather than one gate past the budget
    gates = [{"node": "profiler", "wall_s": w, "parts": {}} for w in (80.0, 90.0, 200.0)]
    short = {**rejected, "started_at": now - 540, "phase_times": gates}
    assert nodes.route_after_decide(short, _runtime(budget_s=600)) == "report"
    assert nodes.stop_reason(short, _runtime(budget_s=600).context.config) == "time budget: not enough left for another candidate"
    assert nodes.route_after_decide({**short, "started_at": now - 500}, _runtime(budget_s=600, final_rounds=0)) == "coder"
    # ... and time for the final comparison after it: 3 arms x 6 rounds against a gate's 2 x 8 children
    assert nodes.route_after_decide({**short, "started_at": now - 500}, _runtime(budget_s=600)) == "report"
    assert nodes.route_after_decide({**short, "started_at": now - 400}, _runtime(budget_s=600)) == "coder"
    assert nodes.route_after_decide({**after_accept, "low_gain_rounds": 2}, _runtime(low_gain_rounds_to_stop=2)) == "report"


def test_the_budget_holds_before_the_first_candidate(monkeypatch):
    """Issue 27: `--budget 6m` took 13 min: nothing asked the budget before the first candidate. Its gate is estimated
    from the baseline child (a child per round of the first look and two for numerics) and must fit, with the
    closing comparison after it; retrieval asks before it hands out an intent."""
    from trainbridge.graph.stops import limit_reached

    now = time.time()
    prepared = [{"node": "prepare", "wall_s": 31.0, "parts": {"baseline": 30.0}}]
    first = {"started_at": now - 100, "phase_times": prepared, "intents": [{"id": "a"}]}
    # 100 s spent + a first gate of (6 + 2) x 30 s = 340 s, and no closing comparison
    assert limit_reached(first, _runtime(budget_s=360, final_rounds=0).context.config) is None
    assert limit_reached(first, _runtime(budget_s=330, final_rounds=0).context.config).message == \
        "time budget: not enough left for another candidate"
    # ... and room for one closing round after it (2 arms x 30 s; the report runs the rounds that fit then)
    assert limit_reached(first, _runtime(budget_s=360, compile_reference=False).context.config) is not None

    choice = SimpleNamespace(data={"id": "a"}, intent=SimpleNamespace(category="gelu", spans=[]), queue=["x"], last_resort=False)
    monkeypatch.setattr(nodes, "choose_intent", lambda *args, **kwargs: choice)
    said = []
    runtime = _runtime(budget_s=330, final_rounds=0)
    runtime.context.kb, runtime.context.say = None, said.append
    update = nodes.retrieval(first, runtime)
    assert update["current_intent"] is None and update["stop_reason"] == "time budget: not enough left for another candidate"
    assert nodes.route_after_retrieval(update) == "report" and "not starting a candidate" in said[0]
    runtime = _runtime(budget_s=360, final_rounds=0)
    runtime.context.kb, runtime.context.say = None, said.append
    assert nodes.retrieval(first, runtime)["recipe_queue"] == ["x"]


@pytest.mark.parametrize("target, expected", [("cpu", ["compile-regional"]), ("npu", [
    "rope-function-npu-rotary-mul", "rope-method-npu-rotary-mul", "rope-complex-npu-rotary-mul", "rope-npu-rotary-mul",
    "rope-chunk-npu-rotary-mul", "rope-halves-npu-rotary-mul"])])
def test_retrieval_falls_back_to_a_regional_compile_only_without_a_recipe(tmp_path, target, expected):
    rope = {"id": "rope-1", "category": "rope", "spans": [{"file": "model.py", "line_start": 51, "line_end": 52}],
            "confidence": 0.9, "source": "runtime"}
    rms = {**rope, "id": "rmsnorm-1", "category": "rmsnorm"}
    config = RunConfig(repo=str(tmp_path), run_id="r", target=target, kb_dir=str(tmp_path / "kb"))
    with KnowledgeBase(config.kb_dir) as kb:
        runtime = SimpleNamespace(context=SimpleNamespace(config=config, kb=kb, say=lambda message: None))
        update = nodes.retrieval({"intents": [rope], "done_intents": []}, runtime)
        # which of its recipes comes first is the knowledge base's ranking (recipe texts move it): the set is the point
        assert update["current_intent"]["id"] == "rope-1" and sorted(update["recipe_queue"]) == sorted(expected)
        # an intent with a recipe of its own gets no last resort
        own = nodes.retrieval({"intents": [rms], "done_intents": []}, runtime)["recipe_queue"]
        assert own and LAST_RESORT not in own
        # the last resort waits until no intent with a recipe of its own is left (on npu, rope has its own)
        first = nodes.retrieval({"intents": [rope, rms], "done_intents": []}, runtime)
        assert first["current_intent"]["id"] == ("rmsnorm-1" if target == "cpu" else "rope-1")
        later = nodes.retrieval({"intents": [rope, rms], "done_intents": ["rmsnorm-1"]}, runtime)
        assert later["current_intent"]["id"] == "rope-1" and sorted(later["recipe_queue"]) == sorted(expected)
        # the run's recipe filter applies to the last resort too
        runtime.context.config = config.model_copy(update={"recipe_ids": ["gelu-tanh-functional"]})
        assert nodes.retrieval({"intents": [rope], "done_intents": []}, runtime)["recipe_queue"] == []


def test_routers_after_retrieval_coder_review():
    assert nodes.route_after_retrieval({"current_intent": None}) == "report"
    assert nodes.route_after_retrieval({"current_intent": {"id": "a"}, "recipe_queue": []}) == "decide"
    assert nodes.route_after_retrieval({"current_intent": {"id": "a"}, "recipe_queue": ["x"]}) == "coder"
    assert nodes.route_after_coder({"candidate": None}, _runtime(review=True)) == "decide"
    assert nodes.route_after_coder({"candidate": {"name": "c"}}, _runtime(review=True)) == "review"
    assert nodes.route_after_coder({"candidate": {"name": "c"}}, _runtime()) == "profiler"
    assert nodes.route_after_review({"review_decision": {"action": "approve"}}) == "profiler"
    assert nodes.route_after_review({"review_decision": {"action": "reject"}}) == "apply_review"
    assert nodes.route_after_apply_review({"candidate": None, "recipe_queue": ["x"]}) == "coder"
    assert nodes.route_after_apply_review({"candidate": None, "recipe_queue": []}) == "decide"


def test_a_verdict_line_keeps_its_figures_and_interval():
    """Issue 27: verdict lines were cut at 120 characters, losing a not_significant verdict's interval."""
    message = ("not significant (the interval includes no change and the signed-rank test finds no direction): ratio 0.9261 "
               "(+7.39% gain), 93.75% CI [0.8598, 1.3073], 6 paired rounds, signed-rank p(faster)=0.219, p(slower)=0.844")
    line = nodes.verdict_line("gelu-1", "not_significant", message)
    assert line == f"verdict gelu-1: not_significant ({message})"
    long = nodes.verdict_line("c", "numerics_mismatch", "gradient of 'w': cosine 0.9 " * 100)
    assert len(long) < nodes.VERDICT_LINE_CHARS + 80 and long.endswith("... (the report has the rest))")


def test_a_gate_says_where_it_is_round_by_round(monkeypatch):
    """run/resume printed nothing for the minutes of a gate (issue 27): the profiler node passes the gate a
    progress callback that says the numerics check, then each round with the rounds planned, the running
    candidate/baseline ratio and the time left."""
    said, clock = [], iter([100.0, 101.0, 110.0, 112.0, 112.0, 118.0, 124.0])
    monkeypatch.setattr(nodes.time, "monotonic", lambda: next(clock))
    progress = nodes.GateProgressLines(said.append)
    from trainbridge.agents.profiler.gate import progress_caller

    assert progress_caller(progress) is progress  # it takes the gate's running ratio
    progress("numerics", 0, 2)
    progress("numerics", 2, 2)
    progress("timing", 0, 10)
    progress("timing", 1, 6, ratio=0.9712)  # the gate counts the numerics check's round at once (it read '0.0 s a round; about 0 s')
    progress("timing", 2, 6, ratio=0.93)  # the running ratio (issue 27: "gate round k of n with the running ratio")
    progress("timing", 3, 8, ratio=None)  # every round so far left out as busy: no ratio to say
    assert said == ["  gate: numerics check (first round)",
                    "  gate: numerics match; timing paired rounds (12 s so far)",
                    "  gate: round 1 of 6 planned: candidate/baseline 0.971 so far (the numerics check's round)",
                    "  gate: round 2 of 6 planned: candidate/baseline 0.930 so far (6.0 s a round; about 24 s to the next look)",
                    "  gate: round 3 of 8 planned (6.0 s a round; about 30 s to the next look)"]


def test_a_long_phase_is_one_progress_bar_in_a_terminal_and_lines_in_a_pipe():
    """Issue 27: a gate's rounds (and a closing comparison's) as one bar updated in place in a terminal, each with its
    line as the bar's text; in a pipe each round is a line, as before; any other line ends the bar first."""
    import io

    from rich.console import Console

    from trainbridge.graph.cli.display import DEFAULT, TerminalProgress, say_at
    from trainbridge.graph.lines import ProgressLine

    rounds = [ProgressLine(f"  gate: round {k} of 6 planned", phase="gate", done=k, total=6) for k in (1, 2, 3)]
    piped = io.StringIO()
    say = say_at(DEFAULT, Console(file=piped, force_terminal=False, width=200))
    for line in ("gate: c1", *rounds, "verdict c1: slower"):
        say(line)
    assert [line.split(" ", 1)[1].strip() for line in piped.getvalue().splitlines()] == [
        "gate: c1", *(r.strip() for r in rounds), "verdict c1: slower"]

    screen = io.StringIO()
    shown = TerminalProgress(Console(file=screen, force_terminal=True, width=200))
    shown("gate: c1")
    for line in rounds:
        shown(line)
        task = shown.bar.tasks[0]
        assert (task.completed, task.total, task.description) == (line.done, 6, line.strip())
    bar = shown.bar
    assert len(bar.tasks) == 1 and bar.live.is_started  # one bar, updated: not a line per round
    shown(ProgressLine("  final comparison: round 1 of 2", phase="final comparison", done=1, total=2))
    assert not bar.live.is_started and shown.bar is not bar  # a new phase, a new bar
    shown("verdict c1: slower")
    assert shown.bar is None and "verdict c1: slower" in screen.getvalue()
