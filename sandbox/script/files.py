"""Script mode's files: the run's working directory and the git-ignored data it reads (parent side).

TrainBridge's worktrees hold what git tracks; the data a script reads (``data/*.bin``, tokenizers,
``meta.pkl``) is usually git-ignored and lives only in the user's checkout. Each script-mode run
gets a working directory of its own in its scratch folder, a mirror of the repository made of
symlinks:

- every file of the worktree, linked, in real folders (so a script can create files in any of its
  folders; a very large tree is linked folder by folder past MIRROR_ENTRIES entries);
- every ``data = [...]`` entry of trainbridge.toml, linked to the user's checkout's copy (a folder
  that also exists in the worktree is merged entry by entry, so tracked files come from the
  worktree and ignored ones from the checkout); nothing is copied, whatever its size;
- when the run's root is a worktree of the checkout (``trainbridge run``), every other git-ignored or
  untracked entry of the checkout that is an input by its name (sandbox/script/ignored.py: not hidden, not an output, cache or
  environment folder), shown without hiding anything already there: folders as real folders of links (up to
  SHOWN_ENTRIES entries, then linked whole), so a file the script creates beside its data lands in the scratch
  folder. Zero config: the user lists nothing (`RunDir.shown` says what was shown, `RunDir.skipped` what not);
- anything the script creates (``out/ckpt.pt``, logs) is a new file in the mirror: the scratch
  folder, removed with the run.

The links make the files visible; the launcher's write guard (sandbox/script/launcher.py) makes
them read-only: opening for writing, removing or renaming anything whose real path lies in the
worktree or the user's checkout fails with a message. `snapshot` / `changed` let the runner report
any change to the user's data after a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SNAPSHOT_LIMIT = 20_000  # files per data entry compared before/after a run
MIRROR_ENTRIES = 5_000  # folders of the worktree are mirrored as real folders up to this many entries, then linked whole
SHOWN_ENTRIES = 20_000  # the same for the checkout's git-ignored folders shown without a data entry


class DataPathError(ValueError):
    """A data entry that is in neither the worktree nor the user's checkout."""


@dataclass
class RunDir:
    cwd: Path
    protected: list[Path]
    data_sources: dict[str, Path] = field(default_factory=dict)  # data entry -> where its files come from
    shown: dict[str, Path] = field(default_factory=dict)  # entry outside git shown without a data entry -> its source
    skipped: dict[str, str] = field(default_factory=dict)  # entry outside git left out -> why
    notes: list[str] = field(default_factory=list)
    checkout: Path | None = None  # the user's checkout the data comes from
    workdir: str = ""  # the folder of the mirror the script runs in (trainbridge.toml's workdir), "" for the root
    script: str = ""  # the launch line's script, from the root ("" for `-m module`)


def user_checkout(root: Path) -> Path:
    """The checkout a worktree belongs to (read from its `.git` file: no git command runs); `root` itself otherwise."""
    root = Path(root).resolve()
    dot_git = root / ".git"
    if not dot_git.is_file():
        return root
    text = dot_git.read_text(encoding="utf-8", errors="replace").strip()
    if not text.startswith("gitdir:"):
        return root
    git_dir = (root / text.split(":", 1)[1].strip()).resolve()
    common = git_dir
    commondir = git_dir / "commondir"
    if commondir.is_file():
        common = (git_dir / commondir.read_text(encoding="utf-8").strip()).resolve()
    return common.parent if common.name == ".git" else root


def make_run_dir(root: Path, data: list[str], dest: Path, *, show_ignored: bool = True, workdir: str | None = None) -> RunDir:
    """Build the mirror of `root` at `dest` (see the module doc); raises DataPathError for a missing data entry.
    `show_ignored`: also show the checkout's other git-ignored inputs when `root` is a worktree of it. `workdir` (the
    folder the script runs in) is a real folder of the mirror at every level, so what the script writes there lands
    in the scratch folder even in a tree linked folder by folder."""
    root = Path(root).resolve()
    checkout = user_checkout(root)
    dest.mkdir(parents=True, exist_ok=True)
    _mirror(root, dest, [MIRROR_ENTRIES], top=True)
    run_dir = RunDir(cwd=dest, protected=sorted({root, checkout}), checkout=checkout)
    for raw in data:
        rel = Path(raw.rstrip("/"))
        sources = [base / rel for base in dict.fromkeys((root, checkout)) if os.path.lexists(base / rel)]
        if not sources:
            raise DataPathError(f"data entry {raw!r} is in neither the worktree ({root}) nor your checkout ({checkout}): "
                                "create it there (e.g. run the repository's data preparation script), or fix data = [...] "
                                "in trainbridge.toml")
        _merge(dest, rel, sources)
        run_dir.data_sources[raw] = sources[-1]
    if show_ignored and checkout != root:
        _show_ignored(run_dir, checkout, data)
    if workdir:
        use_workdir(run_dir, workdir)
    return run_dir


