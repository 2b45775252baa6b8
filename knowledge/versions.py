"""Library version ranges as recipes state them (``">=4.48,<6"``): the versions a library patch was checked against.

Plain comparison of release numbers (``5.25.0``, ``4.48.0.dev0`` counts as ``4.48.0``), so that the patch module a
recipe writes into the user's repository can carry the same check without importing `packaging`:
`tools/codemods/library_patch.py` copies `version_in_range` into it as written here (it must stay self-contained).
"""

from __future__ import annotations

import re

_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


def check_range(spec: str) -> None:
    """Raise ValueError unless ``spec`` is comma-separated clauses such as ``>=4.48`` and ``<6``."""
    clauses = [c for c in spec.split(",") if c.strip()]
    if not clauses:
        raise ValueError(f"version range {spec!r} has no clause (e.g. '>=4.48,<6')")
    for clause in clauses:
        if not _CLAUSE.match(clause):
            raise ValueError(f"version range {spec!r}: {clause.strip()!r} is not OP RELEASE (OP one of >= <= == != > <)")


def version_in_range(version, spec):
    """Whether ``version`` (e.g. '5.25.0') lies in ``spec`` (e.g. '>=4.48,<6'); release numbers only, missing parts 0."""
    import re as _re

    def release(text):
        found = _re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
        if found is None:
            raise ValueError(f"not a version: {text!r}")
        return tuple(int(part) for part in found.group(1).split("."))

    def compare(a, b):
        width = max(len(a), len(b))
        a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
        return (a > b) - (a < b)

    have = release(version)
    for clause in str(spec).split(","):
        clause = clause.strip()
        if not clause:
            continue
        op = clause[:2] if clause[:2] in (">=", "<=", "==", "!=") else clause[:1]
        order = compare(have, release(clause[len(op):]))
        ok = {">=": order >= 0, "<=": order <= 0, "==": order == 0, "!=": order != 0, ">": order > 0, "<": order < 0}[op]
        if not ok:
            return False
    return True
