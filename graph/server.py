"""The loop served by a LangGraph server (`langgraph dev`, a LangGraph Platform deployment, `trainbridge serve`).

`langgraph.json` names `make_graph`: the same nodes as `trainbridge run`, compiled without a
checkpointer (the server brings its own; the thread is the run). A client starts a run with

    input   = {"run_id": "<run id>"}                 (may be left out: the id in the context is used)
    context = {"run": {<RunConfig as JSON>}}         (repository and other paths as seen by the server)

watches it (stream mode "custom" carries the progress lines, "updates" the nodes), sees the review
interrupt as the thread's `__interrupt__` (payload: graph/review.py) and answers with
`command={"resume": {"schema": 1, "action": "approve" | "reject" | "edit", ...}}`. A resumed run needs
no context: the server keeps each run's settings in its run.json (`RunPaths(run_id).config`), so
`trainbridge status/report` on the server's machine find the run's files.

The nodes need live services (knowledge base, git workspace), which cannot travel over the API: the
served graph rebuilds a RunContext from those settings whenever the server starts or resumes a
run on a thread, and closes it when the run stops or pauses.

Importing this module starts nothing, imports no LangGraph and reads no environment or file: all of
that happens when the server calls `make_graph` and runs the graph.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbridge.graph.context import RunContext

GRAPH_ID = "trainbridge"  # the graph's name in langgraph.json; clients use it as the assistant id
SERVER_FILE = "server.json"  # in a served run's directory: {"thread_id", "url"} of the thread and server that own it
START_HELP = ('start a TrainBridge run on the server with input {"run_id": "<id>"} and context {"run": {<RunConfig: repo, '
              'run_id, target, review, ...>}} (`trainbridge run --server URL REPO` does this)')


class ServedRunError(ValueError):
    """A request the served graph cannot run (missing or conflicting settings); the message says what to send."""


def make_graph():
    """The graph factory named in langgraph.json (the server calls it for every run)."""
    return _compiled()


@functools.cache
def _compiled():
    from trainbridge.graph.builder import build_graph

    compiled = build_graph(context_schema=served_context_schema()).compile(name=GRAPH_ID)
    # the same construction as Pregel.copy, into the subclass that turns settings into a RunContext
    return _served_graph_type()(**{k: v for k, v in compiled.__dict__.items() if k != "__orig_class__"})


@functools.cache
def served_context_schema() -> type:
    """The run `context` a client sends (what LangGraph Studio shows as the run's settings form)."""
    from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

    from trainbridge.graph.state import RunConfig

    schema = TypedDict("TrainBridgeRun", {"run": RunConfig}, total=False)
    schema.__doc__ = ("Settings of a TrainBridge run: `run` is its RunConfig (needed to start a run; a resumed run "
                      "uses the settings the server saved when it started).")
    return schema


@functools.cache
def _served_graph_type() -> type:
    """CompiledStateGraph whose runs get a RunContext built from the settings (defined on first use, so
    that importing this module imports no LangGraph)."""
    import asyncio

    from langgraph.graph.state import CompiledStateGraph

    class ServedGraph(CompiledStateGraph):
        def stream(self, input: Any, config: Any = None, *, context: Any = None, **kwargs: Any):
            state_run_id = _state_run_id(self.get_state(config).values) if _has_thread(self, config) else None
            input, run_context = served_run(input, config, context, state_run_id)
            try:
                yield from super().stream(input, config, context=run_context, **kwargs)
            finally:
                if run_context is not context:
                    close_run_context(run_context)

        async def astream(self, input: Any, config: Any = None, *, context: Any = None, **kwargs: Any):
            state_run_id = _state_run_id((await self.aget_state(config)).values) if _has_thread(self, config) else None
            input, run_context = await asyncio.to_thread(served_run, input, config, context, state_run_id)
            try:
                async for part in super().astream(input, config, context=run_context, **kwargs):
                    yield part
            finally:
                if run_context is not context:
                    await asyncio.to_thread(close_run_context, run_context)

    ServedGraph.__module__ = __name__
    ServedGraph.__qualname__ = "ServedGraph"
    return ServedGraph


def _has_thread(graph: Any, config: Any) -> bool:
    return graph.checkpointer is not None and bool(((config or {}).get("configurable") or {}).get("thread_id"))


def _state_run_id(values: Any) -> str | None:
    return values.get("run_id") if isinstance(values, dict) else None


def served_run(input: Any, config: Any, context: Any, state_run_id: str | None) -> tuple[Any, "RunContext"]:
    """The input and RunContext for one server run of the loop.

    `context` is the client's (`{"run": RunConfig}` or nothing); the server also copies it into the
    config's `configurable`, which is read too (some stream modes drop `context`). `state_run_id` is
    the thread's run when it has one. A new run's settings are saved as its run.json, and the run is
    tied to its thread; a later request on the thread may leave the settings out.
    """
    from trainbridge.graph.context import RunContext

    if isinstance(context, RunContext):  # in-process use of the served graph
        return input, context

    from langgraph.types import Command
    from pydantic import ValidationError

    from trainbridge.graph.state import RunConfig, RunPaths

    settings = _settings(context, config)
    input_run_id = input.get("run_id") if isinstance(input, dict) else None
    if settings is not None and "run_id" not in settings and (input_run_id or state_run_id):
        settings = {**settings, "run_id": input_run_id or state_run_id}
    try:
        run_config = RunConfig.model_validate(settings) if settings is not None else None
    except ValidationError as exc:
        raise ServedRunError(f"the run settings in the context are not valid: {exc}") from None
    if run_config is not None:
        from trainbridge.graph.preflight import RunInputError, confinement_notes

        try:
            confinement_notes(run_config)  # the server's machine runs the candidates
        except RunInputError as exc:
            raise ServedRunError(str(exc)) from None
    if run_config is not None and run_config.checkpoint:
        raise ServedRunError("a served run's checkpoints are the server's: `langgraph dev` keeps them in its folder, a LangGraph "
                             "Platform deployment in its own Postgres (POSTGRES_URI); leave `checkpoint` out of the run settings")
    named = {name for name in (input_run_id, state_run_id, run_config.run_id if run_config else None) if name}
    if len(named) > 1:
        held = f" (this thread holds {state_run_id!r})" if state_run_id else ""
        raise ServedRunError(f"the request names runs {sorted(named)}{held}; a thread holds one run: use a new thread for a new run")
    if not named:
        raise ServedRunError(f"no run named: {START_HELP}")
    run_id = named.pop()
    if state_run_id is not None and isinstance(input, dict):
        raise ServedRunError(f"this thread already holds run {run_id!r}: answer its review with command={{\"resume\": ...}}, "
                             f"continue it after a failure with input null, or start a new run on a new thread")
    paths = RunPaths(run_id)
    thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
    run_config = _claim(paths, run_config, str(thread_id) if thread_id else None)
    if state_run_id is None and not isinstance(input, Command):
        input = {**(input or {}), "run_id": run_id}  # a fresh thread: the state starts with the run's id
    return input, RunContext(config=run_config, paths=paths, say=_server_say(run_id), llm=_llm())


def _settings(context: Any, config: Any) -> dict[str, Any] | None:
    for source in (context, ((config or {}).get("configurable") or {})):
        if isinstance(source, dict) and source.get("run") is not None:
            if not isinstance(source["run"], dict):
                raise ServedRunError(f"context.run must be an object of run settings, not {type(source['run']).__name__}")
            return dict(source["run"])
    return None


def _claim(paths, run_config, thread_id: str | None):
    """Save a new run's settings and its thread; for a known run, check the request matches them."""
    import json
    import os

    from trainbridge.graph.state import RunConfig

    run_id = paths.dir.name
    if paths.config.is_file():
        served = served_by(paths.dir)
        owner = served.get("thread_id") if served is not None else None
        if served is None:
            raise ServedRunError(f"run {run_id!r} was started outside the server on this machine: continue it with "
                                 f"`trainbridge resume {run_id}` there, or give the server run another run_id")
        if thread_id and owner != thread_id:
            raise ServedRunError(f"run {run_id!r} belongs to server thread {owner}: answer it there, or give this "
                                 f"thread's run another run_id")
        saved = RunConfig.model_validate_json(paths.config.read_text(encoding="utf-8"))
        if run_config is not None and run_config != saved:
            raise ServedRunError(f"run {run_id!r} exists with other settings ({paths.config}): leave the settings out "
                                 f"to continue it, or start a new run with another run_id")
        return saved
    if run_config is None:
        raise ServedRunError(f"this server has no settings for run {run_id!r}: {START_HELP}")
    paths.dir.mkdir(parents=True, exist_ok=True)
    # the server's own address (`langgraph dev` sets it), so `trainbridge status/report` on this machine can ask it
    _write(paths.dir / SERVER_FILE, json.dumps({"thread_id": thread_id, "url": os.environ.get("LANGGRAPH_API_URL")}) + "\n")
    _write(paths.config, run_config.model_dump_json(indent=2))  # last: a run exists once its settings do
    return run_config


def served_by(run_dir) -> dict[str, Any] | None:
    """{"thread_id", "url"} when the run in `run_dir` belongs to a LangGraph server thread, else None."""
    import json

    record = run_dir / SERVER_FILE
    return json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None


def _write(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _llm():
    import os

    from trainbridge.agents.coder.llm.config import LLMConfig

    return LLMConfig.from_env(os.environ)


def _server_say(run_id: str):
    """Progress lines go to the server log and to clients streaming the run in "custom" mode."""
    import logging

    from langgraph.config import get_stream_writer

    logger = logging.getLogger("trainbridge.server")

    def say(message: str) -> None:
        logger.info("run %s: %s", run_id, message)
        try:
            writer = get_stream_writer()
        except RuntimeError:  # outside a node: the log has it
            return
        writer({"trainbridge": "progress", "run_id": run_id, "message": message})

    return say


def close_run_context(run_context: "RunContext") -> None:
    """Close what a server run opened (the knowledge base), also when it failed or paused for review
    (a RunContext the caller passed in is the caller's to close)."""
    kb = run_context.__dict__.get("kb")  # a cached_property: present only when a node used it
    if kb is not None:
        kb.close()
