"""Write the corpus files named by labels.yaml into a folder, from local git mirrors.

    python benchmarks/corpus/materialise.py --mirrors MIRRORS_DIR --out /tmp/trainbridge-corpus
    python benchmarks/corpus/materialise.py --labels benchmarks/corpus/labels_unseen.yaml --mirrors ... --out ...

``--labels`` picks the labels file (default: ``labels.yaml``, the development corpus;
``labels_unseen.yaml`` is the corpus of repositories the team had not used, issue 30).

MIRRORS_DIR holds one bare or normal git directory per repository, found as
``MIRRORS_DIR/<owner>+<name>/repo`` (the layout the session's ``fetch`` tool leaves),
``MIRRORS_DIR/<owner>+<name>`` or ``MIRRORS_DIR/<name>`` (a ``git clone``). Each file is read with
``git show <commit>:<path>`` at the pinned commit; a record log is cut down to its train_gpt.py.
Nothing is downloaded. Write the folder outside the repository: the files are public code that
is read, never committed here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

LABELS = Path(__file__).resolve().parent / "labels.yaml"
SEPARATOR = "=" * 100


def extract_log_code(text: str) -> str:
    """The train_gpt.py a Modded-NanoGPT record log starts with.

    Early logs open with a line of exactly 100 '=' and hold the code up to the next one; later logs
    start with the code and end it at the first such line.
    """
    lines = text.split("\n")
    marks = [i for i, line in enumerate(lines) if line == SEPARATOR]
    if not marks:
        raise ValueError("no line of exactly 100 '=' in the log")
    if marks[0] == 0:
        if len(marks) < 2:
            raise ValueError("the log opens with a separator but never closes the code")
        body = lines[1 : marks[1]]
    else:
        body = lines[: marks[0]]
    return "\n".join(body) + "\n"


def find_mirror(mirrors: Path, repo: str) -> Path | None:
    owner, name = repo.split("/")
    for candidate in (mirrors / f"{owner}+{name}" / "repo", mirrors / f"{owner}+{name}", mirrors / name):
        if candidate.is_dir():
            return candidate
    return None


def read_at(git_dir: Path, commit: str, path: str) -> str:
    done = subprocess.run(["git", "-C", str(git_dir), "show", f"{commit}:{path}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git show {commit}:{path} in {git_dir} failed: {done.stderr.strip()}")
    return done.stdout


def materialise(mirrors: Path, out: Path, labels: Path = LABELS) -> list[str]:
    """Write every labelled file it can; returns the problems (missing mirrors, failed reads)."""
    out.mkdir(parents=True, exist_ok=True)
    problems = []
    for entry in yaml.safe_load(labels.read_text(encoding="utf-8"))["files"]:
        git_dir = find_mirror(mirrors, entry["repo"])
        if git_dir is None:
            problems.append(f"{entry['local']}: no mirror of {entry['repo']} under {mirrors}")
            continue
        try:
            text = read_at(git_dir, entry["commit"], entry["path"])
            if entry["extract"] == "log_code":
                text = extract_log_code(text)
        except (RuntimeError, ValueError) as exc:
            problems.append(f"{entry['local']}: {exc}")
            continue
        (out / entry["local"]).write_text(text, encoding="utf-8")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--labels", type=Path, default=LABELS, help="labels file naming the files (default: labels.yaml)")
    args = parser.parse_args(argv)
    problems = materialise(args.mirrors, args.out, args.labels)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
