"""Gates judged side by side (issue 17): slots, the verdicts' reducer, the merge that moves the run
branch one verified commit at a time, and (slow) a `--devices cpu:2` run against a sequential one.

- quick: `--devices` syntax and slots (cores split, device visibility); the reducer keeps every
  verdict and is emptied by the merge; the merge of two accepted candidates judged against the same
  head accepts the first and carries the second onto the new head to be judged again (verdict not
  yet recorded), then accepts it on its second verdict; a second candidate whose patch no longer
  applies and whose recipe no longer fits is recorded once as `stale_conflict`; a gate pinned to a
  slot runs in a process whose cores are that slot's;
- slow: the loop workload with `--devices cpu:2` judges its candidates two at a time and ends with the
  accepted rewrites and knowledge-base outcomes a sequential run of the same workload ends with
  (known by construction: loop_fixtures.DECISIONS), one commit per accepted candidate, every verdict once.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.agents.coder.candidate import make_candidate
from trainbridge.graph.team import fanout
from trainbridge.graph.context import RunContext
from trainbridge.graph.team.devices import host_slots, parse_devices, slot_count
from trainbridge.graph.team.gate_jobs import GateJob
from trainbridge.graph.runs import start_run
from trainbridge.graph.state import RunConfig, RunPaths, gathered
from trainbridge.tests.loop_checks import LLM_ENV, assert_clean_repository, run_commits, run_outcomes
from trainbridge.tests.loop_fixtures import GOOD_RECIPE, decided_by_construction, WRONG_RECIPE, git, loop_config, make_loop_repo
from trainbridge.tests.team_support import outcome_view


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


def test_devices_syntax_and_slots():
    assert parse_devices("npu:0-7") == ("npu", list(range(8)))
    assert parse_devices("cuda:0,1") == ("cuda", [0, 1])
    assert parse_devices("npu:0,2-3") == ("npu", [0, 2, 3])
    assert parse_devices("cpu:2") == ("cpu", [0, 1]) and slot_count("cpu:2") == 2 and slot_count(None) == 1
    for wrong in ("cpu", "gpu:0", "cuda:1-0", "cuda:0,0", "cpu:0,1", "npu:a"):
        with pytest.raises(ValueError):
            parse_devices(wrong)
    slots = host_slots("npu:4-5", target="npu", cores=[0, 1, 2, 3])
    assert [(s.device, s.cores, s.env()) for s in slots] == [(4, (0, 1), {"ASCEND_RT_VISIBLE_DEVICES": "4"}),
                                                             (5, (2, 3), {"ASCEND_RT_VISIBLE_DEVICES": "5"})]
    assert host_slots("cuda:1", target="cuda", cores=[0, 1])[0].env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert [s.cores for s in host_slots("cpu:2", target="cpu", cores=[6, 7, 8])] == [(6,), (7,)]
    with pytest.raises(ValueError, match="does not fit --target cpu"):
        host_slots("npu:0-1", target="cpu", cores=[0, 1])
    with pytest.raises(ValueError, match="a core of its own"):
        host_slots("cpu:3", target="cpu", cores=[0, 1])
    with pytest.raises(ValueError, match="one at a time"):
        RunConfig(repo="/r", run_id="r1", review=True, devices="cpu:2")
    assert RunConfig(repo="/r", run_id="r1", review=True, devices="cpu:1").devices == "cpu:1"


def test_the_verdicts_reducer_keeps_every_verdict_and_the_merge_empties_it():
    held = gathered([], [{"index": 1}])
    held = gathered(held, [{"index": 0}])
    assert held == [{"index": 1}, {"index": 0}]
    assert gathered(held, None) == []


@pytest.fixture
def merge_setup(tmp_path, monkeypatch):
    """The loop repository with its GELU and RMSNorm intents and a run workspace: no sandbox runs."""
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "repo")
    config = loop_config(repo, "fan", tmp_path, devices="cpu:2")
    context = RunContext(config=config, paths=RunPaths(config.run_id, tmp_path / "home" / "runs"))
    intents = {str(i.category): i for i in scan_repo_result(repo).intents}
    workspace = context.workspace("HEAD")
    yield SimpleNamespace(repo=repo, config=config, context=context, workspace=workspace, intents=intents,
                          runtime=SimpleNamespace(context=context))
    context.kb.close()


def _accepted(ratio: float = 0.5) -> dict:
    return {"accepted": True, "reason": "accepted", "message": "faster, numerics match", "ratio": ratio,
            "ratio_ci": [ratio - 0.02, ratio + 0.02], "phase_seconds": {}}


def _state(setup, candidates, head):
    jobs = [fanout._job(setup.context, setup.workspace, c, index=i, head=head) for i, c in enumerate(candidates)]
    lanes = [{"intent": setup.intents[c.category].model_dump(mode="json") if c.category in setup.intents else None,
              "queue": []} for c in candidates]
    return {"run_id": "fan", "base_sha": head, "batch_head": head, "intents": [i.model_dump(mode="json") for i in setup.intents.values()],
            "lanes": lanes, "verdicts": [], "done_intents": [], "candidates_tried": 0}, jobs


def test_two_accepted_against_one_head_the_second_is_rebased_and_judged_again(merge_setup):
    setup = merge_setup
    kb, head = setup.context.kb, setup.workspace.head_sha
    gelu = make_candidate(setup.workspace, setup.intents["gelu"], kb.get_recipe(GOOD_RECIPE))
    norm = make_candidate(setup.workspace, setup.intents["rmsnorm"], kb.get_recipe(WRONG_RECIPE))
    state, jobs = _state(setup, [gelu, norm], head)
    # the gates finished in the other order: the merge still decides in batch order
    state["gate_results"] = [{"index": 1, "job": jobs[1].model_dump(mode="json"), "verdict": _accepted(0.9)},
                             {"index": 0, "job": jobs[0].model_dump(mode="json"), "verdict": _accepted(0.5)}]
    update = fanout.merge(state, setup.runtime)
    assert [v["candidate"] for v in update["verdicts"]] == [gelu.name]  # the second is not recorded yet
    assert update["accepted"][0]["sha"] == gelu.sha == setup.workspace.head_sha == update["batch_head"]
    assert update["gate_results"] is None and update["landed"] is True
    [again] = update["batch"]
    assert again["baseline_sha"] == gelu.sha and again["candidate"]["name"] == norm.name
    rebased = again["candidate_sha"]
    assert rebased != norm.sha and git(setup.repo, "rev-parse", f"{rebased}^") == gelu.sha
    assert "x.pow(2)" not in git(setup.repo, "show", f"{rebased}:model.py")  # its own rewrite, on top of the GELU one
    assert "approximate" in git(setup.repo, "show", f"{rebased}:model.py")
    assert fanout.route_after_merge({**state, **update, "verdicts": update["verdicts"]}, setup.runtime)[0].arg["job"] == again

    # its second gate (against the new head) accepts it: the run branch moves once more
    second = {**state, **update, "verdicts": update["verdicts"], "candidates_tried": update["candidates_tried"],
              "gate_results": [{"index": 0, "job": again, "verdict": _accepted(0.95)}]}
    final = fanout.merge(second, setup.runtime)
    assert [v["candidate"] for v in final["verdicts"]] == [norm.name] and final["batch"] == []
    commits = run_commits(setup.repo, head, "trainbridge/fan")
    assert [c["candidate"] for c in commits] == [gelu.name, norm.name] and commits[1]["sha"] == rebased
    outcomes = {o.id for o in run_outcomes(setup.config.kb_dir, "fan")}
    assert outcomes == {f"outcome-fan-{gelu.name}", f"outcome-fan-{norm.name}"}

    # the merge is idempotent (a resumed run redoes it): nothing moves twice
    redo = fanout.merge(second, setup.runtime)
    assert [v["sha"] for v in redo["accepted"]] == [rebased] and setup.workspace.head_sha == rebased


def test_a_second_accept_that_no_longer_applies_is_recorded_once_as_stale(merge_setup):
    setup = merge_setup
    kb, head = setup.context.kb, setup.workspace.head_sha
    recipe = kb.get_recipe(GOOD_RECIPE)
    variant = recipe.model_copy(update={"id": "gelu-tanh-functional-variant",
                                        "replacement": 'torch.nn.functional.gelu(input=$x, approximate="tanh")'})
    first = make_candidate(setup.workspace, setup.intents["gelu"], recipe)
    other = make_candidate(setup.workspace, setup.intents["gelu"], variant, attempt=1)
    state, jobs = _state(setup, [first, other], head)
    state["gate_results"] = [{"index": i, "job": j.model_dump(mode="json"), "verdict": _accepted()} for i, j in enumerate(jobs)]
    update = fanout.merge(state, setup.runtime)
    assert [(v["candidate"], v["accepted"], v["reason"]) for v in update["verdicts"]] == \
           [(first.name, True, "accepted"), (other.name, False, "stale_conflict")]
    assert update["batch"] == [] and len(run_commits(setup.repo, head, "trainbridge/fan")) == 1
    assert git(setup.repo, "for-each-ref", "--format=%(refname)", f"refs/heads/trainbridge/fan.cand/{other.name}") == ""


def test_a_gate_on_a_slot_runs_pinned_to_the_slots_cores(tmp_path):
    """The pinned child is the gate's process; its sandbox children inherit the mask (sched_setaffinity)."""
    from trainbridge.graph.team.devices import Slot
    from trainbridge.graph.team.gate_jobs import GateJobError, judge_on_slot

    core = sorted(os.sched_getaffinity(0))[-1]
    job = GateJob(index=0, candidate={"name": "c"}, baseline_root=str(tmp_path / "nowhere"), baseline_sha="0" * 40,
                  candidate_root=str(tmp_path / "nowhere"), candidate_sha="0" * 40, target="cpu", rounds=2,
                  max_rounds=2, min_gain=0.05)
    probe = tmp_path / "probe.py"  # stands in for the worker: prints its mask and device visibility, answers nothing
    probe.write_text("import os, sys\nprint(sorted(os.sched_getaffinity(0)), os.environ.get('CUDA_VISIBLE_DEVICES'), "
                     "file=sys.stderr)\n", encoding="utf-8")
    with pytest.raises(GateJobError) as failed:
        judge_on_slot(job, Slot(index=1, kind="cuda", device=3, cores=(core,)), worker=[sys.executable, str(probe)])
    assert f"[{core}] 3" in str(failed.value)


