"""The commented `trainbridge.toml` that `trainbridge init` writes from a `Discovery`.

    launch = "python train.py config/train_tiny_poems.py"   # the chosen launch line, with its evidence
    workdir = "projects/chargpt"                            # when the script runs from its own folder
    data = ["data/"]                                        # read by the script, ignored by git
    # [overrides]                                           # left commented: what one could shrink
    # batch_size = 32            # constant, config/train_tiny_poems.py:4

Every value the user may uncomment is valid TOML (a default written as `8 * 64` is shown as 512); a
default that is no literal stays a comment of its own. The text always parses (`tomllib`).
"""

from __future__ import annotations

import ast
import json
import re
import operator
import tomllib
from datetime import date

from trainbridge.tools.launch.discovery import Discovery, LaunchCandidate, Setting

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_OVERRIDE_HINTS = 24


def literal_value(source: str):
    """The value of a literal default (`12`, `6e-4`, `8 * 64`, `'gpt2'`, `True`), else None."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None

    def value(n: ast.expr):
        if isinstance(n, ast.Constant) and isinstance(n.value, (bool, int, float, str)):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            inner = value(n.operand)
            return -inner if isinstance(n.op, ast.USub) and isinstance(inner, (int, float)) else inner
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            left, right = value(n.left), value(n.right)
            if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(right) < 1e6:
                return _OPS[type(n.op)](left, right)
        raise ValueError(source)

    try:
        return value(node)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string is a JSON string


def render_toml(found: Discovery, chosen: LaunchCandidate, *, today: date | None = None,
                overrides: dict[str, tuple[str, str]] | None = None) -> str:
    """The commented file; `overrides` (key -> (value, why)) are written active under [overrides], before the hints."""
    evidence = chosen.evidence[0]
    lines = [
        f"# trainbridge.toml, written by `trainbridge init` on {(today or date.today()).isoformat()} from what it",
        "# found in this repository. Edit it freely; `trainbridge run <repo>` reads it (keys: the README,",
        "# \"The workload contract\").",
        "",
        f"# The launch line, from {evidence.where} ({evidence.kind}); ranked first because:",
        *[f"#   {reason}" for reason in chosen.reasons],
    ]
    others = [c for c in found.candidates if c is not chosen]
    if others:
        lines.append("# Other launch lines it found (swap one in if it is the run you mean):")
        lines += [f"#   launch = {json.dumps(c.launch)}   # {c.evidence[0].where}" for c in others[:5]]
    if chosen.torchrun:
        lines.append(f"# torchrun with {chosen.nproc or 'several'} processes per node: on a smaller machine lower "
                     "--nproc_per_node (2 gloo ranks on the CPU).")
    lines += [f"launch = {json.dumps(chosen.launch)}", ""]
    if chosen.workdir:
        lines += [f"# {chosen.script} is written to run from its own folder (what it opens is relative to it): runs start",
                  "# it there, in the run's mirror of the repository (the launch line names the script from the root).",
                  f"workdir = {json.dumps(chosen.workdir)}", ""]
    if found.pythonpath:
        lines += [f"# {chosen.script} imports packages of the repository from its root (installed with `pip install -e .`",
                  "# by its authors): the root joins the script's import path.",
                  f"pythonpath = [{', '.join(json.dumps(p) for p in found.pythonpath)}]", ""]
    if found.data_paths:
        lines += ["# Paths the script reads that git ignores: they are not in TrainBridge's worktrees, so every",
                  "# run sees your copies here, read-only.",
                  f"data = [{', '.join(json.dumps(p) for p in found.data_paths)}]", ""]
    else:
        lines += ["# No git-ignored path was seen referenced; list data folders here if the script reads any:",
                  "# data = [\"data/\"]", ""]
    if found.data_missing:
        lines += ["# Named by the script, ignored by git, but nowhere in the repository yet (outputs, or data not",
                  f"# prepared yet; add them once they exist): {', '.join(found.data_missing)}", ""]
    lines += _override_hints(found, overrides or {})
    text = "\n".join(lines).rstrip("\n") + "\n"
    tomllib.loads(text)  # a bug here must not leave an unreadable file behind
    return text


def _override_hints(found: Discovery, active: dict[str, tuple[str, str]]) -> list[str]:
    table = ["[overrides]"] + [f"{_bare_or_quoted(key)} = {toml_value(value)}   # {why}" for key, (value, why) in active.items()]
    if not found.settings:
        return table if active else ["# [overrides]   # settings of the script to shrink a run; none were found to suggest"]
    lines = ["# To shrink a run for this machine without editing the script, uncomment what you need",
             "# under [overrides]; the values shown are the script's current defaults. It takes settings by:"]
    lines += [f"#   {how}" for how in found.configurable_by or ["module-level constants"]]
    lines += table if active else ["# [overrides]"]
    hints = [s for s in found.settings[:MAX_OVERRIDE_HINTS] if (s.key or s.name) not in active]
    width = max((len(toml_key(s)) for s in hints), default=0)
    for setting in hints:
        lines.append(_hint(setting, width))
    if len(found.settings) > MAX_OVERRIDE_HINTS:
        lines.append(f"# ... and {len(found.settings) - MAX_OVERRIDE_HINTS} more settings")
    return lines


def toml_key(setting: Setting) -> str:
    """The [overrides] key as TOML writes it: bare for a name, quoted for `Cls.field`, `--flag`, `Cls(kw)`."""
    return _bare_or_quoted(setting.key or setting.name)


def _bare_or_quoted(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else json.dumps(key)


def _hint(setting: Setting, width: int) -> str:
    """One hint, a TOML line behind `# ` that is valid once uncommented: the key the launcher matches, the default;
    the trailing comment says what the setting is and where (its bare name when the key differs). A default with
    no literal value stays a comment of its own (`# # ...`): there is nothing to uncomment."""
    value = literal_value(setting.value)
    key = toml_key(setting)
    where = f"{setting.kind}, {setting.where}"
    if key != setting.name:
        where = f"{setting.name}: {where}"
    if value is None:
        return f"# # {key:<{width}}   (default {setting.value}: no literal; {where})"
    shown = toml_value(value)
    note = f"{where}; written {setting.value}" if shown != setting.value and not isinstance(value, str) else where
    return f"# {key:<{width}} = {shown:<12} # {note}"
