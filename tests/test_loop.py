"""The loop end to end: a real repository, real sandbox runs, real git, a real knowledge base.

- graph tests (fast): the review interrupt against an in-memory checkpointer (invoke -> see
  ``__interrupt__`` -> ``Command(resume=...)``), and the routers as plain functions;
- end to end (slow): one uninterrupted run accepts the GELU rewrite with a measured gain and rejects
  the planted wrong RMSNorm rewrite with numerics_mismatch;
- crash/resume (slow): the same run in subprocesses killed with SIGKILL at many points (during the
  baseline measurement, right after a candidate commit, during a gate timing child, right after the
  run branch moved, at seeded random moments), resumed each time: same commits and verdicts as the
  uninterrupted run, no duplicates, nothing lost, the repository intact;
- review across processes (slow): process 1 stops at the first patch, `trainbridge review` in
  process 2 rejects it with a reason, process 3 approves the next one.

Decisions are deterministic by construction (see tests/loop_fixtures.py): numerics decide the
planted candidate, and the GELU rewrite halves the step against a 5% minimum gain.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.agents.coder.candidate import make_candidate
from trainbridge.graph import nodes
from trainbridge.graph.runs import RunError, resume_run, run_status, start_run
from trainbridge.graph.builder import build_graph
from trainbridge.graph.context import RunContext
from trainbridge.graph.review import ReviewDecision
from trainbridge.graph.state import RunConfig, RunPaths
from trainbridge.knowledge.store import KnowledgeBase
from trainbridge.tools.git_ops import CandidateConflict
from trainbridge.tests.loop_checks import (
    LLM_ENV,
    REJECT_REASON,
    assert_clean_repository,
    child_env,
    cli_argv,
    decision_view,
    harness_children,
    run_commits,
    run_outcomes,
    user_view,
)
from trainbridge.tests.loop_fixtures import (
    GOOD_RECIPE,
    WRONG_RECIPE,
    add_user_changes,
    git,
    loop_config,
    make_loop_repo,
)

ROOT = Path(__file__).resolve().parents[1]

# The loop in a child process. Optionally it SIGKILLs itself right after a given git command
# succeeded (the moment a crash hurts most: the commit or ref move exists, the checkpoint does not).
DRIVER = r"""
import json, os, signal, sys
args = json.loads(sys.argv[1])
if args.get("kill_after"):
    from trainbridge.tools import git_runner
    kind, ref = args["kill_after"]
    original = git_runner._git_status
    def _git_status(cwd, *argv, **kwargs):
        result = original(cwd, *argv, **kwargs)
        moved_run_branch = "update-ref" in argv and ref in argv and argv[-1] != ""  # not its creation
        if result[0] == 0 and ((kind == "commit" and "commit" in argv) or (kind == "move" and moved_run_branch)):
            print(f"KILLING MYSELF after git {' '.join(a for a in argv if not a.startswith('-c'))[:200]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    git_runner._git_status = _git_status
from trainbridge.graph.runs import resume_run, start_run
from trainbridge.graph.state import RunConfig
say = lambda message: print(message, flush=True)
if args["action"] == "start":
    outcome = start_run(RunConfig.model_validate(args["config"]), say=say)
else:
    outcome = resume_run(args["run_id"], say=say)
print("OUTCOME " + json.dumps({"finished": outcome.finished, "waiting": outcome.waiting_for_review}), flush=True)
"""


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


class Driver:
    """One loop process (start or resume) with its log; killable at chosen moments."""

    def __init__(self, args: dict, home: Path, log: Path):
        self.log = log
        self.handle = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT, env=child_env(home),
                                     stdout=self.handle, stderr=subprocess.STDOUT)
        self.sandbox_children: dict[int, str] = {}

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]

    def watch(self, *, kill_at_measure: int | None = None, kill_after_s: float | None = None, timeout_s: float = 600,
              before_kill=None) -> int:
        """Wait for the process; SIGKILL it when its `kill_at_measure`-th timed child is running
        (calling `before_kill()` first), or after `kill_after_s`. Returns the exit status (-9 when killed)."""
        started = time.monotonic()
        while self.proc.poll() is None:
            self.sandbox_children.update(harness_children(self.proc.pid))
            measuring = [pid for pid, mode in self.sandbox_children.items() if mode == "timed"]
            if (kill_at_measure is not None and len(measuring) >= kill_at_measure) or \
                    (kill_after_s is not None and time.monotonic() - started >= kill_after_s):
                if before_kill is not None and kill_at_measure is not None:
                    before_kill()
                self.kill()
                break
            if time.monotonic() - started > timeout_s:
                self.kill()
                pytest.fail(f"loop process ran past {timeout_s} s:\n{self.tail()}")
            time.sleep(0.1)
        status = self.proc.wait()
        self.reap_orphans()
        self.handle.close()
        return status

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def reap_orphans(self) -> None:
        """The sandbox children run in their own sessions and outlive a killed parent: end the ones we saw."""
        for pid in self.sandbox_children:
            try:
                if "trainbridge.sandbox.harness" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def start_args(config: RunConfig, kill_after: tuple[str, str] | None = None) -> dict:
    return {"action": "start", "config": config.model_dump(mode="json"), "kill_after": kill_after}


def resume_args(run_id: str, kill_after: tuple[str, str] | None = None) -> dict:
    return {"action": "resume", "run_id": run_id, "kill_after": kill_after}


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


@pytest.mark.parametrize("target, expected", [("cpu", ["compile-regional"]), ("npu", ["rope-npu-rotary-mul"])])
def test_retrieval_falls_back_to_a_regional_compile_only_without_a_recipe(tmp_path, target, expected):
    rope = {"id": "rope-1", "category": "rope", "spans": [{"file": "model.py", "line_start": 51, "line_end": 52}],
            "confidence": 0.9, "source": "runtime"}
    rms = {**rope, "id": "rmsnorm-1", "category": "rmsnorm"}
    config = RunConfig(repo=str(tmp_path), run_id="r", target=target, kb_dir=str(tmp_path / "kb"))
    with KnowledgeBase(config.kb_dir) as kb:
        runtime = SimpleNamespace(context=SimpleNamespace(config=config, kb=kb, say=lambda message: None))
        update = nodes.retrieval({"intents": [rope], "done_intents": []}, runtime)
        assert update["current_intent"]["id"] == "rope-1" and update["recipe_queue"] == expected
        # an intent with a recipe of its own gets no last resort
        own = nodes.retrieval({"intents": [rms], "done_intents": []}, runtime)["recipe_queue"]
        assert own and LAST_RESORT not in own
        # the last resort waits until no intent with a recipe of its own is left (on npu, rope has its own)
        first = nodes.retrieval({"intents": [rope, rms], "done_intents": []}, runtime)
        assert first["current_intent"]["id"] == ("rmsnorm-1" if target == "cpu" else "rope-1")
        later = nodes.retrieval({"intents": [rope, rms], "done_intents": ["rmsnorm-1"]}, runtime)
        assert later["current_intent"]["id"] == "rope-1" and later["recipe_queue"] == expected
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


# --------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted run of the loop workload (in this process), shared by the slow tests."""
    tmp = tmp_path_factory.mktemp("loop-reference")
    repo = make_loop_repo(tmp / "repo")
    changes = add_user_changes(repo)
    before = user_view(repo)
    config = loop_config(repo, "reference", tmp)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBRIDGE_HOME", str(tmp / "home"))
        for name in LLM_ENV:
            patch.delenv(name, raising=False)
        started = time.monotonic()
        outcome = start_run(config, root=tmp / "home" / "runs")
        wall_s = time.monotonic() - started
    print(f"\nuninterrupted loop run: {wall_s:.1f} s")
    return SimpleNamespace(tmp=tmp, repo=repo, config=config, outcome=outcome, before=before, changes=changes, wall_s=wall_s)


@pytest.mark.slow
def test_end_to_end_accepts_a_measured_gain_and_rejects_wrong_numerics(reference_run):
    run, state = reference_run, reference_run.outcome.state
    assert reference_run.outcome.finished and reference_run.outcome.waiting_for_review is None, state.get("node")
    verdicts = state["verdicts"]
    accepted = [v for v in verdicts if v["accepted"]]
    assert [v["recipe_id"] for v in accepted] == [GOOD_RECIPE], verdicts
    gain = accepted[0]
    assert gain["reason"] == "accepted" and gain["ratio"] <= 1 - run.config.min_gain and gain["ratio_ci"][1] < 1.0, gain
    wrong = [v for v in verdicts if v["recipe_id"] == WRONG_RECIPE]
    assert len(wrong) == 1 and wrong[0]["reason"] == "numerics_mismatch" and not wrong[0]["accepted"], wrong
    assert "gradient" in wrong[0]["message"] and wrong[0]["category"] == "rmsnorm"
    assert state["stop_reason"] == "no intents left" and state["candidates_tried"] == 2

    # the loop's own cost: one entry per node run, in order, with the sub-phases the nodes measured
    times = state["phase_times"]
    assert [t["node"] for t in times][:3] == ["prepare", "analyst", "retrieval"] and times[-1]["node"] == "report"
    assert [t["node"] for t in times].count("profiler") == 2 and all(t["wall_s"] >= 0 for t in times)
    by_node = {t["node"]: t for t in times}
    assert 0 < by_node["prepare"]["parts"]["baseline"] <= by_node["prepare"]["wall_s"]
    assert {"static", "profile"} <= set(by_node["analyst"]["parts"])
    gated = [t for t in times if t["node"] == "profiler"]
    assert all(0 < t["parts"]["numerics"] <= t["wall_s"] for t in gated)
    assert any(t["parts"].get("timing", 0) > 0 for t in gated)  # the accepted candidate was timed
    assert sum(t["wall_s"] for t in times) <= run.wall_s

    # the knowledge base knows both outcomes, with the rejection's reason
    outcomes = {o.recipe_id: o for o in run_outcomes(run.config.kb_dir, "reference")}
    assert set(outcomes) == {GOOD_RECIPE, WRONG_RECIPE}
    assert outcomes[GOOD_RECIPE].verdict == "accepted" and outcomes[GOOD_RECIPE].ratio == gain["ratio"]
    assert outcomes[WRONG_RECIPE].verdict.startswith("numerics_mismatch: numerics mismatch")
    assert wrong[0]["message"][:80] in outcomes[WRONG_RECIPE].verdict

    # exactly one commit per accepted candidate on the run branch, on top of the base
    commits = run_commits(run.repo, state["base_sha"], "trainbridge/reference")
    assert [c["sha"] for c in commits] == [gain["sha"]]
    assert commits[0]["parents"] == [state["base_sha"]] and commits[0]["candidate"] == gain["candidate"]
    assert git(run.repo, "diff", "--name-only", state["base_sha"], gain["sha"]) == "model.py"
    assert 'return torch.nn.functional.gelu(x, approximate="tanh")' in git(run.repo, "show", f"{gain['sha']}:model.py")
    assert_clean_repository(run.repo, "reference")

    # the user's branch, HEAD, index, working tree and uncommitted changes are untouched
    assert user_view(run.repo) == run.before
    for name, text in run.changes.items():
        assert (run.repo / name).read_text(encoding="utf-8") == text

    # the report states the baseline and both decisions
    paths = [Path(p) for p in state["report_paths"]]
    names = {p.name for p in paths}
    assert {"report.md", "report.html", "step_time.png"} <= names and all(p.is_file() for p in paths)
    baseline = f"baseline step: {state['baseline_step_s'] * 1000:.1f} ms"
    markdown = (paths[0].parent / "report.md").read_text(encoding="utf-8")
    html = (paths[0].parent / "report.html").read_text(encoding="utf-8")
    assert baseline in markdown and baseline in html
    assert f"| {GOOD_RECIPE} | accepted |" in markdown and f"| {WRONG_RECIPE} | numerics_mismatch |" in markdown
    assert "<img" in html
    assert "&#x27;" not in markdown and "&amp;" not in html  # verdict messages quote names: escaped once, not twice


# Every client-side hook git knows; each leaves a marker (outside the repository) when it runs.
HOOKS = ("applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit", "prepare-commit-msg",
         "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge", "pre-push", "pre-auto-gc",
         "post-rewrite", "post-index-change", "reference-transaction", "push-to-checkout", "fsmonitor-watchman")


def install_hostile_config(repo: Path, markers: Path) -> None:
    """A user's repository as git allows it to be: every hook installed (a failing post-checkout among
    them), a core.hooksPath with the same hooks, prefix-less and coloured diffs, mandatory signing
    without a key."""
    markers.mkdir(parents=True, exist_ok=True)
    hooks_path = repo.parent / "user-hooks"
    for folder in (repo / ".git" / "hooks", hooks_path):
        folder.mkdir(parents=True, exist_ok=True)
        for name in HOOKS:
            hook = folder / name
            status = 1 if name == "post-checkout" else 0
            hook.write_text(f"#!/bin/sh\necho \"$0 $*\" >> '{markers}/{name}'\nexit {status}\n", encoding="utf-8")
            hook.chmod(0o755)
    for key, value in {"core.hooksPath": str(hooks_path), "diff.noprefix": "true", "diff.mnemonicPrefix": "true",
                       "color.ui": "always", "color.diff": "always", "commit.gpgsign": "true", "tag.gpgSign": "true",
                       "user.signingkey": "0xDEADBEEFNOSUCHKEY", "gpg.program": str(markers / "no-such-gpg")}.items():
        git(repo, "config", key, value)


@pytest.mark.slow
def test_hooks_and_the_users_git_config_change_nothing(reference_run, tmp_path):
    """A whole run on a repository with every hook, core.hooksPath, diff.noprefix, color.ui=always and
    commit.gpgsign=true without a key: no hook runs, the branch and verdicts equal the plain
    repository's, and the user's checkout (tree, index, refs, config) is byte-identical."""
    repo = make_loop_repo(tmp_path / "repo")
    markers = tmp_path / "markers"
    install_hostile_config(repo, markers)
    add_user_changes(repo)
    before = user_view(repo)
    config = loop_config(repo, "hooked", tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
        for name in LLM_ENV:
            patch.delenv(name, raising=False)
        outcome = start_run(config, root=tmp_path / "home" / "runs")
    assert outcome.finished, outcome.state.get("node")
    assert sorted(p.name for p in markers.iterdir()) == [], "hooks ran: " + ", ".join(p.name for p in markers.iterdir())
    state, reference = outcome.state, reference_run.outcome.state
    assert decision_view(state["verdicts"]) == decision_view(reference["verdicts"])
    strip = lambda commits: [(c["tree"], c["subject"]) for c in commits]  # noqa: E731
    assert strip(run_commits(repo, state["base_sha"], "trainbridge/hooked")) == \
        strip(run_commits(reference_run.repo, reference["base_sha"], "trainbridge/reference"))
    assert user_view(repo) == before
    assert_clean_repository(repo, "hooked")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [20240611])
def test_killed_at_many_points_resumes_to_the_same_branch_and_verdicts(reference_run, tmp_path, seed):
    rng = random.Random(seed)
    repo = make_loop_repo(tmp_path / "repo")
    add_user_changes(repo)
    before = user_view(repo)
    config = loop_config(repo, "crash", tmp_path)
    home = tmp_path / "home"
    run_ref = "refs/heads/trainbridge/crash"
    refused = []

    def second_process_is_refused():
        with pytest.raises(RunError, match="already running"):
            resume_run("crash", root=home / "runs")
        refused.append(True)

    plan = [
        ("killed while the baseline is measured (no node finished yet)", start_args(config),
         {"kill_at_measure": 1, "before_kill": second_process_is_refused}, True),
        ("killed right after the candidate commit (coder not checkpointed)", resume_args("crash", ("commit", "")), {}, True),
        ("killed while a gate timing child runs", resume_args("crash"), {"kill_at_measure": 2}, True),
        ("killed right after the run branch moved (decide not checkpointed)", resume_args("crash", ("move", run_ref)), {}, True),
        (f"killed at a random moment (seed {seed})", resume_args("crash"), {"kill_after_s": rng.uniform(4, 25)}, False),
        (f"killed at a random moment (seed {seed})", resume_args("crash"), {"kill_after_s": rng.uniform(4, 25)}, False),
    ]
    timeline = []
    for number, (what, args, how, must_be_killed) in enumerate(plan):
        driver = Driver(args, home, tmp_path / f"process-{number}.log")
        started = time.monotonic()
        status = driver.watch(**how)
        timeline.append(f"{what}: exit {status} after {time.monotonic() - started:.1f} s")
        if must_be_killed:
            assert status == -signal.SIGKILL, f"{what}: the process was not killed (exit {status}):\n{driver.tail()}"
        else:
            assert status in (0, -signal.SIGKILL), f"{what}: exit {status}:\n{driver.tail()}"
        if status == -signal.SIGKILL:
            assert "Traceback" not in driver.tail(20000), driver.tail()
    print("\n" + "\n".join(timeline))
    assert refused == [True]  # a second process could not run the same run while the first was alive
    assert "KILLING MYSELF after git commit" in (tmp_path / "process-1.log").read_text()
    assert "KILLING MYSELF after git update-ref" in (tmp_path / "process-3.log").read_text()

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINBRIDGE_HOME", str(home))
        outcome = resume_run("crash", root=home / "runs")
        status = run_status("crash", root=home / "runs")
    assert outcome.finished and status["finished"], status["next"]
    state, reference = outcome.state, reference_run.outcome.state

    # same decisions, each exactly once (no verdict lost or duplicated by a re-run node)
    assert decision_view(state["verdicts"]) == decision_view(reference["verdicts"])
    assert [a["candidate"] for a in state["accepted"]] == [a["candidate"] for a in reference["accepted"]]
    assert state["candidates_tried"] == reference["candidates_tried"]
    outcomes = run_outcomes(config.kb_dir, "crash")
    assert sorted(o.id for o in outcomes) == sorted(f"outcome-crash-{v['candidate']}" for v in state["verdicts"])

    # the same branch: same trees and subjects, one commit per accepted candidate, moved once
    commits = run_commits(repo, state["base_sha"], "trainbridge/crash")
    expected = run_commits(reference_run.repo, reference["base_sha"], "trainbridge/reference")
    assert [(c["tree"], c["subject"], c["candidate"]) for c in commits] == \
           [(c["tree"], c["subject"], c["candidate"]) for c in expected]
    assert [c["sha"] for c in commits] == [a["sha"] for a in state["accepted"]]
    moves = git(repo, "reflog", "show", "--format=%gs", "trainbridge/crash").splitlines()
    assert sum("accept candidate" in m for m in moves) == len(state["accepted"]), moves
    assert_clean_repository(repo, "crash")
    assert user_view(repo) == before
    assert Path(state["report_paths"][0]).is_file()


@pytest.mark.slow
def test_review_across_processes_reject_then_approve(tmp_path):
    repo = make_loop_repo(tmp_path / "repo")
    home = tmp_path / "home"
    config = loop_config(repo, "reviewed", tmp_path, review=True, gate_rounds=2)
    runs = home / "runs"

    first = Driver(start_args(config), home, tmp_path / "process-1.log")
    assert first.watch() == 0, first.tail()
    assert "OUTCOME" in first.tail() and '"waiting": {' in first.tail()
    paused = run_status("reviewed", root=runs)
    payload = paused["waiting_for_review"]
    assert payload is not None and paused["next"] == ["review"] and payload["schema"] == 1
    first_candidate = payload["candidate"]

    second = subprocess.run([*cli_argv(), "review", "reviewed", "--action", "reject", "--reason", REJECT_REASON],
                            cwd=tmp_path, env=child_env(home), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "paused for review" in second.stderr, second.stderr
    again = run_status("reviewed", root=runs)
    assert again["waiting_for_review"] is not None and again["waiting_for_review"]["candidate"] != first_candidate
    rejected = [v for v in again["state"]["verdicts"] if v["candidate"] == first_candidate]
    assert [(v["reason"], v["message"]) for v in rejected] == [("rejected_in_review", REJECT_REASON)]

    third = subprocess.run([*cli_argv(), "review", "reviewed", "--action", "approve"], cwd=tmp_path, env=child_env(home),
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "run reviewed finished" in third.stderr, third.stderr
    final = run_status("reviewed", root=runs)
    assert final["finished"] and final["waiting_for_review"] is None
    verdicts = final["state"]["verdicts"]
    assert len(verdicts) == 2 and verdicts[0]["candidate"] == first_candidate
    assert verdicts[1]["reason"] != "rejected_in_review"  # approved: the gate judged it
    outcomes = {o.id: o for o in run_outcomes(config.kb_dir, "reviewed")}
    assert outcomes[f"outcome-reviewed-{first_candidate}"].verdict == f"rejected_in_review: {REJECT_REASON}"
    assert len(outcomes) == 2
    assert subprocess.run([*cli_argv(), "review", "reviewed", "--action", "approve"], cwd=tmp_path, env=child_env(home),
                          capture_output=True, text=True, timeout=120).returncode == 2  # nothing waits any more