@pytest.mark.slow
def test_two_slots_end_with_the_same_rewrites_and_outcomes_as_one(tmp_path, monkeypatch):
    """What a run of the loop workload decides is known by construction (loop_fixtures.decided_by_construction;
    tests/test_loop.py holds a sequential run to DECISIONS): the two-slot run must decide that, each candidate once."""
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "two-slots" / "repo")
    config = loop_config(repo, "two-slots", tmp_path / "two-slots", devices="cpu:2")
    started = time.monotonic()
    outcome = start_run(config, root=tmp_path / "home" / "runs")
    print(f"\nloop workload on two slots: {time.monotonic() - started:.1f} s")
    assert outcome.finished, outcome.state.get("node")
    two = outcome.state
    assert two["parallel"]
    # judged two at a time: one batch held both candidates, against one head
    batches = [t for t in two["phase_times"] if t["node"] == "batch"]
    gates = [t for t in two["phase_times"] if t["node"] == "profiler"]
    assert len(gates) == 2 and batches, two["phase_times"]
    view = outcome_view(two["verdicts"])
    assert decided_by_construction(view), [(v["candidate"], v["reason"], v["message"]) for v in two["verdicts"]]
    assert sorted(a["recipe_id"] for a in two["accepted"]) == ([GOOD_RECIPE] if view[0][2] else [])
    assert two["candidates_tried"] == 2
    # the knowledge base learnt the same: one outcome per decided candidate, the same verdicts
    kb_view = sorted((o.category, o.recipe_id, o.verdict.split(":")[0]) for o in run_outcomes(config.kb_dir, "two-slots"))
    assert kb_view == [(category, recipe, reason) for category, recipe, _, reason in view]
    assert sorted(o.id for o in run_outcomes(config.kb_dir, "two-slots")) == \
           sorted({f"outcome-two-slots-{v['candidate']}" for v in two["verdicts"] if v["candidate"]})
    commits = run_commits(repo, two["base_sha"], "trainbridge/two-slots")
    assert [c["sha"] for c in commits] == [a["sha"] for a in two["accepted"]]
    assert len({c["candidate"] for c in commits}) == len(commits)
    assert_clean_repository(repo, "two-slots")
    assert Path(two["report_paths"][0]).is_file()
