"""Why a run stops, in one place: the typed stop reasons, the limits that end the loop (time budget,
candidate limit, diminishing returns), and the exception for a run that cannot go on at all.

The retrieval node (before every intent, the first included) and the router after `decide` ask
`limit_reached`; the report node states `stop_reason`; nothing else compares stop strings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RunStopped(RuntimeError):
    """The run cannot continue (unsafe repository, baseline fails); the message says why."""


class StopReason(StrEnum):
    no_intents = "no_intents"  # retrieval found nothing left to try
    budget_spent = "budget_spent"
    budget_short = "budget_short"  # time left, but less than a typical candidate and the closing comparison
    candidate_limit = "candidate_limit"
    low_gain = "low_gain"


@dataclass(frozen=True)
class Stop:
    reason: StopReason
    message: str  # what the report and the CLI say


NO_INTENTS = Stop(StopReason.no_intents, "no intents left")


def closing_comparison_runs(config) -> bool:
    """Whether the report node will measure anything: not for an NPU target on the emulation, whose candidates wait
    on the pending branch with their speed unmeasured (none is accepted here, so nothing is compared)."""
    if config.target != "npu":
        return True
    from trainbridge.sandbox.backends import npu_emulated

    return not npu_emulated()


def final_comparison_s(state: dict[str, Any], config, typical_gate_s: float, rounds: int | None = None) -> float:
    """What the closing comparison will take over `rounds` rounds (default: all of `final_rounds`): a fresh child
    per arm and round, each as long as the run's own child (`baseline_child_s`, re-estimated after every gate),
    plus the compiled arm's compile once (the analyst's torch.compile reference took that long); never less than
    the same children counted against a typical gate's. Nothing where it will not run (`closing_comparison_runs`)."""
    if not closing_comparison_runs(config):
        return 0.0
    rounds = config.final_rounds if rounds is None else rounds
    arms = 3 if config.compile_reference else 2
    measured = arms * rounds * baseline_child_s(state) + (compile_s(state) if config.compile_reference and rounds else 0.0)
    return max(measured, typical_gate_s * (arms * rounds) / (2 * config.gate_rounds))


def compile_s(state: dict[str, Any]) -> float:
    """The analyst's torch.compile reference's time (what the closing comparison's compiled arm spends once)."""
    return max((t.get("parts", {}).get("reference", 0.0) for t in state.get("phase_times") or [] if t["node"] == "analyst"),
               default=0.0)


def closing_rounds_that_fit(state: dict[str, Any], config) -> int:
    """How many of the closing comparison's `final_rounds` fit in the time the budget has left (the report node
    runs that many, so the budget holds whatever the estimates said when the last candidate started)."""
    left = config.budget_s - elapsed_s(state, config)
    typical = typical_gate_s(state, config)
    fitting = [k for k in range(config.final_rounds, 0, -1) if final_comparison_s(state, config, typical, rounds=k) <= left]
    return fitting[0] if fitting else 0


def closing_round_fits(state: dict[str, Any], config, round_s: float) -> bool:
    """Whether one more round of the closing comparison, as long as its rounds so far (`round_s`), ends within the
    budget: asked between its rounds, so the budget holds whatever `closing_rounds_that_fit` had estimated (a real
    gpt2_pretrain run's 3 closing rounds took 912 s where ~500 s were estimated: each round's compiled arm is a fresh
    child that compiles again, and a fresh child costs more than a gate round)."""
    return elapsed_s(state, config) + round_s <= config.budget_s


