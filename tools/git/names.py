"""Names in the git layer: the run-id rule and the branches a run owns.

Git stores refs as paths, so ``trainbridge/<run>`` and ``trainbridge/<run>/cand/x`` cannot both exist
(a file and a folder of the same name). Run ids therefore contain no dot and everything a run owns
hangs off ``trainbridge/<run>.``: the run branch ``trainbridge/<run>``, candidates
``trainbridge/<run>.cand/<name>``, side branches such as ``trainbridge/<run>.pending-npu``.

The run-id rule here is the only one: graph/state.py's RunConfig and the CLI check ids with
`check_run_id`, so an id accepted at the command line is a valid branch name in `prepare`.
Imports nothing heavy (no GitPython).
"""

from __future__ import annotations

import re

BRANCH_PREFIX = "trainbridge/"
TRAILER_CANDIDATE = "TrainBridge-Candidate"
TRAILER_RUN = "TrainBridge-Run"
RUN_ID_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # the one rule for run ids (graph/state.py, the CLI)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def run_branch_name(run_id: str) -> str:
    return f"{BRANCH_PREFIX}{check_run_id(run_id)}"


def candidate_branch_name(run_id: str, name: str) -> str:
    return f"{run_branch_name(run_id)}.cand/{check_name(name, 'candidate name')}"


def side_branch_name(run_id: str, suffix: str) -> str:
    if check_name(suffix, "branch suffix") == "cand":
        raise ValueError("branch suffix 'cand' is reserved for candidate branches; pick another")
    return f"{run_branch_name(run_id)}.{suffix}"


def check_run_id(run_id: str) -> str:
    """`run_id` if it is a valid run id (it names branches, folders and the checkpoint thread), else ValueError."""
    if not RUN_ID_RULE.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 letters, digits, '_' or '-' (no dots or slashes), "
                         "starting with a letter or digit")
    return run_id


def valid_run_id(value: str | None) -> str | None:
    """Typer callback for a run-id argument or option: `check_run_id` as a usage error (exit 2), so a bad
    id is refused at the command line, before anything is created."""
    if value is None:
        return None
    try:
        return check_run_id(value)
    except ValueError as exc:
        import typer

        raise typer.BadParameter(str(exc)) from None


def check_name(name: str, what: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name or name.endswith((".", ".lock")):
        raise ValueError(f"{what} {name!r} must be 1-100 letters, digits, '.', '_' or '-', start with a letter "
                         "or digit, and not contain '..' or end in '.' or '.lock'")
    return name
