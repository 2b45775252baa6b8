"""A candidate for a region that lives in a library (`Intent.library`): a patch module in the user's repository.

The library's files are never edited. The candidate's diff is `trainbridge_patches.py` beside the entry script (the
file of the intent's user call site), created or given one more section (one module per run branch), plus one import
line at the top of that script, after its imports (tools/codemods/library_patch.py). A recipe checked against other
versions of the library than the one that ran is refused with that reason.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import NamedTuple

from trainbridge.knowledge.schema import Recipe
from trainbridge.records import Intent
from trainbridge.tools.codemods.library_patch import (PATCH_MODULE, PatchRefused, add_import_line, add_patch, refusal,
                                                      target)


class LibraryPatch(NamedTuple):
    """Where a library patch landed in a candidate worktree: the patch module, the entry script and the line of its
    import (0 when the script imported the module already)."""

    module_file: str
    script: str
    import_line: int


def library_commit_message(intent: Intent, recipe: Recipe, patch: LibraryPatch) -> str:
    module_file, script, import_line = patch
    evidence = intent.evidence
    k = "?" if evidence.reference_kernels is None else evidence.reference_kernels
    n = "?" if evidence.target_ops is None else evidence.target_ops
    module, function, distribution, versions = target(recipe)
    lines = [
        f"trainbridge: {recipe.title}",
        "",
        f"Intent {intent.id} ({intent.category}) at {intent.where()}.",
        f"Evidence: reference kernels K={k} vs eager ops N={n} per step; detectors: {', '.join(evidence.detectors) or 'none'}.",
        f"Recipe {recipe.id} ({recipe.provenance.kind}); numerics class {recipe.numerics.class_}.",
        f"Library patch: {module}.{function} replaced from {module_file} when {distribution} is {versions} "
        f"(the library's files are not edited; outside that range the module leaves the library alone).",
        (f"Installed by the import line at {script}:{import_line}." if import_line else
         f"{script} imports {PATCH_MODULE} already."),
    ]
    if intent.estimated_saving_us is not None:
        lines.append(f"Estimated saving (not measured): {intent.estimated_saving_us / 1000:.2f} ms per step.")
    return "\n".join(lines)


def write_library_patch(root: Path, intent: Intent, recipe: Recipe) -> LibraryPatch | str:
    """Write `recipe`'s patch of the library region of `intent` into the worktree at `root`: the patch module beside
    the entry script (created or extended) and the script's import line. A string says why not (nothing written)."""
    why = refusal(recipe, intent.library)
    if why is not None:
        return why
    if not intent.spans:
        return f"no call site in the repository reaches {intent.library}: no entry script to import the patch module from"
    script = next((s.file for s in intent.spans if (root / s.file).is_file()), None)
    if script is None:
        return f"{intent.spans[0].file} does not exist in the run branch"
    module_file = str(PurePosixPath(script).parent / PATCH_MODULE) if "/" in script else PATCH_MODULE
    patch_path = root / module_file
    try:
        existing = patch_path.read_text(encoding="utf-8") if patch_path.is_file() else None
        text = add_patch(existing, recipe, PurePosixPath(script).name)
        compile(text, module_file, "exec")
        entry, import_line = add_import_line((root / script).read_text(encoding="utf-8"), script)
    except PatchRefused as refused:
        return refused.reason
    except SyntaxError as exc:
        return f"the patch module does not compile: {exc}"
    patch_path.write_text(text, encoding="utf-8")
    (root / script).write_text(entry, encoding="utf-8")
    return LibraryPatch(module_file, script, import_line)