def gate_round_s(state: dict[str, Any]) -> float | None:
    """A timed gate round as the run's latest gates measured it (the median over the last three that timed any):
    how long a child of the program takes on this machine now. None before a gate has timed a round."""
    per_round = [gate["timing_s"] / (gate["rounds"] - 1) for v in state.get("verdicts") or []
                 if (gate := v.get("gate") or {}).get("timing_s") and (gate.get("rounds") or 0) > 1]
    recent = sorted(per_round[-3:])
    return recent[len(recent) // 2] if recent else None


def baseline_child_s(state: dict[str, Any]) -> float:
    """One sandbox child of the unmodified program as this machine runs it now: a round of the run's latest gates
    once one has timed rounds, else the prepare node's child (0 before it has run). A slow first child (a cold
    machine, a busy minute) stops counting after the first gate."""
    latest = gate_round_s(state)
    if latest is not None:
        return latest
    return max((t.get("parts", {}).get("baseline", 0.0) for t in state.get("phase_times") or [] if t["node"] == "prepare"),
               default=0.0)


def typical_gate_s(state: dict[str, Any], config) -> float:
    """How long the next gate will take: the median of the run's gates so far; before the first one, a child per
    round of the gate's first look and two for the numerics probe, each as long as the run's baseline child. An NPU
    target on the emulation judges numerics only: its gate stops after the first round (and that round's drift
    child), so the first estimate is four children, not a look's rounds."""
    gates = sorted(t["wall_s"] for t in state.get("phase_times") or [] if t["node"] == "profiler")
    if gates:
        return gates[len(gates) // 2]
    rounds = (min(config.gate_rounds, 6) if closing_comparison_runs(config) else 2)  # timed rounds, or round + drift
    return (rounds + 2) * baseline_child_s(state)


def reanalysis_s(state: dict[str, Any]) -> float:
    """The analysis still to come before the next candidate: after a commit lands the loop re-analyses the new head
    first (fusions interact, lines move), which takes about as long as the run's last analysis without its compile
    reference (a re-analysis does not compile the original again: 58 s after a first analysis of 284 s, 256 s of them
    the reference, for gpt2_pretrain on the busy host); 0 once the head the last analysis counted (`eager_ops_sha`) is
    the last commit."""
    landed = [v.get("sha") for v in state.get("verdicts") or [] if v.get("sha")]
    if not landed or state.get("eager_ops_sha") == landed[-1]:
        return 0.0
    analyses = [t["wall_s"] - (t.get("parts") or {}).get("reference", 0.0) for t in state.get("phase_times") or []
                if t["node"] == "analyst"]
    return max(0.0, analyses[-1]) if analyses else 0.0


def elapsed_s(state: dict[str, Any], config) -> float:
    """The run's time so far against its budget: from its start, or, after a resume, from the resume's origin
    (`RunConfig.budget_origin`: the time the run was down is not counted)."""
    origin = getattr(config, "budget_origin", None) or state.get("started_at") or time.time()
    return time.time() - origin


def budget_allows_another(state: dict[str, Any], config) -> bool:
    """Time left for one more candidate as long as the typical one (`typical_gate_s`, the first one included), after
    the re-analysis of a new head when one is due (`reanalysis_s`: it was not counted, so a run could end an analysis
    past its budget), and then for the final comparison (`final_comparison_s`), so a run ends near its budget rather
    than one gate past it. Before the first gate the estimates rest on one child only: the first candidate needs room
    for one closing round, not all of them (the report node runs the rounds that fit: `closing_rounds_that_fit`)."""
    elapsed = elapsed_s(state, config) + reanalysis_s(state)
    typical = typical_gate_s(state, config)
    first = not any(t["node"] == "profiler" for t in state.get("phase_times") or [])
    rounds = min(1, config.final_rounds) if first else None
    return elapsed + typical + final_comparison_s(state, config, typical, rounds=rounds) <= config.budget_s


def budget_line(state: dict[str, Any], config) -> str:
    """Where the run stands against its budget, from its own figures (said as each candidate starts): time used, the next
    gate's and the closing comparison's estimates, and about how many more candidates like the typical one fit."""
    elapsed = elapsed_s(state, config)
    typical = typical_gate_s(state, config)
    closing = final_comparison_s(state, config, typical)
    more = int(max(0.0, config.budget_s - elapsed - closing - reanalysis_s(state)) // typical) if typical > 0 else None
    return (f"  budget: {elapsed / 60:.1f} of {config.budget_s / 60:.1f} min used; a gate about {typical / 60:.1f} min, "
            f"the closing comparison about {closing / 60:.1f} min"
            + (f"; room for about {more} more candidate(s) like that" if more is not None else ""))


def limit_reached(state: dict[str, Any], config) -> Stop | None:
    """The first limit that ends the loop now, or None while another candidate may be tried."""
    if not budget_allows_another(state, config):
        if elapsed_s(state, config) > config.budget_s:
            return Stop(StopReason.budget_spent, "time budget spent")
        return Stop(StopReason.budget_short, "time budget: not enough left for another candidate")
    if (state.get("candidates_tried") or 0) >= config.max_candidates:
        return Stop(StopReason.candidate_limit, f"candidate limit ({config.max_candidates}) reached")
    if (state.get("low_gain_rounds") or 0) >= config.low_gain_rounds_to_stop:
        return Stop(StopReason.low_gain, f"{config.low_gain_rounds_to_stop} accepted rounds below twice the minimum gain")
    return None


def stop_reason(state: dict[str, Any], config) -> str:
    """Why the loop stopped (called as the report node starts, before its own measurements)."""
    if state.get("stop_reason"):  # set by retrieval: nothing left to try
        return state["stop_reason"]
    return (limit_reached(state, config) or NO_INTENTS).message
