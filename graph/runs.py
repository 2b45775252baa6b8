"""Entry points of the loop: start, resume, review, status. The graph is compiled here with a
checkpointer whose thread id is the run id, so a killed run continues where it stopped: SQLite in
the run's folder by default, Postgres with `checkpoint` (graph/checkpoints.py), where the run's
settings are checkpointed too, so that another machine can find and continue the run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from datetime import datetime
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from langgraph.types import Command

from trainbridge.graph.builder import build_graph
from trainbridge.graph.checkpoints import CheckpointError, database_run_lock, default_checkpoint, open_checkpointer
from trainbridge.graph.context import RunContext
from trainbridge.graph.review import ReviewDecision
from trainbridge.graph.state import RunConfig, RunPaths, runs_root

RECURSION_LIMIT = 10_000  # each candidate is ~5 steps; the budget and candidate limit stop a run long before


class RunError(RuntimeError):
    """A run cannot be started, resumed or reviewed; the message says what to do."""


@dataclass
class RunOutcome:
    run_id: str
    finished: bool
    waiting_for_review: dict[str, Any] | None
    state: dict[str, Any]


@contextmanager
def _compiled(paths: RunPaths, checkpoint: str | None = None) -> Iterator[Any]:
    try:
        with open_checkpointer(checkpoint, paths.checkpoints) as saver:
            yield build_graph().compile(checkpointer=saver)
    except CheckpointError as exc:
        raise RunError(str(exc)) from None


def _thread(run_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": run_id}, "recursion_limit": RECURSION_LIMIT}


def load_config(run_id: str, root: Path | None = None, checkpoint: str | None = None) -> tuple[RunConfig, RunPaths]:
    """The run's settings: its run.json on this machine, else (with a Postgres `checkpoint`, given or
    from TRAINBRIDGE_CHECKPOINT) the settings checkpointed in the database when it started."""
    paths = RunPaths(run_id, root)
    if paths.config.is_file():
        return RunConfig.model_validate_json(paths.config.read_text(encoding="utf-8")), paths
    try:
        url = default_checkpoint(checkpoint)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    known = sorted(p.name for p in (root or runs_root()).glob("*") if (p / "run.json").is_file())
    if url is None:
        raise RunError(f"no run {run_id!r} under {(root or runs_root())} (known: {', '.join(known) or 'none'}); "
                       f"a run checkpointed in Postgres on another machine: add --checkpoint postgresql://...")
    with _compiled(paths, url) as graph:
        settings = graph.get_state(_thread(run_id)).values.get("settings")
    if not settings:
        raise RunError(f"no run {run_id!r} in the checkpoint database {url}, nor under {(root or runs_root())}")
    return RunConfig.model_validate(settings), paths


def start_run(config: RunConfig, *, say: Callable[[str], None] = lambda m: None, root: Path | None = None) -> RunOutcome:
    """Check the input (nothing is created for a run that would fail on it), record the run, run it."""
    from trainbridge.graph.preflight import RunInputError, check_run_input

    paths = RunPaths(config.run_id, root)
    if paths.config.exists():
        raise RunError(f"run {config.run_id!r} already exists: continue it with `trainbridge resume {config.run_id}`")
    try:
        check_run_input(config)
    except RunInputError as exc:
        raise RunError(str(exc)) from None
    if config.checkpoint and config.workspace_dir is None:  # recorded, so another machine resumes in the same worktrees
        config = config.model_copy(update={"workspace_dir": str(paths.workspace.resolve())})
    paths.dir.mkdir(parents=True, exist_ok=True)
    tmp = paths.config.with_suffix(".tmp")
    tmp.write_text(config.model_dump_json(indent=2), encoding="utf-8")
    tmp.replace(paths.config)
    start = {"run_id": config.run_id, "settings": config.model_dump(mode="json")}
    return _invoke(config, paths, start, say)


def resume_run(run_id: str, *, say: Callable[[str], None] = lambda m: None, root: Path | None = None,
               checkpoint: str | None = None, budget_s: float | None = None) -> RunOutcome:
    """Continue the run from its last checkpoint. Its budget counts the time it ran, not the time it was down (from
    its start to its last checkpoint, then on from now); `budget_s` gives it that many seconds from now instead."""
    config, paths = load_config(run_id, root, checkpoint)
    status = run_status(run_id, root, checkpoint)
    if status["waiting_for_review"] is not None:
        return RunOutcome(run_id, False, status["waiting_for_review"], status["state"])
    if status["finished"]:
        return RunOutcome(run_id, True, None, status["state"])
    say = logged(say, paths.dir / LOG_FILE)  # the budget line below belongs in the run's log too
    now = time.time()
    if budget_s is not None:
        config = config.model_copy(update={"budget_s": budget_s, "budget_origin": now})
        say(f"budget: {budget_s / 60:.1f} min from now")
    else:
        used = resume_used_s(status["state"], status.get("checkpoint_at"))
        config = config.model_copy(update={"budget_origin": now - used})
        say(f"budget: {used / 60:.1f} of {config.budget_s / 60:.1f} min used before the stop (the time it was down is not "
            "counted; `resume --budget` gives it a new one)")
    return _invoke(config, paths, None, say)


def resume_used_s(state: dict[str, Any], checkpoint_at: float | None) -> float:
    """How much of its budget a stopped run had used: from its start to its last checkpoint (what ran after that
    checkpoint is done again, and counted again)."""
    started = state.get("started_at")
    if not started or checkpoint_at is None:
        return 0.0
    return max(0.0, checkpoint_at - float(started))


def answer_review(run_id: str, decision: dict[str, Any], *, say: Callable[[str], None] = lambda m: None,
                  root: Path | None = None, checkpoint: str | None = None) -> RunOutcome:
    config, paths = load_config(run_id, root, checkpoint)
    status = run_status(run_id, root, checkpoint)
    if status["waiting_for_review"] is None:
        raise RunError(f"run {run_id!r} is not waiting for a review (last node: {status['state'].get('node')})")
    validated = ReviewDecision.model_validate(decision).model_dump(mode="json", by_alias=True)
    return _invoke(config, paths, Command(resume=validated), say)


@dataclass
class Removal:
    """What `remove_run` removed (the git layer's record, or None when the repository is gone) and the run folder."""

    run_id: str
    git: Any
    folder: Path
    notes: list[str]


def remove_run(run_id: str, root: Path | None = None) -> Removal:
    """Remove a run of this machine: its worktrees, its branches (`trainbridge/<run-id>` and the names under it; a
    branch a checkout of the user's holds stays, and is named) and its folder (settings, checkpoints, report). Refused
    while a process runs it. The user's own branches, checkout and uncommitted work are never touched; a run
    checkpointed in Postgres keeps its rows there."""
    from trainbridge.tools.git.ops import RunWorkspace, open_repo

    paths = RunPaths(run_id, root)
    if not paths.config.is_file():
        known = sorted(p.name for p in (root or runs_root()).glob("*") if (p / "run.json").is_file())
        raise RunError(f"no run {run_id!r} under {(root or runs_root())} (known: {', '.join(known) or 'none'})")
    holder = lock_holder(paths)
    if holder is not None:
        raise RunError(f"run {run_id!r} is running (pid {holder}): stop it first (Ctrl-C, or kill {holder}), then remove it")
    config = RunConfig.model_validate_json(paths.config.read_text(encoding="utf-8"))
    notes: list[str] = []
    removed = None
    try:
        repo = open_repo(Path(config.repo))
    except Exception as exc:  # noqa: BLE001 - a repository moved or deleted since: only the folder is left to remove
        notes.append(f"the repository {config.repo} cannot be opened ({exc}): no branch or worktree removed")
    else:
        root_dir = Path(config.workspace_dir) if config.workspace_dir else paths.workspace
        removed = RunWorkspace(repo, run_id, root_dir).remove_run()
    if config.checkpoint:
        notes.append("its checkpoints in the Postgres database stay (the team's record); only this machine's copy goes")
    shutil.rmtree(paths.dir, ignore_errors=True)
    return Removal(run_id=run_id, git=removed, folder=paths.dir, notes=notes)


def run_status(run_id: str, root: Path | None = None, checkpoint: str | None = None) -> dict[str, Any]:
    config, paths = load_config(run_id, root, checkpoint)
    with _compiled(paths, config.checkpoint) as graph:
        snapshot = graph.get_state(_thread(run_id))
    interrupts = [i.value for task in snapshot.tasks for i in task.interrupts]
    return {
        "checkpoint_at": _timestamp(snapshot.created_at),
        "run_id": run_id,
        "config": config.model_dump(mode="json"),
        "state": dict(snapshot.values),
        "next": list(snapshot.next),
        "finished": bool(snapshot.values) and not snapshot.next,
        "waiting_for_review": interrupts[0] if interrupts else None,
        "running_pid": lock_holder(paths),
        "failure": last_failure(paths),
    }


def _timestamp(iso: str | None) -> float | None:
    """A checkpoint's `created_at` (ISO 8601) as seconds since the epoch."""
    if not iso:
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


FAILURE_FILE = "failure.json"


def lock_holder(paths: RunPaths) -> int | None:
    """The pid of the process on this machine that runs the run now (it holds run.lock), else None. Read from
    /proc/locks, without taking the lock (a status must never make a starting run read 'already running')."""
    try:
        inode = (paths.dir / "run.lock").stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode) and fields[4].isdigit():
            return int(fields[4])
    return None


