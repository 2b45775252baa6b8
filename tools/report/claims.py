"""The report's result: what was measured, and how far each figure may be trusted.

The gate's own per-commit figures lead (interleaved A/B rounds with an interval, at least 6 of them before
anything is accepted). The closing comparison follows: with `MIN_RESULT_ROUNDS` rounds or more it is stated
with its interval (in bold); with fewer it is indicative only, no interval, no verdict, no bold. A one-shot
figure (a single re-measurement of the final head, torch.compile timed once while the analyst compiled it)
says that it is one-shot and makes no faster / slower claim.
"""

from __future__ import annotations

import math
import re
from typing import Any

MIN_RESULT_ROUNDS = 6  # fewer interleaved rounds give no interval worth the name (the gate's first look is 6 too)


def ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1000:.1f} ms"


def ci_label(record: dict[str, Any]) -> str:
    """'93.75% CI': the level the gate's interval has, as its verdict message states it (the exact signed-rank test on 6
    rounds attains 93.75%, not the 95% the report printed); 'CI' when the message does not say."""
    found = re.search(r"(\d+(?:\.\d+)?)% CI", record.get("message") or "")
    return f"{found.group(1)}% CI" if found else "CI"


def combined_ci(ratios: list[tuple[float, tuple[float, float]]]) -> tuple[float, float] | None:
    """Approximate CI of a product of independently measured ratios: each interval's half-widths in
    log space, combined in quadrature (upper and lower sides separately)."""
    if not ratios:
        return None
    log_point = sum(math.log(r) for r, _ in ratios)
    low = math.sqrt(sum((math.log(r) - math.log(ci[0])) ** 2 for r, ci in ratios))
    high = math.sqrt(sum((math.log(ci[1]) - math.log(r)) ** 2 for r, ci in ratios))
    return math.exp(log_point - low), math.exp(log_point + high)


def few_rounds(comparison: dict[str, Any] | None) -> bool:
    return bool(comparison) and (comparison.get("rounds") or 0) < MIN_RESULT_ROUNDS


def result_lines(state: dict[str, Any], final_step_s: float | None) -> list[str]:
    """The paragraphs of the report's Result section, the gate's figures first."""
    accepted = state.get("accepted") or []
    if not accepted:
        pending = [v for v in state.get("verdicts") or [] if v.get("reason") == "speed_unmeasured_numerics_ok" and v.get("sha")]
        if pending:  # an NPU target without an NPU: verified numerics wait for hardware, nothing is faster yet
            return [f"No rewrite was accepted here: there is no NPU to measure speed on, so the run branch equals the base "
                    f"commit. {len(pending)} rewrite(s) with verified numerics wait on `{state.get('run_branch')}.pending-npu` "
                    f"(head `{pending[-1]['sha'][:12]}`) for `trainbridge verify` on an NPU host; their speed is unmeasured."]
        return ["No rewrite was accepted: the run branch equals the base commit."]
    baseline = state.get("baseline_step_s")
    lines = [gate_line(baseline, accepted)]
    comparison = state.get("final_comparison")
    if comparison:
        lines.append(" ".join(comparison_lines(comparison)))
    elif final_step_s and baseline:
        lines.append(one_shot_final_line(baseline, final_step_s, accepted))
    reference = reference_line(state)
    if reference:
        lines.append(reference)
    return [line for line in lines if line]


def gate_line(baseline: float | None, accepted: list[dict[str, Any]]) -> str:
    """Per accepted commit, the gate's ratio (candidate / the head before it) and interval, and their product; bold
    only when every commit's figure has its interval (the gate decided on 6 rounds or more)."""
    measured = [a for a in accepted if a.get("ratio")]
    if not measured:
        return "Accepted commits have no measured ratio (numerics-only verdicts)."

    def figure(record: dict[str, Any]) -> str:
        gate = record.get("gate") or {}
        busy = len(gate.get("busy_rounds") or [])
        rounds = (gate.get("rounds") or 0) - busy
        text = f"{record.get('category')} {record['ratio']:.3f}"
        if record.get("ratio_ci"):
            text += f" ({ci_label(record)} {record['ratio_ci'][0]:.3f}–{record['ratio_ci'][1]:.3f}"
            text += (f", {rounds} rounds" + (f" counted, {busy} left out as busy" if busy else "") + ")") if rounds > 0 else ")"
        return text

    product = math.prod(a["ratio"] for a in measured)
    combined = combined_ci([(a["ratio"], tuple(a["ratio_ci"])) for a in measured if a.get("ratio_ci")])
    levels = {ci_label(a) for a in measured if a.get("ratio_ci")}
    level = levels.pop() if len(levels) == 1 else "CI"
    interval = (f" (approximate {level} of the product {combined[0]:.3f}–{combined[1]:.3f}: the commits' intervals combined "
                "in quadrature on the log scale)") if combined and len(measured) > 1 else ""
    speed = f"{1 / product:.2f}x faster than the baseline of {ms(baseline)}"
    if all(a.get("ratio_ci") for a in measured):
        speed = f"**{speed}**"
    return (f"Gate-measured step-time ratios per accepted commit (candidate / previous head, interleaved A/B rounds): "
            f"{'; '.join(figure(a) for a in measured)}. Their product: ratio {product:.3f}{interval}, {speed}.")


