"""The user's files outside git (git-ignored or untracked) that a script-mode run shows without being told (parent side).

TrainBridge's worktrees hold what git tracks; the data a script reads (``data/shakespeare_char/train.bin``,
``meta.pkl``, a tokenizer, ``input.txt``) is usually git-ignored and lives only in the user's checkout. With no
``data = [...]`` in trainbridge.toml a run still sees it: every git-ignored, untracked entry of the checkout (git's
own list, ``git ls-files --others --ignored --exclude-standard --directory``: a wholly ignored folder is one
entry) is an input, except what a training program writes or what is no input of it:

- hidden entries (``.venv/``, ``.env``, ``.cache/``, ``.ipynb_checkpoints/``): environments, secrets, caches;
- folders named like outputs, caches or environments (``out/``, ``out-shakespeare-char/``, ``outputs/``,
  ``checkpoints/``, ``logs/``, ``runs/``, ``wandb/``, ``lightning_logs/``, ``__pycache__/``, ``venv/``,
  ``build/``, ``*.egg-info/`` ...): what the script writes, not what it reads (a stale output that is shown
  anyway is copied on write: the script's write lands in scratch, sandbox/script/launcher.py);
- compiled bytecode and logs (``*.pyc``, ``*.log``).

Untracked files git does not ignore (``input.txt`` downloaded beside a script, as minGPT's chargpt reads it) are
shown the same way, but for code (``*.py``, a folder holding some): the run judges the commit's code, never
uncommitted code of the checkout.

The caller (sandbox/script/files.py) links them into the run's scratch mirror, read-only, and says which
(`IgnoredInputs.shown`, `skipped` with the reason). Only git is asked (through tools/git's single door); nothing
of the checkout is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainbridge.tools.launch.not_inputs import not_an_input

MAX_ENTRIES = 2_000  # git-ignored entries taken from git's list at most (a wholly ignored folder is one)
_CODE_SUFFIXES = (".py", ".pyi", ".pyx", ".ipynb", ".sh")


@dataclass
class IgnoredInputs:
    """What the checkout holds outside git: `shown` (repo-relative, a folder with a trailing `/`) and `skipped`
    (path -> why), in git's order; `note` when git could not be asked."""

    shown: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    note: str | None = None

    def notes(self, data: list[str], most: int = 8) -> list[str]:
        """What a run will show the script besides the `data` entries, and what it leaves out, in words."""
        listed = [entry.rstrip("/") for entry in data]
        shown = [e for e in self.shown if not any(e.rstrip("/") == d or e.startswith(d + "/") for d in listed)]
        said = [self.note] if self.note else []
        if shown:
            more = f" and {len(shown) - most} more" if len(shown) > most else ""
            left = (f" (left out: {', '.join(list(self.skipped)[:4])}{' ...' if len(self.skipped) > 4 else ''}: outputs, "
                    "caches, environments; data = [...] in trainbridge.toml shows one)") if self.skipped else ""
            said.append(f"the script sees these files of your checkout outside git, read-only: {', '.join(shown[:most])}"
                        f"{more}{left}")
        return said

    def covers(self, rel: str) -> bool:
        """Whether `rel` is an entry already listed, or lies in one."""
        bare = rel.rstrip("/")
        return any(bare == other.rstrip("/") or bare.startswith(other.rstrip("/") + "/") for other in [*self.shown, *self.skipped])

    def skipped_reason(self, rel: str) -> tuple[str, str] | None:
        """The skipped entry `rel` lies in (itself or a folder above it) and why it was skipped, else None."""
        clean = rel.removeprefix("./")
        for entry, why in self.skipped.items():
            bare = entry.rstrip("/")
            if clean == bare or clean.startswith(bare + "/"):
                return entry, why
        return None


def untracked_code(checkout: Path, rel: str) -> str | None:
    """Why an untracked (not ignored) entry is left out: it is code the run's commit does not have, or None."""
    path = checkout / rel
    if path.is_dir():
        code = sorted(p.name for p in path.iterdir() if p.suffix in _CODE_SUFFIXES)[:3]
        return f"untracked code ({', '.join(code)}): commit it for the run to use it" if code else None
    return "untracked code: commit it for the run to use it" if path.suffix in _CODE_SUFFIXES else None


def ignored_inputs(checkout: Path) -> IgnoredInputs:
    """The entries of `checkout` outside git (ignored, then untracked) that a run shows, and those it leaves out (module
    doc)."""
    from trainbridge.tools.git.runner import run_git_status

    checkout = Path(checkout)
    found = IgnoredInputs()
    for ignored in (True, False):
        status, out, err = run_git_status(checkout, "ls-files", "--others", *(("--ignored",) if ignored else ()),
                                          "--exclude-standard", "--directory", "-z", strip=False)
        if status != 0:
            found.note = (f"git could not list the checkout's files outside git ({err.strip()[:200]}): list what the script "
                          "reads in data = [...] of trainbridge.toml")
            return found
        entries = [entry for entry in out.split("\0") if entry]
        if len(entries) > MAX_ENTRIES:
            found.note = (f"the checkout has {len(entries)} {'git-ignored' if ignored else 'untracked'} entries; the first "
                          f"{MAX_ENTRIES} were looked at: list what the script reads in data = [...] of trainbridge.toml")
        for entry in entries[:MAX_ENTRIES]:
            if found.covers(entry):
                continue  # listed already (as ignored)
            why = not_an_input(entry) or (None if ignored else untracked_code(checkout, entry))
            if why is None:
                found.shown.append(entry)
            else:
                found.skipped[entry] = why
    return found
