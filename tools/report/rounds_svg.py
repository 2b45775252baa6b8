"""A gate's decision as a small SVG: per round, candidate / baseline of the two sides' median steps.

Drawn from the rounds the run keeps with each verdict (graph/nodes.gate_summary's `round_medians`): a
point per round (hollow and grey where the machine was busy and the round was left out of the decision),
the line of no change, the accept line (1 - min_gain), the gate's ratio and its interval as a band, and
the rounds at which the gate looked. Self-contained (no script, no external reference); every text is
XML-escaped, so the page can inline it.
"""

from __future__ import annotations

from html import escape
from typing import Any

WIDTH, HEIGHT = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 150, 30, 34


def gate_rounds_svg(gate: dict[str, Any], *, ratio: float | None, ratio_ci: list[float] | tuple[float, float] | None,
                    title: str) -> str | None:
    """The plot, or None when the verdict kept no timed rounds."""
    medians = gate.get("round_medians") or {}
    base, cand = medians.get("baseline") or [], medians.get("candidate") or []
    rounds = [(b, c) for b, c in zip(base, cand) if b and c]
    if not rounds:
        return None
    ratios = [c / b for b, c in rounds]
    busy = set(gate.get("busy_rounds") or [])
    min_gain = gate.get("min_gain")
    accept_line = 1.0 - min_gain if min_gain else None
    values = [*ratios, 1.0, *(v for v in (accept_line, ratio) if v), *(ratio_ci or [])]
    low, high = min(values), max(values)
    pad = max((high - low) * 0.12, 0.01)
    low, high = low - pad, high + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(index: int) -> float:
        return LEFT + (plot_w * (index + 0.5) / len(rounds))

    def y(value: float) -> float:
        return TOP + plot_h * (high - value) / (high - low)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" aria-label="{escape(title)}" font-family="system-ui, sans-serif" font-size="11">',
             f'<title>{escape(title)}</title>',
             f'<text x="{LEFT}" y="16" font-size="12" font-weight="600">{escape(title)}</text>',
             f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafbfc" stroke="#d5dbe1"/>']
    if ratio_ci:
        top, bottom = y(max(ratio_ci)), y(min(ratio_ci))
        parts.append(f'<rect x="{LEFT}" y="{top:.1f}" width="{plot_w}" height="{max(bottom - top, 1):.1f}" fill="#1f7a4d" '
                     f'fill-opacity="0.13"><title>95% interval of the ratio: {min(ratio_ci):.3f}–{max(ratio_ci):.3f}</title></rect>')
        parts.append(_label(y((ratio_ci[0] + ratio_ci[1]) / 2), f"interval {min(ratio_ci):.3f}–{max(ratio_ci):.3f}", "#1f7a4d"))
    parts.append(_hline(y(1.0), "#5b6570", "") + _label(y(1.0), "1.0: no change", "#5b6570", dy=-4))
    if accept_line:
        parts.append(_hline(y(accept_line), "#b8860b", ' stroke-dasharray="5 3"')
                     + _label(y(accept_line), f"{accept_line:.3f}: min gain {min_gain:.0%}", "#b8860b", dy=11))
    if ratio:
        parts.append(_hline(y(ratio), "#1f7a4d", ' stroke-width="2"'))
    for look, after in look_positions(gate, len(rounds)):
        edge = LEFT + plot_w * after / len(rounds)
        parts.append(f'<line x1="{edge:.1f}" y1="{TOP}" x2="{edge:.1f}" y2="{TOP + plot_h}" stroke="#9aa4ae" '
                     f'stroke-dasharray="2 3"><title>the gate looked at {look} counted rounds (after round {after})</title></line>')
    for index, ((b, c), value) in enumerate(zip(rounds, ratios)):
        left_out = index in busy
        tip = (f"round {index + 1}: baseline {b * 1e3:.2f} ms, candidate {c * 1e3:.2f} ms, ratio {value:.3f}"
               + (" (left out: the machine was busy)" if left_out else ""))
        style = 'fill="none" stroke="#9aa4ae" stroke-width="1.5"' if left_out else 'fill="#1d232a"'
        parts.append(f'<circle cx="{x(index):.1f}" cy="{y(value):.1f}" r="3.5" {style}><title>{escape(tip)}</title></circle>')
    for tick in _ticks(low, high):
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" fill="#5b6570">{tick:.2f}</text>')
    step = max(1, len(rounds) // 12)
    for index in range(0, len(rounds), step):
        parts.append(f'<text x="{x(index):.1f}" y="{TOP + plot_h + 14}" text-anchor="middle" fill="#5b6570">{index + 1}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle" fill="#5b6570">round '
                 f'(point: candidate / baseline median step; hollow: left out, machine busy)</text>')
    parts.append(f'<text x="14" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" fill="#5b6570" '
                 f'transform="rotate(-90 14 {TOP + plot_h / 2:.1f})">step-time ratio</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def look_positions(gate: dict[str, Any], rounds: int) -> list[tuple[int, int]]:
    """(counted rounds at the look, the round it followed) per look: the sequential rule counts the rounds not left
    out as busy (agents/profiler/sequential.py), so a look at 6 follows the 6th round that counted."""
    busy = set(gate.get("busy_rounds") or [])
    counted = [index + 1 for index in range(rounds) if index not in busy]
    return [(look, counted[look - 1]) for look in gate.get("look_rounds") or [] if 1 <= look <= len(counted)]


def _hline(at: float, colour: str, extra: str) -> str:
    return f'<line x1="{LEFT}" y1="{at:.1f}" x2="{WIDTH - RIGHT}" y2="{at:.1f}" stroke="{colour}"{extra}/>'


def _label(at: float, text: str, colour: str, dy: float = 4) -> str:
    return f'<text x="{WIDTH - RIGHT + 6}" y="{at + dy:.1f}" fill="{colour}">{escape(text)}</text>'


def _ticks(low: float, high: float) -> list[float]:
    span = high - low
    step = next(s for s in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if span / s <= 6) if span <= 30 else span / 5
    first = (int(low / step) + 1) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]
