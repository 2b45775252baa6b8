"""Gates judged at once (`--devices cpu:2`, `npu:0-7`, `--ray`): the graph's fan-out and merge.

    retrieval ─► batch ─► gate (one Send per candidate, one slot each) ─► merge ─┐
                  ▲          ▲                                                  │
                  │          └── accepted against a head that moved: re-gate ◄──┤
                  └──────────── next batch, or analyst after an accept ◄────────┘

`batch` fills up to one lane per slot: an intent with its recipes left (the retrieval agent's
ranking), and the coder makes each lane's next candidate against the same run head. Each `gate`
runs in its own slot (graph/team/gate_jobs.py, graph/team/ray_gates.py) and adds its verdict to
`gate_results` (a reducer: verdicts arrive in any order, none is lost; a gate that was killed
reruns on resume, the others' verdicts are kept by the checkpoint). `merge` takes them in batch
order: the run branch still moves one verified commit at a time, so an accepted candidate judged
against a head that has since moved is carried onto the new head (graph/team/rebase.py) and judged
again, never stacked unmeasured; its verdict is recorded when that second gate decides.
"""

from __future__ import annotations

from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import Send

from trainbridge.agents.coder.attempts import coder_turn
from trainbridge.agents.coder.candidate import Candidate
from trainbridge.agents.retrieval.choose import choose_intent
from trainbridge.agents.retrieval.sites import tried_key
from trainbridge.graph import npu_pending
from trainbridge.graph.context import RunContext
from trainbridge.graph.detached_views import detached_view
from trainbridge.graph.team.gate_jobs import GateJob
from trainbridge.graph.nodes import (PARTS_KEY, failure_tail, gate_summary, learn_recipe, record_outcome, tried_sites, verdict_line,
                                    verdict_record)
from trainbridge.graph.team.rebase import carry_forward
from trainbridge.graph.state import RunState
from trainbridge.graph.stops import NO_INTENTS, RunStopped, limit_reached
from trainbridge.records import Intent


def gate_width(ctx: RunContext) -> int:
    """How many gates at once: the slots of --devices (with --ray and no --devices: the cluster's devices)."""
    from trainbridge.graph.team.devices import slot_count
    from trainbridge.sandbox.backends import npu_emulated

    if ctx.config.target == "npu" and npu_emulated():
        raise RunStopped("parallel gates need real devices: without an NPU the gates only check numerics and the "
                         "rewrites stack one by one on the pending branch; run without --devices/--ray here")
    if ctx.config.devices:
        return slot_count(ctx.config.devices)
    from trainbridge.graph.team.ray_gates import cluster_width

    return cluster_width(ctx.config)


def route_after_retrieval(state: RunState) -> Literal["coder", "decide", "batch", "report"]:
    """The loop's router after retrieval, with the batch path when gates run side by side (`parallel`,
    written by prepare from the run's settings: a router may run without the run's context)."""
    from trainbridge.graph.nodes import route_after_retrieval as one_at_a_time

    if state.get("current_intent") is not None and state.get("parallel"):
        return "batch"
    return one_at_a_time(state)


# --- batch ---------------------------------------------------------------------------------------