def use_workdir(run_dir: RunDir, workdir: str) -> Path:
    """Make `workdir` the folder of the mirror the script runs in: a real folder at every level (so what the script
    writes there lands in the scratch folder); its path."""
    run_dir.workdir = Path(workdir).as_posix()
    folder = run_dir.cwd
    for part in Path(workdir).parts:
        _explode(folder / part)
        folder = folder / part
    return folder


def _show_ignored(run_dir: RunDir, checkout: Path, data: list[str]) -> None:
    """Show the checkout's git-ignored inputs in the mirror (module doc), beside the data entries (which come first)."""
    from trainbridge.sandbox.script.ignored import ignored_inputs

    found = ignored_inputs(checkout)
    if found.note:
        run_dir.notes.append(found.note)
    run_dir.skipped = dict(found.skipped)
    listed = [Path(raw.rstrip("/")) for raw in data]
    budget = [SHOWN_ENTRIES]
    for entry in found.shown:
        rel = Path(entry.rstrip("/"))
        if any(rel == d or rel.is_relative_to(d) for d in listed):
            continue  # a data entry shows it already
        source = checkout / rel
        if not os.path.lexists(source):
            continue
        parent = run_dir.cwd
        try:
            for part in rel.parts[:-1]:
                _explode(parent / part)
                parent = parent / part
            _overlay(source, parent / rel.name, budget)
        except OSError as exc:  # e.g. the worktree has a file where the checkout has a folder (an uncommitted change)
            run_dir.skipped[entry] = f"could not be shown beside the worktree's files ({type(exc).__name__}: {exc})"
            continue
        run_dir.shown[entry] = source


def _overlay(source: Path, target: Path, budget: list[int]) -> None:
    """Show `source` at `target` without hiding what is there: a new name is linked (a folder as real folders of
    links while `budget` lasts), a folder already there gets the names it lacks; a file already there stays."""
    if not os.path.lexists(target):
        budget[0] -= 1
        if source.is_dir() and not source.is_symlink() and budget[0] > 0:
            target.mkdir()
            _mirror(source, target, budget)
        else:
            os.symlink(source, target)
        return
    if not (source.is_dir() and target.is_dir()):
        return
    if target.is_symlink():
        if Path(os.readlink(target)) == source:
            return
        _explode(target)
    for name in sorted(os.listdir(source)):
        _overlay(source / name, target / name, budget)


def _mirror(source: Path, dest: Path, budget: list[int], *, top: bool = False) -> None:
    """Real folders with symlinked files, so a script can create files in any folder of the repository (they land
    in the scratch mirror); past the budget a folder is linked whole (a write into it then meets the write guard)."""
    for name in sorted(os.listdir(source)):
        if top and name == ".git":
            continue
        budget[0] -= 1
        entry = source / name
        if entry.is_dir() and not entry.is_symlink() and budget[0] > 0:
            (dest / name).mkdir()
            _mirror(entry, dest / name, budget)
        else:
            os.symlink(entry, dest / name)


def _merge(dest: Path, rel: Path, sources: list[Path]) -> None:
    """Make `dest/rel` show the union of `sources` (the first source wins for a name present in several)."""
    parent = dest
    for part in rel.parts[:-1]:  # a real folder at each level, so the entry can be placed inside
        _explode(parent / part)
        parent = parent / part
    target = parent / rel.name
    dirs = [s for s in sources if s.is_dir()]
    if len(dirs) >= 2 and len(dirs) == len(sources):
        _explode(target)
        for name in sorted({name for d in dirs for name in os.listdir(d)}):
            _merge(target, Path(name), [d / name for d in dirs if os.path.lexists(d / name)])
        return
    if target.is_symlink():
        if Path(os.readlink(target)) == sources[0]:
            return
        os.unlink(target)
    elif os.path.lexists(target):
        return  # a folder made for a deeper entry already
    os.symlink(sources[0], target)


def _explode(path: Path) -> None:
    """Replace a symlink to a folder by a real folder of symlinks to its entries (or make an empty folder)."""
    if path.is_symlink() and path.is_dir():
        source = Path(os.readlink(path))
        os.unlink(path)
        path.mkdir()
        for name in sorted(os.listdir(source)):
            os.symlink(source / name, path / name)
    elif not os.path.lexists(path):
        path.mkdir()


def snapshot(paths: list[Path]) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `paths` (at most SNAPSHOT_LIMIT per path), symlinks followed at the top."""
    seen: dict[str, tuple[int, int]] = {}
    for base in paths:
        count = 0
        base = base.resolve()
        walker = [(str(base), [], [base.name])] if base.is_file() else os.walk(base)
        for folder, _, files in walker:
            for name in files:
                full = os.path.join(folder, name) if not base.is_file() else str(base)
                try:
                    stat = os.stat(full)
                except OSError:
                    continue
                seen[full] = (stat.st_size, stat.st_mtime_ns)
                count += 1
                if count >= SNAPSHOT_LIMIT:
                    break
            if count >= SNAPSHOT_LIMIT:
                break
    return seen


def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Files added, removed or modified between two snapshots."""
    return sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
