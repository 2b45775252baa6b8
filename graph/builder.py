"""The loop as a LangGraph state machine. `build_graph` returns it uncompiled; the entry point
compiles it with a checkpointer (SQLite for runs, anything for tests and the LangGraph server)."""

from __future__ import annotations

from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from trainbridge.graph import nodes
from trainbridge.graph.context import RunContext
from trainbridge.graph.state import RunState

# Sandbox and git calls can hit transient trouble (a busy lock, a flaky KB server): retry a little.
_RETRY = RetryPolicy(max_attempts=2, retry_on=(OSError, TimeoutError))


def build_graph() -> StateGraph:
    graph = StateGraph(RunState, context_schema=RunContext)
    graph.add_node("prepare", nodes.prepare, retry_policy=_RETRY)
    graph.add_node("analyst", nodes.analyst, retry_policy=_RETRY)
    graph.add_node("retrieval", nodes.retrieval, retry_policy=_RETRY)
    graph.add_node("coder", nodes.coder, retry_policy=_RETRY)
    graph.add_node("review", nodes.review)
    graph.add_node("apply_review", nodes.apply_review)
    graph.add_node("profiler", nodes.profiler, retry_policy=_RETRY)
    graph.add_node("decide", nodes.decide, retry_policy=_RETRY)
    graph.add_node("report", nodes.report)
    graph.add_edge(START, "prepare")
    graph.add_edge("prepare", "analyst")
    graph.add_edge("analyst", "retrieval")
    graph.add_conditional_edges("retrieval", nodes.route_after_retrieval)
    graph.add_conditional_edges("coder", nodes.route_after_coder)
    graph.add_conditional_edges("review", nodes.route_after_review)
    graph.add_conditional_edges("apply_review", nodes.route_after_apply_review)
    graph.add_edge("profiler", "decide")
    graph.add_conditional_edges("decide", nodes.route_after_decide)
    graph.add_edge("report", END)
    return graph
