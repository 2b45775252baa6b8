"""Make one candidate: apply a recipe to the intent's span in a fresh candidate worktree, commit it.

The user's checkout is never touched: the edit happens in the candidate's own worktree, which is
reset to the run head first (so a re-run after a crash starts clean and the commit is deduplicated
by its trailer).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field

from trainbridge.knowledge.schema import Recipe
from trainbridge.records import Intent, Record, SourceSpan
from trainbridge.agents.coder.library import library_commit_message, write_library_patch
from trainbridge.agents.coder.semantic_match import apply_semantically, probes
from trainbridge.tools.codemods.engine import CodemodRefused, apply_companion, apply_recipe
from trainbridge.tools.codemods.library_patch import refusal as library_patch_refusal


class Candidate(Record):
    name: str
    intent_id: str
    category: str
    recipe_id: str | None
    branch: str
    sha: str
    base_sha: str
    diff: str
    files: list[str] = Field(default_factory=list)
    sites: list[SourceSpan] = Field(default_factory=list)
    worktree: str


class CoderRefusal(Record):
    recipe_id: str
    reason: str
    close: list[str] = Field(default_factory=list)


def candidate_name(intent: Intent, recipe_id: str, attempt: int = 0) -> str:
    name = f"{intent.id}-{re.sub(r'[^A-Za-z0-9_-]', '_', recipe_id)}"
    return name if attempt == 0 else f"{name}-r{attempt}"


def commit_message(intent: Intent, recipe: Recipe, sites: list[SourceSpan], notes: list[str] | None = None) -> str:
    evidence = intent.evidence
    k = "?" if evidence.reference_kernels is None else evidence.reference_kernels
    n = "?" if evidence.target_ops is None else evidence.target_ops
    where = ", ".join(str(s) for s in sites)
    lines = [
        f"trainbridge: {recipe.title}",
        "",
        f"Intent {intent.id} ({intent.category}) at {where}.",
        f"Evidence: reference kernels K={k} vs eager ops N={n} per step; detectors: {', '.join(evidence.detectors) or 'none'}.",
        f"Recipe {recipe.id} ({recipe.provenance.kind}); numerics class {recipe.numerics.class_}.",
    ]
    if intent.estimated_saving_us is not None:
        lines.append(f"Estimated saving (not measured): {intent.estimated_saving_us / 1000:.2f} ms per step.")
    lines += [f"Codemod: {note}." for note in notes or []]  # e.g. a **kwargs dropped, a helper inserted
    return "\n".join(lines)


def apply_companions(workspace, root: Path, recipe: Recipe) -> list[str]:
    """Apply the recipe's companion edits (`Recipe.also`) to every tracked Python file of the candidate worktree at
    `root`; one note per file changed, for the commit message."""
    if not recipe.also:
        return []
    notes = []
    for name in workspace.git(root, "ls-files", "-z", "--", "*.py").split("\0"):
        path = root / name
        if not name or not path.is_file() or path.is_symlink():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        changed, sites, whys = source, [], []
        for companion in recipe.also:
            edit = apply_companion(changed, name, companion)
            if edit is not None:
                changed, sites, whys = edit.source, sites + edit.sites, whys + edit.notes
        if changed != source:
            path.write_text(changed, encoding="utf-8")
            lines = ", ".join(str(site.line_start) for site in sites)
            notes.append(f"also changed {name} line(s) {lines}: {'; '.join(dict.fromkeys(whys))}")
    return notes


def library_refusal(intent: Intent, recipe_id: str) -> CoderRefusal:
    """Why a rewrite of the user's files does not apply to a region that lives in a library (`intent.library`): the
    library file is outside the repository and is never edited; such a region is rewritten by a patch module in the
    user's repository (a `library_patch` recipe, agents/coder/library.py)."""
    library = intent.library
    where = f"{library.file}, {library.function or 'lines ' + library.lines()}" if library else "?"
    owner = " ".join(x for x in (library.distribution, library.version) if x) if library else ""
    return CoderRefusal(recipe_id=recipe_id, reason=(
        f"the region is library code ({where}{', ' + owner if owner else ''}), reached from "
        f"{', '.join(str(s) for s in intent.spans) or 'no line of the repository'}: this recipe rewrites the user's "
        "files, and the library file lies outside the repository (never edited); a library region needs a patch "
        "module in the repository (a library_patch recipe)"))


