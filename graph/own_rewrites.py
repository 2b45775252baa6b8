"""What the run has already rewritten, so re-analysis of a new head does not propose it again.

A rewrite's own code often still looks like its pattern at run time (F.rms_norm on the CPU runs
the same ATen ops as the hand-written norm; the NPU emulation's fused ops are plain PyTorch), so
the analyst would find the same region again under a new intent id. Lines the run's commits added
(relative to the base) are known: an intent whose every span lies in them, in a category the run
has already landed, is the run's own work.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainbridge.records import Intent
from trainbridge.tools.git_ops import run_git

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


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
