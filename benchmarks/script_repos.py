"""Script-mode fixture repositories with their git-ignored data written by the caller: shared by the script-mode
tests and benchmarks/rank_pairing.py."""

from __future__ import annotations

import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "scripts"
VOCAB = 96


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def write_tokens(repo: Path, *, tokens: int = 20_000, seed: int = 0) -> Path:
    """Random token data in the format the nanoGPT-style fixture reads (data/tokens/train.bin + meta.pkl)."""
    folder = repo / "data" / "tokens"
    folder.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, VOCAB, size=tokens, dtype=np.uint16).tofile(folder / "train.bin")
    with (folder / "meta.pkl").open("wb") as handle:
        pickle.dump({"vocab_size": VOCAB}, handle)
    return folder


def nanogpt_repo(path: Path, toml: str, *, data: bool = True, commit: bool = False) -> Path:
    """A copy of the nanoGPT-style fixture with `toml` as its trainbridge.toml (data written unless data=False)."""
    shutil.copytree(FIXTURES / "nanogpt", path, ignore=shutil.ignore_patterns("trainbridge.toml", "__pycache__", "data", "out"))
    (path / "trainbridge.toml").write_text(toml, encoding="utf-8")
    if data:
        write_tokens(path)
    if commit:
        commit_all(path)
    return path


def script_repo(path: Path, script: str, toml: str, files: dict[str, str] | None = None) -> Path:
    """A repository holding one fixture script as train.py."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / script, path / "train.py")
    (path / "trainbridge.toml").write_text(toml, encoding="utf-8")
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return path


def commit_all(repo: Path) -> None:
    git(repo, "init", "-q", "--initial-branch=main")
    git(repo, "config", "user.name", "test")
    git(repo, "config", "user.email", "test@localhost")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "training script")


def stdout_lines(result, prefix: str) -> list[str]:
    return [line for line in result.stdout_tail.splitlines() if line.startswith(prefix)]


def ddp_repo(path: Path, toml: str | None = None, *, commit: bool = False) -> Path:
    """The torchrun DDP fixture (its train.py and README, the nanoGPT fixture's model.py), token data written;
    `toml` as its trainbridge.toml (None: none, as a user who has not run init yet)."""
    shutil.copytree(FIXTURES / "ddp", path, ignore=shutil.ignore_patterns("__pycache__", "data", "out"))
    shutil.copy(FIXTURES / "nanogpt" / "model.py", path / "model.py")
    if toml is not None:
        (path / "trainbridge.toml").write_text(toml, encoding="utf-8")
    write_tokens(path)
    if commit:
        (path / ".gitignore").write_text("data/\nout/\n", encoding="utf-8")
        commit_all(path)
    return path