def last_failure(paths: RunPaths) -> dict[str, Any] | None:
    """What stopped the run's last attempt with an error ({"error", "type", "node"}), None when it did not."""
    try:
        return json.loads((paths.dir / FAILURE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextmanager
def run_lock(paths: RunPaths) -> Iterator[None]:
    """One process per run: a second `resume` or `review` while the run goes on would redo its nodes in
    the same worktrees (resetting a candidate the gate is measuring). The kernel drops the lock when
    its holder dies, so a killed run can be resumed at once."""
    paths.dir.mkdir(parents=True, exist_ok=True)
    handle = open(paths.dir / "run.lock", "a+", encoding="utf-8")  # noqa: SIM115 - held across the yield
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunError(f"run {paths.dir.name!r} is already running (pid {holder}): wait for it to finish or stop "
                           f"it, then `trainbridge resume {paths.dir.name}`") from None
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()


def _invoke(config: RunConfig, paths: RunPaths, payload: Any, say: Callable[[str], None]) -> RunOutcome:
    from trainbridge.agents.coder.llm.config import LLMConfig

    from trainbridge.sandbox.child import fork_server
    from trainbridge.sandbox.scratch import sweep_stale

    from trainbridge.graph.preflight import RunInputError, confinement_notes

    try:  # resumed or reviewed on a machine that cannot confine: refused as a start would be
        confinement_notes(config)
    except RunInputError as exc:
        raise RunError(str(exc)) from None
    say = logged(say, paths.dir / LOG_FILE)
    context = RunContext(config=config, paths=paths, say=say, llm=LLMConfig.from_env(os.environ))
    try:
        run_held = database_run_lock(config.checkpoint, config.run_id)  # across machines (Postgres); the flock: this one
        with run_lock(paths), run_held, _compiled(paths, config.checkpoint) as graph, fork_server.warm_scope():
            swept = sweep_stale()
            if swept:
                say(f"removed {len(swept)} scratch folder(s) left by killed TrainBridge processes")
            (paths.dir / FAILURE_FILE).unlink(missing_ok=True)
            try:
                result = graph.invoke(payload, _thread(config.run_id), context=context)
            except Exception as exc:
                _record_failure(paths, graph, config.run_id, exc)
                raise
            snapshot = graph.get_state(_thread(config.run_id))
    except CheckpointError as exc:
        raise RunError(str(exc)) from None
    interrupts = result.get("__interrupt__") if isinstance(result, dict) else None
    waiting = interrupts[0].value if interrupts else None
    return RunOutcome(config.run_id, finished=not snapshot.next, waiting_for_review=waiting, state=dict(snapshot.values))


LOG_FILE = "run.log"  # in the run's folder: every line the run said, with the time, across its starts and resumes


def logged(say: Callable[[str], None], path: Path) -> Callable[[str], None]:
    """`say`, with every line also appended to the run's log file (kept when the terminal is gone); `say` itself when
    it already logs there."""
    if getattr(say, "logs_to", None) == path:
        return say

    def both(message: str) -> None:
        say(message)
        try:
            with path.open("a", encoding="utf-8") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        except OSError:
            pass  # a full disk must not stop the run; the terminal still has the line

    both.logs_to = path  # type: ignore[attr-defined]
    return both


def _record_failure(paths: RunPaths, graph, run_id: str, exc: Exception) -> None:
    """Leave what stopped the run for `status` (an interrupt or SIGTERM is not a failure: the run is just stopped)."""
    try:
        node = list(graph.get_state(_thread(run_id)).next)
    except Exception:  # noqa: BLE001 - the failure itself is what matters
        node = []
    record = {"error": str(exc)[:4000], "type": type(exc).__name__, "node": node}
    tmp = paths.dir / (FAILURE_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(paths.dir / FAILURE_FILE)


def intents_left(state: dict[str, Any]) -> int:
    done = set(state.get("done_intents") or [])
    return len([i for i in state.get("intents") or [] if i["id"] not in done])


def summary_line(state: dict[str, Any]) -> str:
    accepted = state.get("accepted") or []
    return (f"node {state.get('node')}, intents left {intents_left(state)}, "
            f"candidates tried {state.get('candidates_tried') or 0}, accepted {len(accepted)}")


def dumps(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)
