"""A Modded-NanoGPT record as a user's repository: its training script taken from a fetched mirror of
KellerJordan/modded-nanogpt, random token shards in the format it reads (git-ignored, as the real repository keeps
them), and a trainbridge.toml with the launch line, data and size overrides. Shared by benchmarks/records.py and
its CI test (which builds a fake mirror of its own: public code never enters this repository).

The records' logs begin with the code of the script that wrote them: early logs (records 4-11) open with a line of
100 `=`, the code, and another such line; later logs (17 on) start with the code and close it with that line. The
code is the first non-blank block between those lines.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from records_catalog import DATA_DIR, RecordSource, toml_text

_RULE = re.compile(r"(?m)^={100}[ \t]*\r?\n?")
MAGIC, VERSION = 20240520, 1
BOS = 50256  # GPT-2's <|endoftext|>: the later records align batches to it
GIT_IDENTITY = ("-c", "user.name=trainbridge-bench", "-c", "user.email=bench@localhost")


class MirrorError(RuntimeError):
    """The mirror lacks what a record's source names (the folder, the log, or the code in it)."""


def _git(repo: Path, *args: str, text: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=text, check=False)
    if done.returncode != 0:
        raise MirrorError(f"git {' '.join(args)} in {repo}: {done.stderr.strip()}")
    return done.stdout


def code_from_log(log: str) -> str:
    """The script a record's log begins with: the first non-blank block between lines of 100 `=`."""
    for block in _RULE.split(log):
        if block.strip():
            if not re.search(r"(?m)^(import|from) ", block):
                break
            return block if block.endswith("\n") else block + "\n"
    raise MirrorError("no code before or between lines of 100 '=' in the log")


def record_script(mirror: Path, source: RecordSource) -> str:
    """The record's training script read from the mirror (a bare or working git directory)."""
    if source.commit:  # record 2: its log holds no code; the script is the repository's at the record's commit
        return _git(mirror, "show", f"{source.commit}:{source.log}")
    path = f"HEAD:records/track_1_short/{source.folder}/{source.log}"
    return code_from_log(_git(mirror, "show", path))


def write_shard(path: Path, tokens: int, *, seed: int, vocab: int = BOS + 1, bos_every: int = 97) -> Path:
    """One token shard as `_load_data_shard` reads it: a header of 256 int32 (magic 20240520, version 1, the token
    count) and then the tokens as uint16; every `bos_every`-th token is <|endoftext|> so BOS-aligned loaders find
    document starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = np.random.default_rng(seed).integers(0, min(vocab, BOS), size=tokens, dtype=np.uint16)
    if vocab > BOS:
        body[::bos_every] = BOS
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens)
    with path.open("wb") as handle:
        handle.write(header.tobytes())
        handle.write(body.tobytes())
    return path


def build_repo(dest: Path, source: RecordSource, script: str, *, tokens: int = 262_144) -> Path:
    """`dest` as a user's clone of the record: the script at its name, .gitignore as the real repository has it
    (fineweb10B/, logs/), two train shards and one val shard under data/fineweb10B/ (ignored), trainbridge.toml,
    the empty folders the record writes into without creating them (`source.folders`, tracked), one commit."""
    dest.mkdir(parents=True)
    (dest / source.script).write_text(script, encoding="utf-8")
    (dest / ".gitignore").write_text("fineweb10B/\npylog124M/\n__pycache__/\nlogs/\n", encoding="utf-8")
    data = dest / DATA_DIR
    for index, name in enumerate(("fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin")):
        write_shard(data / name, tokens, seed=index, vocab=source.vocab())
    (dest / "trainbridge.toml").write_text(toml_text(source), encoding="utf-8")
    for folder in source.folders:  # e.g. record 17's logs/, ignored by .gitignore as in the real repository
        (dest / folder).mkdir(parents=True, exist_ok=True)
        (dest / folder / ".gitkeep").write_text("", encoding="utf-8")
    _git(dest, "init", "-q", "--initial-branch=main")
    _git(dest, "add", "-A")
    for folder in source.folders:
        _git(dest, "add", "-f", f"{folder}/.gitkeep")
    _git(dest, *GIT_IDENTITY, "commit", "-qm", f"record {source.number}: {source.name}")
    ignored = _git(dest, "status", "--porcelain", "--ignored", "--", DATA_DIR)
    assert ignored.startswith("!!"), f"the token shards must be git-ignored: {ignored!r}"
    return dest
