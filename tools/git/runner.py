"""The one door to git: every git command TrainBridge runs goes through `run_git` / `run_git_status`.

An argument list through GitPython (never a shell string), with a fixed identity in the environment
and ``-c`` (CI has no global identity; the user's config is never written), hooks off, commit and tag
signing off, automatic gc/maintenance off (our commands never run housekeeping on the user's
repository), and the user's output-shaping config (diff prefixes, colour, external diff drivers,
relative diffs) overridden, so what we parse does not depend on it. tests/test_git_layer.py fails
when git is run anywhere else; RunWorkspace (git/workspace.py) adds the trainbridge/ prefix check
and the workspace lock for every ref it moves.

`_git_status` is the single place a git process starts (tests replace it to kill a run between two
git commands); call `run_git` / `run_git_status`, which look it up at call time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainbridge.records import Record
from trainbridge.tools.git.errors import GitCommandFailed
from trainbridge.tools.git.names import TRAILER_CANDIDATE

_SAFE_CONFIG = ("-c", "gc.auto=0", "-c", "maintenance.auto=false", "-c", "core.hooksPath=/dev/null",
                "-c", "commit.gpgsign=false", "-c", "core.fsmonitor=false", "-c", "advice.detachedHead=false",
                "-c", "log.showSignature=false", "-c", "color.ui=false", "-c", "core.quotePath=false",
                # output we parse must not depend on the user's config: diffs always say a/ and b/,
                # never colour, never relative to a subdirectory, never through an external driver
                "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "diff.relative=false",
                "-c", "diff.external=", "-c", "color.diff=false", "-c", "color.status=false",
                "-c", "color.branch=false", "-c", "core.pager=cat", "-c", "tag.gpgSign=false")


class GitIdentity(Record):
    name: str = "TrainBridge"
    email: str = "trainbridge@localhost"


def run_git(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
            strip: bool = True) -> str:
    """The one door to git: `git <args>` in `cwd` with hooks, signing, housekeeping and the user's
    output-shaping config off, as `identity`; its stdout, or GitCommandFailed."""
    return _git(cwd, *args, identity=identity, env=env, strip=strip)


def run_git_status(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
                   strip: bool = True) -> tuple[int, str, str]:
    """As `run_git`, returning (exit status, stdout, stderr) instead of raising."""
    return _git_status(cwd, *args, identity=identity, env=env, strip=strip)


def _git(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
         strip: bool = True) -> str:
    status, out, err = _git_status(cwd, *args, identity=identity, env=env, strip=strip)
    if status != 0:
        raise GitCommandFailed(list(args), status, err)
    return out


def _git_status(cwd: Path, *args: str, identity: GitIdentity | None = None, env: dict[str, str] | None = None,
                strip: bool = True) -> tuple[int, str, str]:
    ident = identity or GitIdentity()
    argv = ["git", *_SAFE_CONFIG, "-c", f"user.name={ident.name}", "-c", f"user.email={ident.email}", *args]
    full_env = {"GIT_AUTHOR_NAME": ident.name, "GIT_AUTHOR_EMAIL": ident.email, "GIT_COMMITTER_NAME": ident.name,
                "GIT_COMMITTER_EMAIL": ident.email, "GIT_TERMINAL_PROMPT": "0", "GIT_EDITOR": "true",
                "GIT_SEQUENCE_EDITOR": "true", "GIT_MERGE_AUTOEDIT": "no", **(env or {})}
    import git  # GitPython, on first use: importing it runs git and reads the cwd (the served graph imports this module)

    return git.Git(str(cwd)).execute(argv, env=full_env, with_extended_output=True, with_exceptions=False,
                                     strip_newline_in_stdout=strip)


def ref_sha(repo_root: Path, branch: str) -> str | None:
    """The commit branch `refs/heads/<branch>` points at in the repository, None when it does not exist."""
    status, out, _ = _git_status(repo_root, "rev-parse", "--verify", "-q", f"refs/heads/{branch}")
    return out if status == 0 else None


def is_under(path: Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


# ---------------------------------------------------------------- reading commits and worktrees


@dataclass(frozen=True)
class Commit:
    """One commit as `commits` reads it."""

    sha: str
    parents: tuple[str, ...]
    tree: str
    message: str

    def candidate(self) -> str | None:
        """The TrainBridge-Candidate trailer of the message's last paragraph, if any."""
        last = self.message.strip().split("\n\n")[-1]
        match = re.search(rf"^{TRAILER_CANDIDATE}: *(\S+) *$", last, re.MULTILINE)
        return match.group(1) if match else None


@dataclass(frozen=True)
class Worktree:
    path: Path
    ref: str | None
    locked: bool
    prunable: bool


def commits(cwd: Path, *revs: str) -> list[Commit]:
    """The commits `git log <revs>` lists in `cwd`, newest first."""
    out = run_git(cwd, "log", "--format=%H%x00%P%x00%T%x00%B%x1e", *revs, "--")
    commits = []
    for record in out.split("\x1e"):
        if record.strip():
            sha, parents, tree, message = record.lstrip("\n").split("\0", 3)
            commits.append(Commit(sha, tuple(parents.split()), tree, message))
    return commits


def worktrees(cwd: Path) -> list[Worktree]:
    result = []
    for block in run_git(cwd, "worktree", "list", "--porcelain").split("\n\n"):
        fields = [line.partition(" ") for line in block.splitlines() if line]
        info = {key: value for key, _, value in fields}
        if "worktree" in info:
            path = Path(os.path.realpath(info["worktree"]))  # git < 2.31 does not say "prunable" itself
            result.append(Worktree(path, info.get("branch"), "locked" in info,
                                    "prunable" in info or not (path / ".git").exists()))
    return result
