"""The root `.gitignore` of a repository as rules one can ask about, without running git (nothing of
the user's repository is touched, and a folder that is not a git checkout yet works the same).

Supported: blank lines and comments, `!` negation, a trailing `/` (folders only), patterns anchored
by a `/` at the start or in the middle, `*`, `?`, `[...]` and `**`. Nested `.gitignore` files and
`.git/info/exclude` are not read; this is for naming data folders in `trainbridge init`, not for
deciding what git tracks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Rule:
    pattern: str  # as written, without `!` and the trailing `/`
    regex: re.Pattern[str]
    negated: bool
    folders_only: bool
    anchored: bool


def _translate(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out, i = out + "/.*", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            out, i = out + "[" + pattern[i + 1:end].replace("!", "^", 1) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


class IgnoreRules:
    """`IgnoreRules.of(repo).ignored("data/train.bin")`; paths are repo-relative, POSIX."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: list[_Rule] = []
        for raw in lines:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            line = line[1:] if negated else line
            folders_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            body = line.lstrip("/")
            self.rules.append(_Rule(body, re.compile(_translate(body) + "$"), negated, folders_only, anchored))

    @classmethod
    def of(cls, repo: Path) -> IgnoreRules:
        path = repo / ".gitignore"
        return cls(path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else [])

    def _matches(self, rule: _Rule, path: str, is_dir: bool) -> bool:
        if rule.folders_only and not is_dir:
            return False
        if rule.anchored:
            return bool(rule.regex.match(path))
        return bool(rule.regex.match(path.rsplit("/", 1)[-1]))

    def ignored(self, path: str, *, is_dir: bool = False) -> bool:
        """Whether git would ignore `path` by these rules (a path under an ignored folder is ignored)."""
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            prefix, folder = "/".join(parts[:depth]), depth < len(parts) or is_dir
            verdict = None
            for rule in self.rules:
                if self._matches(rule, prefix, folder):
                    verdict = not rule.negated
            if verdict and depth < len(parts):
                return True  # git does not look inside an ignored folder
            if depth == len(parts):
                return bool(verdict)
        return False

    def ignores_inside(self, folder: str) -> bool:
        """Whether some rule ignores things inside `folder` (e.g. `data/**/*.bin` for `data`)."""
        folder = folder.strip("/")
        return any(not r.negated and r.anchored and r.pattern.startswith(folder + "/") for r in self.rules)