def _ci(figure: dict[str, float], confidence: float = 0.95) -> str:
    return f"{figure['ratio']:.3f} ({confidence * 100:g}% CI {figure['ci_low']:.3f}–{figure['ci_high']:.3f})"


def comparison_lines(comparison: dict[str, Any]) -> list[str]:
    """The closing comparison: final head vs the original, and vs torch.compile of the original. From fewer than
    `MIN_RESULT_ROUNDS` rounds they are stated as indicative only: no interval, no verdict, no bold."""
    medians = comparison.get("median_step_s") or {}
    rounds = comparison.get("rounds")
    level = comparison.get("confidence") or 0.95
    final = comparison.get("final_vs_original")
    compiled = comparison.get("compiled_vs_original")
    lines = []
    if few_rounds(comparison):
        if final:
            lines.append(f"Closing comparison, final head vs the original over only {rounds} interleaved round(s): step-time "
                         f"ratio {final['ratio']:.3f} (original {ms(medians.get('original'))}, final {ms(medians.get('final'))}): "
                         f"indicative only, too few rounds for an interval (it takes {MIN_RESULT_ROUNDS}; `--final-rounds`).")
        if compiled:
            lines.append(f"torch.compile of the original in the same rounds: ratio to the original {compiled['ratio']:.3f} "
                         "(indicative only).")
    else:
        if final:
            verdict = (f"{1 / final['ratio']:.2f}x faster" if final["ci_high"] < 1 else
                       f"{final['ratio']:.2f}x the step time, slower" if final["ci_low"] > 1 else
                       f"{1 / final['ratio']:.2f}x, but the interval includes no change: more rounds would be needed to tell")
            lines.append(f"Closing comparison: **Final head vs the original: step-time ratio {_ci(final, level)}, {verdict}** "
                         f"(original {ms(medians.get('original'))}, final {ms(medians.get('final'))}; medians of {rounds} "
                         "interleaved rounds, a fresh sandbox child per program and round, rotated order).")
        versus = comparison.get("final_vs_compiled")
        if versus and compiled:
            side = "faster than" if versus["ci_high"] < 1 else "slower than" if versus["ci_low"] > 1 else "not distinguishable from"
            lines.append(f"torch.compile of the original (Inductor, measured in the same rounds): {ms(medians.get('original_compiled'))}, "
                         f"ratio to the original {_ci(compiled, level)}. Final head / torch.compile of the original: {_ci(versus, level)}: "
                         f"the final head is {side} torch.compile.")
    for arm, why in (comparison.get("failures") or {}).items():
        lines.append(f"The {arm.replace('_', ' ')} arm failed and is left out: {why}.")
    return lines


def one_shot_final_line(baseline: float, final: float, accepted: list[dict[str, Any]]) -> str:
    """A single plain measurement of the final head (`--final-rounds 0`): its figure, no claim."""
    text = (f"A single re-measurement of the final head, one-shot (not interleaved with the baseline, no interval, so no "
            f"claim): {ms(final)}; the baseline measured {ms(baseline)} when the run started.")
    product = math.prod(a["ratio"] for a in accepted if a.get("ratio"))
    if (final > baseline) != (product > 1):
        text += (" It points the other way from the gate's figures; a one-shot measurement can neither confirm nor overrule "
                 "them (`--final-rounds 6` measures the final head interleaved).")
    return text


def reference_line(state: dict[str, Any]) -> str | None:
    """torch.compile of the original as the analyst timed it once, when the closing comparison did not measure it: a
    one-shot figure, stated as such, with no faster / slower claim."""
    reference = state.get("reference_step_s")
    comparison = state.get("final_comparison") or {}
    if not reference or comparison.get("final_vs_compiled") or comparison.get("compiled_vs_original"):
        return None
    text = (f"torch.compile of the original, one-shot (timed once while the analyst compiled it, not interleaved with "
            f"anything): {ms(reference)}")
    if state.get("baseline_step_s"):
        text += f"; the eager baseline measured {ms(state['baseline_step_s'])} at the start"
    return text + ". A one-shot figure carries no interval: nothing here is claimed faster or slower than torch.compile."
