"""Source paths from any machine mapped to the repository: by the longest path suffix that exists under
the repo root (/home/u/proj/model.py -> model.py); paths outside the repo (torch, site-packages) are
dropped."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from trainbridge.tools.inductor.format import EvidenceFormatError

_EXCLUDED_PATH_MARKS = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen", "<eval_with_key")


class RepoPathMapper:
    """Maps a source path from any machine to a repo-relative POSIX path, or None if not in the repo."""

    def __init__(self, repo_root: Path) -> None:
        self.root = Path(repo_root).resolve()
        if not self.root.is_dir():
            raise EvidenceFormatError(f"repo root {repo_root} is not a directory")
        self._cache: dict[str, str | None] = {}

    def map(self, path: str) -> str | None:
        if path not in self._cache:
            self._cache[path] = self._map(path)
        return self._cache[path]

    def _map(self, path: str) -> str | None:
        posix = path.replace("\\", "/")
        try:  # a path under this very root maps directly, whatever it contains
            rel = Path(posix).resolve().relative_to(self.root)
            return rel.as_posix() if (self.root / rel).is_file() else None
        except (ValueError, OSError):
            pass
        if any(mark in posix for mark in _EXCLUDED_PATH_MARKS):
            return None
        parts = [p for p in PurePosixPath(posix).parts if p not in ("/", "")]
        for i in range(len(parts)):  # longest suffix first
            candidate = "/".join(parts[i:])
            if ".." not in parts[i:] and (self.root / candidate).is_file():
                return candidate
        return None
