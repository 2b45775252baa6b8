"""What the loop tests check about a run, shared by test_loop.py and test_server.py: the user's view of
their checkout, the run's commits and decisions, a clean repository afterwards, the knowledge base's
outcomes; and how they start the CLI and find the sandbox children."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from trainbridge.knowledge.store import KnowledgeBase
from trainbridge.sandbox.child.fork_child import CHILD_NAME
from trainbridge.tests.loop_fixtures import git

REJECT_REASON = "keep the hand-written form here: it is the reference for a paper figure"


def user_view(repo: Path) -> dict:
    """Everything of the user's checkout TrainBridge promises not to touch."""
    files = {}
    for path in sorted(repo.rglob("*")):
        if ".git" not in path.relative_to(repo).parts and path.is_file():
            files[str(path.relative_to(repo))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branch": git(repo, "symbolic-ref", "HEAD"),
        "refs": [r for r in git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
                 if not r.startswith("refs/heads/trainbridge/")],
        "status": git(repo, "--no-optional-locks", "status", "--porcelain=v1", "--untracked-files=all"),
        "files": files,
        "index": hashlib.sha256((repo / ".git" / "index").read_bytes()).hexdigest(),
        "config": (repo / ".git" / "config").read_text(encoding="utf-8"),
    }


def run_commits(repo: Path, base: str, branch: str) -> list[dict]:
    """Commits of `branch` above `base`, oldest first: sha, parent, tree, subject, candidate trailer."""
    out = git(repo, "log", "--reverse", "--format=%H%x00%P%x00%T%x00%s%x00%(trailers:key=TrainBridge-Candidate,valueonly)%x1e",
              f"{base}..{branch}")
    commits = []
    for record in out.split("\x1e"):
        if record.strip():
            sha, parents, tree, subject, candidate = record.strip("\n").split("\0")
            commits.append({"sha": sha, "parents": parents.split(), "tree": tree, "subject": subject,
                            "candidate": candidate.strip()})
    return commits


def decision_view(verdicts: list[dict]) -> list[tuple]:
    """What must not depend on noise or on crashes: which candidate, for what, decided how."""
    return [(v["intent_id"], v["category"], v["recipe_id"], v["candidate"], v["accepted"], v["reason"]) for v in verdicts]


def run_outcomes(kb_dir: str, run_id: str) -> list:
    with KnowledgeBase(kb_dir) as kb:
        return [o for o in kb.all_outcomes() if o.run_id == run_id]


def assert_clean_repository(repo: Path, run_id: str) -> None:
    """Only the run branch is left of the run (no candidate branches, worktrees or locks); fsck passes."""
    branches = git(repo, "for-each-ref", "--format=%(refname)", "refs/heads/trainbridge/").split()
    assert branches == [f"refs/heads/trainbridge/{run_id}"], branches
    worktrees = [line for line in git(repo, "worktree", "list", "--porcelain").splitlines() if line.startswith("worktree ")]
    assert worktrees == [f"worktree {repo}"], worktrees
    locks = [str(p) for p in (repo / ".git").rglob("*.lock")]
    assert locks == [], locks
    fsck = subprocess.run(["git", "fsck", "--full", "--strict", "--no-progress"], cwd=repo, capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert not any(word in fsck.stdout + fsck.stderr for word in ("error", "missing", "broken", "corrupt")), fsck.stdout + fsck.stderr


def cli_argv() -> list[str]:
    script = Path(sys.executable).with_name("trainbridge")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "trainbridge"]


LLM_ENV = ("TRAINBRIDGE_LLM_BASE_URL", "TRAINBRIDGE_LLM_MODEL", "TRAINBRIDGE_LLM_API_KEY", "OPENAI_API_KEY")


def child_env(home: Path) -> dict[str, str]:
    """The loop's environment: its own home and temporary folder (a killed process leaves its sandbox
    scratch folders behind), and no LLM (recipes only: tests never reach the network)."""
    env = {k: v for k, v in os.environ.items() if k not in LLM_ENV}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {**env, "TRAINBRIDGE_HOME": str(home), "TMPDIR": str(home / "tmp"), "PYTHONUNBUFFERED": "1"}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def is_harness(pid: int) -> bool:
    """Whether `pid` is a sandbox child: an exec'd harness, or one forked by the fork server."""
    try:
        return _comm(pid) == CHILD_NAME or "trainbridge.sandbox.harness" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def kill_harness_groups(pids) -> None:
    """Sandbox children run in sessions of their own and outlive a killed parent: SIGKILL the process
    group of each of `pids` that is still a sandbox child (a pid since reused by another process is left)."""
    for pid in pids:
        if is_harness(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def harness_children(pid: int) -> dict[int, str]:
    """Sandbox children of `pid` (`python -m trainbridge.sandbox.harness --channel R,W` for timed runs,
    `... request.json MODE` for analysis, and children forked by the fork server, named `CHILD_NAME`,
    which are handed to the gate and run timed rounds): {pid: "timed" or the mode}."""
    found: dict[int, str] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                argv = [a.decode(errors="replace") for a in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0") if a]
            except OSError:
                continue
            if CHILD_NAME == _comm(child):  # forked by the fork server: the server's cmdline, the child's own name
                found[child] = "timed"
            elif "trainbridge.sandbox.harness" in argv:
                # timed children (baseline measurement, every gate child) are driven over --channel and carry no
                # mode in argv; analysis children are labelled with theirs
                found[child] = "timed" if "--channel" in argv else (argv[-1] if not argv[-1].endswith(".json") else "?")
    return found
