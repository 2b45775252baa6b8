"""Client side of runs on a LangGraph server (`langgraph_sdk`): submit a run, follow it, show and answer its review.

What `trainbridge run --server URL` and `trainbridge review --server URL` call. Any other LangGraph
client (LangGraph Studio, a team's own UI) does the same with the same values; see graph/server.py
for the run's input and context, graph/review.py for the interrupt payload and the resume value.

A run is one server thread. Threads started here carry the metadata `trainbridge_run_id`, so a
run can be named by its run id as well as by its thread id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from trainbridge.graph.server import GRAPH_ID

RUN_ID_KEY = "trainbridge_run_id"  # thread metadata: the TrainBridge run the thread holds
STREAM_MODES = ["custom", "updates"]  # custom: progress lines (graph/server.py); updates: nodes and the interrupt


class ServerError(RuntimeError):
    """The server cannot be reached or refuses the request; the message says what to do."""


@dataclass
class ServedOutcome:
    """Where a served run stands after a request: paused for review, finished, failed or still going."""

    thread_id: str
    run_id: str | None  # the TrainBridge run id (from the thread's state)
    status: str  # the thread's: idle, busy, interrupted, error
    finished: bool
    waiting_for_review: dict[str, Any] | None
    state: dict[str, Any]
    error: str | None = None
    next: list[str] = field(default_factory=list)  # the nodes the run continues with
    server_run_ids: list[str] = field(default_factory=list)  # the server's run ids of this request


def connect(url: str):
    """A synchronous langgraph_sdk client for the server at `url` (checked: it answers)."""
    import httpx
    from langgraph_sdk import get_sync_client

    client = get_sync_client(url=url)
    try:
        client.http.get("/ok")
    except httpx.HTTPError as exc:
        raise ServerError(f"no LangGraph server answers at {url} ({exc}): start one with `trainbridge serve` on the "
                          f"machine that runs the loop, and reach it through an SSH tunnel if it listens on loopback") from None
    return client


def submit_run(client, config, on_progress: Callable[[str], None] = lambda m: None) -> ServedOutcome:
    """Start `config` (a RunConfig) on a new thread and follow it until it pauses for review or stops."""
    taken = client.threads.search(metadata={RUN_ID_KEY: config.run_id}, limit=1)
    if taken:
        raise ServerError(f"the server already has run {config.run_id!r} (thread {taken[0]['thread_id']}): answer it with "
                          f"`trainbridge review --server URL {config.run_id}`, or start a run with another --run-id")
    thread = client.threads.create(metadata={RUN_ID_KEY: config.run_id, "trainbridge_repo": config.repo}, graph_id=GRAPH_ID)
    parts = client.runs.stream(thread["thread_id"], GRAPH_ID, input={"run_id": config.run_id},
                               context={"run": config.model_dump(mode="json")}, stream_mode=STREAM_MODES,
                               multitask_strategy="reject", on_disconnect="continue")
    return follow(client, thread["thread_id"], parts, on_progress)


def answer_review(client, thread_id: str, decision: dict[str, Any],
                  on_progress: Callable[[str], None] = lambda m: None) -> ServedOutcome:
    """Resume a run paused for review with `decision` (validated against the review schema first)."""
    from trainbridge.graph.review import ReviewDecision

    resume = ReviewDecision.model_validate(decision).model_dump(mode="json", by_alias=True)
    now = thread_outcome(client, thread_id)
    if now.waiting_for_review is None:
        raise ServerError(f"thread {thread_id} (run {now.run_id}) is not waiting for a review (status {now.status}"
                          f"{', finished' if now.finished else ''})")
    parts = client.runs.stream(thread_id, GRAPH_ID, command={"resume": resume}, stream_mode=STREAM_MODES,
                               multitask_strategy="reject", on_disconnect="continue")
    return follow(client, thread_id, parts, on_progress)


def follow(client, thread_id: str, parts: Iterable[Any], on_progress: Callable[[str], None]) -> ServedOutcome:
    """Pass the run's progress lines to `on_progress` until its stream ends; then read where the thread stands."""
    server_runs: list[str] = []
    error = None
    for part in parts:
        data = part.data
        if part.event == "metadata" and isinstance(data, dict) and data.get("run_id"):
            server_runs.append(str(data["run_id"]))
        elif part.event == "custom" and isinstance(data, dict) and data.get("trainbridge") == "progress":
            on_progress(str(data.get("message")))
        elif part.event == "error":
            error = f"{data.get('error', 'error')}: {data.get('message', '')}" if isinstance(data, dict) else str(data)
    outcome = thread_outcome(client, thread_id)
    outcome.server_run_ids = server_runs
    if error is not None:
        outcome.error = error
    return outcome


def thread_outcome(client, thread_id: str) -> ServedOutcome:
    """The thread's run: its state, whether it finished, and the review payload it waits on (if any)."""
    thread = client.threads.get(thread_id)
    state = client.threads.get_state(thread_id)
    values = state.get("values") or {}
    values = values if isinstance(values, dict) else {}
    interrupts = [i.get("value") for task in state.get("tasks") or [] for i in task.get("interrupts") or []]
    errors = [task.get("error") for task in state.get("tasks") or [] if task.get("error")]
    return ServedOutcome(
        thread_id=thread_id, run_id=values.get("run_id") or (thread.get("metadata") or {}).get(RUN_ID_KEY),
        status=thread.get("status") or "unknown", finished=bool(values) and not state.get("next"),
        waiting_for_review=interrupts[0] if interrupts else None, state=values, error=errors[0] if errors else None,
        next=list(state.get("next") or []))


def resolve_thread(client, ref: str) -> str:
    """The thread of `ref`: a thread id, or the run id of a run started by `trainbridge run --server`."""
    from langgraph_sdk.errors import NotFoundError

    try:
        uuid.UUID(ref)
    except ValueError:
        found = client.threads.search(metadata={RUN_ID_KEY: ref}, limit=2)
        if not found:
            known = [t["metadata"][RUN_ID_KEY] for t in client.threads.search(limit=50)
                     if RUN_ID_KEY in (t.get("metadata") or {})]
            raise ServerError(f"the server has no run {ref!r} (runs there: {', '.join(sorted(known)) or 'none'}); "
                              f"name a run id or a thread id") from None
        if len(found) > 1:
            raise ServerError(f"several threads hold run {ref!r}: name one by its thread id "
                              f"({', '.join(t['thread_id'] for t in found)})")
        return found[0]["thread_id"]
    try:
        client.threads.get(ref)
    except NotFoundError:
        raise ServerError(f"the server has no thread {ref}") from None
    return ref
