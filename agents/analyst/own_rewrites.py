"""What the run has already rewritten, so re-analysis of a new head does not propose it again.

A rewrite's own code often still looks like its pattern at run time (F.rms_norm on the CPU runs
the same ATen ops as the hand-written norm; the NPU emulation's fused ops are plain PyTorch), so
the analyst would find the same region again under a new intent id. Lines the run's commits added
(relative to the base) are known: an intent whose every span lies in them, in a category the run
has already landed, is the run's own work.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainbridge.agents.profiler.verdict import VerdictReason
from trainbridge.records import Intent
from trainbridge.tools.git.ops import run_git

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def verdict_landed(verdict: Mapping[str, Any]) -> bool:
    """Whether a verdict record put its rewrite on the run: accepted, or numerics verified and
    waiting on the pending NPU branch."""
    return bool(verdict.get("accepted")) or verdict.get("reason") == VerdictReason.speed_unmeasured_numerics_ok.value


def added_lines(worktree: Path, base_sha: str) -> dict[str, set[int]]:
    """Repo-relative path -> line numbers (in the worktree's HEAD) added or changed since `base_sha`."""
    # explicit prefixes: the runner already overrides diff.noprefix / mnemonicPrefix, this says what is parsed
    diff = run_git(worktree, "diff", "-U0", "--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/",
                   "--dst-prefix=b/", base_sha, "HEAD", "--")
    added: dict[str, set[int]] = {}
    current: str | None = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif current is not None and (match := _HUNK.match(line)):
            start, count = int(match.group(1)), int(match.group(2) if match.group(2) is not None else 1)
            added.setdefault(current, set()).update(range(start, start + count))
    return added


def is_own_rewrite(intent: Intent, added: dict[str, set[int]], landed_categories: set[str]) -> bool:
    if str(intent.category) not in landed_categories or not intent.spans:
        return False
    return all(set(range(span.line_start, span.line_end + 1)) <= added.get(span.file, set()) for span in intent.spans)


@dataclass(frozen=True)
class OwnRewriteSplit:
    """An analysis's intents, parted into the ones still to work on and the run's own rewrites."""

    kept: list[Intent]
    own: list[Intent]


def split_own_rewrites(intents: Iterable[Intent], head: Path, base_sha: str,
                       verdicts: Iterable[Mapping[str, Any]]) -> OwnRewriteSplit:
    """Part `intents` (found on the worktree `head`) by whether they lie on lines the run's landed
    rewrites added since `base_sha`, in a category one of `verdicts` landed. Runs git only when
    something landed."""
    intents = list(intents)
    landed = {str(v["category"]) for v in verdicts if verdict_landed(v)}
    added = added_lines(head, base_sha) if landed else {}
    own = [i for i in intents if is_own_rewrite(i, added, landed)]
    return OwnRewriteSplit(kept=[i for i in intents if i not in own], own=own)
