"""Tiny repositories laid out the way public training repositories are (written here, not copied from any), for the
zero-config tests: a nanoGPT-style one (a configurator, git-ignored token files under data/<dataset>/, a README
whose GPU line comes before its CPU line) and a minGPT-style one (a script that builds a Trainer from a package of
the repository; the optimizer and backward() live in the trainer)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from script_repos import commit_all, git  # noqa: F401  (git: the tests' own, re-exported)

VOCAB = 40

MODEL = '''"""A very small character model."""
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 1
    n_embd: int = 32
    dropout: float = 0.0


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(config.n_embd), nn.Linear(config.n_embd, config.n_embd), nn.GELU(),
                                                  nn.Dropout(config.dropout)) for _ in range(config.n_layer))
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, learning_rate):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate)
'''

CONFIGURATOR = '''"""--key=value arguments and config files become globals of the script that execs this file."""
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    if "=" not in arg:
        exec(open(arg).read())
        continue
    key, val = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    try:
        val = literal_eval(val)
    except (SyntaxError, ValueError):
        pass
    globals()[key] = val
'''

NANO_TRAIN = '''"""Train a character-level model on data/<dataset>/train.bin (prepare it first)."""
import os
import pickle

import numpy as np
import torch

from model import GPT, GPTConfig

out_dir = "out"
dataset = "shakespeare_char"
batch_size = 4
block_size = 16
n_layer = 1
n_embd = 32
dropout = 0.0
learning_rate = 1e-3
max_iters = 500
device = "cuda"
exec(open("configurator.py").read())

torch.manual_seed(1337)
data_dir = os.path.join("data", dataset)
with open(os.path.join(data_dir, "meta.pkl"), "rb") as f:
    meta = pickle.load(f)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


model = GPT(GPTConfig(block_size=block_size, vocab_size=meta["vocab_size"], n_layer=n_layer, n_embd=n_embd, dropout=dropout))
model.to(device)
optimizer = model.configure_optimizers(learning_rate)
for iter_num in range(max_iters):
    X, Y = get_batch("train")
    logits, loss = model(X, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print(f"iter {iter_num}: loss {loss.item():.4f}")
    if iter_num > 0 and iter_num % 250 == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(out_dir, "ckpt.pt"))
'''

PREPARE = '''"""Writes train.bin, val.bin and meta.pkl beside this file (from a text it downloads, in the real thing)."""
import os

print("tokenizing into", os.path.dirname(__file__))
'''

NANO_README = '''# tinygpt

Prepare the data, then train on a GPU:

```sh
python data/shakespeare_char/prepare.py
python train.py config/train_shakespeare_char.py
```

No GPU? Train on the CPU:

```sh
python train.py config/train_shakespeare_char.py --device=cpu --max_iters=300
```
'''

NANO_CONFIG = '''# a small character model
out_dir = "out-shakespeare-char"
batch_size = 4
block_size = 16
'''

NANO_GITIGNORE = "__pycache__/\n*.bin\n*.pkl\n*.pt\n.venv/\n"

TRAINER = '''"""A generic trainer: builds the optimizer and runs the loop (as a library module of the repository)."""
import torch


class Trainer:
    def __init__(self, config, model, dataset):
        self.config, self.model, self.dataset = config, model, dataset
        self.callbacks = []

    def add_callback(self, fn):
        self.callbacks.append(fn)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config["learning_rate"])
        generator = torch.Generator().manual_seed(0)
        for self.iter_num in range(config["max_iters"]):
            x, y = self.dataset.batch(config["batch_size"], generator)
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            self.optimizer.step()
            for fn in self.callbacks:
                fn(self)
'''

CHAR_SCRIPT = '''"""Trains a character-level model on input.txt beside this script."""
import os

import torch

from mingpt.model import GPT, GPTConfig
from mingpt.trainer import Trainer


class CharDataset:
    def __init__(self, text, block_size):
        chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size, self.block_size = len(chars), block_size
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def batch(self, batch_size, generator):
        ix = torch.randint(len(self.data) - self.block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.data[i:i + self.block_size] for i in ix])
        y = torch.stack([self.data[i + 1:i + 1 + self.block_size] for i in ix])
        return x, y


if __name__ == "__main__":
    text = open(os.path.join(os.path.dirname(__file__), "input.txt")).read()
    dataset = CharDataset(text, block_size=16)
    model = GPT(GPTConfig(block_size=16, vocab_size=dataset.vocab_size))
    trainer = Trainer({"learning_rate": 1e-3, "max_iters": 500, "batch_size": 4}, model, dataset)

    def report(trainer):
        if trainer.iter_num % 100 == 0:
            model.eval()
            with torch.no_grad():
                print(f"iter {trainer.iter_num}: loss {trainer.loss.item():.4f}")
            model.train()

    trainer.add_callback(report)
    trainer.run()
'''


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def tokens(folder: Path, *, count: int = 4000, seed: int = 0) -> None:
    """Random token data as a nanoGPT-style prepare.py writes it: train.bin, val.bin (uint16) and meta.pkl."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        rng.integers(0, VOCAB, size=count, dtype=np.uint16).tofile(folder / f"{split}.bin")
    with (folder / "meta.pkl").open("wb") as handle:
        pickle.dump({"vocab_size": VOCAB}, handle)


def nanogpt_style(path: Path, *, data: bool = True, readme: str = NANO_README) -> Path:
    """A committed nanoGPT-style repository; its token data (git-ignored) written after the commit, as prepare.py
    would; a stale checkpoint of an earlier run in out-shakespeare-char/ and a .venv/, both git-ignored too."""
    write(path, {"README.md": readme, "train.py": NANO_TRAIN, "model.py": MODEL, "configurator.py": CONFIGURATOR,
                 "config/train_shakespeare_char.py": NANO_CONFIG, "data/shakespeare_char/prepare.py": PREPARE,
                 ".gitignore": NANO_GITIGNORE})
    commit_all(path)
    if data:
        tokens(path / "data" / "shakespeare_char")
    (path / "out-shakespeare-char").mkdir()
    (path / "out-shakespeare-char" / "ckpt.pt").write_bytes(b"stale checkpoint")
    (path / ".venv" / "lib").mkdir(parents=True)
    return path


def mingpt_style(path: Path) -> Path:
    """A committed minGPT-style repository: projects/chargpt/chargpt.py builds a Trainer of mingpt/trainer.py; its
    input.txt is untracked (not ignored), downloaded by the user beside the script."""
    write(path, {"README.md": "# mingpt\n\nA small GPT library; see projects/.\n", "mingpt/__init__.py": "",
                 "mingpt/model.py": MODEL, "mingpt/trainer.py": TRAINER, "projects/chargpt/chargpt.py": CHAR_SCRIPT,
                 ".gitignore": "__pycache__/\n"})
    commit_all(path)
    rng = np.random.default_rng(1)
    (path / "projects" / "chargpt" / "input.txt").write_text("".join(rng.choice(list("abcdefgh \n"), size=3000)), encoding="utf-8")
    return path
