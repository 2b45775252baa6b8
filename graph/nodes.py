"""The loop's nodes: each a function of (state, runtime) that returns a partial state update.

Every node can be re-run after a crash (LangGraph restarts the interrupted node from its first line):
git operations are idempotent (candidate commits carry a trailer, accepts are compare-and-swap),
knowledge-base outcomes have deterministic ids, and measurements are simply taken again.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Literal

from langgraph.runtime import Runtime
from langgraph.types import interrupt

from trainbridge.agents.analyst.own_rewrites import split_own_rewrites, verdict_landed
from trainbridge.agents.coder.attempts import coder_turn
from trainbridge.agents.coder.candidate import Candidate
from trainbridge.agents.retrieval.choose import Choice, choose_intent, intent_coverage
from trainbridge.agents.retrieval.sites import site_fingerprint, tried_key
from trainbridge.graph import npu_pending
from trainbridge.graph.context import RunContext
from trainbridge.graph.detached_views import detached_view, remove_view
from trainbridge.graph.lines import Detail, ProgressLine, VerdictLine
from trainbridge.graph.team.devices import parallel_gates
from trainbridge.graph.npu_port import port_to_npu
from trainbridge.graph.review import REVIEW_SCHEMA_VERSION, ReviewDecision, review_payload
from trainbridge.graph.state import RunState
from trainbridge.graph.stops import NO_INTENTS, RunStopped, budget_line, closing_round_fits, closing_rounds_that_fit, limit_reached, stop_reason
from trainbridge.knowledge.schema import Outcome
from trainbridge.records import Intent
from trainbridge.sandbox.backends import npu_emulated
from trainbridge.sandbox.workload import Workload
from trainbridge.tools.report.sections import intent_record


PARTS_KEY = "_parts"  # a node's sub-phase seconds; builder.timed moves them into `phase_times`


# --- prepare -------------------------------------------------------------------------------------


def prepare(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    ctx = runtime.context
    workspace = ctx.workspace(state.get("base_sha") or "HEAD")
    update: dict[str, Any] = {"node": "prepare", "base_sha": workspace.info.base_sha, "run_branch": workspace.branch,
                              "parallel": parallel_gates(ctx.config)}
    if not state.get("started_at"):
        update["started_at"] = time.time()
    if ctx.config.target == "npu" and not state.get("ported"):
        update["ported"] = port_to_npu(ctx, workspace)
    if state.get("baseline_step_s") is None:
        ctx.say("measuring the baseline step")
        started = time.monotonic()
        result = _measure(ctx.config.workload(workspace.worktree), ctx)
        if result.failure is not None:
            raise RunStopped(f"the unmodified program fails in the sandbox ({result.failure.kind}): {result.failure.message}")
        update["baseline_step_s"] = result.median_step_s()
        update["baseline_kernels"] = result.kernels_per_step  # NPU kernels per step on the emulated device (else None)
        if result.mode == "script":  # once per run: is the program repeatable under one seed? (the gate needs to know)
            update["determinism"] = _determinism(ctx.config.workload(workspace.worktree), result, ctx)
        update[PARTS_KEY] = {"baseline": round(time.monotonic() - started, 3)}
    return update


def _determinism(workload: Workload, measured, ctx: RunContext) -> dict[str, Any]:
    """The baseline run once more with the same seed, its losses compared with `measured`'s."""
    from trainbridge.sandbox.script.determinism import check_repeatable

    try:
        report = check_repeatable(workload, backend=ctx.config.target, first=measured)
    except RuntimeError as exc:
        raise RunStopped(f"the unmodified program fails in the sandbox on its second run: {exc}") from None
    if not report.repeatable:
        ctx.say(f"{report.message}; the gate judges it with the numerics checks that still apply")
    return report.model_dump(mode="json")


def _measure(workload: Workload, ctx: RunContext):
    from trainbridge.sandbox.runner import run_workload

    return run_workload(workload, backend=ctx.config.target)


