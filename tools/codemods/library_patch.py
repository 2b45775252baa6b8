"""Library patches (match kind ``library_patch``): a region that lives in a library is rewritten from the user's
repository, never in site-packages.

The rewrite is one module, ``trainbridge_patches.py`` beside the entry script (one per run branch: a second patch is
a second section of the same file), plus one import line at the top of the entry script, after its imports. Each
section is the recipe's patch function (the library function's signature kept) and one ``_install(...)`` call that
assigns it on the library's class or module when the installed version lies in the range the recipe was checked
against; outside it the library is left alone with a warning. A module-level function is also replaced where other
loaded modules imported it by name. Pure text in, text out: the coder writes the files (agents/coder/library.py).
"""

from __future__ import annotations

import ast
import inspect

from trainbridge.knowledge.schema import Recipe
from trainbridge.knowledge.versions import version_in_range
from trainbridge.records import LibrarySpan

PATCH_MODULE = "trainbridge_patches.py"
IMPORT_LINE = "import trainbridge_patches  # noqa: F401  (TrainBridge: library patches, see the file)"
SECTION = "# === TrainBridge patch "

_HEADER = '''"""TrainBridge: patches of library code for this repository, installed when {script} imports this module.

Each section below replaces one function or method of an installed library by assignment (site-packages is never
edited), and only when the installed version lies in the range the recipe was checked against: outside it the
library is left alone and a warning says so. Delete a section to undo that patch, or the import line in {script} to
undo them all.
"""

{imports}


{version_in_range}

def _install(distribution, versions, module_name, qualname, patch):
    """Assign `patch` to `qualname` ('func' or 'Class.method') of `module_name` when `distribution`'s version lies in
    `versions` and the signatures agree; else warn and leave the library alone. A module-level function is also
    replaced in every loaded module that imported it by name. Returns whether it was installed."""
    where = module_name + "." + qualname
    try:
        top = importlib.import_module(module_name.split(".")[0])
        installed = getattr(top, "__version__", None) or importlib.metadata.version(distribution)
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        warnings.warn(f"TrainBridge: {{where}} not patched: {{distribution}} is not importable ({{exc}})", stacklevel=2)
        return False
    if not version_in_range(installed, versions):
        warnings.warn(f"TrainBridge: {{where}} not patched: {{distribution}} {{installed}} is outside {{versions}}, the "
                      "versions the patch was checked against; the library is left alone", stacklevel=2)
        return False
    owner_name, _, name = qualname.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        warnings.warn(f"TrainBridge: {{where}} not patched: {{module_name}} does not import ({{exc}})", stacklevel=2)
        return False
    owner = getattr(module, owner_name, None) if owner_name else module
    original = vars(owner).get(name) if owner is not None else None
    behind = _function_behind(original, name)
    if behind is None:
        warnings.warn(f"TrainBridge: {{where}} not patched: this version of {{distribution}} ({{installed}}) does not "
                      "define it there; the library is left alone", stacklevel=2)
        return False
    if list(inspect.signature(behind).parameters) != list(inspect.signature(patch).parameters):
        warnings.warn(f"TrainBridge: {{where}} not patched: its signature is not the patch's ({{inspect.signature(behind)}} "
                      f"vs {{inspect.signature(patch)}}); the library is left alone", stacklevel=2)
        return False
    patch.__trainbridge_original__ = original
    setattr(owner, name, patch)
    if not owner_name:
        for other in list(sys.modules.values()):  # `from module import name`: the importer's own binding
            namespace = getattr(other, "__dict__", None)
            if other is not module and isinstance(namespace, dict) and namespace.get(name) is original:
                setattr(other, name, patch)
        _replace_in_registries(module_name.split(".")[0], original, patch)
    INSTALLED.append(where)
    return True


def _replace_in_registries(top, original, patch):
    """The library's own class-level registries that hold the function are given the patch too: transformers calls
    sdpa_attention_forward through AttentionInterface._global_mapping["sdpa"], never by its module name."""
    for other in list(sys.modules.values()):
        namespace = getattr(other, "__dict__", None)
        if not isinstance(namespace, dict) or not str(namespace.get("__name__", "")).startswith(top + "."):
            continue
        for value in list(namespace.values()):
            if not isinstance(value, type) or value.__module__ != namespace["__name__"]:
                continue
            for registry in list(vars(value).values()):
                if type(registry) is dict:  # a plain dict (lazy mappings import on every lookup)
                    for key in [k for k, v in registry.items() if v is original]:
                        registry[key] = patch


def _function_behind(value, name):
    """The library's function `value` is or wraps, or None: with the `kernels` package installed, transformers wraps
    hub-kernel functions (apply_rotary_pos_emb) in a module object whose forward calls the function from a closure."""
    if inspect.isfunction(value):
        return value
    forward = getattr(type(value), "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return inner
    return None


INSTALLED = []  # what was patched in this process: module.qualname
'''

