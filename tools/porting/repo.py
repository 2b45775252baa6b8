"""Port every Python file of a repository (`port_repo`); nothing is written here."""

from __future__ import annotations

import os
from pathlib import Path

from trainbridge.tools.porting import npu_surface as surface
from trainbridge.tools.porting.results import RepoPortResult, SkipCategory, Skipped
from trainbridge.tools.porting.source import port_source

# Folders that are never the user's source: VCS data, environments, caches, build output.
SKIP_DIRS = frozenset({".git", ".hg", ".svn", ".venv", "venv", "env", "__pycache__", ".mypy_cache", ".pytest_cache",
                       ".ruff_cache", ".tox", ".nox", "node_modules", "build", "dist", "site-packages", ".eggs"})
CUDA_SOURCE_SUFFIXES = (".cu", ".cuh")


def iter_repo_files(root: Path) -> list[Path]:
    """Files under `root` in path order, without SKIP_DIRS, hidden folders, *.egg-info or symlinks."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
                         and not (Path(folder) / d).is_symlink())
        found += [Path(folder) / f for f in sorted(files) if not (Path(folder) / f).is_symlink()]
    return found


def port_repo(root: Path) -> RepoPortResult:
    """Port every `.py` file under `root` and report CUDA sources; returns the new sources, not written."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory: pass the root of the repository to port")
    result = RepoPortResult(root=str(root))
    for path in iter_repo_files(root):
        relpath = path.relative_to(root).as_posix()
        if path.suffix == ".py":
            try:
                code = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                result.other_skipped.append(Skipped(file=relpath, line=1, category=SkipCategory.parse_error,
                                                    code="", blocking=True,
                                                    reason=f"not UTF-8 text ({exc.reason}); left untouched"))
                continue
            result.files.append(port_source(code, relpath))
        elif path.suffix in CUDA_SOURCE_SUFFIXES:
            first = next((ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()), "")
            result.other_skipped.append(Skipped(file=relpath, line=1, category=SkipCategory.cuda_source,
                                                code=first[:200], reason=surface.CUDA_SOURCE_REASON,
                                                blocking=True))
    return result