# --- analyst -------------------------------------------------------------------------------------


def analyst(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    from trainbridge.agents.analyst.analyze import analyze_repo
    from trainbridge.agents.analyst.earlier_reference import earlier_lookup

    ctx = runtime.context
    workspace = ctx.workspace(state["base_sha"])
    ctx.say("analysing the run branch head")
    pack = Path(ctx.config.reference_pack) if ctx.config.reference_pack else None
    first = not state.get("analyses")
    head = workspace.worktree
    pending = npu_pending.pending_head(ctx, workspace)
    if pending is not None:
        head = npu_pending.pending_view(workspace, pending)  # emulated NPU: rewrites stack on the pending branch: analyse its head
    # the reference is compiled (or read from the pack) once, on the original; a later head is analysed with its counts
    # for every region whose code is unchanged since (found by site, not by its moved lines)
    earlier = None if first else earlier_lookup(state.get("intent_evidence") or {}, lambda i: site_fingerprint(head, i))
    analysis = analyze_repo(ctx.config.workload(head), backend=ctx.config.target, reference_pack=pack if first else None,
                            compile_reference=ctx.config.compile_reference and first,
                            on_phase=_server_starter(ctx, workspace.worktree) if first else None, earlier=earlier)
    done = set(state.get("done_intents", []))
    wanted = set(ctx.config.categories) if ctx.config.categories else None
    found = split_own_rewrites(analysis.intents, head, state["base_sha"], state.get("verdicts", []))
    if found.own:
        ctx.say(f"skipping {len(found.own)} finding(s) on lines this run already rewrote: "
                f"{', '.join(str(i.category) for i in found.own)}")
    intents = [i for i in found.kept if i.id not in done and (wanted is None or str(i.category) in wanted)]
    update: dict[str, Any] = {
        "node": "analyst",
        "intents": [i.model_dump(mode="json") for i in intents],
        "intent_evidence": {i.id: intent_record(i, site_fingerprint(head, i)) for i in found.kept},
        "analyses": (state.get("analyses") or 0) + 1,
        "eager_ops_now": analysis.eager_ops_per_step,
        "eager_ops_sha": pending or workspace.head_sha,  # which head `eager_ops_now` counts (the report's "after")
        PARTS_KEY: {_ANALYSIS_PARTS.get(phase, phase): seconds for phase, seconds in analysis.phase_seconds.items()},
    }
    if first:
        update["eager_ops_before"] = analysis.eager_ops_per_step
        update["reference_step_s"] = analysis.reference_step_s
        update["reference_kernels"] = dict(analysis.reference.kernels_per_step) if analysis.reference is not None else None
    return update


_ANALYSIS_PARTS = {"static_scan": "static", "target_profile": "profile", "reference": "reference"}
_MEASURED_PHASES = ("static_scan", "target_profile")  # the analyst's phases that time the program: no server starts beside them


def _server_starter(ctx: RunContext, head: Path):
    """An analysis phase callback that launches the first gate's fork servers once the analyst's timed
    phases are over (its compile reference takes a minute or more: their imports overlap it)."""
    from trainbridge.agents.profiler.judge import ready_servers

    started = False

    def on_phase(phase: str) -> None:
        nonlocal started
        if started or phase in _MEASURED_PHASES:
            return
        started = True
        launched = ready_servers(head, target=ctx.config.target, launch=ctx.config.launch)
        if launched:
            ctx.say(f"starting {launched} fork server(s) for the gate in the background")

    return on_phase


# --- retrieval -----------------------------------------------------------------------------------


def retrieval(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """The retrieval agent picks the best remaining intent and the recipes to try for it, best first."""
    ctx = runtime.context
    done, tried = set(state.get("done_intents", [])), set(state.get("tried_sites") or [])
    sites = {key: (evidence or {}).get("site") for key, evidence in (state.get("intent_evidence") or {}).items()}
    tried_before: list[str] = []  # intents found again after a re-analysis, every recipe already tried on their code
    while True:
        choice = choose_intent(state.get("intents", []), done=done | set(tried_before), kb=ctx.kb,
                               target=ctx.config.target, allowed=ctx.config.recipe_ids)
        site = sites.get(choice.data.get("id")) if choice is not None else None
        fresh = [r for r in choice.queue if site is None or tried_key(r, site) not in tried] if choice is not None else []
        if choice is None or fresh:
            break
        ctx.say(f"intent {choice.intent.category} at {', '.join(str(s) for s in choice.intent.spans)}: its recipes were "
                "all tried on this code before (its lines moved since); not again")
        tried_before.append(choice.data["id"])
    seen = {"done_intents": tried_before} if tried_before else {}
    if choice is None:
        return {"node": "retrieval", "current_intent": None, "recipe_queue": [],
                "stop_reason": state.get("stop_reason") or NO_INTENTS.message, **seen}
    if len(fresh) < len(choice.queue):
        ctx.say(f"  {len(choice.queue) - len(fresh)} recipe(s) were tried on this code before; not again")
        choice = Choice(choice.data, choice.intent, fresh, choice.last_resort)
    stop = limit_reached(state, ctx.config)  # the budget holds from the first candidate on, not only after a verdict
    if stop is not None:
        ctx.say(f"not starting a candidate for intent {choice.intent.category}: {stop.message}")
        return {"node": "retrieval", "current_intent": None, "recipe_queue": [], "stop_reason": stop.message, **seen}
    ctx.say(f"intent {choice.intent.category} at {', '.join(str(s) for s in choice.intent.spans)}: {len(choice.queue)} "
            f"{'last-resort ' if choice.last_resort else ''}recipe(s)")
    ctx.say(budget_line(state, ctx.config))  # the run's own ETA (issue 27)
    return {"node": "retrieval", "current_intent": choice.data, "recipe_queue": choice.queue, "candidate": None,
            "review_feedback": None, "verdict": None, **seen}


def route_after_retrieval(state: RunState) -> Literal["coder", "decide", "report"]:
    if state.get("current_intent") is None:
        return "report"
    return "coder" if state.get("recipe_queue") else "decide"


# --- coder ---------------------------------------------------------------------------------------


def coder(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """The coder agent applies the next recipe that fits; refusals are recorded as verdicts and the queue moves on."""
    ctx = runtime.context
    workspace = ctx.workspace(state["base_sha"])
    turn = coder_turn(workspace, Intent.model_validate(state["current_intent"]), state.get("recipe_queue", []), kb=ctx.kb,
                      llm=ctx.llm, verdicts=state.get("verdicts", []), feedback=state.get("review_feedback"),
                      target=ctx.config.target, overlay=npu_pending.pending_head(ctx, workspace), say=ctx.say)
    candidate = turn.candidate.model_dump(mode="json") if turn.candidate is not None else None
    return {"node": "coder", "candidate": candidate, "recipe_queue": turn.queue, "verdicts": turn.refusals,
            "tried_sites": tried_sites(state, turn.refusals)}


def tried_sites(state: RunState, records: list[dict[str, Any]]) -> list[str]:
    """recipe@site of each verdict record (agents/retrieval/sites.py): what a later analysis must not try again."""
    evidence = state.get("intent_evidence") or {}
    keys = []
    for record in records:
        site = (evidence.get(record.get("intent_id") or "") or {}).get("site")
        if site and record.get("recipe_id"):
            keys.append(tried_key(record["recipe_id"], site))
    return keys


def route_after_coder(state: RunState, runtime: Runtime[RunContext]) -> Literal["review", "profiler", "decide"]:
    if state.get("candidate") is None:
        return "decide"
    return "review" if runtime.context.config.review else "profiler"


# --- review --------------------------------------------------------------------------------------


def review(state: RunState) -> dict[str, Any]:
    """Only the interrupt: on resume a node restarts from its first line, so nothing else lives here."""
    decision = interrupt(review_payload(state))
    # by alias ("schema", not "schema_"): apply_review validates this dict again with the strict model
    return {"node": "review", "review_decision": ReviewDecision.model_validate(decision).model_dump(mode="json", by_alias=True)}


def route_after_review(state: RunState) -> Literal["apply_review", "profiler"]:
    decision = state.get("review_decision") or {}
    return "profiler" if decision.get("action") == "approve" else "apply_review"


def apply_review(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """A rejection goes back to the coder (next recipe) with its reason; an edit replaces the patch."""
    ctx = runtime.context
    decision = ReviewDecision.model_validate(state["review_decision"])
    candidate = Candidate.model_validate(state["candidate"])
    workspace = ctx.workspace(state["base_sha"])
    if decision.action == "reject":
        workspace.reject_candidate(candidate.name)
        record = verdict_record(candidate, accepted=False, reason="rejected_in_review", message=decision.reason or "rejected")
        record_outcome(ctx, state, candidate, record)
        return {"node": "apply_review", "candidate": None, "review_feedback": decision.reason, "verdicts": [record],
                "candidates_tried": (state.get("candidates_tried") or 0) + 1}
    from trainbridge.graph.review import apply_edit

    try:
        edited = apply_edit(workspace, candidate, decision.patch or "")
    except ValueError as exc:  # the reviewer's patch does not apply: drop the candidate, say why
        workspace.reject_candidate(candidate.name)
        record = verdict_record(candidate, accepted=False, reason="review_edit_failed", message=str(exc))
        return {"node": "apply_review", "candidate": None, "verdicts": [record], "review_feedback": str(exc)}
    return {"node": "apply_review", "candidate": edited.model_dump(mode="json"),
            "review_decision": {"action": "approve", "schema": REVIEW_SCHEMA_VERSION}}


def route_after_apply_review(state: RunState) -> Literal["coder", "profiler", "decide"]:
    if state.get("candidate") is not None:
        return "profiler"
    return "coder" if state.get("recipe_queue") else "decide"


# --- profiler ------------------------------------------------------------------------------------


class GateProgressLines:
    """The gate's progress as lines for the operator: the numerics check, then each timing round with the rounds
    planned so far (the sequential rule may look again later), the running candidate/baseline ratio (the gate's own
    estimate over the rounds it keeps; below 1 is faster) and the time the planned ones will take at the rounds' mean
    so far."""

    def __init__(self, say):
        self.say, self.started = say, time.monotonic()
        self.timing_since: float | None = None

    def __call__(self, phase: str, done: int, total: int, ratio: float | None = None) -> None:
        now = time.monotonic()
        so_far = f": candidate/baseline {ratio:.3f} so far" if ratio is not None else ""
        if phase == "numerics" and done == 0:
            self.say("  gate: numerics check (first round)")
        elif phase == "timing" and done == 0:
            self.timing_since = now
            self.say(f"  gate: numerics match; timing paired rounds ({now - self.started:.0f} s so far)")
        elif phase == "timing" and done == 1:  # the numerics check's own round, counted as it ends: no time of its own
            self.say(ProgressLine(f"  gate: round 1 of {total} planned{so_far} (the numerics check's round)", phase="gate",
                                  done=1, total=total))
        elif phase == "timing" and self.timing_since is not None:
            per_round = (now - self.timing_since) / (done - 1)  # the rounds timed after the numerics check's
            left = max(0, total - done) * per_round
            self.say(ProgressLine(f"  gate: round {done} of {total} planned{so_far} ({per_round:.1f} s a round; about {left:.0f} s "
                                  "to the next look)", phase="gate", done=done, total=total))


def profiler(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    from trainbridge.agents.profiler.judge import judge_candidate, speed_measurable

    ctx = runtime.context
    candidate = Candidate.model_validate(state["candidate"])
    workspace = ctx.workspace(state["base_sha"])
    recipe = ctx.kb.get_recipe(candidate.recipe_id) if candidate.recipe_id else None
    measurable = speed_measurable(ctx.config.target)
    ctx.say(f"gate: {candidate.name} ({f'{ctx.config.gate_rounds} interleaved rounds' if measurable else 'numerics only: no NPU here'})")
    reference, reference_root, reference_what = None, None, None  # what the candidate may match instead of the baseline
    if recipe is not None and recipe.numerics.precision_reference is not None and state.get("current_intent"):
        from trainbridge.agents.coder.precision_reference import make_reference

        reference = make_reference(workspace, Intent.model_validate(state["current_intent"]), recipe,
                                   overlay=npu_pending.pending_head(ctx, workspace))
        reference_root = Path(reference.worktree) if reference is not None else None
    if reference_root is None:
        reference_root = npu_pending.pending_reference(ctx, workspace, state)
        reference_what = npu_pending.PENDING_REFERENCE if reference_root is not None else None
    try:
        verdict = judge_candidate(workspace.worktree, Path(candidate.worktree), target=ctx.config.target,
                                  recipe_numerics=recipe.numerics if recipe is not None else None, rounds=ctx.config.gate_rounds,
                                  max_rounds=ctx.config.gate_rounds_limit, min_gain=ctx.config.min_gain, launch=ctx.config.launch,
                                  determinism=state.get("determinism"), sites=candidate.sites,
                                  baseline_step_s=state.get("baseline_step_s"),
                                  watched=(ctx.paths.config,),  # the run's settings: hashed over the gate (agents/profiler/tamper.py)
                                  on_progress=GateProgressLines(ctx.say),
                                  reference_root=reference_root, reference_what=reference_what)
    finally:
        if reference is not None:
            workspace.reject_candidate(reference.name)
    return {"node": "profiler", "verdict": verdict.model_dump(mode="json"), "candidates_tried": (state.get("candidates_tried") or 0) + 1,
            PARTS_KEY: dict(verdict.phase_seconds)}


# --- decide --------------------------------------------------------------------------------------


def decide(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    """Fast-forward or drop the candidate, record the outcome, and decide whether to go on."""
    ctx = runtime.context
    update: dict[str, Any] = {"node": "decide", "verdict": None}
    intent_data = state.get("current_intent")
    candidate_data = state.get("candidate")
    verdict = state.get("verdict")
    if candidate_data is not None and verdict is not None:
        candidate = Candidate.model_validate(candidate_data)
        workspace = ctx.workspace(state["base_sha"])
        record = verdict_record(candidate, accepted=verdict["accepted"], reason=verdict["reason"], message=verdict["message"],
                                 ratio=verdict.get("ratio"), ratio_ci=verdict.get("ratio_ci"))
        record["gate"] = gate_summary(verdict)
        recipe = ctx.kb.get_recipe(candidate.recipe_id) if candidate.recipe_id else None
        if recipe is not None and recipe.numerics.precision_change and (
                verdict["accepted"] or verdict["reason"] == "speed_unmeasured_numerics_ok"):
            record["precision_change"] = recipe.numerics.precision_change  # kept, flagged for review (tools/report/sections.py)
        if verdict.get("precision_reference"):  # later candidates on the pending branch are judged against its head too
            record["precision_reference"] = verdict["precision_reference"]
        if verdict["accepted"]:
            result = workspace.accept_candidate(candidate.name)
            record["sha"] = result.sha
            update["accepted"] = [record]
            if candidate.recipe_id is None:
                learn_recipe(ctx, workspace, candidate, state)
            gain = 1.0 - (verdict.get("ratio") or 1.0)
            update["low_gain_rounds"] = 0 if gain >= 2 * ctx.config.min_gain else (state.get("low_gain_rounds") or 0) + 1
        elif verdict["reason"] == "speed_unmeasured_numerics_ok":
            record["pending_branch"], record["sha"] = npu_pending.stack_on_pending(ctx, workspace, candidate)
            workspace.reject_candidate(candidate.name)
            # one pending rewrite per region: a second recipe for the same span would not apply on top
            # of the first on the pending branch (cherry-pick conflict), so the intent is done here
            update["recipe_queue"] = []
            update["done_intents"] = [candidate.intent_id]
        else:
            workspace.reject_candidate(candidate.name)
        record_outcome(ctx, state, candidate, record)
        update["verdicts"] = [record]
        update["tried_sites"] = tried_sites(state, [record])
        update["candidate"] = None
        ctx.say(verdict_line(candidate.name, record["reason"], record["message"]))
        tail = failure_tail(verdict)
        if tail:
            ctx.say(tail)
        if verdict["accepted"] or "done_intents" in update:
            update["done_intents"] = [candidate.intent_id]
            return update
    if state.get("recipe_queue") and not (verdict or {}).get("accepted"):
        return update  # try the next recipe for the same intent
    if intent_data is not None and intent_data["id"] not in state.get("done_intents", []):
        update["done_intents"] = [intent_data["id"]]
    return update


def route_after_decide(state: RunState, runtime: Runtime[RunContext]) -> Literal["coder", "retrieval", "analyst", "report"]:
    last = (state.get("verdicts") or [{}])[-1]
    if limit_reached(state, runtime.context.config) is not None:
        return "report"
    current = (state.get("current_intent") or {}).get("id")
    if verdict_landed(last) and state.get("candidate") is None and last.get("intent_id") == current and current in state.get("done_intents", []):
        return "analyst"  # fusions interact (and lines move): re-profile the new head before choosing again
    if state.get("recipe_queue") and state.get("current_intent") and state["current_intent"]["id"] not in state.get("done_intents", []):
        return "coder"
    return "retrieval"


# --- report --------------------------------------------------------------------------------------


def report(state: RunState, runtime: Runtime[RunContext]) -> dict[str, Any]:
    from trainbridge.tools.report.write import write_report

    ctx = runtime.context
    workspace = ctx.workspace(state["base_sha"])
    reason = stop_reason(state, ctx.config)  # before the closing measurements spend more of the budget
    final, comparison, parts = None, None, {}
    if state.get("accepted"):
        started = time.monotonic()
        rounds = closing_rounds_that_fit(state, ctx.config)  # the budget holds: as many rounds as fit in what is left
        if 0 < rounds < ctx.config.final_rounds:
            ctx.say(f"final comparison: {rounds} of {ctx.config.final_rounds} rounds fit in the budget's time left")
        if rounds > 0:
            comparison = _final_comparison(ctx, workspace, state["base_sha"], rounds,
                                           round_fits=lambda round_s: closing_round_fits(state, ctx.config, round_s))
        elif ctx.config.final_rounds > 0:
            ctx.say("no final comparison: the budget has no time left for one round of it")
        elif ctx.config.final_rounds == 0:
            ctx.say("measuring the final branch head")
            result = _measure(ctx.config.workload(workspace.worktree), ctx)
            final = result.median_step_s() if result.failure is None else None
        parts = {"final_comparison" if comparison else "final_measure": round(time.monotonic() - started, 3)}
    coverage = intent_coverage(state.get("intents", []), done=set(state.get("done_intents", [])), kb=ctx.kb, target=ctx.config.target,
                               allowed=ctx.config.recipe_ids)
    paths = write_report({**state, "intent_coverage": coverage.as_record()}, ctx.config, ctx.paths.report, final_step_s=final, stop_reason=reason,
                         emulated_npu=ctx.config.target == "npu" and npu_emulated(), kb_stats=_kb_stats(ctx),
                         final_comparison=comparison, kb_added=_kb_added(ctx, state), closing_s=parts)
    remove_view(workspace, npu_pending.PENDING_VIEW)
    workspace.cleanup()
    ctx.say(coverage.line())
    return {"node": "report", "stop_reason": reason, "report_paths": [str(p) for p in paths], "final_comparison": comparison,
            "intent_coverage": coverage.as_record(), PARTS_KEY: parts}


def _final_comparison(ctx: RunContext, workspace, base_sha: str, rounds: int, round_fits=None) -> dict[str, Any] | None:
    """The final head against the original (and torch.compile of it), interleaved; None when it cannot run."""
    from trainbridge.agents.profiler.final import FinalComparisonError, compare_final

    arms = "original, final head" + (", torch.compile of the original" if ctx.config.compile_reference else "")
    ctx.say(f"final comparison: {arms}, {rounds} interleaved rounds")
    original = detached_view(workspace, BASE_VIEW, base_sha)
    try:
        started = time.monotonic()  # the comparison took minutes without a line (issue 27): a line per round, with the time left
        result = compare_final(ctx.config.workload(original), ctx.config.workload(workspace.worktree), backend=ctx.config.target,
                               rounds=rounds, with_compile=ctx.config.compile_reference,
                               on_round=lambda done, total: ctx.say(ProgressLine(
                                   f"  final comparison: round {done} of {total} ({(time.monotonic() - started) / done:.0f} s a "
                                   f"round; about {(total - done) * (time.monotonic() - started) / done:.0f} s left)",
                                   phase="final comparison", done=done, total=total)),
                               round_fits=round_fits)
        if result.rounds < rounds:
            ctx.say(f"final comparison: stopped after {result.rounds} of {rounds} rounds: another would overrun the budget")
    except FinalComparisonError as exc:
        ctx.say(f"no final comparison: {exc}")
        return None
    finally:
        remove_view(workspace, BASE_VIEW)
    return result.model_dump(mode="json")


BASE_VIEW = "base-view"


def _kb_stats(ctx: RunContext) -> dict[str, Any] | None:
    try:
        return ctx.kb.stats().model_dump(mode="json")
    except Exception as exc:  # a report must still be written when the KB server went away overnight
        return {"error": str(exc)}


def _kb_added(ctx: RunContext, state: RunState) -> list[dict[str, Any]] | None:
    """The knowledge-base entries this run recorded (its outcomes, the recipes it learned), for the report's table;
    None when the knowledge base cannot be read (the report says so from `_kb_stats`)."""
    shas = {f"commit {a.get('sha')}" for a in state.get("accepted") or [] if a.get("sha")}
    try:
        learned = [r for r in ctx.kb.list_recipes() if r.provenance.kind == "learned" and shas & set(r.provenance.sources)]
        outcomes = [o for o in ctx.kb.all_outcomes() if o.run_id == ctx.config.run_id]
    except Exception:  # noqa: BLE001 - a report must still be written when the KB server went away overnight
        return None
    return ([{"kind": "learned recipe", "id": r.id, "recipe_id": r.id, "category": str(r.category), "verdict": None, "ratio": None}
             for r in learned]
            + [{"kind": "outcome", "id": o.id, "recipe_id": o.recipe_id, "category": str(o.category), "verdict": o.verdict,
                "ratio": o.ratio} for o in outcomes])


def learn_recipe(ctx: RunContext, workspace, candidate: Candidate, state: RunState) -> None:
    """An accepted LLM rewrite becomes a `learned` recipe, so the next run needs no LLM for it."""
    from trainbridge.agents.coder.learned import LearnedRecipeError, learned_recipe

    try:
        recipe = learned_recipe(candidate, Intent.model_validate(state["current_intent"]), repo_root=workspace.repo.root,
                                target=ctx.config.target)
    except LearnedRecipeError as exc:
        ctx.say(f"accepted LLM patch kept, but not generalised into a recipe: {exc}")
        return
    ctx.kb.upsert_recipe(recipe)
    ctx.say(f"learned recipe {recipe.id}")


# --- helpers -------------------------------------------------------------------------------------


def gate_summary(verdict: dict[str, Any]) -> dict[str, Any]:
    """What the run keeps of how the gate got there: its wall time, rounds, busy rounds, wait policy
    and the region lab's verdict and ratio (benchmarks/loop_cost.py reads them back)."""
    region = verdict.get("region") or {}
    speed = verdict.get("speed") or {}
    return {"wall_s": verdict.get("wall_s"), "rounds": len(verdict.get("baseline_rounds") or []),
            "timing_s": (verdict.get("phase_seconds") or {}).get("timing"),  # graph/stops.py re-estimates a child from it
            "busy_rounds": verdict.get("busy_rounds") or [], "wait_policy": verdict.get("wait_policy"),
            "region_verdict": region.get("verdict"), "region_ratio": region.get("ratio"), "region_interval": region.get("interval"),
            # per round, each side's median step (s): what the report plots the gate's decision from (busy rounds included)
            "round_medians": {"baseline": [statistics.median(r) for r in verdict.get("baseline_rounds") or [] if r],
                              "candidate": [statistics.median(r) for r in verdict.get("candidate_rounds") or [] if r]},
            "look_rounds": speed.get("look_rounds"), "min_gain": speed.get("min_gain"),
            "device_kernels": verdict.get("device_kernels")}  # NPU kernels per step of both sides, where the emulation counts them


def failure_tail(verdict: dict[str, Any]) -> Detail | None:
    """The failed child's traceback tail, for `-v` (the verdict line has its message)."""
    tail = ((verdict.get("failure") or {}).get("traceback_tail") or "").strip()
    return Detail("  child's stderr tail:\n" + "\n".join("    " + line for line in tail.splitlines())) if tail else None


VERDICT_LINE_CHARS = 600  # the figures, the interval and the numerics summary; the report holds the whole message


def verdict_line(name: str, reason: str, message: str) -> str:
    """What the CLI prints for a verdict: its reason and its message, figures first, cut only past
    `VERDICT_LINE_CHARS` (it used to be cut at 120, which lost a not_significant verdict's interval)."""
    text = message if len(message) <= VERDICT_LINE_CHARS else message[:VERDICT_LINE_CHARS].rsplit(" ", 1)[0] + " ... (the report has the rest)"
    return VerdictLine(f"verdict {name}: {reason} ({text})")


def verdict_record(candidate: Candidate, *, accepted: bool, reason: str, message: str, ratio=None, ratio_ci=None) -> dict[str, Any]:
    """The run's record of one decision; `unconfined` when this machine ran the candidate without the sandbox's
    confinement (a run allowed to with --unconfined)."""
    from trainbridge.sandbox.confinement import bubblewrap

    return {"intent_id": candidate.intent_id, "category": candidate.category, "recipe_id": candidate.recipe_id,
            "candidate": candidate.name, "files": candidate.files, "diff": candidate.diff, "accepted": accepted,
            "reason": reason, "message": message, "ratio": ratio, "ratio_ci": list(ratio_ci) if ratio_ci else None,
            "unconfined": not bubblewrap().usable}


def record_outcome(ctx: RunContext, state: RunState, candidate: Candidate, record: dict[str, Any]) -> None:
    intent = Intent.model_validate(state["current_intent"])
    versions = (state.get("verdict") or {}).get("candidate_versions") or {}
    outcome = Outcome(
        id=f"outcome-{ctx.config.run_id}-{candidate.name}",
        run_id=ctx.config.run_id, intent_id=intent.id, category=intent.category, evidence=intent.evidence,
        recipe_id=candidate.recipe_id, diff=candidate.diff,
        verdict="accepted" if record["accepted"] else f"{record['reason']}: {record['message']}"[:2000],
        ratio=record.get("ratio"), ratio_ci=tuple(record["ratio_ci"]) if record.get("ratio_ci") else None,
        backend=ctx.config.target, versions=versions,
    )
    ctx.kb.record_outcome(outcome)
