"""The package's imports run one way: no module imports itself back through others, no layer imports
a layer above it (settings <- records <- knowledge <- tools <- sandbox <- agents <- graph), and no module uses
another's private names.

Imports inside functions count too: a cycle joined through a function-level import is still a
cycle (it only fails later, at the first call). The graph is read from the source with `ast`, so
the test imports nothing of the package and runs in a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trainbridge"
SKIPPED = {"tests", "benchmarks", "examples", ".venv"}  # not part of the installed import graph's layers
# The CPU stand-in for torch_npu is imported as `torch_npu` by sandbox children, never as trainbridge.*.
EMULATED = ("sandbox", "npu_emulation", "torch_npu")
LAYERS = ["settings", "records", "knowledge", "tools", "sandbox", "agents", "graph"]


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIPPED or rel.parts[: len(EMULATED)] == EMULATED:
            continue
        parts = (PACKAGE, *rel.with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (`from pkg import submodule`
    counts as an import of the submodule, as Python resolves it)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules]
                targets = submodules if len(submodules) == len(node.names) else [node.module, *submodules]
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_package_has_no_import_cycle():
    found = cycles(import_edges(package_modules()))
    assert not found, "import cycles (each line: modules that import one another):\n" + "\n".join(map(str, found))


def test_no_layer_imports_a_layer_above_it():
    upward = sorted(f"{a} -> {b}" for a, targets in import_edges(package_modules()).items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    assert not upward, f"imports against the layering {' <- '.join(LAYERS)}:\n" + "\n".join(upward)


def private_uses(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """`file:line name` wherever a module imports another module's private (`_x`) name or reaches
    into it as `module._x`: a helper used across modules is API and gets a public name."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.module}.{alias.name}")
                    aliases.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                aliases |= {alias.asname or alias.name for alias in node.names if alias.name.startswith(PACKAGE)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = private_uses(package_modules())
    assert not found, "private names used across modules (make them public or move them):\n" + "\n".join(found)


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path):
    """The walker itself: a planted cycle through a function-level import, and tools -> sandbox."""
    for rel, text in {
        "tools/__init__.py": "", "tools/a.py": "def f():\n    from trainbridge.tools import b\n",
        "tools/b.py": "from trainbridge.tools.a import f\n", "sandbox/__init__.py": "",
        "sandbox/c.py": "_x = 1\n", "tools/d.py": "import trainbridge.sandbox.c\n",
        "tools/e.py": "from trainbridge.sandbox.c import _x\nfrom trainbridge.tools import a\na._f()\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    edges = import_edges(package_modules(tmp_path))
    assert cycles(edges) == [["trainbridge.tools.a", "trainbridge.tools.b"]]
    assert "trainbridge.sandbox.c" in edges["trainbridge.tools.d"] and layer("trainbridge.sandbox.c") > layer("trainbridge.tools.d")
    assert [hit.split(" ")[1] for hit in private_uses(package_modules(tmp_path), tmp_path)] == ["trainbridge.sandbox.c._x", "a._f"]


FAMILY_LIMIT = 4  # modules of one folder sharing a name prefix: from this many on, the family gets a folder of its own


def prefix_families(root: Path = ROOT, limit: int = FAMILY_LIMIT) -> list[str]:
    """`folder: prefix_ (module, ...)` for every folder of the package or of benchmarks/ that keeps `limit` or
    more modules named by a shared first word: a subpackage in all but name (DESIGN.md's layout names each
    family's folder). The tests keep pytest's `test_` names and the emulated torch_npu upstream's layout."""
    found = []
    for folder in sorted({p.parent for p in root.rglob("*.py")}):
        rel = folder.relative_to(root)
        if rel.parts[:1] in (("tests",), (".venv",), ("examples",)) or rel.parts[: len(EMULATED)] == EMULATED:
            continue
        families: dict[str, list[str]] = {}
        for path in folder.glob("*.py"):
            if path.stem != "__init__":
                families.setdefault(path.stem.split("_")[0], []).append(path.stem)
        found += [f"{rel.as_posix() or '.'}: {prefix}_ ({', '.join(sorted(names))})"
                  for prefix, names in sorted(families.items()) if len(names) >= limit]
    return found


def test_no_folder_keeps_a_prefix_family():
    found = prefix_families()
    assert not found, ("folders keeping a family of modules by name prefix (give the family a subpackage whose "
                       "module names do not repeat the folder, e.g. tools/git/runner.py):\n" + "\n".join(found))


def test_benchmarks_import_nothing_from_the_tests():
    """What a benchmark and the tests share lives in the package or in benchmarks/ (tests/conftest.py puts
    benchmarks/ on the tests' path), never in tests/."""
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if name.split(".")[:2] == [PACKAGE, "tests"] or name.split(".")[0] == "tests"]
    assert not found, "benchmarks importing from tests/:\n" + "\n".join(found)


def test_the_family_check_finds_a_planted_family(tmp_path):
    for rel in ("tools/__init__.py", "tools/git_a.py", "tools/git_b.py", "tools/git_c.py", "tools/git_d.py",
                "tools/other.py", "tools/sub/__init__.py", "tools/sub/x_1.py", "tools/sub/x_2.py", "tools/sub/x_3.py",
                "tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_d.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("", encoding="utf-8")
    assert prefix_families(tmp_path) == ["tools: git_ (git_a, git_b, git_c, git_d)"]
