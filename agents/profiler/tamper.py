"""What a candidate must leave alone, hashed before and after it runs (parent side).

A gate child can reach files outside its own process: the baseline's worktree (its partner's
working directory, found through /proc), the installed tool and the virtual environment's start-up
files. Writing there forges later verdicts: a bytecode cache in the baseline's `__pycache__` that
carries the untouched source's timestamp and size is what Python loads (PYTHONDONTWRITEBYTECODE
stops writing, not reading), and code added to the package or a `.pth` runs in the next gate. So:

- the **baseline's worktree** is compared before and after every round (`baseline_findings`), every
  `__pycache__` and `.pyc` included: its children never write bytecode, so any bytecode, source or
  start-up file that changed there is tampering, and any other change is tampering unless the
  candidate wrote the same path in its own worktree that round (the program's own outputs);
- the **harness** (`harness_digest`) is compared before and after each gate (`harness_findings`):
  the installed package's folder (with an editable install, the checkout: hidden folders, build
  outputs, benchmarks and tests at its top are not what the tool imports), the site-packages' `.pth`,
  `sitecustomize`/`usercustomize` and trainbridge entries, and the run's state files the caller
  names. A bytecode cache there that appeared or changed is accepted only when its code is exactly
  the compiled source beside it (`bytecode_matches_source`): the gate's own process, or another one
  using the same install, writes those legitimately; a removed one is recompiled from source.

A file's signature is its size and the SHA-256 of its bytes (a file rewritten with the same bytes,
by an editor or git, is unchanged); past `HASHED_BYTES`, its size, inode, modification and change
times instead (the change time moves on every write and cannot be set back from user space).
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import re
import site
import sys
from collections.abc import Iterable
from pathlib import Path

from trainbridge.agents.profiler.integrity import Finding, FindingKind

HASHED_BYTES = 4 << 20  # larger files (data, checkpoints) by their stat alone: any write moves their change time
MAX_LISTED = 5
NOT_PACKAGE_AT_TOP = ("build", "dist", "benchmarks", "tests")  # in or beside the package folder, never imported by the tool (pytest
# writes its own assertion-rewritten bytecode into tests/__pycache__)
CODE_SUFFIXES = (".py", ".pyc", ".pth", ".so", ".pyd")
START_UP = ("sitecustomize", "usercustomize")

Signature = tuple


def signature(path: Path) -> Signature | None:
    """The file's signature, None when it is gone."""
    try:
        stat = path.lstat()
        if os.path.islink(path):
            return (stat.st_size, "->" + os.readlink(path))
        if stat.st_size <= HASHED_BYTES:
            return (stat.st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    except OSError:
        return None
    return (stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns)


def digest_tree(root: Path, *, exclude: Iterable[Path] = (), top_skip=lambda name: False) -> dict[str, Signature]:
    """Every file under `root` by its path relative to `root`: `.git` and the folders in `exclude`
    are not descended into, nor entries at the top for which `top_skip(name)` holds."""
    root = Path(root)
    left_out = {os.path.realpath(p) for p in exclude}
    found: dict[str, Signature] = {}
    for folder, dirs, files in os.walk(root):
        at_top = folder == str(root)
        dirs[:] = [d for d in dirs if d != ".git" and not (at_top and top_skip(d))
                   and os.path.realpath(os.path.join(folder, d)) not in left_out]
        for name in files:
            if at_top and top_skip(name):
                continue
            path = Path(folder) / name
            sig = signature(path)
            if sig is not None:
                found[path.relative_to(root).as_posix()] = sig
    return found


def changed(before: dict[str, Signature], after: dict[str, Signature]) -> list[str]:
    """Paths added, removed or changed, sorted."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:MAX_LISTED]) + (f" and {len(paths) - MAX_LISTED} more" if len(paths) > MAX_LISTED else "")


def _is_code(path: str) -> bool:
    return "__pycache__" in path.split("/") or path.endswith(CODE_SUFFIXES)


def baseline_findings(root: Path, before: dict[str, Signature], after: dict[str, Signature], candidate_written: Iterable[str],
                      where: str) -> list[Finding]:
    """The baseline's worktree over one round: code or bytecode that changed, or anything else the
    candidate did not also write in its own worktree (an honest program writes the same outputs on
    both sides)."""
    own = set(candidate_written)
    moved = [p for p in changed(before, after) if _is_code(p) or p not in own]
    if not moved:
        return []
    return [Finding(kind=FindingKind.tampered_harness, message=(
        f"{where}: the baseline's worktree {root} changed while the candidate ran: {_listed(moved)}. Its children never "
        "write there (no bytecode, no sources); a file planted there (a bytecode cache carrying the source's timestamp "
        "and size is what Python loads) changes the baseline of this and every later gate"))]


def package_root() -> Path:
    """The folder of the installed package (with an editable install: the checkout)."""
    import trainbridge

    return Path(trainbridge.__file__).resolve().parent


def _outside_package(name: str) -> bool:
    return name.startswith(".") or name.endswith(".egg-info") or name in NOT_PACKAGE_AT_TOP


def site_dirs() -> list[Path]:
    """The site-packages folders of this interpreter (its virtual environment's), and the user's when enabled."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d).resolve() for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _site_entry(name: str) -> bool:
    stem = name.split(".", 1)[0]
    return name.endswith(".pth") or stem in START_UP or "trainbridge" in name.lower()


def _pth_imports(pth: Path) -> list[str]:
    """The modules a `.pth` file's `import` lines run at every start (setuptools' `_distutils_hack`)."""
    try:
        lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        if line.startswith(("import ", "import\t")):
            statement = line.split(";")[0].removeprefix("import").strip()
            names += [part.strip().split(" ")[0].split(".")[0] for part in statement.split(",")]
            names += [found.split(".")[0] for found in re.findall(r"__import__\(\s*['\"]([\w.]+)", line)]
    return [n for n in names if n.isidentifier()]


def _site_files(folder: Path) -> dict[str, Signature]:
    """In one site folder: the `.pth` files and the modules their `import` lines run, the start-up
    modules and the trainbridge entries (with their bytecode caches), by absolute path."""
    found: dict[str, Signature] = {}
    imported = {n for pth in folder.glob("*.pth") for n in _pth_imports(pth)}
    for inner in ("", "__pycache__"):
        try:
            names = os.listdir(folder / inner) if inner else os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not _site_entry(name) and name.split(".", 1)[0] not in imported:
                continue
            path = folder / inner / name
            if path.is_dir() and not path.is_symlink():
                found.update({str(path / rel): sig for rel, sig in digest_tree(path).items()})
            elif (sig := signature(path)) is not None:
                found[str(path)] = sig
    return found


def harness_digest(watched: Iterable[Path] = ()) -> dict[str, Signature]:
    """Signatures of the installed package, the site folders' start-up entries, any `sitecustomize` or
    `usercustomize` on sys.path, and the files in `watched` (the run's state), by absolute path."""
    root = package_root()
    found = {str(root / rel): sig for rel, sig in digest_tree(root, top_skip=_outside_package).items()}
    for folder in site_dirs():
        found.update(_site_files(folder))
    for entry in sys.path:
        for name in START_UP:
            path = Path(entry or ".").resolve() / f"{name}.py"
            if (sig := signature(path)) is not None:
                found[str(path)] = sig
    for path in watched:
        if (sig := signature(Path(path))) is not None:
            found[str(Path(path).resolve())] = sig
    return found


def bytecode_matches_source(pyc: Path) -> bool:
    """Whether the bytecode cache `pyc` holds exactly the code of the source it caches (as this
    interpreter compiles it): what Python writes itself, and nothing else."""
    try:
        source = Path(importlib.util.source_from_cache(str(pyc)))
        data, text = pyc.read_bytes(), source.read_bytes()
    except (ValueError, NotImplementedError, OSError):
        return False
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return False
    level = pyc.name.split(".opt-")[1].split(".")[0] if ".opt-" in pyc.name else "0"
    try:
        return marshal.loads(data[16:]) == compile(text, str(source), "exec", dont_inherit=True, optimize=int(level))
    except (ValueError, EOFError, TypeError, SyntaxError):
        return False


def harness_findings(before: dict[str, Signature], after: dict[str, Signature], where: str = "over the gate") -> list[Finding]:
    """The installed tool, its environment's start-up files and the run's state over a gate."""
    moved = []
    for path in changed(before, after):
        parts = path.split(os.sep)
        if "__pycache__" in parts:
            if path not in after or not path.endswith(".pyc"):
                continue  # removed (recompiled from source) or an interpreter's temporary file (never loaded)
            if bytecode_matches_source(Path(path)):
                continue
        moved.append(path)
    if not moved:
        return []
    return [Finding(kind=FindingKind.tampered_harness, message=(
        f"{where}: the installed tool, its environment or the run's state changed while the candidate was judged: "
        f"{_listed(moved)}. Code written there runs in the gate's process or in the next gate: the verdicts are "
        "no longer the tool's"))]