def batch(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """Up to one candidate per slot, all against the run head: lanes carried over keep their queues."""
    ctx = runtime.context
    width = gate_width(ctx)
    workspace = ctx.workspace(state["base_sha"])
    head = workspace.head_sha
    intents = {i["id"]: i for i in state.get("intents", [])}
    done = set(state.get("done_intents", []))
    lanes = [lane for lane in state.get("lanes") or [] if lane["intent"]["id"] in intents and lane["intent"]["id"] not in done]
    verdicts = list(state.get("verdicts", []))
    refusals: list[dict[str, Any]] = []
    newly_done: list[str] = []
    jobs: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    overlay = npu_pending.pending_head(ctx, workspace)
    while len(jobs) < width:
        taken = done | set(newly_done) | {lane["intent"]["id"] for lane in kept}
        if not lanes:
            choice = choose_intent(state.get("intents", []), done=taken, kb=ctx.kb, target=ctx.config.target,
                                   allowed=ctx.config.recipe_ids)
            if choice is None:
                break
            tried = {v.get("recipe_id") for v in verdicts + refusals if v.get("intent_id") == choice.intent.id}
            site = ((state.get("intent_evidence") or {}).get(choice.intent.id) or {}).get("site")  # its code, judged before?
            tried |= {r for r in choice.queue if site and tried_key(r, site) in set(state.get("tried_sites") or [])}
            lanes = [{"intent": choice.data, "queue": [r for r in choice.queue if r not in tried]}]
        lane = lanes.pop(0)
        intent = Intent.model_validate(lane["intent"])
        turn = coder_turn(workspace, intent, lane["queue"], kb=ctx.kb, llm=ctx.llm, verdicts=verdicts + refusals,
                          feedback=None, target=ctx.config.target, overlay=overlay, say=ctx.say)
        refusals += turn.refusals
        if turn.candidate is None:
            newly_done.append(intent.id)
            continue
        kept.append({"intent": lane["intent"], "queue": turn.queue})
        jobs.append(_job(ctx, workspace, turn.candidate, index=len(jobs), head=head, baseline_step_s=state.get("baseline_step_s"),
                         intent=intent, overlay=overlay, state=state).model_dump(mode="json"))
    update: dict[str, Any] = {"node": "batch", "lanes": kept + lanes, "batch": jobs, "batch_head": head,
                              "gate_results": None, "verdicts": refusals, "done_intents": newly_done,
                              "tried_sites": tried_sites(state, refusals)}
    if not jobs:
        update["stop_reason"] = state.get("stop_reason") or NO_INTENTS.message
    else:
        ctx.say(f"judging {len(jobs)} candidate(s) at once against {head[:12]}: {', '.join(j['candidate']['name'] for j in jobs)}")
    return update


def _job(ctx: RunContext, workspace, candidate: Candidate, *, index: int, head: str, baseline_step_s: float | None = None,
         intent: Intent | None = None, overlay: str | None = None, state: RunState | None = None) -> GateJob:
    recipe = ctx.kb.get_recipe(candidate.recipe_id) if candidate.recipe_id else None
    view = detached_view(workspace, f"gate-base-{index}", head)  # each slot reads a baseline of its own
    reference = None
    if recipe is not None and recipe.numerics.precision_reference is not None and intent is not None:
        from trainbridge.agents.coder.precision_reference import make_reference

        reference = make_reference(workspace, intent, recipe, overlay=overlay)
    reference_root = reference.worktree if reference is not None else None
    reference_what = None
    if reference_root is None and state is not None:  # a candidate stacked on a precision change (graph/npu_pending.py)
        pending = npu_pending.pending_reference(ctx, workspace, state, view=f"{npu_pending.PENDING_REFERENCE_VIEW}-{index}")
        reference_root, reference_what = (str(pending), npu_pending.PENDING_REFERENCE) if pending is not None else (None, None)
    return GateJob(index=index, candidate=candidate.model_dump(mode="json"), baseline_root=str(view), baseline_sha=head,
                   candidate_root=candidate.worktree, candidate_sha=candidate.sha, target=ctx.config.target,
                   numerics=recipe.numerics.model_dump(mode="json", by_alias=True) if recipe is not None else None,
                   rounds=ctx.config.gate_rounds, max_rounds=ctx.config.gate_rounds_limit, min_gain=ctx.config.min_gain,
                   launch=ctx.config.launch, slot=index, baseline_step_s=baseline_step_s,
                   reference_root=reference_root, reference_what=reference_what,
                   reference_name=reference.name if reference is not None else None)


def route_after_batch(state: RunState, runtime: Runtime[RunContext]) -> list[Send] | Literal["report"]:
    if not state.get("batch"):
        return "report"
    return [Send("gate", {"job": job}) for job in state["batch"]]


# --- gate ----------------------------------------------------------------------------------------


def gate(job_state: dict[str, Any], runtime: Runtime[RunContext]) -> dict[str, Any]:
    """One candidate's gate on its slot. Writes only `gate_results` (and its time): gates run side by
    side in one step, so they must not write the channels that hold one value."""
    ctx = runtime.context
    job = GateJob.model_validate(job_state["job"])
    ctx.say(f"gate on slot {job.slot}: {job.candidate['name']}")
    if ctx.config.ray is not None:
        from trainbridge.graph.team.ray_gates import judge_on_ray

        verdict = judge_on_ray(ctx, job)
    else:
        from trainbridge.graph.team.devices import host_slots
        from trainbridge.graph.team.gate_jobs import judge_on_slot

        verdict = judge_on_slot(job, host_slots(ctx.config.devices, target=ctx.config.target)[job.slot])
    return {"gate_results": [{"index": job.index, "job": job.model_dump(mode="json"), "verdict": verdict}],
            PARTS_KEY: dict(verdict.get("phase_seconds") or {})}


# --- merge ---------------------------------------------------------------------------------------


def merge(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """Decide the batch in its order. Idempotent on resume: accepts are compare-and-swap (an accepted
    candidate is found again by its trailer), outcomes have deterministic ids, a rebase is redone."""
    ctx = runtime.context
    workspace = ctx.workspace(state["base_sha"])
    results = sorted(state.get("gate_results") or [], key=lambda r: r["index"])
    head = state["batch_head"]
    lanes = {lane["intent"]["id"]: lane for lane in state.get("lanes") or []}
    records, accepted, done, stale = [], [], [], []
    low_gain = state.get("low_gain_rounds") or 0
    for result in results:
        job, verdict = GateJob.model_validate(result["job"]), result["verdict"]
        candidate = Candidate.model_validate(job.candidate)
        if job.reference_name:  # the precision reference has served its gate
            workspace.reject_candidate(job.reference_name)
        lane = lanes.get(candidate.intent_id) or {"intent": None, "queue": []}
        if verdict["accepted"] and job.baseline_sha != head:
            stale.append((job, candidate, lane))
            continue
        record = verdict_record(candidate, accepted=verdict["accepted"], reason=verdict["reason"], message=verdict["message"],
                                 ratio=verdict.get("ratio"), ratio_ci=verdict.get("ratio_ci"))
        record["gate"] = gate_summary(verdict)  # the rounds the report plots, as the one-gate path keeps them
        if verdict.get("precision_reference"):  # later candidates on the pending branch are judged against its head too
            record["precision_reference"] = verdict["precision_reference"]
        intent_state = {"current_intent": lane["intent"] or _intent_of(state, candidate), "verdict": verdict}
        if verdict["accepted"]:
            moved = workspace.accept_candidate(candidate.name)
            head = moved.sha
            record["sha"] = moved.sha
            accepted.append(record)
            if candidate.recipe_id is None:
                learn_recipe(ctx, workspace, candidate, {**state, **intent_state})
            gain = 1.0 - (verdict.get("ratio") or 1.0)
            low_gain = 0 if gain >= 2 * ctx.config.min_gain else low_gain + 1
            done.append(candidate.intent_id)
        elif verdict["reason"] == "speed_unmeasured_numerics_ok":
            record["pending_branch"], record["sha"] = npu_pending.stack_on_pending(ctx, workspace, candidate)
            workspace.reject_candidate(candidate.name)
            done.append(candidate.intent_id)
        else:
            workspace.reject_candidate(candidate.name)
            if not lane["queue"]:
                done.append(candidate.intent_id)
        record_outcome(ctx, intent_state, candidate, record)
        records.append(record)
        ctx.say(verdict_line(candidate.name, record["reason"], record["message"]))
        tail = failure_tail(verdict)
        if tail:
            ctx.say(tail)
    regate = []
    for job, candidate, lane in stale:
        moved, how = carry_forward(workspace, candidate, lambda: _recode(ctx, workspace, candidate, lane))
        if moved is None:
            record = verdict_record(candidate, accepted=False, reason="stale_conflict", message=how)
            record_outcome(ctx, {"current_intent": lane["intent"] or _intent_of(state, candidate), "verdict": None},
                            candidate, record)
            records.append(record)
            done.append(candidate.intent_id)
            continue
        ctx.say(f"{candidate.name} was judged against {job.baseline_sha[:12]}; {how} onto {head[:12]}: judged again")
        view = detached_view(workspace, f"gate-base-{len(regate)}", head)
        regate.append(job.model_copy(update={"index": len(regate), "slot": len(regate), "candidate": moved.model_dump(mode="json"),
                                             "candidate_sha": moved.sha, "candidate_root": moved.worktree,
                                             "baseline_root": str(view), "baseline_sha": head,
                                             "reference_root": None, "reference_what": None, "reference_name": None}).model_dump(mode="json"))
    keep = [lane for key, lane in lanes.items() if key not in done]
    return {"node": "merge", "verdicts": records, "tried_sites": tried_sites(state, records), "accepted": accepted,
            "done_intents": done, "low_gain_rounds": low_gain,
            "candidates_tried": (state.get("candidates_tried") or 0) + len(results), "batch": regate, "batch_head": head,
            "landed": bool(accepted),
            "gate_results": None, "lanes": keep, "candidate": None, "verdict": None}


def _recode(ctx: RunContext, workspace, candidate: Candidate, lane: dict[str, Any]) -> Candidate | None:
    """The candidate made again from its recipe on the new run head (its patch no longer applies)."""
    if candidate.recipe_id is None or lane["intent"] is None:
        return None
    turn = coder_turn(workspace, Intent.model_validate(lane["intent"]), [candidate.recipe_id], kb=ctx.kb, llm=None,
                      verdicts=[], feedback=None, target=ctx.config.target, overlay=None, say=ctx.say)
    return turn.candidate


def _intent_of(state: RunState, candidate: Candidate) -> dict[str, Any]:
    found = next((i for i in state.get("intents", []) if i["id"] == candidate.intent_id), None)
    if found is None:
        raise RunStopped(f"candidate {candidate.name} names intent {candidate.intent_id}, which the run no longer knows")
    return found


def route_after_merge(state: RunState, runtime: Runtime[RunContext]) -> list[Send] | Literal["batch", "analyst", "report"]:
    if state.get("batch"):
        return [Send("gate", {"job": job}) for job in state["batch"]]  # moved heads: judged again before anything new
    if limit_reached(state, runtime.context.config) is not None:
        return "report"
    return "analyst" if state.get("landed") else "batch"  # fusions interact and lines move: re-profile after an accept