def make_candidate(workspace, intent: Intent, recipe: Recipe, attempt: int = 0, *, overlay: str | None = None) -> Candidate | CoderRefusal:
    """Apply `recipe` at the first of the intent's spans where it applies; commit; or say why not.

    `overlay`: a commit whose files are laid over the run head first (the pending-NPU branch head, so
    numerics-verified NPU rewrites stack: the candidate then carries them too, and its cherry-pick onto
    that branch adds only the new rewrite)."""
    if recipe.match.kind == "library_patch" or intent.library is not None:
        return _library_candidate(workspace, intent, recipe, attempt, overlay=overlay)
    name = candidate_name(intent, recipe.id, attempt)
    cand = workspace.start_candidate(name)
    if overlay is not None:
        workspace.git(Path(cand.path), "checkout", overlay, "--", ".")
    reasons, close = [], []
    for span in intent.spans:
        path = Path(cand.path) / span.file
        if not path.is_file():
            reasons.append(f"{span.file} does not exist in the run branch")
            continue
        source = path.read_text(encoding="utf-8")
        try:
            edit = apply_recipe(source, recipe, span)
        except CodemodRefused as refused:
            edit, why = apply_semantically(source, span, recipe, root=Path(cand.path)) if probes(recipe) else (None, "")
            if edit is None:
                reasons.append(refused.reason + (f"; by behaviour: {why}" if why else ""))
                close.extend(refused.close)
                continue
            edit.notes.append(why)
        try:
            compile(edit.source, str(path), "exec")
        except SyntaxError as exc:
            reasons.append(f"the rewritten {span.file} does not compile: {exc}")
            continue
        path.write_text(edit.source, encoding="utf-8")
        edit.notes.extend(apply_companions(workspace, Path(cand.path), recipe))
        result = workspace.commit_candidate(name, commit_message(intent, recipe, edit.sites, edit.notes))
        if result.sha is None:
            reasons.append("the rewrite left the file unchanged")
            continue
        return Candidate(
            name=name, intent_id=intent.id, category=str(intent.category), recipe_id=recipe.id,
            branch=result.branch, sha=result.sha, base_sha=result.base_sha,
            diff=workspace.candidate_diff(name), files=result.files, sites=edit.sites, worktree=str(cand.path),
        )
    workspace.reject_candidate(name)
    return CoderRefusal(recipe_id=recipe.id, reason="; ".join(reasons) or "the intent has no source span", close=close[:5])


def _library_candidate(workspace, intent: Intent, recipe: Recipe, attempt: int, *, overlay: str | None) -> Candidate | CoderRefusal:
    """A library region (`intent.library`) takes only library patches: a patch module in the user's repository plus
    its import line in the entry script (agents/coder/library.py); a library patch never rewrites an in-repo region."""
    if intent.library is not None and recipe.match.kind != "library_patch":
        return library_refusal(intent, recipe.id)
    why = library_patch_refusal(recipe, intent.library)
    if why is not None:  # refused before a worktree is made: another function, another version of the library
        return CoderRefusal(recipe_id=recipe.id, reason=why)
    name = candidate_name(intent, recipe.id, attempt)
    cand = workspace.start_candidate(name)
    if overlay is not None:
        workspace.git(Path(cand.path), "checkout", overlay, "--", ".")
    patch = write_library_patch(Path(cand.path), intent, recipe)
    if isinstance(patch, str):
        workspace.reject_candidate(name)
        return CoderRefusal(recipe_id=recipe.id, reason=patch)
    result = workspace.commit_candidate(name, library_commit_message(intent, recipe, patch))
    if result.sha is None:
        workspace.reject_candidate(name)
        return CoderRefusal(recipe_id=recipe.id, reason=f"the patch left the repository unchanged ({patch.module_file} "
                            "already holds it)")
    return Candidate(name=name, intent_id=intent.id, category=str(intent.category), recipe_id=recipe.id,
                     branch=result.branch, sha=result.sha, base_sha=result.base_sha, diff=workspace.candidate_diff(name),
                     files=result.files, sites=[], worktree=str(cand.path))
