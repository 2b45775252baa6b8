"""What kind of line a run says, for the terminal's `-q` / `-v` (graph/cli/display.py).

A node says plain strings; two kinds are marked by their type, so that the marking travels through
every wrapper of `say` (the run log keeps every line whatever its kind):

- `VerdictLine`: a candidate's verdict, the one thing `-q` keeps besides the final line;
- `Detail`: what only `-v` shows (a failed child's stderr tail).

Everything else (phases, the gate's progress) is the default output.
"""

from __future__ import annotations


class VerdictLine(str):
    """A verdict line (graph/nodes.verdict_line)."""


class Detail(str):
    """A line for `-v` only."""
