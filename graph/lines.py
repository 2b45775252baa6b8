"""What kind of line a run says, for the terminal's `-q` / `-v` (graph/cli/display.py).

A node says plain strings; two kinds are marked by their type, so that the marking travels through
every wrapper of `say` (the run log keeps every line whatever its kind):

- `VerdictLine`: a candidate's verdict, the one thing `-q` keeps besides the final line;
- `Detail`: what only `-v` shows (a failed child's stderr tail);
- `ProgressLine`: a step of a long phase (a gate's round k of n, a closing comparison's round): in a terminal the CLI
  shows it as one progress bar that each new step updates, elsewhere (a pipe, a log) as a line like any other.

Everything else (phases, the gate's progress) is the default output.
"""

from __future__ import annotations


class VerdictLine(str):
    """A verdict line (graph/nodes.verdict_line)."""


class Detail(str):
    """A line for `-v` only."""


class ProgressLine(str):
    """A step `done` of `total` of a long phase, `phase` naming it (graph/nodes.GateProgressLines, the closing
    comparison's rounds); the text is the whole line, as a pipe or the run log shows it."""

    phase: str
    done: int
    total: int

    def __new__(cls, text: str, *, phase: str, done: int, total: int) -> "ProgressLine":
        line = super().__new__(cls, text)
        line.phase, line.done, line.total = phase, done, total
        return line