_BASE_IMPORTS = ["import importlib", "import importlib.metadata", "import inspect", "import sys", "import warnings"]


class PatchRefused(Exception):
    """The library patch does not apply; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def target(recipe: Recipe) -> tuple[str, str, str, str]:
    """(module, function, distribution, versions) a library-patch recipe replaces."""
    params = recipe.match.params
    module = str(params["module"])
    return module, str(params["function"]), str(params.get("distribution") or module.split(".")[0]), str(params["versions"])


def fits(recipe: Recipe, library: LibrarySpan | None) -> bool:
    """Whether ``recipe`` is a library patch of exactly the library function ``library`` locates."""
    if recipe.match.kind != "library_patch" or library is None:
        return False
    module, function, _, _ = target(recipe)
    return library.module == module and library.function == function


def refusal(recipe: Recipe, library: LibrarySpan | None) -> str | None:
    """Why ``recipe`` cannot patch the region ``library`` (None when it can): another function, or a version of the
    library outside the range the recipe was checked against."""
    module, function, distribution, versions = target(recipe)
    if library is None:
        return (f"recipe {recipe.id} patches library code ({module}.{function}); this region lies in the repository "
                "(an in-repo recipe rewrites it)")
    if not fits(recipe, library):
        return f"recipe {recipe.id} patches {module}.{function}, not {library.module}.{library.function}"
    if library.distribution and library.distribution != distribution:
        return f"recipe {recipe.id} patches {distribution}'s code, the region is {library.distribution}'s"
    if library.version is None:
        return (f"recipe {recipe.id} was checked against {distribution} {versions}; the version of the {distribution} "
                "that ran is unknown, so the patch is not applied")
    if not version_in_range(library.version, versions):
        return (f"recipe {recipe.id} was checked against {distribution} {versions}; {distribution} {library.version} "
                "ran here, outside that range: not applied")
    return None


def patch_functions(recipe: Recipe) -> list[str]:
    """The top-level function names the recipe's replacement defines; the last is the patch, the others helpers."""
    try:
        tree = ast.parse(recipe.replacement)
    except SyntaxError as exc:
        raise PatchRefused(f"recipe {recipe.id}: the patch does not parse: {exc}") from None
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    others = [ast.unparse(node)[:60] for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.Expr))]
    if not names or others:
        raise PatchRefused(f"recipe {recipe.id}: a patch is function definitions only (the last one the patch)"
                           + (f"; found {others[0]!r}" if others else ""))
    return names


def add_patch(existing: str | None, recipe: Recipe, script: str) -> str:
    """The patch module's text with ``recipe``'s section added (a new module when ``existing`` is None)."""
    module, function, distribution, versions = target(recipe)
    names = patch_functions(recipe)
    text = existing if existing is not None else _HEADER.format(
        script=script, imports="\n".join(_BASE_IMPORTS), version_in_range=inspect.getsource(version_in_range))
    where = f"{module}.{function}"
    if f"{SECTION}{recipe.id}:" in text or f": {where} (" in text:
        raise PatchRefused(f"{PATCH_MODULE} already patches {where}")
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise PatchRefused(f"{PATCH_MODULE} on the run branch does not parse: {exc}") from None
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    clash = [n for n in names if n in defined]
    if clash:
        raise PatchRefused(f"{PATCH_MODULE} already defines {', '.join(clash)}, which recipe {recipe.id} defines too")
    text = _add_module_imports(text, tree, recipe.imports)
    section = (f"\n\n{SECTION}{recipe.id}: {where} ({distribution} {versions}) ===\n"
               f"# {recipe.title}\n\n{recipe.replacement.strip()}\n\n\n"
               f"_install({distribution!r}, {versions!r}, {module!r}, {function!r}, {names[-1]})\n")
    return text.rstrip("\n") + "\n" + section


def _add_module_imports(text: str, tree: ast.Module, imports: list[str]) -> str:
    present = {ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
    missing = [line.strip() for line in imports if ast.unparse(ast.parse(line.strip()).body[0]) not in present]
    if not missing:
        return text
    last = max(node.end_lineno for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    lines = text.splitlines(keepends=True)
    return "".join(lines[:last]) + "".join(f"{line}\n" for line in missing) + "".join(lines[last:])


def add_import_line(source: str, file: str) -> tuple[str, int]:
    """``source`` (the entry script ``file``) with `IMPORT_LINE` after its leading imports, and the line it landed on;
    unchanged (line 0) when the script imports the patch module already."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise PatchRefused(f"{file} does not parse: {exc}") from None
    for node in tree.body:
        if isinstance(node, ast.Import) and any(alias.name == "trainbridge_patches" for alias in node.names):
            return source, 0
    after = 0
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or docstring:
            after = node.end_lineno
            continue
        break
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines[:after]) + IMPORT_LINE + "\n" + "".join(lines[after:]), after + 1
