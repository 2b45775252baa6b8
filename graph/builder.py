"""The loop as a LangGraph state machine. `build_graph` returns it uncompiled; the entry point
compiles it with a checkpointer (SQLite for runs, anything for tests and the LangGraph server)."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from trainbridge.graph import nodes
from trainbridge.graph.team import fanout
from trainbridge.graph.context import RunContext
from trainbridge.graph.state import RunState

# Sandbox and git calls can hit transient trouble (a busy lock, a flaky KB server): retry a little.
_RETRY = RetryPolicy(max_attempts=2, retry_on=(OSError, TimeoutError))


def timed(name: str, node: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Wrap a node so its update also appends {"node", "wall_s", "parts"} to `phase_times`; a node
    reports its own sub-phases by returning them under the private key `_parts` (removed here)."""
    takes_runtime = "runtime" in inspect.signature(node).parameters

    def record(started: float, update: dict[str, Any]) -> dict[str, Any]:
        parts = update.pop(nodes.PARTS_KEY, None) or {}
        entry = {"node": name, "wall_s": round(time.monotonic() - started, 3), "parts": parts}
        return {**update, "phase_times": [entry]}

    if takes_runtime:
        @functools.wraps(node)
        def with_runtime(state, runtime):
            started = time.monotonic()
            return record(started, node(state, runtime))
        return with_runtime

    @functools.wraps(node)
    def without_runtime(state):
        started = time.monotonic()
        return record(started, node(state))
    return without_runtime


def build_graph(context_schema: type = RunContext) -> StateGraph:
    """The loop, uncompiled. `context_schema` is what a run's `context` is declared as: a RunContext
    in process; the LangGraph server declares its serialisable settings instead (graph/server.py)."""
    graph = StateGraph(RunState, context_schema=context_schema)
    graph.add_node("prepare", timed("prepare", nodes.prepare), retry_policy=_RETRY)
    graph.add_node("analyst", timed("analyst", nodes.analyst), retry_policy=_RETRY)
    graph.add_node("retrieval", timed("retrieval", nodes.retrieval), retry_policy=_RETRY)
    graph.add_node("coder", timed("coder", nodes.coder), retry_policy=_RETRY)
    graph.add_node("review", timed("review", nodes.review))
    graph.add_node("apply_review", timed("apply_review", nodes.apply_review))
    graph.add_node("profiler", timed("profiler", nodes.profiler), retry_policy=_RETRY)
    graph.add_node("decide", timed("decide", nodes.decide), retry_policy=_RETRY)
    graph.add_node("report", timed("report", nodes.report))
    # parallel gates (--devices, --ray): graph/team/fanout.py; a gate's time counts as the profiler's (budget stops)
    graph.add_node("batch", timed("batch", fanout.batch), retry_policy=_RETRY)
    graph.add_node("gate", timed("profiler", fanout.gate), retry_policy=_RETRY)
    graph.add_node("merge", timed("merge", fanout.merge), retry_policy=_RETRY)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "analyst")
    graph.add_edge("analyst", "retrieval")
    graph.add_conditional_edges("retrieval", fanout.route_after_retrieval)
    graph.add_conditional_edges("coder", nodes.route_after_coder)
    graph.add_conditional_edges("review", nodes.route_after_review)
    graph.add_conditional_edges("apply_review", nodes.route_after_apply_review)
    graph.add_edge("profiler", "decide")
    graph.add_conditional_edges("decide", nodes.route_after_decide)
    graph.add_conditional_edges("batch", fanout.route_after_batch, ["gate", "report"])
    graph.add_edge("gate", "merge")
    graph.add_conditional_edges("merge", fanout.route_after_merge, ["gate", "batch", "analyst", "report"])
    graph.add_edge("report", END)
    return graph
