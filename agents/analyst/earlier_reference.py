"""K for a later analysis: the counts the run's one compile reference made, for regions whose code is unchanged.

A run compiles its reference once, on the original program (a cold torch.compile takes minutes). Every later
analysis of the run's head (after an accepted rewrite, or a pending one on the NPU) profiles the eager step again
but compiles nothing, so without this each intent's K was unknown ("?") from the first accept on, and its saving
fell back to the coarse estimate. The reference still describes every region the run has not rewritten: what
Inductor fused there depends on the region's code, not on its line numbers, which the run's edits elsewhere move (a
library patch's import line moves the whole entry script down a line).

A region is recognised by its site (agents/retrieval/sites.py: category, library function and version, the code of
its spans, no line numbers), the key the run already keeps with each intent's evidence (the state's
`intent_evidence`). A site whose records disagree on K (two identical lines of one function, counted apart by the
reference) lends none; a region whose code changed since has a new site and keeps K unknown, as it should: the
reference never compiled that code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainbridge.agents.analyst.align import NO_KERNEL_NOTE, EarlierLookup, EarlierReference
from trainbridge.records import Intent

_CONFLICT = object()


def earlier_references(records: Mapping[str, Mapping[str, Any]]) -> dict[str, EarlierReference]:
    """Site -> what the reference counted there, from the run's intent records (`intent_record` dumps: site and
    evidence). Records without a site, or whose analysis had no reference for them, lend nothing."""
    found: dict[str, Any] = {}
    for record in records.values():
        site, evidence = record.get("site"), record.get("evidence") or {}
        if not site:
            continue
        if evidence.get("reference_kernels") is not None:
            counted = EarlierReference(int(evidence["reference_kernels"]), tuple(evidence.get("kernels") or ()))
        elif any(str(note).startswith(NO_KERNEL_NOTE) for note in evidence.get("notes") or ()):
            counted = EarlierReference(None)
        else:
            continue
        held = found.get(site)
        if held is None:
            found[site] = counted
        elif held is not _CONFLICT and held.kernels != counted.kernels:
            found[site] = _CONFLICT
    return {site: counted for site, counted in found.items() if counted is not _CONFLICT}


def earlier_lookup(records: Mapping[str, Mapping[str, Any]],
                   site_of: Callable[[Intent], str | None]) -> EarlierLookup | None:
    """The lookup `align` takes: an intent's site (`site_of`, read on the head being analysed) -> the reference's
    counts there. None when no record lends anything (the run had no reference)."""
    known = earlier_references(records)
    if not known:
        return None

    def lookup(intent: Intent) -> EarlierReference | None:
        site = site_of(intent)
        return known.get(site) if site is not None else None

    return lookup
