"""Where a recipe was already tried, by the code it was tried on rather than by line numbers (issue 25, item 2).

A run re-analyses its head after every accepted (or, on the NPU, pending) rewrite; the lines of every region
below the rewrite move, so an intent found again gets a new id, and a recipe that crashed or was refused there
was tried again after every re-analysis (a speedrun's cross-entropy recipe crashed four times). A site is the
text of an intent's spans (file, function and the lines' code, whitespace-normalised), which a rewrite
elsewhere leaves unchanged, and for a region in a library its library function and version; `tried_key` pairs it with a recipe, and the run keeps the keys of every verdict.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from trainbridge.records import Intent


def site_fingerprint(root: Path, intent: Intent) -> str | None:
    """A digest of the intent's code at `root`, or None when a span's file cannot be read (no site: never skipped)."""
    digest = hashlib.sha256(str(intent.category).encode())
    library = intent.library
    if library is not None:  # a region in a library: where it is there (its lines do not move), beside the call site
        digest.update(f"\0{library.module or library.file}\0{library.function or ''}\0{library.version or ''}".encode())
    for span in intent.spans:
        try:
            lines = (root / span.file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return None
        code = "\n".join(" ".join(line.split()) for line in lines[span.line_start - 1: span.line_end])
        digest.update(f"\0{span.file}\0{span.function or ''}\0{code}".encode())
    return digest.hexdigest()[:20]


def tried_key(recipe_id: str, site: str) -> str:
    return f"{recipe_id}@{site}"
